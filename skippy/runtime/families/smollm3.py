"""smollm3 (llama.cpp ``src/models/smollm3.cpp``): llama's layer (RMS norms, RoPE in pairs
(2i, 2i+1), optional Q/K/V biases, SiLU-gated FFN) without RoPE on every 4th layer (3, 7,
11...: the loader's fixed interval, no metadata key), no ``rope_freqs`` and no output bias."""

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

ARCH = "smollm3"
NO_ROPE_STEP = 4  # llama.cpp's n_no_rope_layer_step for smollm3: layer il skips RoPE when
# (il + 1) % 4 == 0


def read(kv: Mapping[str, Any]) -> ModelSpec:
    d = read_decoder(kv, ARCH)
    nope = frozenset(il for il in range(d["n_layer"]) if (il + 1) % NO_ROPE_STEP == 0)
    return ModelSpec(**{**d, "rope_style": "normal", "nope_layers": nope})


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    return [
        *attention_tensors(spec, il),
        *qkv_bias_tensors(spec, il, required=False),
        *dense_ffn_tensors(spec, il),
    ]


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    q, k, v = b.qkv(w, b.norm(x, w[T.ATTN_NORM]))
    if b.spec.uses_rope(il):
        q, k = b.rope(q, il), b.rope(k, il)
    o = b.linear(w[T.ATTN_OUT], b.attention(il, q, k, v, b.spec.attn_scale))
    o, x = b.last_rows(il, o, x)
    x = b.add(o, x)
    f = b.ffn(b.norm(x, w[T.FFN_NORM]), w[T.FFN_GATE], w[T.FFN_UP], w[T.FFN_DOWN], "silu")
    return b.add(f, x)


FAMILY = Family(ARCH, read, layer_tensors, build_layer)
