"""llama (llama.cpp ``src/models/llama.cpp``): RMS norms, RoPE in pairs (2i, 2i+1) with the
optional ``rope_freqs`` factors, optional Q/K/V and output biases, SiLU-gated FFN."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skippy.runtime.families.base import (
    Family,
    T,
    attention_tensors,
    dense_ffn_tensors,
    qkv_bias_tensors,
    read_decoder,
    tensor,
)
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import ModelSpec, TensorSpec

ARCH = "llama"


def read(kv: Mapping[str, Any]) -> ModelSpec:
    return ModelSpec(**{**read_decoder(kv, ARCH), "rope_style": "normal"})


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    return [
        *attention_tensors(spec, il),
        *qkv_bias_tensors(spec, il, required=False),
        tensor(T.ATTN_OUT, il, (spec.width,), "vector", False, "bias"),
        *dense_ffn_tensors(spec, il),
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
    f = b.ffn(b.norm(x, w[T.FFN_NORM]), w[T.FFN_GATE], w[T.FFN_UP], w[T.FFN_DOWN], "silu")
    return b.add(f, x)


FAMILY = Family(ARCH, read, layer_tensors, build_layer, model_tensors)
