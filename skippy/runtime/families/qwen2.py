"""qwen2 (llama.cpp ``src/models/qwen2.cpp``): the llama block with required Q/K/V biases,
NEOX RoPE and no output bias."""

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
)
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import ModelSpec, TensorSpec

ARCH = "qwen2"


def read(kv: Mapping[str, Any]) -> ModelSpec:
    return ModelSpec(**read_decoder(kv, ARCH))


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    return [
        *attention_tensors(spec, il),
        *qkv_bias_tensors(spec, il, required=True),
        *dense_ffn_tensors(spec, il),
    ]


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    q, k, v = b.qkv(w, b.norm(x, w[T.ATTN_NORM]))
    q, k = b.rope(q, il), b.rope(k, il)
    o = b.linear(w[T.ATTN_OUT], b.attention(il, q, k, v, b.spec.attn_scale))
    o, x = b.last_rows(il, o, x)
    x = b.add(o, x)
    f = b.ffn(b.norm(x, w[T.FFN_NORM]), w[T.FFN_GATE], w[T.FFN_UP], w[T.FFN_DOWN], "silu")
    return b.add(f, x)


FAMILY = Family(ARCH, read, layer_tensors, build_layer)
