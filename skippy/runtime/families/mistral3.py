"""mistral3 (llama.cpp ``src/models/mistral3.cpp``; Ministral 3): llama's block (RMS norms,
RoPE in pairs (2i, 2i+1) with optional ``rope_freqs``, optional biases, SiLU-gated FFN) with
YaRN RoPE scaling (``rope.scaling.type = yarn``: factor, beta fast/slow, log multiplier,
original context) and, where ``attention.temperature_scale`` is set, Q scaled per position by
log(floor(pos / original context) + 1) * scale + 1 before attention."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skippy.runtime.families import llama
from skippy.runtime.families.base import Family, T, read_decoder, read_float, read_int
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import MAX_CONTEXT, AttnTemperature, ModelSpec

ARCH = "mistral3"


def read(kv: Mapping[str, Any]) -> ModelSpec:
    d = read_decoder(kv, ARCH, yarn=True)
    d["rope_style"] = "normal"
    a = f"{ARCH}."
    temp_scale = read_float(kv, a + "attention.temperature_scale", 0.0)
    if temp_scale != 0.0:
        # llama.cpp floors positions by the original (pre-YaRN) context
        yarn = d.get("yarn")
        floor_scale = (
            yarn.n_ctx_orig
            if yarn is not None
            else read_int(
                kv,
                a + "rope.scaling.original_context_length",
                1,
                MAX_CONTEXT,
                default=d["context_length"],
            )
        )
        d["attn_temperature"] = AttnTemperature(temp_scale, floor_scale)
    return ModelSpec(**d)


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    q, k, v = b.qkv(w, b.norm(x, w[T.ATTN_NORM]))
    q, k = b.rope(q, il), b.rope(k, il)
    q = b.temperature(q)
    o = b.attention(il, q, k, v, b.spec.attn_scale)
    o = b.linear(w[T.ATTN_OUT], o, w.get(T.ATTN_OUT, "bias"))
    o, x = b.last_rows(il, o, x)
    x = b.add(o, x)
    f = b.ffn(b.norm(x, w[T.FFN_NORM]), w[T.FFN_GATE], w[T.FFN_UP], w[T.FFN_DOWN], "silu")
    return b.add(f, x)


FAMILY = Family(ARCH, read, llama.layer_tensors, build_layer, llama.model_tensors)
