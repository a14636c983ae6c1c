"""llama4 (llama.cpp ``src/models/llama4.cpp``; Llama 4 Scout and Maverick): llama's block
(RMS pre-norms, RoPE in pairs (2i, 2i+1) with optional ``rope_freqs``, optional Q/K/V biases)
with chunked attention on three layers of every four (each position sees only its own chunk
of 8192, aligned to multiples of it; the file's ``attention.sliding_window_pattern`` may say
otherwise), no RoPE on every 4th layer (3, 7, 11...: the loader's fixed step) whose Q is
instead scaled by the attention temperature log(floor((pos + 1) / 8192) + 1) * 0.1 + 1, an
RMS norm without weight ("L2 norm") of the rotated Q and K unless the model has 128 experts
(Maverick), and a mixture of experts every ``interleave_moe_layer_step``-th layer (dense FFNs
between): experts picked by their raw router logits, each picked expert's input multiplied by
the sigmoid of its logit before it runs, plus a shared expert as wide as the routed ones.

The pinned llama.cpp fixes the chunk (8192) and the temperature's constants for every chunked
file (no metadata key sets them); a file whose ``attention.sliding_window`` is 0 (no chunking)
is refused (llama.cpp asserts on it: the temperature's scale is left 0). The rows whose
logits are not wanted are dropped after the last layer's attention, as llama.cpp's builder
does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from skippy.runtime.boundary import StageUnsupported
from skippy.runtime.families import llama
from skippy.runtime.families.base import (
    Family,
    T,
    attention_tensors,
    bad,
    dense_ffn_tensors,
    expert_tensors,
    qkv_bias_tensors,
    read_decoder,
    read_experts,
    read_float,
    read_int,
    read_swa_layers,
    rope_scale_train,
    tensor,
)
from skippy.runtime.graph import GraphBuilder, LayerWeights
from skippy.runtime.model import MAX_FF, MAX_LAYERS, AttnTemperature, ModelSpec, TensorSpec

ARCH = "llama4"
# llama.cpp 0.3.36's llama4 loader, for a chunked file: n_swa, the temperature's floor scale,
# scale and offset are constants, the pattern 3 chunked - 1 full, RoPE skipped every 4th layer
CHUNK: Final = 8192
TEMPERATURE: Final = AttnTemperature(scale=0.1, floor_scale=8192, offset=1.0)
SWA_PERIOD: Final = 4
NO_ROPE_STEP: Final = 4
# llama.cpp normalises Q and K unless the model is the 17B-128E type (Maverick), which its
# loader tells by the expert count alone
NO_QK_NORM_EXPERTS: Final = 128


def read(kv: Mapping[str, Any]) -> ModelSpec:
    a = f"{ARCH}."
    swa = kv.get(a + "attention.sliding_window")
    if swa is not None and read_int(kv, a + "attention.sliding_window", 0, 1 << 31) == 0:
        raise StageUnsupported(
            f"{a}attention.sliding_window = 0 (llama4 without chunked attention) is not run by "
            "the stage runtime: llama.cpp's graph for it scales the last layer's Q by an "
            "attention temperature its loader leaves unset (llama.cpp itself aborts on it)",
            code="unsupported_hyperparameter",
            actual=a + "attention.sliding_window",
        )
    # llama.cpp's llama4 loader reads no YaRN beta or log-multiplier key: its defaults
    d = read_decoder(kv, ARCH, dense_ffn=False, yarn=True, yarn_tuning_keys=False)
    d["rope_style"] = "normal"
    n_layer = d["n_layer"]
    # both required by llama.cpp's loader
    step = read_int(kv, a + "interleave_moe_layer_step", 0, MAX_LAYERS)
    read_int(kv, a + "expert_feed_forward_length", 1, MAX_FF)
    if any(not _is_moe(step, il) for il in range(n_layer)) and d["n_ff"] < 1:
        raise bad(
            f"{a}feed_forward_length is missing or 0, but interleave_moe_layer_step = {step} "
            "leaves dense layers that need it",
            a + "feed_forward_length",
        )
    experts = read_experts(kv, ARCH, d["n_ff"], own_width=True)
    d["sliding_window"] = CHUNK
    d["swa_type"] = "chunked"
    d["swa_layers"] = read_swa_layers(kv, ARCH, n_layer, SWA_PERIOD)
    d["nope_layers"] = frozenset(il for il in range(n_layer) if (il + 1) % NO_ROPE_STEP == 0)
    d["rope_base_swa"] = read_float(kv, a + "rope.freq_base_swa", d["rope_base"])
    if d["rope_base_swa"] <= 0:
        raise bad(f"{a}rope.freq_base_swa must be positive", a + "rope.freq_base_swa")
    d["rope_scale_swa"] = rope_scale_train(kv, ARCH)
    d["attn_temperature"] = TEMPERATURE
    # 1.0f / sqrtf(float(n_embd_head)), in single precision
    d["attn_scale"] = float(np.float32(1.0) / np.sqrt(np.float32(d["head_dim"])))
    d |= experts
    d["expert_weights_norm"] = False
    d["expert_gating"] = "sigmoid"
    d["n_ff_shexp"] = experts["n_ff_exp"]  # llama.cpp sizes the shared expert as a routed one
    d["dense_layers"] = frozenset(il for il in range(n_layer) if not _is_moe(step, il))
    d["qk_rms_norm"] = experts["n_expert"] != NO_QK_NORM_EXPERTS
    return ModelSpec(**d)


def _is_moe(step: int, il: int) -> bool:
    return step > 0 and (il + 1) % step == 0


def layer_tensors(spec: ModelSpec, il: int) -> list[TensorSpec]:
    w, ff = spec.width, spec.n_ff_shexp
    if il not in spec.dense_layers:
        ffn = [
            tensor(T.FFN_NORM, il, (w,), "vector"),
            *expert_tensors(spec, il),
            tensor(T.FFN_GATE_SHEXP, il, (w, ff), "matrix"),
            tensor(T.FFN_UP_SHEXP, il, (w, ff), "matrix"),
            tensor(T.FFN_DOWN_SHEXP, il, (ff, w), "matrix"),
        ]
    else:
        ffn = dense_ffn_tensors(spec, il)
    return [*attention_tensors(spec, il), *qkv_bias_tensors(spec, il, required=False), *ffn]


def build_layer(b: GraphBuilder, w: LayerWeights, il: int, x: int) -> int:
    spec = b.spec
    q, k, v = b.qkv(w, b.norm(x, w[T.ATTN_NORM]))
    if spec.uses_rope(il):
        q, k = b.rope(q, il), b.rope(k, il)
        if spec.qk_rms_norm:
            q, k = b.rms(q), b.rms(k)
    else:
        q = b.temperature(q)
    o = b.linear(w[T.ATTN_OUT], b.attention(il, q, k, v, spec.attn_scale))
    o, x = b.last_rows(il, o, x)
    x = b.add(o, x)
    h = b.norm(x, w[T.FFN_NORM])
    if il not in spec.dense_layers:
        routed = b.moe_ffn(
            h,
            w[T.FFN_GATE_INP],
            w[T.FFN_UP_EXP],
            w[T.FFN_GATE_EXP],
            w[T.FFN_DOWN_EXP],
            n_expert_used=spec.n_expert_used,
            norm_weights=False,
            gating=spec.expert_gating,
            weight_before_ffn=True,
        )
        shared = b.ffn(h, w[T.FFN_GATE_SHEXP], w[T.FFN_UP_SHEXP], w[T.FFN_DOWN_SHEXP], "silu")
        f = b.add(routed, shared)
    else:
        f = b.ffn(h, w[T.FFN_GATE], w[T.FFN_UP], w[T.FFN_DOWN], "silu")
    return b.add(f, x)


FAMILY = Family(
    ARCH, read, layer_tensors, build_layer, llama.model_tensors, moe=True, numpy_reference=False
)
