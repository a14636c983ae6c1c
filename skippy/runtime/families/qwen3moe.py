"""qwen3moe (llama.cpp ``src/models/qwen3moe.cpp``): qwen3's attention (per-head Q/K norms,
NEOX RoPE) and a mixture-of-experts FFN in every layer: a router over ``expert_count``
experts, the ``expert_used_count`` most probable per token, their weights normalised
(``graph.GraphBuilder.moe_ffn``), no shared expert."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skippy.runtime.families.base import (
    Family,
    T,
    attention_tensors,
    expert_tensors,
    qk_norm_tensors,
    read_decoder,
    read_experts,
    tensor,
)
from skippy.runtime.families.qwen3 import attention_block
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import ModelSpec, TensorSpec

ARCH = "qwen3moe"


def read(kv: Mapping[str, Any]) -> ModelSpec:
    """The qwen3 hyperparameters plus the experts' (``read_experts``)."""
    d = read_decoder(kv, ARCH, dense_ffn=False)
    return ModelSpec(**{**d, **read_experts(kv, ARCH, d["n_ff"], own_width=True)})


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    return [
        *attention_tensors(spec, il),
        *qk_norm_tensors(spec, il),
        tensor(T.FFN_NORM, il, (spec.width,), "vector"),
        *expert_tensors(spec, il),
    ]


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    o, x = b.last_rows(il, attention_block(b, w, il, x), x)
    x = b.add(o, x)
    f = b.moe_ffn(
        b.norm(x, w[T.FFN_NORM]),
        w[T.FFN_GATE_INP],
        w[T.FFN_UP_EXP],
        w[T.FFN_GATE_EXP],
        w[T.FFN_DOWN_EXP],
        n_expert_used=b.spec.n_expert_used,
        norm_weights=True,
    )
    return b.add(f, x)


FAMILY = Family(ARCH, read, layer_tensors, build_layer, moe=True)
