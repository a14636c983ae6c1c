"""gemma2 (llama.cpp ``src/models/gemma2.cpp``): embeddings scaled by sqrt(width); norm
weights already include Gemma's +1; NEOX RoPE; sliding-window layers alternating with global
ones (even layers slide: period 2, or the file's pattern key; window 4096 unless the file
says); attention scores soft-capped (tanh(s / cap) * cap, cap 50 unless the file says) before
the softmax; Q scaled before attention; post-attention and post-FFN norms; GELU-tanh gated
FFN; tied output head with the final logits soft-capped (cap 30 unless the file says)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from skippy.runtime.boundary import StageUnsupported
from skippy.runtime.families.base import (
    Family,
    T,
    attention_tensors,
    bad,
    dense_ffn_tensors,
    read_decoder,
    read_float,
    read_int,
    read_swa_layers,
    tensor,
)
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import MAX_CONTEXT, ModelSpec, TensorSpec

ARCH = "gemma2"
SWA_PERIOD = 2  # llama.cpp: load_swa_pattern(ml, 2)
SLIDING_WINDOW = 4096  # llama.cpp's default n_swa for gemma2
FINAL_SOFTCAP = 30.0  # llama.cpp's default f_final_logit_softcapping
N_LAYER_27B = 46  # gemma2 27B scales attention by 1/sqrt(n_embd/n_head) (llama.cpp)


def read(kv: Mapping[str, Any]) -> ModelSpec:
    d = read_decoder(kv, ARCH, attn_softcap=True)
    a = f"{ARCH}."
    if d["rope_scale"] != 1.0:
        # llama.cpp scales gemma2's sliding layers too; the runtime's sliding layers never are
        raise StageUnsupported(
            "RoPE scaling on gemma2 is not implemented by the stage runtime",
            code="unsupported_rope_scaling",
            actual=ARCH,
            remediation="run this model with --engine llama",
        )
    d["sliding_window"] = read_int(
        kv, a + "attention.sliding_window", 1, MAX_CONTEXT, default=SLIDING_WINDOW
    )
    d["swa_layers"] = read_swa_layers(kv, ARCH, d["n_layer"], SWA_PERIOD)
    d["rope_base_swa"] = read_float(kv, a + "rope.freq_base_swa", d["rope_base"])
    cap = read_float(kv, a + "final_logit_softcapping", FINAL_SOFTCAP)
    if cap <= 0:
        raise bad(f"{a}final_logit_softcapping must be positive", a + "final_logit_softcapping")
    d["final_logit_softcap"] = cap
    scale_dim = d["width"] // d["n_head"] if d["n_layer"] == N_LAYER_27B else d["head_dim"]
    d["attn_scale"] = 1.0 / math.sqrt(scale_dim)
    d["scale_q_before_attention"] = True
    d["embed_scale"] = math.sqrt(d["width"])
    d["activation"] = "gelu_tanh"
    return ModelSpec(**d)


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    w = spec.width
    return [
        *attention_tensors(spec, il),
        *dense_ffn_tensors(spec, il),
        tensor(T.ATTN_POST_NORM, il, (w,), "vector"),
        tensor(T.FFN_POST_NORM, il, (w,), "vector"),
    ]


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    q, k, v = b.qkv(w, b.norm(x, w[T.ATTN_NORM]))
    q, k = b.rope(q, il), b.rope(k, il)
    q = b.scale(q, b.spec.attn_scale)
    o = b.linear(w[T.ATTN_OUT], b.attention(il, q, k, v, 1.0))
    o, x = b.last_rows(il, o, x)
    x = b.add(b.norm(o, w[T.ATTN_POST_NORM]), x)
    f = b.ffn(b.norm(x, w[T.FFN_NORM]), w[T.FFN_GATE], w[T.FFN_UP], w[T.FFN_DOWN], "gelu")
    return b.add(b.norm(f, w[T.FFN_POST_NORM]), x)


FAMILY = Family(ARCH, read, layer_tensors, build_layer)
