"""Which ggml type each tensor gets: a pure port of llama.cpp's per-tensor rules.

Ported from llama.cpp as vendored by llama-cpp-python 0.3.36 (ggml 0.25.3, commit 0c1e570),
``src/llama-quant.cpp``: ``tensor_allows_quantization``, ``tensor_get_category``,
``llama_tensor_get_type`` / ``llama_tensor_get_type_impl``, ``tensor_type_fallback``,
``tensor_requires_imatrix``, ``llama_ftype_get_default_type`` and the iteration order of
``llama_model_loader::weights_map`` (``weight_name_comparer``). The preset names are
``tools/quantize/quantize.cpp``'s ``QUANT_OPTIONS``. Each function names the C++ function it
mirrors; docs/quantize.md lists what we follow and where we deliberately differ (only with
a recipe: see ``plan_types``).

The rules are order-dependent (llama.cpp counts attn_v / ffn_down tensors as it meets them),
so ``plan_types`` walks the tensors in llama.cpp's order and returns the choices in the
caller's order.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any, Final

from skippy.errors import ModelError, SkippyError, UsageError
from skippy.findings import Finding
from skippy.gguf.constants import GGML_TYPES
from skippy.package.quantization import QuantizationBlock
from skippy.produce.recipe import Recipe, parse_recipe

# ggml type ids by name (GGML_TYPES is the one table of ids, block sizes and type sizes).
T: Final[dict[str, int]] = {name: tid for tid, (name, _, _) in GGML_TYPES.items()}
F32, F16, BF16 = T["F32"], T["F16"], T["BF16"]
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = T["Q4_0"], T["Q4_1"], T["Q5_0"], T["Q5_1"], T["Q8_0"]
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = T["Q2_K"], T["Q3_K"], T["Q4_K"], T["Q5_K"], T["Q6_K"]
IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S = T["IQ1_S"], T["IQ1_M"], T["IQ2_XXS"], T["IQ2_XS"], T["IQ2_S"]
IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS = T["IQ3_XXS"], T["IQ3_S"], T["IQ4_NL"], T["IQ4_XS"]
TQ1_0, TQ2_0, MXFP4 = T["TQ1_0"], T["TQ2_0"], T["MXFP4"]

# Types ggml_quantize_chunk can produce (ggml.c); quantizing to any other (Q8_1, Q8_K, I8...)
# would hit an assert and abort the process, so they are refused up front.
QUANTIZE_TARGETS: Final = frozenset(
    T[n]
    for n in (
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q1_0", "MXFP4", "NVFP4",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "TQ1_0", "TQ2_0", "IQ2_XXS", "IQ2_XS", "IQ2_S",
        "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS",
    )
)  # fmt: skip
UNQUANTIZED: Final = frozenset({F32, F16, BF16})
# ggml_quantize_requires_imatrix (ggml.c): ggml asserts (aborts) without one.
GGML_REQUIRES_IMATRIX: Final = frozenset({IQ2_XXS, IQ2_XS, IQ1_S})


def is_quantized(type_id: int) -> bool:
    """ggml_is_quantized: every type but the plain floats (F32, F16, BF16, F64) and the
    integer types (I8..I64)."""
    name = GGML_TYPES[type_id][0]
    plain = name in ("F32", "F16", "BF16", "F64") or (name[0] == "I" and name[1:].isdigit())
    return not plain


def block_size(type_id: int) -> int:
    return GGML_TYPES[type_id][1]


def type_name(type_id: int) -> str:
    return GGML_TYPES[type_id][0] if type_id in GGML_TYPES else f"type {type_id}"


# --- presets: tools/quantize/quantize.cpp QUANT_OPTIONS + llama_ftype_get_default_type -------
@dataclass(frozen=True)
class FileType:
    """A llama-quantize preset: its llama_ftype number and its default tensor type."""

    name: str
    ftype: int
    default_type: int

    @property
    def canonical(self) -> str:
        """``Q4_K`` is llama-quantize's alias for ``Q4_K_M``: record the preset, not the alias."""
        return _ALIASES.get(self.name, self.name)


_ALIASES: Final = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}

# name -> (llama_ftype, default ggml type). Q2_0 is left out: our GGUF tables (and gguf-py)
# do not know its ggml type (42) yet; COPY is write-package's job.
_PRESETS: Final[dict[str, tuple[int, int]]] = {
    "Q1_0": (40, T["Q1_0"]),
    "Q4_0": (2, Q4_0),
    "Q4_1": (3, Q4_1),
    "MXFP4_MOE": (38, MXFP4),
    "Q5_0": (8, Q5_0),
    "Q5_1": (9, Q5_1),
    "IQ2_XXS": (19, IQ2_XXS),
    "IQ2_XS": (20, IQ2_XS),
    "IQ2_S": (28, IQ2_XS),
    "IQ2_M": (29, IQ2_S),
    "IQ1_S": (24, IQ1_S),
    "IQ1_M": (31, IQ1_M),
    "TQ1_0": (36, TQ1_0),
    "TQ2_0": (37, TQ2_0),
    "Q2_K": (10, Q2_K),
    "Q2_K_S": (21, Q2_K),
    "IQ3_XXS": (23, IQ3_XXS),
    "IQ3_S": (26, IQ3_S),
    "IQ3_M": (27, IQ3_S),
    "Q3_K": (12, Q3_K),
    "IQ3_XS": (22, IQ3_S),
    "Q3_K_S": (11, Q3_K),
    "Q3_K_M": (12, Q3_K),
    "Q3_K_L": (13, Q3_K),
    "IQ4_NL": (25, IQ4_NL),
    "IQ4_XS": (30, IQ4_XS),
    "Q4_K": (15, Q4_K),
    "Q4_K_S": (14, Q4_K),
    "Q4_K_M": (15, Q4_K),
    "Q5_K": (17, Q5_K),
    "Q5_K_S": (16, Q5_K),
    "Q5_K_M": (17, Q5_K),
    "Q6_K": (18, Q6_K),
    "Q8_0": (7, Q8_0),
    "F16": (1, F16),
    "BF16": (32, BF16),
    "F32": (0, F32),
}
FILE_TYPES: Final[dict[str, FileType]] = {
    n: FileType(n, ftype, default) for n, (ftype, default) in _PRESETS.items()
}


class F(IntEnum):
    """The llama_ftype numbers the rules test (llama.h)."""

    Q4_0 = 2
    Q5_0 = 8
    Q2_K = 10
    Q3_K_S = 11
    Q3_K_M = 12
    Q3_K_L = 13
    Q4_K_S = 14
    Q4_K_M = 15
    Q5_K_M = 17
    IQ2_XXS = 19
    IQ2_XS = 20
    Q2_K_S = 21
    IQ3_XS = 22
    IQ3_XXS = 23
    IQ1_S = 24
    IQ4_NL = 25
    IQ3_S = 26
    IQ3_M = 27
    IQ2_S = 28
    IQ2_M = 29
    IQ4_XS = 30
    IQ1_M = 31
    TQ1_0 = 36
    TQ2_0 = 37
    MXFP4_MOE = 38
    Q2_0 = 41


def parse_file_type(text: str) -> FileType:
    """A preset name, case-insensitively, as llama-quantize accepts it (``try_parse_ftype``)."""
    ft = FILE_TYPES.get(text.strip().upper())
    if ft is None:
        raise UsageError(
            f"--type {text!r} is not a quantization type this tool knows",
            code="unknown_quant_type",
            remediation="one of: " + ", ".join(FILE_TYPES),
        )
    return ft


# --- model facts the rules read (llama_hparams / llama_model::type) -----------------------------
@dataclass(frozen=True)
class ModelFacts:
    arch: str
    n_layer_all: int  # <arch>.block_count
    n_layer: int  # block_count - nextn_predict_layers (llama_hparams::n_layer)
    n_expert: int
    n_head: int  # layer 0 (llama_hparams::n_head(0))
    n_head_kv: int

    @property
    def n_gqa(self) -> int:
        return 0 if self.n_head_kv == 0 else self.n_head // self.n_head_kv

    @property
    def is_70b(self) -> bool:
        """llama_model::type == LLM_TYPE_70B, as each architecture's load_arch_hparams sets it
        (only that size changes a rule)."""
        if self.arch == "llama":
            return self.n_expert != 8 and self.n_layer == 80 and self.n_head != self.n_head_kv
        if self.arch in ("qwen2", "deci", "olmo"):
            return self.n_layer == 80
        return self.arch == "jais2" and self.n_layer == 68


def _first(value: Any, default: int) -> int:
    """get_key_or_arr: a per-layer array or one value; the rules read layer 0."""
    if isinstance(value, list):
        value = value[0] if value else default
    if isinstance(value, bool) or not isinstance(value, int):
        return default
    return value


def model_facts(metadata: Mapping[str, Any]) -> ModelFacts:
    arch = str(metadata.get("general.architecture", ""))

    def key(name: str) -> Any:
        return metadata.get(f"{arch}.{name}")

    n_all = _first(key("block_count"), 0)
    n_head = _first(key("attention.head_count"), 0)
    return ModelFacts(
        arch=arch,
        n_layer_all=n_all,
        n_layer=n_all - _first(key("nextn_predict_layers"), 0),
        n_expert=_first(key("expert_count"), 0),
        n_head=n_head,
        n_head_kv=_first(key("attention.head_count_kv"), n_head),
    )


# --- tensors ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorFacts:
    name: str
    shape: tuple[int, ...]  # GGUF order, ne0 first
    ggml_type: int

    @property
    def n_dims(self) -> int:
        """ggml_n_dims: trailing dimensions of 1 do not count (a (64, 1) tensor is 1-D)."""
        for i in range(len(self.shape) - 1, 0, -1):
            if self.shape[i] > 1:
                return i + 1
        return 1

    def ne(self, i: int) -> int:
        return self.shape[i] if i < len(self.shape) else 1


class Category(Enum):
    """tensor_category"""

    TOKEN_EMBD = "token_embd"
    ATTENTION_Q = "attn_q"
    ATTENTION_V = "attn_v"
    ATTENTION_K = "attn_k"
    ATTENTION_QKV = "attn_qkv"
    ATTENTION_KV_B = "attn_kv_b"
    ATTENTION_OUTPUT = "attn_output"
    FFN_UP = "ffn_up"
    FFN_GATE = "ffn_gate"
    FFN_DOWN = "ffn_down"
    OUTPUT = "output"
    OTHER = "other"


def category_of(name: str) -> Category:
    """tensor_get_category (substring tests, in this order)."""
    if name == "output.weight":
        return Category.OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return Category.TOKEN_EMBD
    for needle, cat in (
        ("attn_qkv.weight", Category.ATTENTION_QKV),
        ("attn_kv_b.weight", Category.ATTENTION_KV_B),
        ("attn_v.weight", Category.ATTENTION_V),
        ("attn_k.weight", Category.ATTENTION_K),
        ("attn_q.weight", Category.ATTENTION_Q),
        ("attn_output.weight", Category.ATTENTION_OUTPUT),
        ("ffn_up", Category.FFN_UP),
        ("ffn_gate", Category.FFN_GATE),
        ("ffn_down", Category.FFN_DOWN),
    ):
        if needle in name:
            return cat
    return Category.OTHER


_ATTN_V_LIKE: Final = frozenset(
    {Category.ATTENTION_V, Category.ATTENTION_QKV, Category.ATTENTION_KV_B}
)

# Substrings that keep a tensor unquantized (tensor_allows_quantization), in every architecture.
_NEVER_QUANTIZE: Final = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
    "indexer.q_proj.weight", "time_mix_first.weight", "time_mix_w0.weight",
    "time_mix_w1.weight", "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight",
    "time_mix_v2.weight", "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight",
    "time_mix_g1.weight", "time_mix_g2.weight", "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight", "attn_rel_b.weight",
    ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd",
    ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)  # fmt: skip
_GLM5_NEXT_KEEP: Final = (
    "hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_gate",
    "indexer_compressor_ape", "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight",
    "ssm_g_b.weight", "ssm_beta.weight", "attn_kv_a_mqa.weight", "attn_k_b.weight",
    "attn_v_b.weight",
)  # fmt: skip


def allows_quantization(t: TensorFacts, arch: str) -> bool:
    """tensor_allows_quantization (params: quantize_output_tensor=true, only_copy=false)."""
    if t.n_dims < 2:
        return False
    name = t.name
    # C++: name.rfind("weight") == name.size() - 6. With size_t arithmetic a 5-character
    # name also passes (npos == size - 6 after the wrap-around); kept for fidelity.
    if not (name.endswith("weight") or len(name) == 5):
        return False
    if any(s in name for s in _NEVER_QUANTIZE):
        return False
    if name in ("position_embd.weight", "token_types.weight"):
        return False
    return not (arch == "glm5-next" and any(s in name for s in _GLM5_NEXT_KEEP))


def requires_imatrix(name: str, dst_type: int, ftype: int) -> bool:
    """tensor_requires_imatrix"""
    if name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return False
    if dst_type in (IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_M, IQ1_S):
        return True
    return dst_type == Q2_K and ftype == F.Q2_K_S


_BLK_RE: Final = re.compile(r"blk\.\s*([+-]?\d+)", re.ASCII)


def _layer_of(name: str) -> int:
    """sscanf(name, "blk.%d.", &layer), or -1."""
    m = _BLK_RE.match(name)
    return int(m.group(1)) if m else -1


def llama_order(names: Sequence[str]) -> list[int]:
    """Indices of ``names`` in llama_model_loader::weights_map order (weight_name_comparer:
    by blk number, -1 for the rest, then by name)."""
    return sorted(range(len(names)), key=lambda i: (_layer_of(names[i]), names[i].encode()))


def _cdiv(a: int, b: int) -> int:
    """C integer division (truncates toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def _cmod(a: int, b: int) -> int:
    return a - b * _cdiv(a, b)


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return (
        i_layer < _cdiv(n_layers, 8)
        or i_layer >= _cdiv(7 * n_layers, 8)
        or _cmod(i_layer - _cdiv(n_layers, 8), 3) == 2
    )


# --- the rules -------------------------------------------------------------------------------
@dataclass
class _State:
    """quantize_state_impl: the counters the rules advance as they meet tensors."""

    model: ModelFacts
    has_imatrix: bool
    tied: bool
    n_attention_wv: int = 0
    n_ffn_down: int = 0
    n_ffn_gate: int = 0
    n_ffn_up: int = 0
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0


class RuleError(ModelError):
    """A tensor the rules cannot place (llama.cpp throws the same runtime_error)."""

    code = "quant_rule_failed"


def _layer_info(qs: _State, i_layer: int, n_layer: int, name: str) -> tuple[int, int]:
    if qs.model.n_expert > 1:
        layer = _layer_of(name)
        if not _BLK_RE.match(name):
            raise RuleError(f"failed to determine the layer of tensor {name}")
        if not 0 <= layer < n_layer:
            raise RuleError(f"bad layer {layer} for tensor {name}: must be in [0, {n_layer})")
        return layer, n_layer
    return i_layer, n_layer


# A literal port: branch for branch as in the C++ (not merged or reordered) so a reviewer can
# hold the two side by side.
def _get_type_impl(
    qs: _State, new_type: int, t: TensorFacts, ftype: int, cat: Category
) -> int:
    """llama_tensor_get_type_impl (output_tensor_type / token_embedding_type unset)."""
    m = qs.model
    arch, name = m.arch, t.name
    iq_low = (F.IQ2_XXS, F.IQ2_XS, F.IQ3_XXS, F.IQ1_S, F.IQ2_S, F.IQ2_M, F.IQ1_M)

    glm5_pinned = ("attn_q_a", "attn_q_b", "nextn.eh_proj")
    if arch == "glm5-next" and any(s in name for s in glm5_pinned) and new_type not in UNQUANTIZED:
        return Q8_0

    if cat == Category.OUTPUT or (qs.tied and cat == Category.TOKEN_EMBD):
        nx, qk_k = t.ne(0), block_size(new_type)
        if ftype == F.MXFP4_MOE or arch == "falcon" or nx % qk_k != 0:
            new_type = Q8_0
        elif ftype in iq_low:
            new_type = Q5_K
        elif new_type != Q8_0:
            new_type = Q6_K
    elif ftype == F.MXFP4_MOE:
        bailing_expert = arch == "bailingmoe3" and cat in (
            Category.FFN_UP,
            Category.FFN_GATE,
            Category.FFN_DOWN,
        )
        expert = t.ne(2) > 1 and (arch != "bailingmoe3" or bailing_expert)
        new_type = MXFP4 if expert else Q8_0
    elif cat == Category.TOKEN_EMBD:
        if ftype in (F.IQ2_XXS, F.IQ2_XS, F.IQ1_S, F.IQ1_M):
            new_type = Q2_K
        elif ftype in (F.IQ2_S, F.IQ2_M, F.IQ3_XXS):
            new_type = IQ3_S
        elif ftype in (F.TQ1_0, F.TQ2_0, F.Q2_0):
            new_type = Q4_K
    elif ftype in (F.IQ2_XXS, F.IQ2_XS, F.IQ1_S, F.IQ2_S, F.IQ2_M, F.IQ1_M):
        iq2sm = ftype in (F.IQ2_S, F.IQ2_M)
        if cat in _ATTN_V_LIKE:
            wide = m.n_gqa >= 4 or m.n_expert >= 4
            new_type = Q4_K if wide else (IQ3_S if iq2sm else Q2_K)
            qs.i_attention_wv += 1
        elif m.n_expert == 8 and cat == Category.ATTENTION_K:
            new_type = Q4_K
        elif cat == Category.FFN_DOWN:
            if qs.i_ffn_down < _cdiv(qs.n_ffn_down, 8):
                new_type = IQ3_S if iq2sm else Q2_K
            qs.i_ffn_down += 1
        elif cat == Category.ATTENTION_OUTPUT:
            if m.n_expert == 8:
                new_type = Q5_K
            elif ftype in (F.IQ1_S, F.IQ1_M):
                new_type = IQ2_XXS
            elif iq2sm:
                new_type = IQ3_S
    elif cat in _ATTN_V_LIKE:
        if ftype == F.Q2_K:
            new_type = Q4_K if m.n_gqa >= 4 else Q3_K
        elif ftype == F.Q2_K_S and m.n_gqa >= 4:
            new_type = Q4_K
        elif ftype == F.IQ3_XXS:
            new_type = Q4_K if m.n_gqa >= 4 else (IQ3_S if not qs.has_imatrix else IQ3_XXS)
        elif ftype in (F.IQ3_XS, F.IQ3_S) and m.n_gqa >= 4:  # noqa: SIM114 - as in the C++
            new_type = Q4_K
        elif ftype == F.IQ3_M:
            new_type = Q4_K
        elif ftype == F.Q3_K_M:
            new_type = Q5_K if qs.i_attention_wv < 2 else Q4_K
        elif ftype == F.Q3_K_L:  # noqa: SIM114 - two C++ branches, kept apart
            new_type = Q5_K
        elif ftype in (F.IQ4_NL, F.IQ4_XS) and m.n_gqa >= 4:
            new_type = Q5_K
        elif ftype in (F.Q4_K_M, F.Q5_K_M) and _use_more_bits(
            qs.i_attention_wv, qs.n_attention_wv
        ):
            new_type = Q6_K
        elif ftype == F.Q4_K_S and qs.i_attention_wv < 4:
            new_type = Q5_K
        if m.is_70b and new_type in (Q3_K, Q4_K):
            new_type = Q5_K
        if m.n_expert == 8:
            new_type = Q8_0
        qs.i_attention_wv += 1
    elif cat == Category.ATTENTION_K:
        if m.n_expert == 8:
            new_type = Q8_0
        elif ftype == F.IQ3_XS:
            new_type = IQ3_XXS
        elif ftype == F.IQ3_XXS:
            new_type = IQ2_S
    elif cat == Category.ATTENTION_Q:
        if ftype == F.IQ3_XS:
            new_type = IQ3_XXS
        elif ftype == F.IQ3_XXS:
            new_type = IQ2_S
    elif cat == Category.FFN_DOWN:
        i_layer, n_layer = _layer_info(qs, qs.i_ffn_down, qs.n_ffn_down, name)
        falcon = arch == "falcon"
        if ftype == F.Q2_K:
            new_type = Q3_K
        elif ftype == F.Q2_K_S:
            if i_layer < _cdiv(n_layer, 8):
                new_type = Q4_K
        elif ftype == F.IQ3_XXS and not qs.has_imatrix:
            new_type = Q4_K if i_layer < _cdiv(n_layer, 8) else Q3_K
        elif ftype == F.Q3_K_M:
            if i_layer < _cdiv(n_layer, 16):
                new_type = Q5_K
            elif not falcon or _use_more_bits(i_layer, n_layer):
                new_type = Q4_K
            else:
                new_type = Q3_K
        elif ftype == F.IQ3_M and (
            i_layer < _cdiv(n_layer, 8) or (m.n_expert == 8 and _use_more_bits(i_layer, n_layer))
        ):
            new_type = Q4_K
        elif ftype == F.Q3_K_L:
            new_type = Q4_K if falcon else Q5_K
        elif ftype == F.Q4_K_M:
            if falcon:
                if i_layer < _cdiv(n_layer, 16):
                    new_type = Q6_K
                else:
                    new_type = Q5_K if _use_more_bits(i_layer, n_layer) else Q4_K
            elif _use_more_bits(i_layer, n_layer):
                new_type = Q6_K
        elif (
            i_layer < _cdiv(n_layer, 8)
            and ftype in (F.IQ4_NL, F.IQ4_XS)
            and not qs.has_imatrix
        ):
            new_type = Q5_K
        elif ftype == F.Q5_K_M and _use_more_bits(i_layer, n_layer):
            new_type = Q6_K
        elif ftype == F.Q4_K_S and not falcon and i_layer < _cdiv(n_layer, 8):
            new_type = Q5_K
        elif ftype in (F.Q4_0, F.Q5_0) and qs.has_imatrix and i_layer < _cdiv(n_layer, 8):
            new_type = Q4_1 if ftype == F.Q4_0 else Q5_1
        qs.i_ffn_down += 1
    elif cat == Category.ATTENTION_OUTPUT:
        if arch != "falcon":
            if m.n_expert == 8:
                if ftype in (
                    F.Q2_K, F.IQ3_XS, F.IQ3_XXS, F.Q3_K_S, F.Q3_K_M, F.IQ4_NL, F.Q4_K_S,
                    F.Q4_K_M, F.IQ3_S, F.IQ3_M, F.IQ4_XS,
                ):  # fmt: skip
                    new_type = Q5_K
            else:
                new_type = _ATTN_OUTPUT_TYPES.get(ftype, new_type)
        elif ftype == F.Q3_K_L:
            new_type = Q4_K
    elif cat == Category.ATTENTION_QKV:
        if ftype in (F.Q3_K_M, F.Q3_K_L, F.IQ3_M):
            new_type = Q4_K
        elif ftype == F.Q4_K_M:
            new_type = Q5_K
        elif ftype == F.Q5_K_M:
            new_type = Q6_K
    elif cat in (Category.FFN_GATE, Category.FFN_UP):
        gate = cat == Category.FFN_GATE
        i_cur = qs.i_ffn_gate if gate else qs.i_ffn_up
        i_layer, n_layer = _layer_info(qs, i_cur, qs.n_ffn_gate if gate else qs.n_ffn_up, name)
        if ftype == F.IQ3_XS and _cdiv(n_layer, 8) <= i_layer < _cdiv(7 * n_layer, 8):
            new_type = IQ3_XXS
        if gate:
            qs.i_ffn_gate += 1
        else:
            qs.i_ffn_up += 1
    return new_type


_ATTN_OUTPUT_TYPES: Final[dict[int, int]] = {
    F.Q2_K: Q3_K,
    F.IQ3_XXS: IQ3_S,
    F.Q3_K_M: Q4_K,
    F.Q3_K_L: Q5_K,
    F.IQ3_M: Q4_K,
}


def fallback_type(t: TensorFacts, target: int) -> int:
    """tensor_type_fallback: a type whose block does not divide the row length is replaced."""
    ncols, qk_k = t.ne(0), block_size(target)
    if ncols % qk_k == 0:
        return target
    if target in (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_XS):
        out = IQ4_NL
    elif target in (Q2_K, Q3_K, TQ1_0, TQ2_0):
        out = Q4_0
    elif target == Q4_K:
        out = Q5_0
    elif target == Q5_K:
        out = Q5_1
    elif target == Q6_K:
        out = Q8_0
    elif qk_k <= 32:
        out = target
    else:
        raise RuleError(f"no tensor type fallback is defined for type {type_name(target)}")
    return out if ncols % block_size(out) == 0 else F16


# --- the plan --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorChoice:
    """What happens to one tensor: its target type and why (for --json and the docs)."""

    name: str
    source_type: int
    target_type: int
    reason: str  # "kept" | "preset" | "pure" | "fallback" | "recipe:<line>"
    requires_imatrix: bool = False

    @property
    def converts(self) -> bool:
        return self.source_type != self.target_type


@dataclass(frozen=True)
class QuantPlan:
    file_type: FileType
    pure: bool
    choices: tuple[TensorChoice, ...]  # in the caller's tensor order
    recipe_hits: tuple[int, ...]  # per recipe rule: tensors it decided

    def by_name(self) -> dict[str, TensorChoice]:
        return {c.name: c for c in self.choices}

    def type_counts(self) -> dict[str, int]:
        """Tensors per resulting type, by type name (sorted)."""
        return dict(sorted(Counter(type_name(c.target_type) for c in self.choices).items()))

    def tensor_rows(self) -> list[dict[str, str]]:
        """Every tensor's name, source type, type and why (for --json and --dry-run)."""
        return [
            {
                "name": c.name,
                "source_type": type_name(c.source_type),
                "type": type_name(c.target_type),
                "reason": c.reason,
            }
            for c in self.choices
        ]


def plan_types(
    tensors: Sequence[TensorFacts],
    model: ModelFacts,
    file_type: FileType,
    *,
    pure: bool = False,
    recipe: Recipe | None = None,
    has_imatrix: bool = False,
) -> QuantPlan:
    """llama_model_quantize_impl's preliminary loop: every tensor's target type.

    Two deliberate differences from llama.cpp's ``--tensor-type`` (docs/quantize.md), both
    only with a recipe: a recipe type whose block does not divide a tensor's rows raises
    ``recipe_type_shape`` instead of falling back silently; and a tensor a recipe decides
    still advances the rules' position counters (llama.cpp skips the rules for it, so the
    position-based choices of later attn_v / ffn_down tensors shift). A recipe thus changes
    exactly the tensors it names; without a recipe the plan is llama.cpp's.
    """
    names = [t.name for t in tensors]
    cats = [category_of(n) for n in names]
    qs = _State(model=model, has_imatrix=has_imatrix, tied=Category.OUTPUT not in cats)
    qs.n_attention_wv = sum(c in _ATTN_V_LIKE for c in cats)
    qs.n_ffn_down = qs.n_ffn_gate = qs.n_ffn_up = model.n_layer_all
    default = file_type.default_type
    rules = recipe.rules if recipe is not None else ()
    hits = [0] * len(rules)
    out: list[TensorChoice | None] = [None] * len(tensors)
    for i in llama_order(names):
        t = tensors[i]
        if not allows_quantization(t, model.arch):
            out[i] = TensorChoice(t.name, t.ggml_type, t.ggml_type, "kept")
            continue
        new_type, reason = default, "preset"
        if is_quantized(default):
            rule = next((k for k, r in enumerate(rules) if r.regex.search(t.name)), None)
            if rule is not None:
                hits[rule] += 1
                if not pure:  # advance the rules' counters as if there were no recipe
                    _get_type_impl(qs, new_type, t, file_type.ftype, cats[i])
                new_type, reason = rules[rule].type_id, f"recipe:{rules[rule].line_no}"
                if t.ne(0) % block_size(new_type):
                    raise UsageError(
                        f"recipe line {rules[rule].line_no} gives {t.name} (rows of {t.ne(0)}) "
                        f"the type {type_name(new_type)}, whose blocks of "
                        f"{block_size(new_type)} do not divide its rows",
                        code="recipe_type_shape",
                        remediation="choose a type with a smaller block for this tensor, or "
                        "narrow the pattern",
                    )
            elif pure:
                reason = "pure"
            else:
                new_type = _get_type_impl(qs, new_type, t, file_type.ftype, cats[i])
            fb = fallback_type(t, new_type)
            if fb != new_type:
                new_type, reason = fb, "fallback"
        out[i] = TensorChoice(
            t.name,
            t.ggml_type,
            new_type,
            reason,
            requires_imatrix=requires_imatrix(t.name, new_type, file_type.ftype)
            or new_type in GGML_REQUIRES_IMATRIX,
        )
    return QuantPlan(
        file_type=file_type,
        pure=pure,
        choices=tuple(c for c in out if c is not None),
        recipe_hits=tuple(hits),
    )


# --- consumers: do the tensors match the recorded quantization? ----------------------------
_MAX_TYPE_FINDINGS: Final = 10


def recorded_type_findings(
    block: QuantizationBlock, metadata: Mapping[str, Any], tensors: Sequence[TensorFacts]
) -> list[Finding]:
    """A quantized package's tensors against its ``quantization`` block, without the source:
    the rules only read names, shapes and metadata, so every tensor they quantize must have
    the type they give it. (Tensors they keep keep the source's type, unknown here.)"""
    file_type = FILE_TYPES.get(block.type)
    if file_type is None or file_type.ftype != block.ftype:
        return [
            Finding(
                "quantization_unknown_type",
                f"quantization.type {block.type!r} (ftype {block.ftype}) is not a preset this "
                "runtime knows; tensor types were not checked",
                severity="warning",
            )
        ]
    try:
        recipe = None
        if block.recipe is not None:
            recipe = parse_recipe(block.recipe.encode("utf-8"), allowed_types=QUANTIZE_TARGETS)
        plan = plan_types(
            tensors,
            model_facts(metadata),
            file_type,
            pure=block.pure,
            recipe=recipe,
            has_imatrix=block.imatrix_sha256 is not None,
        )
    except SkippyError as exc:
        return [
            Finding("quantization_not_reproducible", f"quantization block: {exc.message}")
        ]
    actual = {t.name: t.ggml_type for t in tensors}
    wrong = [c for c in plan.choices if c.reason != "kept" and actual[c.name] != c.target_type]
    out = [
        Finding(
            "quantization_type_mismatch",
            f"{c.name} is {type_name(actual[c.name])}, but quantization {block.type}"
            f"{' with its recipe' if recipe else ''} makes it {type_name(c.target_type)}",
        )
        for c in wrong[:_MAX_TYPE_FINDINGS]
    ]
    if len(wrong) > _MAX_TYPE_FINDINGS:
        out.append(
            Finding(
                "quantization_type_mismatch",
                f"{len(wrong) - _MAX_TYPE_FINDINGS} more tensors differ from the recorded "
                f"quantization ({len(wrong)} in all)",
            )
        )
    return out
