"""qwen3 (llama.cpp ``src/models/qwen3.cpp``): per-head RMS norms on Q and K before NEOX
RoPE, no biases, SiLU-gated FFN."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skippy.runtime.families.base import (
    Family,
    T,
    attention_tensors,
    dense_ffn_tensors,
    qk_norm_tensors,
    read_decoder,
)
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import ModelSpec, TensorSpec

ARCH = "qwen3"


def read(kv: Mapping[str, Any]) -> ModelSpec:
    return ModelSpec(**read_decoder(kv, ARCH))


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    return [*attention_tensors(spec, il), *qk_norm_tensors(spec, il), *dense_ffn_tensors(spec, il)]


def attention_block(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    """Normed Q/K, RoPE, attention and the output projection (qwen3 and qwen3moe share it)."""
    q, k, v = b.qkv(w, b.norm(x, w[T.ATTN_NORM]))
    q, k = b.norm(q, w[T.ATTN_Q_NORM]), b.norm(k, w[T.ATTN_K_NORM])
    q, k = b.rope(q, il), b.rope(k, il)
    return b.linear(w[T.ATTN_OUT], b.attention(il, q, k, v, b.spec.attn_scale))


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    o, x = b.last_rows(il, attention_block(b, w, il, x), x)
    x = b.add(o, x)
    f = b.ffn(b.norm(x, w[T.FFN_NORM]), w[T.FFN_GATE], w[T.FFN_UP], w[T.FFN_DOWN], "silu")
    return b.add(f, x)


FAMILY = Family(ARCH, read, layer_tensors, build_layer)
