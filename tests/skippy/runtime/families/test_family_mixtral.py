"""Mixtral: llama's family runs a llama file with experts (``expert_count`` > 0) as a mixture
of experts, as llama.cpp's llama builder does, and a llama file without them (or with 0) as
the dense model. Parity with llama.cpp over every layout and dtype is the canary's
(``python -m skippy.runtime.canary.check mixtral``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from stagetools import numpy_reference_agrees

from skippy.package.ranges import LayerRange
from skippy.runtime.families import spec_from_metadata, stage_tensors

pytestmark = pytest.mark.llama

FF = 96


def _kv(**experts: int) -> dict[str, Any]:
    kv: dict[str, Any] = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": FF,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
    }
    return kv | {f"llama.{k}": v for k, v in experts.items()}


def _layer_tensors(kv: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    spec = spec_from_metadata(kv)
    plan = stage_tensors(spec, LayerRange(0, 1, 2), vocab=None, tied=False)
    return {t.name: t.shape for t in plan if t.name.startswith("blk.0.ffn")}


def test_expert_count_decides_between_the_dense_ffn_and_experts_of_its_width() -> None:
    """8 experts, 2 used: the router and stacked experts, each feed_forward_length wide (no
    expert_feed_forward_length in llama's reading); absent or 0: the dense FFN."""
    spec = spec_from_metadata(_kv(expert_count=8, expert_used_count=2))
    assert (spec.n_expert, spec.n_expert_used, spec.n_ff_exp) == (8, 2, FF)
    assert spec.expert_weights_norm  # Mixtral normalises the picked experts' weights
    assert _layer_tensors(_kv(expert_count=8, expert_used_count=2)) == {
        "blk.0.ffn_norm.weight": (64,),
        "blk.0.ffn_gate_inp.weight": (64, 8),
        "blk.0.ffn_gate_exps.weight": (64, FF, 8),
        "blk.0.ffn_up_exps.weight": (64, FF, 8),
        "blk.0.ffn_down_exps.weight": (FF, 64, 8),
    }
    dense = {
        "blk.0.ffn_norm.weight": (64,),
        "blk.0.ffn_gate.weight": (64, FF),
        "blk.0.ffn_up.weight": (64, FF),
        "blk.0.ffn_down.weight": (FF, 64),
    }
    assert _layer_tensors(_kv()) == dense
    assert _layer_tensors(_kv(expert_count=0)) == dense


def test_experts_used_beyond_the_experts_is_a_coded_error() -> None:
    from skippy.errors import ModelError

    with pytest.raises(ModelError) as e:
        spec_from_metadata(_kv(expert_count=4, expert_used_count=5))
    assert e.value.code == "invalid_hyperparameters"
    assert "llama.expert_used_count" in e.value.message


def test_the_numpy_reference_runs_mixtral(tmp_path: Path) -> None:
    """The f32 oracle computes the experts on its own: within 0.02 of llama.cpp, the same
    next token at >= 95% of positions (weights not normalised would be 0.8+ apart)."""
    agree, diff = numpy_reference_agrees("mixtral", tmp_path)
    assert agree >= 0.95 and diff < 0.02, (agree, diff)
