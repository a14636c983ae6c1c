"""llama (llama.cpp ``src/models/llama.cpp``): RMS norms, RoPE in pairs (2i, 2i+1) with the
optional ``rope_freqs`` factors, optional Q/K/V and output biases, SiLU-gated FFN. With
experts in the file (``expert_count`` > 0: Mixtral) every layer's FFN is a mixture of experts
instead, each ``feed_forward_length`` wide, the picked experts' weights normalised."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skippy.runtime.families.base import (
    Family,
    T,
    attention_tensors,
    dense_ffn_tensors,
    expert_tensors,
    qkv_bias_tensors,
    read_decoder,
    read_experts,
    tensor,
)
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import ModelSpec, TensorSpec

ARCH = "llama"


def read(kv: Mapping[str, Any]) -> ModelSpec:
    d = {**read_decoder(kv, ARCH), "rope_style": "normal"}
    if kv.get(f"{ARCH}.expert_count", 0):  # llama.cpp: 0 or absent is the dense model
        d |= read_experts(kv, ARCH, d["n_ff"], own_width=False)
    return ModelSpec(**d)


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    ffn = (
        [tensor(T.FFN_NORM, il, (spec.width,), "vector"), *expert_tensors(spec, il)]
        if spec.n_expert
        else dense_ffn_tensors(spec, il)
    )
    return [
        *attention_tensors(spec, il),
        *qkv_bias_tensors(spec, il, required=False),
        tensor(T.ATTN_OUT, il, (spec.width,), "vector", False, "bias"),
        *ffn,
    ]


def model_tensors(spec: ModelSpec) -> list[TensorSpec]:
    return [tensor(T.ROPE_FREQS, None, (spec.head_dim // 2,), "vector", False)]


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    q, k, v = b.qkv(w, b.norm(x, w[T.ATTN_NORM]))
    q, k = b.rope(q, il), b.rope(k, il)
    o = b.attention(il, q, k, v, b.spec.attn_scale)
    o = b.linear(w[T.ATTN_OUT], o, w.get(T.ATTN_OUT, "bias"))
    o, x = b.last_rows(il, o, x)
    x = b.add(o, x)
    h = b.norm(x, w[T.FFN_NORM])
    if b.spec.n_expert:
        f = b.moe_ffn(
            h,
            w[T.FFN_GATE_INP],
            w[T.FFN_UP_EXP],
            w[T.FFN_GATE_EXP],
            w[T.FFN_DOWN_EXP],
            n_expert_used=b.spec.n_expert_used,
            norm_weights=True,
        )
    else:
        f = b.ffn(h, w[T.FFN_GATE], w[T.FFN_UP], w[T.FFN_DOWN], "silu")
    return b.add(f, x)


FAMILY = Family(ARCH, read, layer_tensors, build_layer, model_tensors, moe_optional=True)
