"""Synthetic models of every family the stage runtime claims: the canary's test data.

One small declarative ``FamilySpec`` per family (llama.cpp's architecture name, the metadata
its loader reads, the tensors of the model and of each layer with their shapes, the MoE
facts) and one generic writer, ``write_model``, that turns a spec, ``Dims``, a dtype and a
seed into a GGUF through gguf-py's ``GGUFWriter``. Tensor names come from gguf-py's
vocabulary (``gguf.TENSOR_NAMES``), metadata keys from ``gguf.Keys``.

What each spec holds was read off the pinned llama.cpp's loader (``load_arch_hparams`` and
``load_arch_tensors`` of ``src/models/<family>.cpp`` in llama-cpp-python 0.3.36): every tensor
it requires, with the shape it checks, plus the optional ones that carry the family's own
feature (qwen2's q/k/v biases, phi3's fused qkv), and every key whose default would switch a
feature off (gemma2's soft-capping, granite's multipliers).

Values. Each tensor's values depend only on ``(seed, tensor name)``, so the F32, F16, Q8_0
and Q4_K files of a family are the same network at four precisions. Matrices are normal with
standard deviation ``1/sqrt(fan-in)`` (ne0), which keeps activations near unit scale through
the layers; untied token embeddings are unit normal, so each token's own identity stays a
large part of the residual stream; norm weights are ``1 + 0.1 N``; biases ``0.1 N``.

Routing spreads over the experts. The router (``ffn_gate_inp``) is drawn with standard
deviation ``ROUTER_STD_FAN_IN / sqrt(width)``: its inputs are RMS-normed, so a token's router
logits have a standard deviation of about ``ROUTER_STD_FAN_IN`` (2) and top-k is decided by
clear margins; the choice varies from token to token because the hidden states keep their
token's embedding. Measured with llama.cpp's own top-k (``LlamaOracle.expert_choices``) over
the 320-token prompt: every expert of every layer of every MoE family gets at least 5 tokens
(phimoe, 16 experts top-2, the sparsest); with embeddings at the matrices' 1/sqrt(width)
scale, context averaging dominated the residual stream by layer 3 and qwen3moe, olmoe and
phimoe left experts unused there.

Quantization follows llama.cpp's quantizer: 1-D tensors (norms, biases, the shared expert's
gate vector) and routers stay F32; every other matrix takes the file's type, except that the
K-quant file (``Q4_K``, llama.cpp's Q4_K_M in spirit) keeps ``output.weight`` in Q6_K, as
llama.cpp does, so one file holds both K-quants. Quantized bytes come from ggml's own
``ggml_quantize_chunk`` (``skippy.gguf.ggml``), byte-identical to llama.cpp's quantizer.
K-quants need rows of a multiple of 256 values: every row length in ``Dims`` is one.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import gguf
import numpy as np
import numpy.typing as npt

from skippy.atomic import publish, temp_name_for
from skippy.errors import UsageError

K = gguf.Keys
T = gguf.MODEL_TENSOR
A = gguf.MODEL_ARCH
Q = gguf.GGMLQuantizationType

DTYPES: tuple[str, ...] = ("F32", "F16", "Q8_0", "Q4_K")  # every family's
# A family's own extra dtype (``FamilySpec.extra_dtypes``): MXFP4 experts, every other matrix
# Q8_0, as llama.cpp's MXFP4_MOE quantization (gpt-oss's checkpoints) writes them.
MXFP4 = "MXFP4"
ALL_DTYPES: tuple[str, ...] = (*DTYPES, MXFP4)
Dtype = Literal["F32", "F16", "Q8_0", "Q4_K", "MXFP4"]
Role = Literal["matrix", "embedding", "norm", "bias", "router", "vector", "gain"]

ROUTER_STD_FAN_IN = 2.0
# A "gain" norm's scale: gpt-oss's FFN input norm, so that about 8% of the experts' gate and
# up values (then about N(0, 4^2)) pass the clamped SwiGLU's limit of 7 and the clamp matters.
GAIN = 4.0
_FILE_TYPES: dict[str, gguf.LlamaFileType] = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    MXFP4: gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
}
_MATRIX_TYPES: dict[str, Q] = {
    "F32": Q.F32,
    "F16": Q.F16,
    "Q8_0": Q.Q8_0,
    "Q4_K": Q.Q4_K,
    MXFP4: Q.Q8_0,  # the experts are MXFP4 (tensor_type)
}
_EXPERT_TENSORS = frozenset({T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP})
_QUANT_ROW = 256  # K-quant super-block: every quantized row length must be a multiple


# --- dimensions -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dims:
    """Small but not degenerate: GQA (4 query heads over 2 KV heads), head dim 64, a
    500-token vocabulary, a context longer than the long prompt, rows of 256 multiples."""

    n_layers: int = 4
    embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    ff: int = 512
    ff_exp: int = 256
    ff_shexp: int = 512
    vocab: int = 512
    n_ctx_train: int = 4096
    n_expert: int = 0
    n_expert_used: int = 0
    # deepseek2's latent attention: Q's low rank, the KV latent, each head's rotated part,
    # non-rotated key part and value (ne0 of attn_k_b is the non-rotated part: 256 for Q4_K)
    q_lora: int = 256
    kv_lora: int = 256
    rope_mla: int = 64
    nope_mla: int = 256
    v_mla: int = 64

    def __post_init__(self) -> None:
        for name in ("n_layers", "embd", "n_head", "n_head_kv", "head_dim", "ff", "vocab"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be at least 1", code="invalid_synth_dims")
        if self.n_head % self.n_head_kv:
            raise UsageError(
                f"n_head_kv ({self.n_head_kv}) must divide n_head ({self.n_head})",
                code="invalid_synth_dims",
            )
        if self.n_expert and not 0 < self.n_expert_used <= self.n_expert:
            raise UsageError(
                f"expert_used_count must be 1..{self.n_expert} (got {self.n_expert_used})",
                code="invalid_synth_dims",
            )

    # Derived sizes, referred to by name in the tensor shapes below.
    @property
    def q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def qkv(self) -> int:
        return self.q + 2 * self.kv

    @property
    def ff2(self) -> int:  # phi3's fused gate and up
        return 2 * self.ff

    @property
    def embd2(self) -> int:  # a NextN layer's [embedding, hidden state] input
        return 2 * self.embd

    @property
    def half_head(self) -> int:  # glm4moe's RoPE rotates half of the head
        return self.head_dim // 2

    @property
    def kv_a_mla(self) -> int:  # the latent and the shared rope key: attn_kv_a_mqa's rows
        return self.kv_lora + self.rope_mla

    @property
    def k_mla(self) -> int:  # a head's key before absorption: non-rotated then rotated part
        return self.nope_mla + self.rope_mla

    @property
    def q_mla(self) -> int:  # every head's query
        return self.n_head * self.k_mla

    @property
    def o_mla(self) -> int:  # every head's value: attn_output's input
        return self.n_head * self.v_mla

    @property
    def expert(self) -> int:
        return self.n_expert

    def size(self, name: str) -> int:
        value = getattr(self, name)
        if not isinstance(value, int):
            raise UsageError(f"no dimension named {name!r}", code="invalid_synth_spec")
        return value


@dataclass(frozen=True)
class Dim:
    """A metadata value taken from ``Dims`` (``Dim("ff_exp")``)."""

    name: str


SpecValue = bool | int | float | str | Dim


# --- specs ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """One tensor: its gguf-py name, ``shape`` as ``Dims`` names in GGUF order (ne0 first),
    and what its values are (``role``)."""

    tensor: gguf.MODEL_TENSOR
    shape: tuple[str, ...]
    role: Role = "matrix"
    suffix: str = "weight"

    def name(self, layer: int | None = None) -> str:
        base = gguf.TENSOR_NAMES[self.tensor]
        return f"{base.format(bid=layer) if layer is not None else base}.{self.suffix}"


@dataclass(frozen=True)
class MoE:
    """Experts per layer and how many each token is routed to."""

    n_expert: int
    n_expert_used: int


@dataclass(frozen=True)
class FamilySpec:
    """Everything that makes one family's synthetic model (see the module doc)."""

    name: str  # the canary's name for it (unique; "mixtral" is llama with experts)
    arch: gguf.MODEL_ARCH
    model: tuple[TensorSpec, ...]
    layer: tuple[TensorSpec, ...]
    kv: Mapping[str, SpecValue] = field(default_factory=dict)
    ff_key: str = "ff"  # the Dims size written as feed_forward_length
    moe: MoE | None = None
    n_layers: int = 4
    n_head_kv: int | None = None  # None: Dims' (GQA)
    exercises: str = ""  # what the model checks, for the docs and test ids
    extra_dtypes: tuple[str, ...] = ()  # beyond DTYPES: the family's own (MXFP4 for gpt-oss)
    # the first ``dense_lead`` layers hold ``dense_layer`` instead of ``layer`` (glm4moe's
    # leading dense blocks)
    dense_lead: int = 0
    dense_layer: tuple[TensorSpec, ...] = ()
    # one NextN/MTP layer after the ``n_layers`` of the trunk, holding ``layer`` and these
    # (empty: none); ``block_count`` then counts it
    nextn: tuple[TensorSpec, ...] = ()

    @property
    def arch_name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]

    @property
    def n_nextn(self) -> int:
        return 1 if self.nextn else 0

    def layer_count(self, base: Dims | None = None) -> int:
        """The package's layers: the trunk's and the NextN layers after it."""
        return self.dims(base).n_layers + self.n_nextn

    def layer_tensors(self, il: int, d: Dims) -> tuple[TensorSpec, ...]:
        if il >= d.n_layers:
            return (*self.layer, *self.nextn)
        return self.dense_layer if il < self.dense_lead else self.layer

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes this family's synthetic model comes in: ``DTYPES``, then its own."""
        return (*DTYPES, *self.extra_dtypes)

    def dims(self, base: Dims | None = None) -> Dims:
        d = replace(base or Dims(), n_layers=self.n_layers)
        if self.n_head_kv is not None:
            d = replace(d, n_head_kv=self.n_head_kv)
        if self.moe is not None:
            d = replace(d, n_expert=self.moe.n_expert, n_expert_used=self.moe.n_expert_used)
        return d


def _t(tensor: gguf.MODEL_TENSOR, *shape: str, role: Role = "matrix") -> TensorSpec:
    return TensorSpec(tensor, shape, role)


def _bias(tensor: gguf.MODEL_TENSOR, size: str) -> TensorSpec:
    return TensorSpec(tensor, (size,), "bias", "bias")


def _norm(tensor: gguf.MODEL_TENSOR, size: str = "embd") -> TensorSpec:
    return TensorSpec(tensor, (size,), "norm")


EMBD = _t(T.TOKEN_EMBD, "embd", "vocab", role="embedding")
OUT_NORM = _norm(T.OUTPUT_NORM)
OUTPUT = _t(T.OUTPUT, "embd", "vocab")
UNTIED = (EMBD, OUT_NORM, OUTPUT)
# Tied embeddings are also the output head, so they keep a matrix's 1/sqrt(width) scale (the
# gemmas multiply them by sqrt(width) on the way in, which makes them unit-scale there).
TIED = (_t(T.TOKEN_EMBD, "embd", "vocab"), OUT_NORM)

ATTN = (
    _t(T.ATTN_Q, "embd", "q"),
    _t(T.ATTN_K, "embd", "kv"),
    _t(T.ATTN_V, "embd", "kv"),
    _t(T.ATTN_OUT, "q", "embd"),
)
QKV_BIAS = (_bias(T.ATTN_Q, "q"), _bias(T.ATTN_K, "kv"), _bias(T.ATTN_V, "kv"))
HEAD_QK_NORM = (_norm(T.ATTN_Q_NORM, "head_dim"), _norm(T.ATTN_K_NORM, "head_dim"))
FFN = (
    _t(T.FFN_GATE, "embd", "ff"),
    _t(T.FFN_UP, "embd", "ff"),
    _t(T.FFN_DOWN, "ff", "embd"),
)
PRE_NORMS = (_norm(T.ATTN_NORM), _norm(T.FFN_NORM))
POST_NORMS = (_norm(T.ATTN_POST_NORM), _norm(T.FFN_POST_NORM))
GEMMA_NORMS = (_norm(T.ATTN_NORM), _norm(T.FFN_PRE_NORM), *POST_NORMS)  # same file names


# The router and the stacked experts. Every MoE loader here sizes the experts either by
# expert_feed_forward_length or by feed_forward_length; spec.ff_key picks which key says ff_exp.
EXPERTS = (
    _t(T.FFN_GATE_INP, "embd", "expert", role="router"),
    _t(T.FFN_GATE_EXP, "embd", "ff_exp", "expert"),
    _t(T.FFN_UP_EXP, "embd", "ff_exp", "expert"),
    _t(T.FFN_DOWN_EXP, "ff_exp", "embd", "expert"),
)


GRANITE_SCALES: dict[str, SpecValue] = {
    # Multipliers as granite checkpoints carry them, chosen so each one changes the result:
    # embeddings x12, each residual branch x0.22, attention scores x1/64 (not 1/sqrt(64)),
    # logits divided by 8.
    K.LLM.EMBEDDING_SCALE: 12.0,
    K.LLM.RESIDUAL_SCALE: 0.22,
    K.Attention.SCALE: 1.0 / 64.0,
    K.LLM.LOGIT_SCALE: 8.0,
}
SLIDING_WINDOW = 128  # shorter than the long prompt: the window must cut in


# glm4moe's attention block, in its dense and its MoE layers alike
GLM4MOE_ATTN = (
    _norm(T.ATTN_NORM),
    *ATTN,
    *QKV_BIAS,
    *HEAD_QK_NORM,
    _norm(T.ATTN_POST_NORM),  # the FFN's input norm
)

# deepseek2's attention (absorbed MLA, as current converters write it) and the FFN's norm,
# with Q low-rank (V3) or direct (V2-Lite); the metadata the loader needs for it
def _mla_block(q_lora: bool) -> tuple[TensorSpec, ...]:
    q = (
        (
            _norm(T.ATTN_Q_A_NORM, "q_lora"),
            _t(T.ATTN_Q_A, "embd", "q_lora"),
            _t(T.ATTN_Q_B, "q_lora", "q_mla"),
        )
        if q_lora
        else (_t(T.ATTN_Q, "embd", "q_mla"),)
    )
    return (
        _norm(T.ATTN_NORM),
        *q,
        _norm(T.ATTN_KV_A_NORM, "kv_lora"),
        _t(T.ATTN_KV_A_MQA, "embd", "kv_a_mla"),
        _t(T.ATTN_K_B, "nope_mla", "kv_lora", "n_head"),
        _t(T.ATTN_V_B, "kv_lora", "v_mla", "n_head"),
        _t(T.ATTN_OUT, "o_mla", "embd"),
        _norm(T.FFN_NORM),
    )


def _mla_kv(q_lora: bool, log_mul: float) -> dict[str, SpecValue]:
    return {
        # 0: Q direct (the loader requires the key unless the layer count says lite)
        K.Attention.Q_LORA_RANK: Dim("q_lora") if q_lora else 0,
        K.Attention.KV_LORA_RANK: Dim("kv_lora"),
        K.Attention.KEY_LENGTH: Dim("kv_a_mla"),  # one KV head: latent + rope key
        K.Attention.VALUE_LENGTH: Dim("kv_lora"),
        K.Attention.KEY_LENGTH_MLA: Dim("k_mla"),
        K.Attention.VALUE_LENGTH_MLA: Dim("v_mla"),
        K.Rope.DIMENSION_COUNT: Dim("rope_mla"),
        K.LLM.EXPERT_FEED_FORWARD_LENGTH: Dim("ff_exp"),
        # YaRN factor 4 over an original context of 128, which the long prompt runs past,
        # with DeepSeek's mscale (the converter writes 0.1 x mscale_all_dim)
        K.Rope.SCALING_TYPE: "yarn",
        K.Rope.SCALING_FACTOR: 4.0,
        K.Rope.SCALING_ORIG_CTX_LEN: 128,
        K.Rope.SCALING_YARN_LOG_MUL: log_mul,
    }


_SHARED_EXPERT = (
    _t(T.FFN_GATE_SHEXP, "embd", "ff_shexp"),
    _t(T.FFN_UP_SHEXP, "embd", "ff_shexp"),
    _t(T.FFN_DOWN_SHEXP, "ff_shexp", "embd"),
)

FAMILIES: tuple[FamilySpec, ...] = (
    # --- today's dense four ---
    FamilySpec(
        "llama",
        A.LLAMA,
        UNTIED,
        (*PRE_NORMS, *ATTN, *FFN),
        exercises="the baseline: RMS norms, GQA, normal RoPE, SwiGLU, untied output",
    ),
    FamilySpec(
        "qwen2",
        A.QWEN2,
        UNTIED,
        (*PRE_NORMS, *ATTN, *QKV_BIAS, *FFN),
        exercises="q/k/v biases, NEOX RoPE",
    ),
    FamilySpec(
        "qwen3",
        A.QWEN3,
        UNTIED,
        (*PRE_NORMS, *ATTN, *HEAD_QK_NORM, *FFN),
        exercises="per-head q/k RMS norms, NEOX RoPE",
    ),
    FamilySpec(
        "gemma3",
        A.GEMMA3,
        TIED,
        (*GEMMA_NORMS, *ATTN, *HEAD_QK_NORM, *FFN),
        kv={K.Attention.SLIDING_WINDOW: SLIDING_WINDOW, K.Rope.FREQ_BASE: 1_000_000.0},
        n_layers=6,
        exercises=(
            f"sliding window {SLIDING_WINDOW} on layers 0-4 and a global layer 5 (the "
            "loader's default pattern of 6), per-head q/k norms, post-norms, GELU, scaled "
            "embeddings, tied output"
        ),
    ),
    # --- dense families ---
    FamilySpec(
        "phi3",
        A.PHI3,
        UNTIED,
        (
            *PRE_NORMS,
            _t(T.ATTN_QKV, "embd", "qkv"),
            _t(T.ATTN_OUT, "q", "embd"),
            _t(T.FFN_UP, "embd", "ff2"),
            _t(T.FFN_DOWN, "ff", "embd"),
        ),
        exercises="fused qkv and fused gate+up (ffn_up is 2 x ff), NEOX RoPE",
    ),
    FamilySpec(
        "gemma2",
        A.GEMMA2,
        TIED,
        (*GEMMA_NORMS, *ATTN, *FFN),
        kv={
            K.Attention.SLIDING_WINDOW: SLIDING_WINDOW,
            # About twice the scores' and the logits' standard deviation on these weights:
            # tanh is in its curved range for a good share of them (50 and 30, the real
            # values, would leave it linear here).
            K.LLM.ATTN_LOGIT_SOFTCAPPING: 2.0,
            K.LLM.FINAL_LOGIT_SOFTCAPPING: 3.0,
        },
        exercises=(
            f"attention and final logit soft-capping, sliding window {SLIDING_WINDOW} on "
            "even layers (alternating with global ones), post-norms, tied output"
        ),
    ),
    FamilySpec(
        "granite",
        A.GRANITE,
        UNTIED,
        (*PRE_NORMS, *ATTN, *FFN),
        kv=GRANITE_SCALES,
        exercises="embedding, residual and attention multipliers and the logit scale",
    ),
    FamilySpec(
        "olmo2",
        A.OLMO2,
        UNTIED,
        (*ATTN, _norm(T.ATTN_Q_NORM, "q"), _norm(T.ATTN_K_NORM, "kv"), *POST_NORMS, *FFN),
        exercises="post-norms only (no pre-norms), q/k norms over the whole projection",
    ),
    FamilySpec(
        "smollm3",
        A.SMOLLM3,
        UNTIED,
        (*PRE_NORMS, *ATTN, *FFN),
        exercises="no RoPE on every 4th layer (layer 3; the loader's fixed interval)",
    ),
    FamilySpec(
        "mistral3",
        A.MISTRAL3,
        UNTIED,
        (*PRE_NORMS, *ATTN, *FFN),
        kv={
            K.Rope.SCALING_TYPE: "yarn",
            K.Rope.SCALING_FACTOR: 4.0,
            K.Rope.SCALING_ORIG_CTX_LEN: 128,
            # Over 128 positions the fastest RoPE pair turns ~20 times: beta_fast 8 puts the
            # ramp between full and interpolated frequencies inside the head (32, Ministral's,
            # would be past every pair and change nothing).
            K.Rope.SCALING_YARN_BETA_FAST: 8.0,
            K.Rope.SCALING_YARN_BETA_SLOW: 1.0,
            K.Rope.SCALING_YARN_LOG_MUL: 1.0,
            K.Attention.TEMPERATURE_SCALE: 0.1,
        },
        exercises=(
            "YaRN RoPE scaling (factor 4 over an original context of 128) and the "
            "position-dependent attention temperature, which steps up at position 127"
        ),
    ),
    # --- mixtures of experts ---
    FamilySpec(
        "qwen3moe",
        A.QWEN3MOE,
        UNTIED,
        (*PRE_NORMS, *ATTN, *HEAD_QK_NORM, *EXPERTS),
        kv={K.LLM.EXPERT_FEED_FORWARD_LENGTH: Dim("ff_exp")},
        moe=MoE(16, 4),
        exercises="16 experts top-4 with normalised weights, per-head q/k norms",
    ),
    FamilySpec(
        "qwen2moe",
        A.QWEN2MOE,
        UNTIED,
        (
            *PRE_NORMS,
            *ATTN,
            *QKV_BIAS,
            *EXPERTS,
            _t(T.FFN_GATE_INP_SHEXP, "embd", role="vector"),
            _t(T.FFN_GATE_SHEXP, "embd", "ff_shexp"),
            _t(T.FFN_UP_SHEXP, "embd", "ff_shexp"),
            _t(T.FFN_DOWN_SHEXP, "ff_shexp", "embd"),
        ),
        kv={
            K.LLM.EXPERT_FEED_FORWARD_LENGTH: Dim("ff_exp"),
            K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: Dim("ff_shexp"),
        },
        moe=MoE(8, 2),
        exercises="8 experts top-2 (weights not normalised), a shared expert behind its "
        "own sigmoid gate, q/k/v biases",
    ),
    FamilySpec(
        "mixtral",
        A.LLAMA,
        UNTIED,
        (*PRE_NORMS, *ATTN, *EXPERTS),
        ff_key="ff_exp",
        moe=MoE(8, 2),
        exercises="llama with 8 experts top-2 (Mixtral): expert size from feed_forward_length",
    ),
    FamilySpec(
        "olmoe",
        A.OLMOE,
        UNTIED,
        (
            *PRE_NORMS,
            *ATTN,
            _norm(T.ATTN_Q_NORM, "q"),
            _norm(T.ATTN_K_NORM, "kv"),
            *EXPERTS,
        ),
        ff_key="ff_exp",
        moe=MoE(16, 4),
        # The loader sizes attn_k_norm by the width: OLMoE has as many KV heads as heads.
        n_head_kv=4,
        exercises="16 experts top-4 (weights not normalised), q/k norms over the projection, "
        "no GQA",
    ),
    FamilySpec(
        "granitemoe",
        A.GRANITE_MOE,
        UNTIED,
        (*PRE_NORMS, *ATTN, *EXPERTS),
        kv=GRANITE_SCALES,
        ff_key="ff_exp",
        moe=MoE(8, 2),
        exercises="granite's four multipliers with 8 experts top-2",
    ),
    FamilySpec(
        "phimoe",
        A.PHIMOE,
        (EMBD, OUT_NORM, _bias(T.OUTPUT_NORM, "embd"), OUTPUT, _bias(T.OUTPUT, "vocab")),
        (
            _norm(T.ATTN_NORM),
            _bias(T.ATTN_NORM, "embd"),
            *ATTN,
            _bias(T.ATTN_OUT, "embd"),
            _norm(T.FFN_NORM),
            _bias(T.FFN_NORM, "embd"),
            *EXPERTS,
        ),
        ff_key="ff_exp",
        moe=MoE(16, 2),
        exercises="16 experts top-2, norm biases, output and attention-output biases",
    ),
    FamilySpec(
        "gpt-oss",
        A.GPT_OSS,
        UNTIED,
        (
            _norm(T.ATTN_NORM),
            *ATTN,
            *QKV_BIAS,
            _bias(T.ATTN_OUT, "embd"),
            _t(T.ATTN_SINKS, "n_head", role="vector"),
            TensorSpec(T.ATTN_POST_NORM, ("embd",), "gain"),  # the FFN's input norm
            *EXPERTS,
            _bias(T.FFN_GATE_INP, "expert"),
            TensorSpec(T.FFN_GATE_EXP, ("ff_exp", "expert"), "bias", "bias"),
            TensorSpec(T.FFN_UP_EXP, ("ff_exp", "expert"), "bias", "bias"),
            TensorSpec(T.FFN_DOWN_EXP, ("embd", "expert"), "bias", "bias"),
        ),
        kv={
            K.LLM.EXPERT_FEED_FORWARD_LENGTH: Dim("ff_exp"),
            K.Attention.SLIDING_WINDOW: SLIDING_WINDOW,
            # gpt-oss's YaRN factor (32) over an original context of 128 (4096 in the
            # checkpoints), which the long prompt runs past; the loader reads no beta keys
            # (llama.cpp's 32 and 1: the ramp between extrapolated and interpolated
            # frequencies then covers pairs 0-11 of the head's 32)
            K.Rope.SCALING_TYPE: "yarn",
            K.Rope.SCALING_FACTOR: 32.0,
            K.Rope.SCALING_ORIG_CTX_LEN: 128,
        },
        moe=MoE(8, 4),
        extra_dtypes=(MXFP4,),
        exercises=(
            "attention sinks, sliding window "
            f"{SLIDING_WINDOW} on even layers (alternating with global ones), YaRN on every "
            "layer, q/k/v, attention-output, router and expert biases, 8 experts top-4 picked "
            "by raw logits and weighted by a softmax over the picked, the clamped SwiGLU; "
            "MXFP4 experts"
        ),
    ),
    FamilySpec(
        "glm4moe",
        A.GLM4_MOE,
        UNTIED,
        (
            *GLM4MOE_ATTN,
            *EXPERTS,
            _bias(T.FFN_EXP_PROBS_B, "expert"),
            _t(T.FFN_GATE_SHEXP, "embd", "ff_shexp"),
            _t(T.FFN_UP_SHEXP, "embd", "ff_shexp"),
            _t(T.FFN_DOWN_SHEXP, "ff_shexp", "embd"),
        ),
        kv={
            K.LLM.EXPERT_FEED_FORWARD_LENGTH: Dim("ff_exp"),
            K.LLM.EXPERT_SHARED_COUNT: 2,  # the shared expert is ff_shexp = 2 x ff_exp wide
            K.LLM.EXPERT_GATING_FUNC: 2,  # sigmoid
            K.LLM.EXPERT_WEIGHTS_NORM: True,
            K.LLM.EXPERT_WEIGHTS_SCALE: 2.5,  # GLM-4.5's routed scaling factor
            K.Rope.DIMENSION_COUNT: Dim("half_head"),
            # YaRN (factor 4 over an original context of 128, which the long prompt runs
            # past) on the rotated half of each head; the loader reads no beta keys
            K.Rope.SCALING_TYPE: "yarn",
            K.Rope.SCALING_FACTOR: 4.0,
            K.Rope.SCALING_ORIG_CTX_LEN: 128,
        },
        moe=MoE(16, 4),
        dense_lead=1,
        dense_layer=(*GLM4MOE_ATTN, *FFN),
        nextn=(
            _t(T.NEXTN_EH_PROJ, "embd2", "embd"),
            _norm(T.NEXTN_ENORM),
            _norm(T.NEXTN_HNORM),
            _norm(T.NEXTN_SHARED_HEAD_NORM),
        ),
        exercises=(
            "a leading dense layer, then 16 experts top-4 by sigmoid scores with a "
            "selection-only bias, normalised weights times 2.5 and a shared expert; q/k/v "
            "biases, per-head q/k norms, NEOX RoPE over half the head with YaRN; one NextN "
            "layer after the trunk, held by the final stage and never run by it"
        ),
    ),
    FamilySpec(
        "deepseek2-lite",
        A.DEEPSEEK2,
        UNTIED,
        (*_mla_block(False), *EXPERTS, *_SHARED_EXPERT),
        kv={
            **_mla_kv(False, 0.0707),  # V2-Lite's mscale_all_dim 0.707
            K.LLM.EXPERT_SHARED_COUNT: 2,  # ff_shexp = 2 x ff_exp
        },
        moe=MoE(8, 2),
        n_head_kv=1,
        dense_lead=1,
        dense_layer=(*_mla_block(False), *FFN),
        exercises=(
            "DeepSeek-V2-Lite's shape: latent attention (absorbed MLA, one cached latent + "
            "rope key per token) with Q projected directly, normal RoPE over part of the key "
            "with YaRN and DeepSeek's mscale; a leading dense layer, then 8 experts top-2 by "
            "softmax (weights not normalised) beside two shared experts"
        ),
    ),
    FamilySpec(
        "deepseek2",
        A.DEEPSEEK2,
        UNTIED,
        (*_mla_block(True), *EXPERTS, _bias(T.FFN_EXP_PROBS_B, "expert"), *_SHARED_EXPERT),
        kv={
            **_mla_kv(True, 0.1),  # V3's mscale_all_dim 1.0
            K.LLM.EXPERT_SHARED_COUNT: 2,
            K.LLM.EXPERT_GATING_FUNC: 2,  # sigmoid
            K.LLM.EXPERT_WEIGHTS_NORM: True,
            K.LLM.EXPERT_WEIGHTS_SCALE: 2.5,
            # 4 groups of 4 experts, each token keeps its best group and picks 2 there; llama.cpp
            # asserts fewer groups used than groups (and kept after the canary's doubling)
            K.LLM.EXPERT_GROUP_COUNT: 4,
            K.LLM.EXPERT_GROUP_USED_COUNT: 1,
        },
        moe=MoE(16, 2),
        n_head_kv=1,
        dense_lead=1,
        dense_layer=(*_mla_block(True), *FFN),
        nextn=(
            _t(T.NEXTN_EH_PROJ, "embd2", "embd"),
            _norm(T.NEXTN_ENORM),
            _norm(T.NEXTN_HNORM),
            _norm(T.NEXTN_SHARED_HEAD_NORM),
        ),
        exercises=(
            "DeepSeek-V3's shape: latent attention with low-rank Q (q_lora), YaRN with "
            "DeepSeek's mscale; a leading dense layer, then 16 experts top-2 by sigmoid "
            "scores with a selection-only bias, chosen within the best of 4 expert groups, "
            "weights normalised times 2.5, beside shared experts; one NextN layer after the "
            "trunk, held by the final stage and never run by it"
        ),
    ),
)
FAMILY_NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES)


def family(name: str) -> FamilySpec:
    for spec in FAMILIES:
        if spec.name == name:
            return spec
    raise UsageError(
        f"no synthetic family named {name!r}",
        code="unknown_synth_family",
        expected=list(FAMILY_NAMES),
        actual=name,
    )


# --- metadata -------------------------------------------------------------------------------------
MetadataValue = bool | int | float | str | list[str] | list[float] | list[int]
# ids 0-3. "<|endoftext|>" because llama.cpp's vocabulary loader looks it up (and throws
# without it) for any model whose general.name says phi3.
SPECIALS = ("<unk>", "<s>", "</s>", "<|endoftext|>")


def tokenizer_metadata(vocab: int) -> dict[str, MetadataValue]:
    """A SentencePiece-style ("llama") vocabulary of ``vocab`` pieces: ``SPECIALS`` (unknown,
    then control tokens) and ``▁w<i>`` words. Callers feed token ids, never text."""
    words = vocab - len(SPECIALS)
    tokens = [*SPECIALS, *(f"▁w{i}" for i in range(words))]
    return {
        K.Tokenizer.MODEL: "llama",
        K.Tokenizer.LIST: tokens,
        K.Tokenizer.SCORES: [0.0] * len(SPECIALS) + [-float(i) for i in range(words)],
        K.Tokenizer.TOKEN_TYPE: [2] + [3] * (len(SPECIALS) - 1) + [1] * words,  # unk, control
        K.Tokenizer.UNK_ID: 0,
        K.Tokenizer.BOS_ID: 1,
        K.Tokenizer.EOS_ID: 2,
        K.Tokenizer.ADD_BOS: True,
        K.Tokenizer.ADD_EOS: False,
    }


def model_metadata(spec: FamilySpec, d: Dims, dtype: Dtype) -> dict[str, MetadataValue]:
    """Every key written besides ``general.architecture``, with ``{arch}`` filled in."""
    arch = spec.arch_name
    kv: dict[str, SpecValue] = {
        K.General.TYPE: "model",
        K.General.NAME: f"synthetic {spec.name} {dtype}",
        K.LLM.CONTEXT_LENGTH: Dim("n_ctx_train"),
        K.LLM.EMBEDDING_LENGTH: Dim("embd"),
        K.LLM.BLOCK_COUNT: Dim("n_layers"),
        K.LLM.FEED_FORWARD_LENGTH: Dim(spec.ff_key),
        K.LLM.VOCAB_SIZE: Dim("vocab"),
        K.Attention.HEAD_COUNT: Dim("n_head"),
        K.Attention.HEAD_COUNT_KV: Dim("n_head_kv"),
        K.Attention.KEY_LENGTH: Dim("head_dim"),
        K.Attention.VALUE_LENGTH: Dim("head_dim"),
        K.Attention.LAYERNORM_RMS_EPS: 1e-6,
        K.Rope.DIMENSION_COUNT: Dim("head_dim"),
        K.Rope.FREQ_BASE: 10000.0,
    }
    if spec.moe is not None:
        kv[K.LLM.EXPERT_COUNT] = Dim("n_expert")
        kv[K.LLM.EXPERT_USED_COUNT] = Dim("n_expert_used")
    if spec.nextn:
        kv[K.LLM.BLOCK_COUNT] = d.n_layers + spec.n_nextn
        kv[K.LLM.NEXTN_PREDICT_LAYERS] = spec.n_nextn
    if spec.dense_lead:
        kv[K.LLM.LEADING_DENSE_BLOCK_COUNT] = spec.dense_lead
    kv.update(spec.kv)
    kv[K.General.FILE_TYPE] = int(_FILE_TYPES[dtype])
    if dtype not in ("F32", "F16"):
        kv[K.General.QUANTIZATION_VERSION] = gguf.GGML_QUANT_VERSION
    out: dict[str, MetadataValue] = {
        key.format(arch=arch): d.size(v.name) if isinstance(v, Dim) else v for key, v in kv.items()
    }
    out.update(tokenizer_metadata(d.vocab))
    return out


def _add_kv(writer: gguf.GGUFWriter, key: str, value: MetadataValue) -> None:
    if isinstance(value, list):
        item = (
            gguf.GGUFValueType.STRING
            if value and isinstance(value[0], str)
            else gguf.GGUFValueType.FLOAT32
            if value and isinstance(value[0], float)
            else gguf.GGUFValueType.INT32
        )
        writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, item)
    elif isinstance(value, bool):
        writer.add_key_value(key, value, gguf.GGUFValueType.BOOL)
    elif isinstance(value, int):
        writer.add_key_value(key, value, gguf.GGUFValueType.UINT32)
    elif isinstance(value, float):
        writer.add_key_value(key, value, gguf.GGUFValueType.FLOAT32)
    else:
        writer.add_key_value(key, value, gguf.GGUFValueType.STRING)


# --- tensors --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order, ne0 first
    role: Role
    qtype: Q


def tensor_type(spec: TensorSpec, shape: tuple[int, ...], dtype: Dtype) -> Q:
    """llama.cpp's quantizer's choice for this tensor in a file of ``dtype`` (it quantizes
    only ``.weight`` tensors of two or more dimensions: gpt-oss's 2-D expert biases stay F32)."""
    if len(shape) < 2 or spec.role in ("router", "bias") or spec.suffix != "weight":
        return Q.F32
    if dtype == "Q4_K" and spec.tensor == T.OUTPUT:
        return Q.Q6_K
    if dtype == MXFP4 and spec.tensor in _EXPERT_TENSORS:
        return Q.MXFP4
    return _MATRIX_TYPES[dtype]


def plan(spec: FamilySpec, d: Dims, dtype: Dtype) -> list[PlannedTensor]:
    """Every tensor of the model, in file order, with its shape and type."""
    out: list[PlannedTensor] = []
    entries: list[tuple[TensorSpec, int | None]] = [(t, None) for t in spec.model]
    n_all = d.n_layers + spec.n_nextn
    entries += [(t, i) for i in range(n_all) for t in spec.layer_tensors(i, d)]
    for t, layer in entries:
        name = t.name(layer)
        shape = tuple(d.size(s) for s in t.shape)
        qtype = tensor_type(t, shape, dtype)
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if shape[0] % block:
            raise UsageError(
                f"{name}: rows of {shape[0]} values cannot be stored as {qtype.name} "
                f"(blocks of {block}); pick dimensions that are multiples of {_QUANT_ROW}",
                code="invalid_synth_dims",
            )
        out.append(PlannedTensor(name, shape, t.role, qtype))
    return out


def tensor_values(seed: int, t: PlannedTensor) -> npt.NDArray[np.float32]:
    """The tensor's real values (numpy order), seeded by ``(seed, name)`` alone."""
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
    values = rng.standard_normal(tuple(reversed(t.shape)), dtype=np.float32)
    if t.role == "embedding":
        return values
    if t.role == "norm":
        return 1.0 + np.float32(0.1) * values
    if t.role == "gain":
        return np.float32(GAIN) * (1.0 + np.float32(0.1) * values)
    if t.role == "bias":
        return np.float32(0.1) * values
    scale = (ROUTER_STD_FAN_IN if t.role == "router" else 1.0) / math.sqrt(t.shape[0])
    return np.float32(scale) * values


def quantize(values: npt.NDArray[np.float32], qtype: Q) -> npt.NDArray[np.uint8]:
    """``values`` (rows along the last axis) as ``qtype`` blocks through ggml's own quantizer:
    uint8 of shape (..., row bytes), as ``GGUFWriter.add_tensor`` takes quantized data."""
    from skippy.gguf import ggml

    g = ggml.load()
    src = np.ascontiguousarray(values, dtype=np.float32)
    n = src.shape[-1]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    out = np.empty((*src.shape[:-1], n // block * type_size), dtype=np.uint8)
    g.ggml_quantize_init(int(qtype))
    size = g.ggml_quantize_chunk(
        int(qtype), src.ctypes.data, out.ctypes.data, 0, src.size // n, n, None
    )
    if size != out.nbytes or not g.ggml_validate_row_data(int(qtype), out.ctypes.data, size):
        raise UsageError(
            f"ggml could not quantize {src.shape} to {qtype.name}: it wrote {size} bytes "
            f"of {out.nbytes}, or rows it does not accept",
            code="synth_quantize_failed",
        )
    return out


def tensor_data(seed: int, t: PlannedTensor) -> npt.NDArray[np.generic]:
    values = tensor_values(seed, t)
    if t.qtype == Q.F32:
        return values
    if t.qtype == Q.F16:
        return values.astype(np.float16)
    return quantize(values, t.qtype)


# --- writing --------------------------------------------------------------------------------------
def check_dtype(dtype: str, spec: FamilySpec | None = None) -> Dtype:
    """``dtype`` if ``spec``'s model comes in it (any family's ``DTYPES`` without one)."""
    allowed = DTYPES if spec is None else spec.dtypes
    if dtype not in allowed:
        whose = "the synthetic models come" if spec is None else f"{spec.name}'s model comes"
        raise UsageError(
            f"dtype {dtype!r} is not one {whose} in",
            code="invalid_synth_dtype",
            expected=list(allowed),
            actual=dtype,
        )
    return dtype  # type: ignore[return-value]  # checked against the dtypes just above


def write_model(
    spec: FamilySpec, path: Path, *, dtype: str, seed: int = 0, dims: Dims | None = None
) -> Path:
    """Write ``spec``'s model at ``dtype`` to ``path`` (atomically: nothing half-written)."""
    dt = check_dtype(dtype, spec)
    d = spec.dims(dims)
    tensors = plan(spec, d, dt)
    metadata = model_metadata(spec, d, dt)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name_for(path)
    try:
        writer = gguf.GGUFWriter(tmp, spec.arch_name)
        with contextlib.closing(writer):
            for key, value in metadata.items():
                _add_kv(writer, key, value)
            for t in tensors:
                data = tensor_data(seed, t)
                raw = None if t.qtype in (Q.F32, Q.F16) else t.qtype
                writer.add_tensor(t.name, data, raw_dtype=raw)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        publish(tmp, path, durable=False)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def model_file_name(spec: FamilySpec, dtype: str, seed: int = 0) -> str:
    return f"{spec.name}-{dtype}-s{seed}.gguf"


def long_prompt(n: int = 320, *, vocab: int = 512, seed: int = 0) -> list[int]:
    """``n`` seeded token ids, none of them a special token."""
    rng = np.random.default_rng([seed, n])
    return [int(i) for i in rng.integers(len(SPECIALS), vocab, size=n)]


__all__ = [
    "ALL_DTYPES",
    "DTYPES",
    "FAMILIES",
    "FAMILY_NAMES",
    "MXFP4",
    "ROUTER_STD_FAN_IN",
    "SLIDING_WINDOW",
    "Dim",
    "Dims",
    "FamilySpec",
    "MoE",
    "PlannedTensor",
    "SpecValue",
    "TensorSpec",
    "check_dtype",
    "family",
    "long_prompt",
    "model_file_name",
    "model_metadata",
    "plan",
    "quantize",
    "tensor_values",
    "tokenizer_metadata",
    "write_model",
]
