"""olmo2 (llama.cpp ``src/models/olmo2.cpp``): no norms before attention or the FFN; RMS norms
on Q and K over the whole projection (all heads at once, before the heads are split); NEOX
RoPE; post-attention and post-FFN norms inside the residual branches; SiLU-gated FFN; untied
output head. OLMo 3 is the same architecture with ``attention.sliding_window``: then three
layers of four slide (or the file's pattern key), rotated with the global RoPE base and
unscaled."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skippy.runtime.families.base import (
    Family,
    T,
    bad,
    qkv_bias_tensors,
    read_decoder,
    read_int,
    read_swa_layers,
    tensor,
)
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import MAX_CONTEXT, ModelSpec, TensorSpec

ARCH = "olmo2"
SWA_PERIOD = 4  # llama.cpp's default period of the sliding-window pattern for olmo2


def read(kv: Mapping[str, Any]) -> ModelSpec:
    d = read_decoder(kv, ARCH)
    if d["n_head"] * d["head_dim"] != d["width"]:
        # llama.cpp's loader shapes attn_output and the K norm from embedding_length / heads
        raise bad(
            f"{ARCH} needs head_count x key_length == embedding_length "
            f"({d['n_head']} x {d['head_dim']} != {d['width']})",
            f"{ARCH}.attention.key_length",
        )
    window = f"{ARCH}.attention.sliding_window"
    if kv.get(window):
        d["sliding_window"] = read_int(kv, window, 1, MAX_CONTEXT)
        d["swa_layers"] = read_swa_layers(kv, ARCH, d["n_layer"], SWA_PERIOD)
        # olmo2.cpp rotates sliding layers with the global base (read_decoder's
        # rope_base_swa; the file's rope.freq_base_swa is unused) and unscaled
    return ModelSpec(**d)


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    w, q, kv, ff = spec.width, spec.q_dim, spec.kv_dim, spec.n_ff
    return [
        tensor(T.ATTN_Q, il, (w, q), "matrix"),
        tensor(T.ATTN_K, il, (w, kv), "matrix"),
        tensor(T.ATTN_V, il, (w, kv), "matrix"),
        *qkv_bias_tensors(spec, il, required=False),
        tensor(T.ATTN_Q_NORM, il, (q,), "vector"),
        tensor(T.ATTN_K_NORM, il, (kv,), "vector"),
        tensor(T.ATTN_OUT, il, (q, w), "matrix"),
        tensor(T.ATTN_POST_NORM, il, (w,), "vector"),
        tensor(T.FFN_GATE, il, (w, ff), "matrix"),
        tensor(T.FFN_UP, il, (w, ff), "matrix"),
        tensor(T.FFN_DOWN, il, (ff, w), "matrix"),
        tensor(T.FFN_POST_NORM, il, (w,), "vector"),
    ]


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    q, k, v = b.qkv(w, x, split_heads=False)
    q = b.heads(b.norm(q, w[T.ATTN_Q_NORM]), b.spec.n_head)
    k = b.heads(b.norm(k, w[T.ATTN_K_NORM]), b.spec.n_head_kv)
    q, k = b.rope(q, il), b.rope(k, il)
    o = b.linear(w[T.ATTN_OUT], b.attention(il, q, k, v, b.spec.attn_scale))
    o, x = b.last_rows(il, o, x)
    x = b.add(b.norm(o, w[T.ATTN_POST_NORM]), x)
    f = b.ffn(x, w[T.FFN_GATE], w[T.FFN_UP], w[T.FFN_DOWN], "silu")
    return b.add(b.norm(f, w[T.FFN_POST_NORM]), x)


FAMILY = Family(ARCH, read, layer_tensors, build_layer)
