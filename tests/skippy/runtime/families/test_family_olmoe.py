"""olmoe: Q/K norms over the whole projections (before the split into heads) and experts
whose weights are not normalised. Parity with llama.cpp over every layout and dtype is the
canary's (``python -m skippy.runtime.canary.check olmoe``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from stagetools import numpy_reference_agrees

from skippy.package.ranges import LayerRange
from skippy.runtime.families import spec_from_metadata, stage_tensors

pytestmark = pytest.mark.llama


def _kv() -> dict[str, Any]:
    return {
        "general.architecture": "olmoe",
        "olmoe.block_count": 2,
        "olmoe.embedding_length": 64,
        "olmoe.feed_forward_length": 32,
        "olmoe.attention.head_count": 4,
        "olmoe.attention.head_count_kv": 2,
        "olmoe.attention.layer_norm_rms_epsilon": 1e-5,
        "olmoe.expert_count": 16,
        "olmoe.expert_used_count": 4,
    }


def test_the_q_k_norms_span_the_projections_and_experts_are_ff_wide() -> None:
    spec = spec_from_metadata(_kv())
    assert (spec.n_expert, spec.n_expert_used, spec.n_ff_exp) == (16, 4, 32)
    assert not spec.expert_weights_norm
    tensors = stage_tensors(spec, LayerRange(0, 1, 2), vocab=None, tied=False)
    plan = {t.name: t.shape for t in tensors}
    assert plan["blk.0.attn_q_norm.weight"] == (spec.q_dim,)  # 64, not head_dim 16
    assert plan["blk.0.attn_k_norm.weight"] == (spec.kv_dim,)
    assert plan["blk.0.ffn_up_exps.weight"] == (64, 32, 16)


def test_the_numpy_reference_runs_olmoe(tmp_path: Path) -> None:
    """The f32 oracle norms the whole projections and leaves the weights unnormalised on its
    own: within 0.02 of llama.cpp, the same next token at >= 95% of positions."""
    agree, diff = numpy_reference_agrees("olmoe", tmp_path)
    assert agree >= 0.95 and diff < 0.02, (agree, diff)
