"""Model hyperparameters and the tensors each stage must hold, per architecture (pure).

``ModelSpec.from_metadata`` reads the GGUF KV of a package's ``shared/metadata.gguf`` (the
full KV set of the source model) into one frozen value; ``stage_tensor_plan`` says, for a
layer range, exactly which tensors the stage's parts must contain, with their GGUF shapes
(ne0 first) and which types are allowed. Both engines (ggml and the numpy reference) take
these and nothing else, so an architecture detail lives in one place.

Supported: ``llama`` (incl. ``rope_freqs``), ``qwen2`` (q/k/v biases), ``qwen3`` (per-head
q/k RMS norms) and ``gemma3`` (docs/runtime-facts.md): embeddings scaled by sqrt(width);
norm weights already include Gemma's +1; per-head q/k norms; NEOX RoPE over the head;
sliding-window layers (``layer % 6 != 5`` or the file's pattern key) with base
``rope.freq_base_swa`` (default 10000) and global layers with ``rope.freq_base``;
post-attention and post-FFN norms; GELU-tanh gated FFN; tied output head. The RoPE styles
and attention scales follow llama.cpp's builders for these architectures. Anything else
(another architecture, MoE, YaRN scaling, an unknown tensor) is refused with a code, never
run approximately.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from skippy.constants import KEY_ARCHITECTURE, OUTPUT_WEIGHT_TENSOR, TOKEN_EMBEDDING_TENSOR
from skippy.errors import ModelError
from skippy.gguf.constants import GGML_TYPES, ggml_type_name
from skippy.package.ranges import LayerRange
from skippy.runtime.boundary import StageUnsupported

ARCHITECTURES: Final = ("llama", "qwen2", "qwen3", "gemma3")
# What to do with a model the stage runtime refuses: llama.cpp runs it whole, on one node.
LLAMA_HINT: Final = (
    "run the whole model on one node with llama.cpp: skippy-model-package run REF --engine llama"
)
RopeStyle = Literal["normal", "neox"]  # pairs (2i, 2i+1) | pairs (i, i + d/2)
Activation = Literal["silu", "gelu_tanh"]

# ggml types a weight matrix may have: ggml's CPU backend multiplies all of them and gguf-py
# dequantizes all of them (the numpy reference). Norms, biases and rope factors are F32 (what
# llama.cpp's converters write; ggml's broadcasting ops want F32 there).
F32: Final = 0
MATRIX_TYPES: Final = frozenset(
    {
        0,  # F32
        1,  # F16
        30,  # BF16
        2,  # Q4_0
        3,  # Q4_1
        6,  # Q5_0
        7,  # Q5_1
        8,  # Q8_0
        10,  # Q2_K
        11,  # Q3_K
        12,  # Q4_K
        13,  # Q5_K
        14,  # Q6_K
        20,  # IQ4_NL
        23,  # IQ4_XS
    }
)
VECTOR_TYPES: Final = frozenset({F32})

# Bounds that keep a hostile metadata file from making us allocate without limit.
MAX_WIDTH: Final = 1 << 16
MAX_HEADS: Final = 1 << 10
MAX_HEAD_DIM: Final = 1 << 11
MAX_FF: Final = 1 << 20
MAX_VOCAB: Final = 1 << 24
MAX_LAYERS: Final = 1 << 16
MAX_CONTEXT: Final = 1 << 24

ROPE_FREQS_TENSOR: Final = "rope_freqs.weight"
OUTPUT_NORM_TENSOR: Final = "output_norm.weight"


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Everything the forward pass needs to know about a model, read from its metadata."""

    arch: str
    n_layer: int
    width: int  # n_embd
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rms_eps: float
    context_length: int
    rope_style: RopeStyle
    rope_base: float
    rope_base_swa: float  # sliding-window layers (gemma3)
    rope_scale: float  # freq_scale = 1 / linear factor (1.0: none)
    sliding_window: int | None  # tokens a sliding layer sees, None: no sliding layers
    swa_layers: frozenset[int]
    attn_scale: float  # applied to q . k
    scale_q_before_attention: bool  # gemma3 scales q (llama.cpp), others scale in softmax
    embed_scale: float | None  # gemma3: sqrt(width)
    qk_norm: bool  # per-head RMS norms on q and k (qwen3, gemma3)
    post_norms: bool  # post-attention and post-FFN norms (gemma3)
    qkv_bias: Literal["none", "optional", "required"]
    activation: Activation
    final_logit_softcap: float | None

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    def is_swa(self, layer: int) -> bool:
        return layer in self.swa_layers

    def rope_base_for(self, layer: int) -> float:
        return self.rope_base_swa if self.is_swa(layer) else self.rope_base

    def rope_scale_for(self, layer: int) -> float:
        # llama.cpp: sliding layers of gemma3 keep scale 1.0; scaling applies to global ones.
        return 1.0 if self.is_swa(layer) else self.rope_scale

    @classmethod
    def from_metadata(cls, kv: Mapping[str, Any]) -> ModelSpec:
        return _spec_from_kv(kv)

    def to_dict(self) -> dict[str, Any]:
        return {
            "arch": self.arch,
            "n_layer": self.n_layer,
            "width": self.width,
            "n_head": self.n_head,
            "n_head_kv": self.n_head_kv,
            "head_dim": self.head_dim,
            "n_ff": self.n_ff,
            "sliding_window": self.sliding_window,
        }


# --- reading the metadata ---------------------------------------------------------------------
def _bad(message: str, key: str | None = None) -> ModelError:
    return ModelError(message, code="invalid_hyperparameters", actual=key)


def _int(kv: Mapping[str, Any], key: str, lo: int, hi: int, default: int | None = None) -> int:
    value = kv.get(key, default)
    if value is None:
        raise ModelError(
            f"the model metadata has no {key}", code="missing_hyperparameter", actual=key
        )
    if isinstance(value, bool) or not isinstance(value, int):
        # e.g. a per-layer array of head counts: a shape this runtime does not run
        raise StageUnsupported(
            f"{key} is {type(value).__name__} {str(value)[:40]}; the stage runtime needs one "
            "integer",
            code="unsupported_hyperparameter",
            actual=key,
        )
    if not lo <= value <= hi:
        raise _bad(f"{key} = {value} is outside {lo}..{hi}", key)
    return value


def _float(kv: Mapping[str, Any], key: str, default: float | None = None) -> float:
    value = kv.get(key, default)
    if value is None:
        raise ModelError(
            f"the model metadata has no {key}", code="missing_hyperparameter", actual=key
        )
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"{key} = {value!r} is not a finite number", key)
    return float(value)


def _swa_layers(kv: Mapping[str, Any], arch: str, n_layer: int) -> frozenset[int]:
    """Sliding-window layers of gemma3: the file's pattern key when present (an int period
    N: layer i slides unless i % N == N - 1; or one bool per layer), else llama.cpp's
    default period 6 (global layers 5, 11, 17 of gemma3-270m)."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = kv.get(key, 6)
    if isinstance(pattern, list):
        if len(pattern) != n_layer or not all(isinstance(p, bool) for p in pattern):
            raise _bad(f"{key} must hold one bool per layer ({n_layer})", key)
        return frozenset(i for i, p in enumerate(pattern) if p)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or not 1 <= pattern <= MAX_LAYERS:
        raise _bad(f"{key} = {pattern!r} is not a period in 1..{MAX_LAYERS}", key)
    return frozenset(i for i in range(n_layer) if i % pattern < pattern - 1)


def _rope_scale(kv: Mapping[str, Any], arch: str) -> float:
    kind = kv.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        factor = kv.get(f"{arch}.rope.scale_linear")  # the older spelling of linear scaling
        return 1.0 / _float(kv, f"{arch}.rope.scale_linear") if factor else 1.0
    if kind == "linear":
        factor = _float(kv, f"{arch}.rope.scaling.factor")
        if factor <= 0:
            raise _bad(f"{arch}.rope.scaling.factor must be positive", arch)
        return 1.0 / factor
    raise StageUnsupported(
        f"RoPE scaling {kind!r} is not implemented by the stage runtime (only none and linear)",
        code="unsupported_rope_scaling",
        actual=str(kind),
        remediation="run this model with --engine llama",
    )


def _spec_from_kv(kv: Mapping[str, Any]) -> ModelSpec:
    arch = kv.get(KEY_ARCHITECTURE)
    if arch not in ARCHITECTURES:
        raise StageUnsupported(
            f"architecture {arch!r} is not supported by the stage runtime "
            f"(supported: {', '.join(ARCHITECTURES)})",
            code="unsupported_architecture",
            actual=str(arch),
            remediation=LLAMA_HINT,
        )
    a = f"{arch}."
    if kv.get(a + "expert_count", 0):
        raise StageUnsupported(
            f"{arch} with experts (MoE) is not supported by the stage runtime (it runs dense "
            f"{', '.join(ARCHITECTURES)} models)",
            code="unsupported_architecture",
            actual=f"{arch} (MoE)",
            remediation=LLAMA_HINT + "; a split needs a dense model",
        )
    n_layer = _int(kv, a + "block_count", 1, MAX_LAYERS)
    width = _int(kv, a + "embedding_length", 1, MAX_WIDTH)
    n_head = _int(kv, a + "attention.head_count", 1, MAX_HEADS)
    n_head_kv = _int(kv, a + "attention.head_count_kv", 1, n_head, default=n_head)
    if n_head % n_head_kv:
        raise _bad(f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}", arch)
    default_hd = width // n_head if width % n_head == 0 else None
    head_dim = _int(kv, a + "attention.key_length", 2, MAX_HEAD_DIM, default=default_hd)
    v_dim = _int(kv, a + "attention.value_length", 2, MAX_HEAD_DIM, default=head_dim)
    rope_dims = _int(kv, a + "rope.dimension_count", 2, MAX_HEAD_DIM, default=head_dim)
    if v_dim != head_dim or rope_dims != head_dim or head_dim % 2:
        raise StageUnsupported(
            f"head dims k={head_dim} v={v_dim} rope={rope_dims}: the stage runtime needs one "
            "even head dimension, rotated whole",
            code="unsupported_hyperparameter",
            actual=arch,
        )
    n_ff = _int(kv, a + "feed_forward_length", 1, MAX_FF)
    eps = _float(kv, a + "attention.layer_norm_rms_epsilon")
    if not 0 < eps < 1:
        raise _bad(f"rms epsilon {eps} is outside (0, 1)", arch)
    context_length = _int(kv, a + "context_length", 1, MAX_CONTEXT, default=MAX_CONTEXT)
    rope_base = _float(kv, a + "rope.freq_base", 10000.0)
    if rope_base <= 0:
        raise _bad("rope.freq_base must be positive", arch)
    rope_scale = _rope_scale(kv, arch)
    softcap = kv.get(a + "final_logit_softcapping")
    softcap_value = _float(kv, a + "final_logit_softcapping") if softcap else None
    if kv.get(a + "attn_logit_softcapping"):
        raise StageUnsupported(
            "attention logit soft-capping is not implemented by the stage runtime",
            code="unsupported_hyperparameter",
            actual=arch,
        )
    gemma = arch == "gemma3"
    sliding = None
    swa_layers: frozenset[int] = frozenset()
    if gemma and kv.get(a + "attention.sliding_window"):
        sliding = _int(kv, a + "attention.sliding_window", 1, MAX_CONTEXT)
        swa_layers = _swa_layers(kv, arch, n_layer)
    rope_base_swa = _float(kv, a + "rope.freq_base_swa", 10000.0) if gemma else rope_base
    return ModelSpec(
        arch=arch,
        n_layer=n_layer,
        width=width,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=n_ff,
        rms_eps=eps,
        context_length=context_length,
        rope_style="normal" if arch == "llama" else "neox",
        rope_base=rope_base,
        rope_base_swa=rope_base_swa,
        rope_scale=rope_scale,
        sliding_window=sliding,
        swa_layers=swa_layers,
        # llama.cpp: 1/sqrt(head_dim); gemma3 27B (62 layers) uses 1/sqrt(n_embd/n_head).
        attn_scale=1.0 / math.sqrt(width / n_head if gemma and n_layer == 62 else head_dim),
        scale_q_before_attention=gemma,
        embed_scale=math.sqrt(width) if gemma else None,
        qk_norm=arch in ("qwen3", "gemma3"),
        post_norms=gemma,
        qkv_bias="required" if arch == "qwen2" else "optional" if arch == "llama" else "none",
        activation="gelu_tanh" if gemma else "silu",
        final_logit_softcap=softcap_value,
    )


# --- the tensors a stage holds ----------------------------------------------------------------
Kind = Literal["matrix", "vector"]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a stage needs: GGUF shape (ne0 first), kind (allowed types), required."""

    name: str
    shape: tuple[int, ...]
    kind: Kind
    required: bool = True

    @property
    def allowed_types(self) -> frozenset[int]:
        return MATRIX_TYPES if self.kind == "matrix" else VECTOR_TYPES


def layer_tensors(spec: ModelSpec, layer: int) -> list[TensorSpec]:
    w, q, kv, hd, ff = spec.width, spec.q_dim, spec.kv_dim, spec.head_dim, spec.n_ff
    p = f"blk.{layer}."
    out = [
        TensorSpec(p + "attn_norm.weight", (w,), "vector"),
        TensorSpec(p + "attn_q.weight", (w, q), "matrix"),
        TensorSpec(p + "attn_k.weight", (w, kv), "matrix"),
        TensorSpec(p + "attn_v.weight", (w, kv), "matrix"),
        TensorSpec(p + "attn_output.weight", (q, w), "matrix"),
        TensorSpec(p + "ffn_norm.weight", (w,), "vector"),
        TensorSpec(p + "ffn_gate.weight", (w, ff), "matrix"),
        TensorSpec(p + "ffn_up.weight", (w, ff), "matrix"),
        TensorSpec(p + "ffn_down.weight", (ff, w), "matrix"),
    ]
    if spec.qkv_bias != "none":
        required = spec.qkv_bias == "required"
        out += [
            TensorSpec(p + "attn_q.bias", (q,), "vector", required),
            TensorSpec(p + "attn_k.bias", (kv,), "vector", required),
            TensorSpec(p + "attn_v.bias", (kv,), "vector", required),
        ]
    if spec.arch == "llama":
        out.append(TensorSpec(p + "attn_output.bias", (w,), "vector", False))
    if spec.qk_norm:
        out += [
            TensorSpec(p + "attn_q_norm.weight", (hd,), "vector"),
            TensorSpec(p + "attn_k_norm.weight", (hd,), "vector"),
        ]
    if spec.post_norms:
        out += [
            TensorSpec(p + "post_attention_norm.weight", (w,), "vector"),
            TensorSpec(p + "post_ffw_norm.weight", (w,), "vector"),
        ]
    return out


def stage_tensors(
    spec: ModelSpec, layers: LayerRange, *, vocab: int | None, tied: bool
) -> list[TensorSpec]:
    """Every tensor a stage over ``layers`` may hold. ``vocab`` is the embedding row count
    (known once the embeddings or output part is open); ``tied``: logits through
    ``token_embd.weight``."""
    out: list[TensorSpec] = []
    if spec.arch == "llama":
        out.append(TensorSpec(ROPE_FREQS_TENSOR, (spec.head_dim // 2,), "vector", False))
    if vocab is not None and (layers.owns_input or (layers.owns_output and tied)):
        out.append(TensorSpec(TOKEN_EMBEDDING_TENSOR, (spec.width, vocab), "matrix"))
    for i in layers:
        out += layer_tensors(spec, i)
    if layers.owns_output:
        out.append(TensorSpec(OUTPUT_NORM_TENSOR, (spec.width,), "vector"))
        if vocab is not None and not tied:
            out.append(TensorSpec(OUTPUT_WEIGHT_TENSOR, (spec.width, vocab), "matrix"))
    return out


def attention_mask(
    start: int, n: int, window: int | None, *, n_kv: int | None = None
) -> npt.NDArray[np.float32]:
    """[n x n_kv] additive mask (``n_kv`` defaults to start+n; more keys are cells not yet
    written, masked): query i (position start+i) sees key j iff j <= start+i and, for a
    sliding layer, start+i - j < window (llama.cpp's LLAMA_SWA_TYPE_STANDARD)."""
    q = np.arange(start, start + n, dtype=np.int64)[:, None]
    k = np.arange(start + n if n_kv is None else n_kv, dtype=np.int64)[None, :]
    visible = k <= q
    if window is not None:
        visible &= (q - k) < window
    return np.where(visible, np.float32(0.0), np.float32("-inf")).astype(np.float32)


def type_name(type_id: int) -> str:
    return ggml_type_name(type_id) if type_id in GGML_TYPES else str(type_id)


def describe_allowed(allowed: frozenset[int], name: Callable[[int], str] = type_name) -> str:
    return ", ".join(sorted(name(t) for t in allowed))
