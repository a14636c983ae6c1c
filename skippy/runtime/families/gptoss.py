"""gpt-oss (llama.cpp ``src/models/openai-moe.cpp``, architecture ``gpt-oss``): RMS pre-norms
(the FFN's is the file's ``attn_post_norm``), Q/K/V with optional biases, NEOX RoPE with the
file's scaling (YaRN in real checkpoints, sliding layers scaled too), attention sinks (one
learned logit per head in every softmax), sliding-window layers alternating with global ones
(even layers slide: period 2, or the file's pattern key), an attention-output bias, and a
mixture of experts in every layer with a biased router, experts picked by their raw router
logits and weighted by a softmax over the picked ones, biased experts and the clamped SwiGLU
(``ggml_swiglu_oai``). The rows whose logits are not wanted are dropped after the last layer,
not inside it (llama.cpp's builder does so when no MTP head reads the hidden states). Real
checkpoints store the experts in MXFP4."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from skippy.runtime.families.base import (
    Family,
    T,
    attention_tensors,
    bad,
    qkv_bias_tensors,
    read_decoder,
    read_experts,
    read_float,
    read_int,
    read_swa_layers,
    rope_scale_train,
    tensor,
)
from skippy.runtime.graph import ExpertBiases, GraphBuilder, LayerWeights
from skippy.runtime.model import MAX_CONTEXT, MAX_FF, ModelSpec, TensorSpec

ARCH = "gpt-oss"
SWA_PERIOD = 2  # llama.cpp: load_swa_pattern(ml, 2)


def read(kv: Mapping[str, Any]) -> ModelSpec:
    a = f"{ARCH}."
    # llama.cpp's gpt-oss loader reads no YaRN beta or log-multiplier key: its defaults
    d = read_decoder(kv, ARCH, dense_ffn=False, yarn=True, yarn_tuning_keys=False)
    # llama.cpp requires both keys for gpt-oss (no default width, no default window)
    read_int(kv, a + "expert_feed_forward_length", 1, MAX_FF)
    experts = read_experts(kv, ARCH, d["n_ff"], own_width=True)
    d["sliding_window"] = read_int(kv, a + "attention.sliding_window", 1, MAX_CONTEXT)
    d["swa_layers"] = read_swa_layers(kv, ARCH, d["n_layer"], SWA_PERIOD)
    d["rope_base_swa"] = read_float(kv, a + "rope.freq_base_swa", d["rope_base"])
    if d["rope_base_swa"] <= 0:
        raise bad(f"{a}rope.freq_base_swa must be positive", a + "rope.freq_base_swa")
    d["rope_scale_swa"] = rope_scale_train(kv, ARCH)  # the sliding layers'
    # 1.0f / sqrtf(float(n_rot)), in single precision
    d["attn_scale"] = float(np.float32(1.0) / np.sqrt(np.float32(d["head_dim"])))
    return ModelSpec(**{**d, **experts, "expert_weights_norm": False})


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    w, ff, e = spec.width, spec.n_ff_exp, spec.n_expert
    return [
        *attention_tensors(spec, il),
        *qkv_bias_tensors(spec, il, required=False),
        tensor(T.ATTN_OUT, il, (w,), "vector", suffix="bias"),
        tensor(T.ATTN_SINKS, il, (spec.n_head,), "vector"),
        tensor(T.ATTN_POST_NORM, il, (w,), "vector"),
        tensor(T.FFN_GATE_INP, il, (w, e), "matrix"),
        tensor(T.FFN_GATE_INP, il, (e,), "vector", suffix="bias"),
        tensor(T.FFN_GATE_EXP, il, (w, ff, e), "matrix"),
        tensor(T.FFN_UP_EXP, il, (w, ff, e), "matrix"),
        tensor(T.FFN_DOWN_EXP, il, (ff, w, e), "matrix"),
        tensor(T.FFN_GATE_EXP, il, (ff, e), "vector", suffix="bias"),
        tensor(T.FFN_UP_EXP, il, (ff, e), "vector", suffix="bias"),
        tensor(T.FFN_DOWN_EXP, il, (w, e), "vector", suffix="bias"),
    ]


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    q, k, v = b.qkv(w, b.norm(x, w[T.ATTN_NORM]))
    q, k = b.rope(q, il), b.rope(k, il)
    o = b.attention(il, q, k, v, b.spec.attn_scale, sinks=w[T.ATTN_SINKS])
    x = b.add(b.linear(w[T.ATTN_OUT], o, w.get(T.ATTN_OUT, "bias")), x)
    f = b.moe_ffn(
        b.norm(x, w[T.ATTN_POST_NORM]),
        w[T.FFN_GATE_INP],
        w[T.FFN_UP_EXP],
        w[T.FFN_GATE_EXP],
        w[T.FFN_DOWN_EXP],
        n_expert_used=b.spec.n_expert_used,
        norm_weights=False,
        gating="softmax_weight",
        biases=ExpertBiases(
            router=w.get(T.FFN_GATE_INP, "bias"),
            up=w.get(T.FFN_UP_EXP, "bias"),
            gate=w.get(T.FFN_GATE_EXP, "bias"),
            down=w.get(T.FFN_DOWN_EXP, "bias"),
        ),
        act="swiglu_oai",
    )
    return b.final_rows(il, b.add(f, x))


FAMILY = Family(ARCH, read, layer_tensors, build_layer, moe=True, numpy_reference=False)
