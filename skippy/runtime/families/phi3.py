"""phi3 (llama.cpp ``src/models/phi3.cpp``): one fused Q/K/V projection (``attn_qkv``, split
by views), NEOX RoPE, Q scaled by 1/sqrt(head_dim) before attention, and one fused gate+up
projection (``ffn_up`` is 2 x n_ff: SiLU of the first half times the second). llama.cpp turns
phi3's sliding window off, so it is ignored here too; the long-context variants' per-layer
``rope_factors_long``/``short`` are not in the plan (such files are refused when loaded)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skippy.runtime.families.base import Family, T, read_decoder, tensor
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import ModelSpec, TensorSpec

ARCH = "phi3"


def read(kv: Mapping[str, Any]) -> ModelSpec:
    d = read_decoder(kv, ARCH)
    d["scale_q_before_attention"] = True
    return ModelSpec(**d)


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    w, q, ff = spec.width, spec.q_dim, spec.n_ff
    return [
        tensor(T.ATTN_NORM, il, (w,), "vector"),
        tensor(T.ATTN_QKV, il, (w, q + 2 * spec.kv_dim), "matrix"),
        tensor(T.ATTN_OUT, il, (q, w), "matrix"),
        tensor(T.FFN_NORM, il, (w,), "vector"),
        tensor(T.FFN_UP, il, (w, 2 * ff), "matrix"),
        tensor(T.FFN_DOWN, il, (ff, w), "matrix"),
    ]


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    q, k, v = b.qkv(w, b.norm(x, w[T.ATTN_NORM]))
    q, k = b.rope(q, il), b.rope(k, il)
    q = b.scale(q, b.spec.attn_scale)
    o = b.linear(w[T.ATTN_OUT], b.attention(il, q, k, v, 1.0))
    o, x = b.last_rows(il, o, x)
    x = b.add(o, x)
    f = b.ffn(b.norm(x, w[T.FFN_NORM]), None, w[T.FFN_UP], w[T.FFN_DOWN], "silu")
    return b.add(f, x)


FAMILY = Family(ARCH, read, layer_tensors, build_layer)
