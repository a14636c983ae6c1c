"""phimoe (llama.cpp ``src/models/phimoe.cpp``, built by phi3's graph): RMS norms with biases
(attention, FFN and output norms), NEOX RoPE, Q scaled by 1/sqrt(head_dim) before attention,
optional Q/K/V biases and a required attention-output bias, a mixture-of-experts FFN in every
layer (softmax router, ``expert_used_count`` experts per token, weights normalised, each expert
``feed_forward_length`` wide), an untied output head with its bias. The long/short RoPE factor
tensors of 128k-context checkpoints are not in the plan (such a file is refused)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from skippy.runtime.families.base import (
    Family,
    T,
    attention_tensors,
    qkv_bias_tensors,
    read_decoder,
    read_experts,
    tensor,
)
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import ModelSpec, TensorSpec

ARCH = "phimoe"


def read(kv: Mapping[str, Any]) -> ModelSpec:
    d = read_decoder(kv, ARCH)
    return ModelSpec(
        **{
            **d,
            # llama.cpp scales Q by 1.0f / sqrtf(head_dim), in single precision
            "attn_scale": float(np.float32(1.0) / np.sqrt(np.float32(d["head_dim"]))),
            "scale_q_before_attention": True,
            # llama.cpp sizes phimoe's experts by feed_forward_length
            **read_experts(kv, ARCH, d["n_ff"], own_width=False),
        }
    )


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    w, ff, e = spec.width, spec.n_ff_exp, spec.n_expert
    return [
        *attention_tensors(spec, il),
        tensor(T.ATTN_NORM, il, (w,), "vector", suffix="bias"),
        *qkv_bias_tensors(spec, il, required=False),
        tensor(T.ATTN_OUT, il, (w,), "vector", suffix="bias"),
        tensor(T.FFN_NORM, il, (w,), "vector"),
        tensor(T.FFN_NORM, il, (w,), "vector", suffix="bias"),
        tensor(T.FFN_GATE_INP, il, (w, e), "matrix"),
        tensor(T.FFN_GATE_EXP, il, (w, ff, e), "matrix"),
        tensor(T.FFN_UP_EXP, il, (w, ff, e), "matrix"),
        tensor(T.FFN_DOWN_EXP, il, (ff, w, e), "matrix"),
    ]


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    h = b.norm(x, w[T.ATTN_NORM], w.get(T.ATTN_NORM, "bias"))
    q, k, v = b.qkv(w, h)
    q, k = b.rope(q, il), b.rope(k, il)
    q = b.scale(q, b.spec.attn_scale)
    o = b.linear(w[T.ATTN_OUT], b.attention(il, q, k, v, 1.0), w.get(T.ATTN_OUT, "bias"))
    o, x = b.last_rows(il, o, x)
    x = b.add(o, x)
    f = b.moe_ffn(
        b.norm(x, w[T.FFN_NORM], w.get(T.FFN_NORM, "bias")),
        w[T.FFN_GATE_INP],
        w[T.FFN_UP_EXP],
        w[T.FFN_GATE_EXP],
        w[T.FFN_DOWN_EXP],
        n_expert_used=b.spec.n_expert_used,
        norm_weights=True,
    )
    return b.add(x, f)


FAMILY = Family(ARCH, read, layer_tensors, build_layer, moe=True, output_biases=True)
