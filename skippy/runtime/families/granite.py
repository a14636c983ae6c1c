"""granite (llama.cpp ``src/models/granite.cpp``): llama's layer (RMS norms, RoPE in pairs
with the optional ``rope_freqs`` factors, optional Q/K/V and output biases, SiLU-gated FFN)
with granite's four multipliers: embeddings times ``embedding_scale``, each residual branch's
output times ``residual_scale`` before its add, attention scores times ``attention.scale``
(instead of 1/sqrt(head_dim)) and the logits divided by ``logit_scale``. A multiplier of 0
(or absent, except the logit scale, which is required) leaves that step out, as llama.cpp."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from gguf import Keys

from skippy.runtime.boundary import StageUnsupported
from skippy.runtime.families.base import (
    Family,
    T,
    attention_tensors,
    bad,
    dense_ffn_tensors,
    qkv_bias_tensors,
    read_decoder,
    read_float,
    tensor,
)
from skippy.runtime.families.llama import model_tensors
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import ModelSpec, TensorSpec

ARCH = "granite"


def read_granite(kv: Mapping[str, Any], arch: str, *, dense_ffn: bool = True) -> dict[str, Any]:
    """llama's hyperparameters plus granite's multipliers, as ``ModelSpec`` keyword arguments
    (granitemoe reads the same keys)."""
    d = read_decoder(kv, arch, dense_ffn=dense_ffn)

    def key(k: str) -> str:
        return k.format(arch=arch)

    if kv.get(key(Keys.Rope.SCALING_FINETUNED), True) is not True:
        # llama.cpp reads rope.scaling.finetuned = false as "no RoPE in any layer"
        raise StageUnsupported(
            f"{key(Keys.Rope.SCALING_FINETUNED)} is not true: a {arch} model without RoPE is "
            "not implemented by the stage runtime",
            code="unsupported_hyperparameter",
            actual=key(Keys.Rope.SCALING_FINETUNED),
            remediation="run this model with --engine llama",
        )
    logit = read_float(kv, key(Keys.LLM.LOGIT_SCALE))
    if logit == 0:
        raise bad(
            f"{key(Keys.LLM.LOGIT_SCALE)} is 0: the logits are divided by it (is the metadata "
            "corrupt?)",
            key(Keys.LLM.LOGIT_SCALE),
        )
    embedding = read_float(kv, key(Keys.LLM.EMBEDDING_SCALE), 0.0)
    residual = read_float(kv, key(Keys.LLM.RESIDUAL_SCALE), 0.0)
    attention = read_float(kv, key(Keys.Attention.SCALE), 0.0)
    return {
        **d,
        "rope_style": "normal",
        # llama.cpp computes 1.0f / f_logit_scale in single precision
        "logit_scale": float(np.float32(1.0) / np.float32(logit)),
        "embed_scale": embedding or None,
        "residual_scale": residual or None,
        "attn_scale": attention or d["attn_scale"],
    }


def read(kv: Mapping[str, Any]) -> ModelSpec:
    return ModelSpec(**read_granite(kv, ARCH))


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    return [
        *attention_tensors(spec, il),
        *qkv_bias_tensors(spec, il, required=False),
        tensor(T.ATTN_OUT, il, (spec.width,), "vector", False, "bias"),
        *dense_ffn_tensors(spec, il),
    ]


FeedForward = Callable[[GraphBuilder, LayerWeights, int], int]  # (b, w, normed x) -> out


def granite_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int, ffn: FeedForward) -> int:
    """granite's layer around its feed-forward block ``ffn`` (dense or experts): llama's
    attention at the model's attention scale, each branch's output scaled before its add."""
    q, k, v = b.qkv(w, b.norm(x, w[T.ATTN_NORM]))
    q, k = b.rope(q, il), b.rope(k, il)
    o = b.attention(il, q, k, v, b.spec.attn_scale)
    o = b.linear(w[T.ATTN_OUT], o, w.get(T.ATTN_OUT, "bias"))
    o, x = b.last_rows(il, o, x)
    rs = b.spec.residual_scale
    x = b.add(b.scale(o, rs) if rs is not None else o, x)
    f = ffn(b, w, b.norm(x, w[T.FFN_NORM]))
    return b.add(b.scale(f, rs) if rs is not None else f, x)


def _dense(b: GraphBuilder, w: LayerWeights, h: int) -> int:
    return b.ffn(h, w[T.FFN_GATE], w[T.FFN_UP], w[T.FFN_DOWN], "silu")


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    return granite_layer(b, w, il, x, _dense)


FAMILY = Family(ARCH, read, layer_tensors, build_layer, model_tensors)
