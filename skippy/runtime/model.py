"""The family-independent view of a model and of the tensors a stage holds (pure).

``ModelSpec`` is what the rest of the runtime reads about a model (layer count, width, heads,
context limit, RoPE, sliding windows, scales); each family (``skippy.runtime.families``) builds
it from the GGUF KV of a package's ``shared/metadata.gguf``, bounds-checked, with coded errors.
``TensorSpec`` is one entry of a stage's tensor plan (GGUF shape, ne0 first, and the types
allowed; named by ``tensor_name``, from gguf-py); the families say which tensors a layer range
holds (``skippy.runtime.families.stage_tensors``). Anything a family does not run (another
architecture, YaRN scaling, an unknown tensor) is refused with a code, never run
approximately.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt
from gguf import MODEL_TENSOR, TENSOR_NAMES

from skippy.gguf.constants import GGML_TYPES, ggml_type_name

# What to do with a model the stage runtime refuses: llama.cpp runs it whole, on one node.
LLAMA_HINT: Final = (
    "run the whole model on one node with llama.cpp: skippy-model-package run REF --engine llama"
)
RopeStyle = Literal["normal", "neox"]  # pairs (2i, 2i+1) | pairs (i, i + d/2)
# the gated FFN's activation (the numpy reference reads it; ggml builders name their own)
Activation = Literal["silu", "gelu_tanh"]
# How a token's router logits become its experts' weights (llama.cpp's
# llama_expert_gating_func_type): "softmax" over every expert, the picked experts'
# probabilities; "sigmoid" (deepseek-v3, glm4moe) each expert's own sigmoid, the picked
# ones'; "softmax_weight" (gpt-oss) the experts picked by their raw logits, a softmax over the
# picked ones only.
ExpertGating = Literal["softmax", "sigmoid", "softmax_weight"]

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
        39,  # MXFP4 (gpt-oss's experts)
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
MAX_EXPERTS: Final = 1024  # llama.cpp's LLAMA_MAX_EXPERTS


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling as ``ggml_rope_ext`` takes it (the values llama.cpp's context
    derives from the file: ``llama_context`` for ``attn_factor``)."""

    ext_factor: float
    attn_factor: float
    beta_fast: float
    beta_slow: float
    n_ctx_orig: int  # the context the model was trained on before scaling


@dataclass(frozen=True)
class AttnTemperature:
    """Q scaled per position before attention (llama.cpp's ``inp_attn_scale``, Llama 4 and
    Ministral 3): log(floor((pos + offset) / floor_scale) + 1) * scale + 1."""

    scale: float
    floor_scale: int
    offset: float = 0.0

    def factors(self, positions: npt.NDArray[np.int32]) -> npt.NDArray[np.float32]:
        """One factor per position, ``[n]`` F32, computed in llama.cpp's precisions (the
        quotient in f32, the logarithm in f64)."""
        f32 = np.float32
        q = np.floor((positions.astype(f32) + f32(self.offset)) / f32(self.floor_scale))
        scale = float(f32(self.scale))
        return np.array([math.log(float(v) + 1.0) * scale + 1.0 for v in q], dtype=f32)


@dataclass(frozen=True)
class Mla:
    """Multi-head latent attention (deepseek2, llama.cpp's absorbed MLA): K and V are one
    compressed latent per token (``kv_lora_rank`` values, RMS-normed) plus a rotated key
    part shared by every head (``rope_dim``); each head's query is absorbed into the latent
    through ``attn_k_b`` and its output expanded from it through ``attn_v_b``. The cache holds
    only latent + rope key, one "head" of ``ModelSpec.head_dim = kv_lora_rank + rope_dim``;
    V is a view of its first ``kv_lora_rank`` values."""

    q_lora_rank: int  # 0: Q projected directly from the input (V2-Lite), else low-rank (V3)
    kv_lora_rank: int
    rope_dim: int  # the rotated part of each head's key and query (qk_rope_head_dim)
    k_head_dim: int  # a head's key width before absorption: nope + rope (key_length_mla)
    v_head_dim: int  # a head's value width after expansion (value_length_mla)

    @property
    def nope_dim(self) -> int:
        return self.k_head_dim - self.rope_dim


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
    rope_base_swa: float  # sliding-window layers
    rope_scale: float  # freq_scale = 1 / linear factor (1.0: none)
    sliding_window: int | None  # tokens a sliding layer sees, None: no sliding layers
    swa_layers: frozenset[int]
    attn_scale: float  # applied to q . k
    scale_q_before_attention: bool  # q scaled before attention (gemma3), else in the softmax
    embed_scale: float | None  # gemma3: sqrt(width)
    activation: Activation
    final_logit_softcap: float | None
    # attention scores soft-capped before the softmax (gemma2: tanh(s / cap) * cap)
    attn_softcap: float | None = None
    yarn: Yarn | None = None  # YaRN RoPE scaling (rope_scale is then 1 / its factor)
    attn_temperature: AttnTemperature | None = None
    # a mixture-of-experts FFN (0: dense): experts per layer, experts each token uses, and
    # each expert's hidden width
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    # layers whose Q and K are not rotated (smollm3: every 4th)
    nope_layers: frozenset[int] = frozenset()
    # granite's multipliers: each residual branch's output before its add, and the logits
    # (None: unscaled)
    residual_scale: float | None = None
    logit_scale: float | None = None
    # the picked experts' weights normalised to sum 1 (qwen3moe, Mixtral; not qwen2moe, olmoe)
    expert_weights_norm: bool = True
    # the router's gating function, and the factor the picked experts' weights are multiplied
    # by after any normalisation (``expert_weights_scale``; 0 and 1: none, as llama.cpp)
    expert_gating: ExpertGating = "softmax"
    expert_weights_scale: float = 1.0
    # the head dimensions RoPE rotates, from the first (0: the whole head; glm4moe rotates
    # half of it: ``rope.dimension_count``)
    n_rot: int = 0
    # the first layers run a dense FFN, the others experts (``leading_dense_block_count``)
    n_layer_dense_lead: int = 0
    # NextN/MTP layers after the trunk (``nextn_predict_layers``): counted in ``n_layer``
    # (``block_count``, the package's layers) but never run by the trunk's graph; they live
    # with the final stage, for native MTP drafting
    n_layer_nextn: int = 0
    # group-limited routing (deepseek-v3): the experts in ``expert_groups`` equal groups, each
    # token choosing only among the ``expert_groups_used`` groups whose two best experts score
    # highest (0: no groups)
    expert_groups: int = 0
    expert_groups_used: int = 0
    # a shared expert every token runs beside the routed ones (qwen2moe; 0: none): its width
    n_ff_shexp: int = 0
    # RoPE frequency scale of the sliding layers (llama.cpp's rope_freq_scale_train_swa:
    # 1.0 unless the family scales them too, as gpt-oss's YaRN does)
    rope_scale_swa: float = 1.0
    # multi-head latent attention (deepseek2): the cache holds K only, V is a view of it
    mla: Mla | None = None

    @property
    def n_trunk(self) -> int:
        """The layers the trunk runs: all but the NextN layers after them."""
        return self.n_layer - self.n_layer_nextn

    @property
    def rope_dims(self) -> int:
        return self.n_rot or self.head_dim

    def trunk_layers(self, start: int, stop: int) -> range:
        """The layers of ``start..stop`` the trunk's graph runs (NextN layers excluded)."""
        return range(start, min(stop, self.n_trunk))

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def attn_out_dim(self) -> int:
        """The attention's output width per row, before the output projection (MLA expands
        each head's latent output to its own value width)."""
        return self.q_dim if self.mla is None else self.n_head * self.mla.v_head_dim

    @property
    def has_v_cache(self) -> bool:
        """The KV cache stores V apart from K (not under MLA, whose V is part of K)."""
        return self.mla is None

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    def is_swa(self, layer: int) -> bool:
        return layer in self.swa_layers

    def uses_rope(self, layer: int) -> bool:
        return layer not in self.nope_layers

    def rope_base_for(self, layer: int) -> float:
        return self.rope_base_swa if self.is_swa(layer) else self.rope_base

    def rope_scale_for(self, layer: int) -> float:
        # llama.cpp: sliding layers keep their own scale (1.0 unless the family says).
        return self.rope_scale_swa if self.is_swa(layer) else self.rope_scale

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
            "n_expert": self.n_expert,
            "n_expert_used": self.n_expert_used,
        }


# --- the tensors a stage holds ----------------------------------------------------------------
Kind = Literal["matrix", "vector"]


def tensor_name(tensor: MODEL_TENSOR, layer: int | None = None, suffix: str = "weight") -> str:
    """gguf-py's name of ``tensor`` (with the block id for a layer's), e.g.
    ``blk.3.attn_q.weight``: the one way the runtime spells a tensor name."""
    base = TENSOR_NAMES[tensor]
    return f"{base.format(bid=layer) if layer is not None else base}.{suffix}"


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
