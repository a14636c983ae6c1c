"""olmoe (llama.cpp ``src/models/olmoe.cpp``): RMS norms over the whole Q and K projections
(before the split into heads), NEOX RoPE, and in every layer a mixture of experts (softmax
router, the ``expert_used_count`` most probable experts per token, their weights not
normalised), each expert ``feed_forward_length`` wide."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skippy.runtime.families.base import (
    Family,
    T,
    attention_tensors,
    expert_tensors,
    qkv_bias_tensors,
    read_decoder,
    read_experts,
    tensor,
)
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import ModelSpec, TensorSpec

ARCH = "olmoe"


def read(kv: Mapping[str, Any]) -> ModelSpec:
    d = read_decoder(kv, ARCH)
    d |= read_experts(kv, ARCH, d["n_ff"], own_width=False)
    return ModelSpec(**d, expert_weights_norm=False)


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    return [
        *attention_tensors(spec, il),
        *qkv_bias_tensors(spec, il, required=False),
        tensor(T.ATTN_Q_NORM, il, (spec.q_dim,), "vector"),
        tensor(T.ATTN_K_NORM, il, (spec.kv_dim,), "vector"),
        tensor(T.FFN_NORM, il, (spec.width,), "vector"),
        *expert_tensors(spec, il),
    ]


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    h = b.norm(x, w[T.ATTN_NORM])
    q, k, v = b.qkv(w, h, proj_norms=(w[T.ATTN_Q_NORM], w[T.ATTN_K_NORM]))
    q, k = b.rope(q, il), b.rope(k, il)
    o = b.linear(w[T.ATTN_OUT], b.attention(il, q, k, v, b.spec.attn_scale))
    o, x = b.last_rows(il, o, x)
    x = b.add(o, x)
    f = b.moe_ffn(
        b.norm(x, w[T.FFN_NORM]),
        w[T.FFN_GATE_INP],
        w[T.FFN_UP_EXP],
        w[T.FFN_GATE_EXP],
        w[T.FFN_DOWN_EXP],
        n_expert_used=b.spec.n_expert_used,
        norm_weights=False,
    )
    return b.add(f, x)


FAMILY = Family(ARCH, read, layer_tensors, build_layer, moe=True)
