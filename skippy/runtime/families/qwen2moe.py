"""qwen2moe (llama.cpp ``src/models/qwen2moe.cpp``): qwen2's attention (Q/K/V biases, NEOX
RoPE) and in every layer a mixture of experts (softmax router, the ``expert_used_count`` most
probable experts per token, their weights not normalised) plus a shared expert every token
runs, scaled by its own sigmoid gate (``graph.GraphBuilder.shared_expert``)."""

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
    read_int,
    tensor,
)
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import MAX_FF, ModelSpec, TensorSpec

ARCH = "qwen2moe"


def read(kv: Mapping[str, Any]) -> ModelSpec:
    """The qwen2 hyperparameters, the experts' (``read_experts``; each expert
    ``expert_feed_forward_length`` wide) and the shared expert's width
    (``expert_shared_feed_forward_length``, default ``feed_forward_length``, as llama.cpp)."""
    d = read_decoder(kv, ARCH, dense_ffn=False)
    d |= read_experts(kv, ARCH, d["n_ff"], own_width=True)
    d["n_ff_shexp"] = read_int(
        kv,
        f"{ARCH}.expert_shared_feed_forward_length",
        1,
        MAX_FF,
        default=d["n_ff"] or None,  # 0 (absent): no width to fall back on
    )
    return ModelSpec(**d, expert_weights_norm=False)


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    w, ff = spec.width, spec.n_ff_shexp
    return [
        *attention_tensors(spec, il),
        *qkv_bias_tensors(spec, il, required=False),
        tensor(T.FFN_NORM, il, (w,), "vector"),
        *expert_tensors(spec, il),
        tensor(T.FFN_GATE_INP_SHEXP, il, (w,), "vector"),
        tensor(T.FFN_GATE_SHEXP, il, (w, ff), "matrix"),
        tensor(T.FFN_UP_SHEXP, il, (w, ff), "matrix"),
        tensor(T.FFN_DOWN_SHEXP, il, (ff, w), "matrix"),
    ]


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    q, k, v = b.qkv(w, b.norm(x, w[T.ATTN_NORM]))
    q, k = b.rope(q, il), b.rope(k, il)
    o = b.linear(w[T.ATTN_OUT], b.attention(il, q, k, v, b.spec.attn_scale))
    o, x = b.last_rows(il, o, x)
    x = b.add(o, x)
    h = b.norm(x, w[T.FFN_NORM])
    f = b.moe_ffn(
        h,
        w[T.FFN_GATE_INP],
        w[T.FFN_UP_EXP],
        w[T.FFN_GATE_EXP],
        w[T.FFN_DOWN_EXP],
        n_expert_used=b.spec.n_expert_used,
        norm_weights=False,
    )
    shared = b.shared_expert(
        h, w[T.FFN_GATE_INP_SHEXP], w[T.FFN_GATE_SHEXP], w[T.FFN_UP_SHEXP], w[T.FFN_DOWN_SHEXP]
    )
    return b.add(b.add(f, shared), x)


FAMILY = Family(ARCH, read, layer_tensors, build_layer, moe=True)
