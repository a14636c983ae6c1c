"""qwen2moe: a shared expert beside the routed ones, behind its own sigmoid gate, and the
widths llama.cpp reads for both. Parity with llama.cpp over every layout and dtype is the
canary's (``python -m skippy.runtime.canary.check qwen2moe``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from stagetools import numpy_reference_agrees

from skippy.errors import ModelError
from skippy.package.ranges import LayerRange
from skippy.runtime.families import spec_from_metadata, stage_tensors

pytestmark = pytest.mark.llama


def _kv(**keys: int | None) -> dict[str, Any]:
    kv: dict[str, Any] = {
        "general.architecture": "qwen2moe",
        "qwen2moe.block_count": 2,
        "qwen2moe.embedding_length": 64,
        "qwen2moe.feed_forward_length": 96,
        "qwen2moe.attention.head_count": 4,
        "qwen2moe.attention.head_count_kv": 2,
        "qwen2moe.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen2moe.expert_count": 8,
        "qwen2moe.expert_used_count": 2,
    }
    for key, value in keys.items():
        if value is None:
            kv.pop(f"qwen2moe.{key}")
        else:
            kv[f"qwen2moe.{key}"] = value
    return kv


@pytest.mark.parametrize(
    ("keys", "ff_exp", "ff_shexp"),
    [
        ({"expert_feed_forward_length": 32, "expert_shared_feed_forward_length": 80}, 32, 80),
        ({}, 48, 96),  # llama.cpp's defaults: n_ff / used, and n_ff
    ],
    ids=["keys", "defaults"],
)
def test_the_experts_and_the_shared_expert_have_llama_cpps_widths(
    keys: dict[str, int], ff_exp: int, ff_shexp: int
) -> None:
    spec = spec_from_metadata(_kv(**keys))
    assert (spec.n_ff_exp, spec.n_ff_shexp, spec.expert_weights_norm) == (ff_exp, ff_shexp, False)
    tensors = stage_tensors(spec, LayerRange(0, 1, 2), vocab=None, tied=False)
    plan = {t.name: t.shape for t in tensors}
    assert plan["blk.0.ffn_gate_exps.weight"] == (64, ff_exp, 8)
    assert plan["blk.0.ffn_gate_inp_shexp.weight"] == (64,)  # the gate is one row
    assert plan["blk.0.ffn_gate_shexp.weight"] == (64, ff_shexp)
    assert plan["blk.0.ffn_down_shexp.weight"] == (ff_shexp, 64)


def test_no_width_for_the_shared_expert_is_a_coded_error() -> None:
    """Neither expert_shared_feed_forward_length nor feed_forward_length: llama.cpp would
    build a 0-wide shared expert; this is refused before ggml, naming the key."""
    with pytest.raises(ModelError) as e:
        spec_from_metadata(_kv(feed_forward_length=None, expert_feed_forward_length=32))
    assert e.value.code == "missing_hyperparameter"
    assert "qwen2moe.expert_shared_feed_forward_length" in e.value.message


def test_the_numpy_reference_runs_the_shared_expert(tmp_path: Path) -> None:
    """The f32 oracle adds the gated shared expert on its own: within 0.02 of llama.cpp, the
    same next token at >= 95% of positions."""
    agree, diff = numpy_reference_agrees("qwen2moe", tmp_path)
    assert agree >= 0.95 and diff < 0.02, (agree, diff)
