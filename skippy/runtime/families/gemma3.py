"""gemma3 (llama.cpp ``src/models/gemma3.cpp``; docs/runtime-facts.md): embeddings scaled by
sqrt(width); norm weights already include Gemma's +1; per-head Q/K norms; NEOX RoPE;
sliding-window layers (``layer % 6 != 5`` or the file's pattern key) with their own RoPE base
(``rope.freq_base_swa``, default 10000) and no RoPE scaling; Q scaled before attention;
post-attention and post-FFN norms; GELU-tanh gated FFN; tied output head."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from skippy.runtime.families.base import (
    Family,
    T,
    attention_tensors,
    dense_ffn_tensors,
    qk_norm_tensors,
    read_decoder,
    read_float,
    read_int,
    read_swa_layers,
    tensor,
)
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import MAX_CONTEXT, ModelSpec, TensorSpec

ARCH = "gemma3"
# llama.cpp's default period of the sliding-window pattern (load_swa_pattern(ml, 6))
SWA_PERIOD = 6
N_LAYER_27B = 62  # gemma3 27B scales attention by 1/sqrt(n_embd/n_head) (llama.cpp)


def read(kv: Mapping[str, Any]) -> ModelSpec:
    d = read_decoder(kv, ARCH)
    a = f"{ARCH}."
    if kv.get(a + "attention.sliding_window"):
        d["sliding_window"] = read_int(kv, a + "attention.sliding_window", 1, MAX_CONTEXT)
        d["swa_layers"] = read_swa_layers(kv, ARCH, d["n_layer"], SWA_PERIOD)
    d["rope_base_swa"] = read_float(kv, a + "rope.freq_base_swa", 10000.0)
    scale_dim = d["width"] / d["n_head"] if d["n_layer"] == N_LAYER_27B else d["head_dim"]
    d["attn_scale"] = 1.0 / math.sqrt(scale_dim)
    d["scale_q_before_attention"] = True
    d["embed_scale"] = math.sqrt(d["width"])
    d["activation"] = "gelu_tanh"
    return ModelSpec(**d)


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    w = spec.width
    return [
        *attention_tensors(spec, il),
        *qk_norm_tensors(spec, il),
        *dense_ffn_tensors(spec, il),
        tensor(T.ATTN_POST_NORM, il, (w,), "vector"),
        tensor(T.FFN_POST_NORM, il, (w,), "vector"),
    ]


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    q, k, v = b.qkv(w, b.norm(x, w[T.ATTN_NORM]))
    q, k = b.norm(q, w[T.ATTN_Q_NORM]), b.norm(k, w[T.ATTN_K_NORM])
    q, k = b.rope(q, il), b.rope(k, il)
    q = b.scale(q, b.spec.attn_scale)
    o = b.linear(w[T.ATTN_OUT], b.attention(il, q, k, v, 1.0))
    o, x = b.last_rows(il, o, x)
    x = b.add(b.norm(o, w[T.ATTN_POST_NORM]), x)
    f = b.ffn(b.norm(x, w[T.FFN_NORM]), w[T.FFN_GATE], w[T.FFN_UP], w[T.FFN_DOWN], "gelu")
    return b.add(b.norm(f, w[T.FFN_POST_NORM]), x)


FAMILY = Family(ARCH, read, layer_tensors, build_layer)
