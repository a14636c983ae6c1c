"""Vocabulary of package generation defaults.

Spec sections: "Generation Defaults", "Execution Policy", "Policy Resolution", "Speculative
Decoding" (docs/layer-packages.md). Field names, path values, profile names,
tensor-name patterns and finding codes live here and nowhere else in ``skippy.generation``.
"""

from __future__ import annotations

import re
from typing import Final

# --- the generation object ("Generation Defaults") ------------------------------------------------
GENERATION: Final = "generation"
POLICY: Final = "policy"
THRESHOLDS: Final = "thresholds"
SPECULATIVE: Final = "speculative_decoding"
GENERATION_FIELDS: Final = (POLICY, THRESHOLDS, SPECULATIVE)

# --- generation.policy ("Execution Policy") -------------------------------------------------------
PROFILE: Final = "profile"
INDEXSHARE: Final = "indexshare"
EXPERIMENTAL: Final = "experimental"

PHASE_DECODE: Final = "decode"
PHASE_SHORT_PREFILL: Final = "short_prefill"
PHASE_LONG_PREFILL: Final = "long_prefill"
PHASE_VERIFY: Final = "verify"
# The request phases a policy names a path for, in manifest order.
PHASES: Final = (PHASE_DECODE, PHASE_SHORT_PREFILL, PHASE_LONG_PREFILL, PHASE_VERIFY)
# A caller that does not know short from long passes "prefill"; the resolver classifies it
# with short_prefill_max_tokens ("Threshold units").
PHASE_PREFILL: Final = "prefill"

# Semantic path values ("Execution Policy": "Suggested semantic path values").
PATH_AUTO: Final = "auto"
PATH_DENSE: Final = "dense"
PATH_DIRECT_SPARSE: Final = "direct-sparse"
PATH_COMPACT_FLASH: Final = "compact-flash"
PATH_SPARSE_CHUNKED: Final = "sparse-chunked"
PATH_FALLBACK: Final = "fallback"
PATH_VALUES: Final = frozenset(
    {
        PATH_AUTO,
        PATH_DENSE,
        PATH_DIRECT_SPARSE,
        PATH_COMPACT_FLASH,
        PATH_SPARSE_CHUNKED,
        PATH_FALLBACK,
    }
)
# Paths a backend can execute ("auto" is a resolver instruction, not a path).
EXECUTABLE_PATHS: Final = PATH_VALUES - {PATH_AUTO}

INDEXSHARE_REQUIRED: Final = "required"
INDEXSHARE_VALUES: Final = frozenset({INDEXSHARE_REQUIRED})

EXP_SELECTED_ROW_FLASH: Final = "selected_row_flash"
EXP_MOE_WEIGHTED_DOWN: Final = "moe_weighted_down"
EXP_MOE_MERGED_SHARED_GATE_UP: Final = "moe_merged_shared_gate_up"
EXPERIMENTAL_SWITCHES: Final = frozenset(
    {EXP_SELECTED_ROW_FLASH, EXP_MOE_WEIGHTED_DOWN, EXP_MOE_MERGED_SHARED_GATE_UP}
)
EXP_EVIDENCE_GATED: Final = "evidence-gated"
EXP_DISABLED: Final = "disabled"
# "evidence-gated" is the only value the spec names; "disabled" is the conservative opposite.
# A graduated experiment becomes a new profile version ("Generation Defaults"), not "enabled".
EXPERIMENTAL_VALUES: Final = frozenset({EXP_EVIDENCE_GATED, EXP_DISABLED})

PROFILE_GLM_DSA_V1: Final = "glm-dsa-v1"
KNOWN_PROFILES: Final = frozenset({PROFILE_GLM_DSA_V1})

# --- generation.thresholds ("Execution Policy": "Threshold units") --------------------------------
TH_SHORT_PREFILL_MAX_TOKENS: Final = "short_prefill_max_tokens"  # tokens
TH_COMPACT_FLASH_MIN_KV: Final = "compact_flash_min_kv"  # KV rows
TH_DENSE_MASK_MAX_BYTES: Final = "dense_mask_max_bytes"  # bytes
THRESHOLD_FIELDS: Final = (
    TH_SHORT_PREFILL_MAX_TOKENS,
    TH_COMPACT_FLASH_MIN_KV,
    TH_DENSE_MASK_MAX_BYTES,
)

# glm-dsa-v1 package defaults ("Policy Resolution": phase intent table; manifest example).
GLM_DSA_V1_POLICY: Final = {
    PROFILE: PROFILE_GLM_DSA_V1,
    PHASE_DECODE: PATH_COMPACT_FLASH,
    PHASE_SHORT_PREFILL: PATH_DENSE,
    PHASE_LONG_PREFILL: PATH_SPARSE_CHUNKED,
    PHASE_VERIFY: PATH_AUTO,
    INDEXSHARE: INDEXSHARE_REQUIRED,
    EXPERIMENTAL: {
        EXP_SELECTED_ROW_FLASH: EXP_EVIDENCE_GATED,
        EXP_MOE_WEIGHTED_DOWN: EXP_EVIDENCE_GATED,
        EXP_MOE_MERGED_SHARED_GATE_UP: EXP_EVIDENCE_GATED,
    },
}
GLM_DSA_V1_THRESHOLDS: Final = {
    TH_SHORT_PREFILL_MAX_TOKENS: 2048,
    TH_COMPACT_FLASH_MIN_KV: 1,
    TH_DENSE_MASK_MAX_BYTES: 268435456,  # 256 MiB
}

# Resolver arithmetic ("Policy Resolution": first-order estimates). Both the dense sparse mask
# and the IndexShare top-k sideband are 4-byte elements.
DENSE_MASK_ELEMENT_BYTES: Final = 4
INDEXSHARE_ELEMENT_BYTES: Final = 4

# Backend and kernel vocabulary that must never name a manifest field ("Generation Defaults":
# "Kernel names, Metal/CUDA dispatch choices, simdgroup tuning, row-height sweeps ...").
BACKEND_TOKENS: Final = frozenset(
    {
        "metal",
        "cuda",
        "cpu",
        "vulkan",
        "rocm",
        "hip",
        "sycl",
        "opencl",
        "musa",
        "cann",
        "kernel",
        "kernels",
        "simdgroup",
        "nsg",
        "nr0",
        "dispatch",
    }
)
FIELD_TOKEN_SPLIT_RE: Final = re.compile(r"[_\-.\s]+")

# --- generation.speculative_decoding ("Speculative Decoding") -------------------------------------
SD_DEFAULT: Final = "default"
SD_PROPOSERS: Final = "proposers"
SD_STRATEGIES: Final = "strategies"
SD_FIELDS: Final = frozenset({SD_DEFAULT, SD_PROPOSERS, SD_STRATEGIES})

TYPE: Final = "type"
NATIVE_MTP: Final = "native-mtp"
NGRAM_CACHE: Final = "ngram-cache"
NGRAM_SUFFIX: Final = "ngram-suffix"
COMPOSITE: Final = "composite"
DRAFT_MODEL: Final = "draft-model"
PROPOSER_TYPES: Final = frozenset({NATIVE_MTP, NGRAM_CACHE, NGRAM_SUFFIX})
NGRAM_TYPES: Final = frozenset({NGRAM_CACHE, NGRAM_SUFFIX})
STRATEGY_TYPES: Final = frozenset({NATIVE_MTP, NGRAM_CACHE, NGRAM_SUFFIX, COMPOSITE, DRAFT_MODEL})

PREDICTION_DEPTH: Final = "prediction_depth"
LAYER_INDICES: Final = "layer_indices"
NGRAM_MIN: Final = "ngram_min"
NGRAM_MAX: Final = "ngram_max"
MAX_PROPOSAL_TOKENS: Final = "max_proposal_tokens"
HISTORY_SCOPE: Final = "history_scope"
PROPOSER: Final = "proposer"
PRIMARY: Final = "primary"
EXTENDER: Final = "extender"
EXTENSION_POLICY: Final = "extension_policy"
WINDOW_POLICY: Final = "window_policy"
DRAFT_MODEL_FIELD: Final = "draft_model"

NATIVE_MTP_FIELDS: Final = (PREDICTION_DEPTH, LAYER_INDICES)
NGRAM_FIELDS: Final = (NGRAM_MIN, NGRAM_MAX, MAX_PROPOSAL_TOKENS, HISTORY_SCOPE)

SUPPORTED_PREDICTION_DEPTH: Final = 1
HISTORY_SCOPE_REQUEST: Final = "request"
NGRAM_CACHE_MAX_WINDOW: Final = 4  # llama.cpp's cache match-window limit
NGRAM_SUFFIX_MIN: Final = 3
NGRAM_SUFFIX_MAX: Final = 64

EXT_INITIAL_TOKENS: Final = "initial_tokens"
EXT_MAX_TOKENS: Final = "max_tokens"
EXT_TAIL_BACKOFF_PROPOSALS: Final = "tail_backoff_proposals"
EXTENSION_FIELDS: Final = (EXT_INITIAL_TOKENS, EXT_MAX_TOKENS, EXT_TAIL_BACKOFF_PROPOSALS)

WP_DEFAULT: Final = "default"
WP_INITIAL: Final = "initial_window"
WP_MIN: Final = "min_window"
WP_MAX: Final = "max_window"
WP_PIPELINE_DEPTH: Final = "pipeline_depth"
WINDOW_MODES: Final = frozenset({"fixed", "adaptive"})
WINDOW_FIXED: Final = "fixed"
WINDOW_ADAPTIVE: Final = "adaptive"
LEGACY_WINDOW: Final = 1  # omitted window_policy / pipeline_depth keep the legacy depth of 1

# Stable strategy ids ("Speculative Decoding": "full product menu").
STRATEGY_MTP: Final = "mtp"
STRATEGY_DISABLED: Final = "disabled"  # runtime/operator baseline, never a package strategy
STRATEGY_AUTO: Final = "auto"
LEGACY_STRATEGY_ALIASES: Final = {"native-mtp-n1": STRATEGY_MTP}

# A layer package that does not declare the ngram-cache / ngram-suffix strategy an operator
# asks for is served a request-local plan with these bounds, for each one the operator does
# not set: ngram-suffix as measured on gemma3-270m and SmolLM2-135M (docs/generation.md,
# "Executing N-gram speculation"), ngram-cache within llama.cpp's match window of 4 (the
# spec's example range), with an adaptive verify window of 4 drafts (1..8).
RUNTIME_NGRAM_BOUNDS: Final = {
    NGRAM_CACHE: {NGRAM_MIN: 2, NGRAM_MAX: 4, MAX_PROPOSAL_TOKENS: 8},
    NGRAM_SUFFIX: {NGRAM_MIN: 3, NGRAM_MAX: 16, MAX_PROPOSAL_TOKENS: 8},
}
RUNTIME_WINDOW_INITIAL: Final = 4
RUNTIME_WINDOW_MIN: Final = 1
RUNTIME_WINDOW_MAX: Final = 8

# --- GGUF evidence the writer reads (llama.cpp gguf-py naming) ------------------------------------
NEXTN_PREDICT_LAYERS_KEY: Final = "nextn_predict_layers"  # "<arch>.nextn_predict_layers"
INDEXER_TOP_K_KEY: Final = "attention.indexer.top_k"  # "<arch>.attention.indexer.top_k"
LAYER_TENSOR_RE: Final = re.compile(
    r"\Ablk\.(\d+)\.([A-Za-z0-9_.]+?)(?:\.(?:weight|bias))?\Z", re.ASCII
)
# llama.cpp creates these three NextN tensors unconditionally (embed_tokens, shared_head_head
# and shared_head_norm are TENSOR_NOT_REQUIRED), so they are what "holds NextN tensors" means.
NEXTN_REQUIRED_PARTS: Final = frozenset({"eh_proj", "enorm", "hnorm"})

GLM_DSA_ARCHES: Final = frozenset({"glm-dsa"})
# Split MLA attention: attn_kv_a_mqa plus the split attn_k_b / attn_v_b ("Policy Resolution").
GLM_DSA_ATTENTION_TENSORS: Final = frozenset({"attn_kv_a_mqa", "attn_k_b", "attn_v_b"})
ROUTED_MOE_TENSORS: Final = frozenset({"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"})
ROUTED_MOE_MERGED_TENSORS: Final = frozenset({"ffn_gate_up_exps", "ffn_down_exps"})
SHARED_MOE_TENSORS: Final = frozenset({"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"})
# The lightning-indexer tensors a Full IndexShare layer owns.
INDEXER_TENSORS: Final = frozenset(
    {"indexer.k_norm", "indexer.proj", "indexer.attn_k", "indexer.attn_q_b"}
)

# --- operator overrides ("Speculative Decoding": config.toml / --speculative-strategy) ------------
CFG_SPECULATIVE: Final = "speculative"
CFG_MODELS: Final = "models"
CFG_MODEL_NAME: Final = "name"
CFG_STRATEGY: Final = "strategy"
CFG_EXTENSION_INITIAL_TOKENS: Final = "extension_initial_tokens"
CFG_EXTENSION_MAX_TOKENS: Final = "extension_max_tokens"
CFG_TAIL_BACKOFF_PROPOSALS: Final = "tail_backoff_proposals"
CFG_MAX_WINDOW: Final = "max_window"
CFG_PIPELINE_DEPTH: Final = "pipeline_depth"
CFG_BOUND_FIELDS: Final = (
    NGRAM_MIN,
    NGRAM_MAX,
    MAX_PROPOSAL_TOKENS,
    CFG_EXTENSION_INITIAL_TOKENS,
    CFG_EXTENSION_MAX_TOKENS,
    CFG_TAIL_BACKOFF_PROPOSALS,
    CFG_MAX_WINDOW,
    CFG_PIPELINE_DEPTH,
)
CFG_FIELDS: Final = (CFG_STRATEGY, *CFG_BOUND_FIELDS)

# --- finding / error codes (stable; see docs/generation.md) ---------------------------------------
# schema and policy
C_GENERATION_NOT_OBJECT: Final = "generation_not_object"
C_UNSUPPORTED_GENERATION_FIELD: Final = "unsupported_generation_field"
C_BACKEND_SPECIFIC_FIELD: Final = "backend_specific_generation_field"
C_POLICY_NOT_OBJECT: Final = "generation_policy_not_object"
C_MISSING_PROFILE: Final = "missing_policy_profile"
C_UNSUPPORTED_PROFILE: Final = "unsupported_policy_profile"
C_UNSUPPORTED_POLICY_VALUE: Final = "unsupported_policy_value"
C_UNSUPPORTED_POLICY_FIELD: Final = "unsupported_policy_field"
C_UNSUPPORTED_EXPERIMENTAL_SWITCH: Final = "unsupported_experimental_switch"
C_UNSUPPORTED_EXPERIMENTAL_VALUE: Final = "unsupported_experimental_value"
C_THRESHOLDS_NOT_OBJECT: Final = "generation_thresholds_not_object"
C_INVALID_THRESHOLD: Final = "invalid_threshold"
C_IGNORED_UNKNOWN_THRESHOLD: Final = "ignored_unknown_threshold"
C_PROFILE_EVIDENCE_MISSING: Final = "profile_evidence_missing"
# speculative decoding
C_SPECULATIVE_NOT_OBJECT: Final = "speculative_decoding_not_object"
C_IGNORED_SPECULATIVE_FIELD: Final = "ignored_speculative_field"
C_MISSING_DEFAULT: Final = "missing_speculative_default"
C_UNKNOWN_DEFAULT_STRATEGY: Final = "unknown_default_strategy"
C_DISABLED_NOT_PACKAGE_STRATEGY: Final = "disabled_is_not_a_package_strategy"
C_MISSING_STRATEGIES: Final = "missing_speculative_strategies"
C_INVALID_ENTRY: Final = "invalid_speculative_entry"
C_UNSUPPORTED_PROPOSER_TYPE: Final = "unsupported_proposer_type"
C_UNSUPPORTED_PREDICTION_DEPTH: Final = "unsupported_prediction_depth"
C_INVALID_LAYER_INDICES: Final = "invalid_mtp_layer_indices"
C_LAYER_INDEX_OUT_OF_RANGE: Final = "mtp_layer_index_out_of_range"
C_MTP_LAYER_MISSING_NEXTN: Final = "mtp_layer_missing_nextn_tensors"
C_NEXTN_CHECK_SKIPPED: Final = "nextn_check_skipped"
C_INVALID_NGRAM_BOUNDS: Final = "invalid_ngram_bounds"
C_INVALID_MAX_PROPOSAL_TOKENS: Final = "invalid_max_proposal_tokens"
C_NGRAM_CACHE_WINDOW: Final = "ngram_cache_window_too_wide"
C_NGRAM_SUFFIX_BOUNDS: Final = "ngram_suffix_bounds_out_of_range"
C_INVALID_HISTORY_SCOPE: Final = "invalid_history_scope"
C_AMBIGUOUS_STRATEGY_SOURCE: Final = "ambiguous_strategy_source"
C_UNKNOWN_PROPOSER_REFERENCE: Final = "unknown_proposer_reference"
C_STRATEGY_PROPOSER_MISMATCH: Final = "strategy_proposer_type_mismatch"
C_COMPOSITE_PRIMARY: Final = "composite_primary_not_native_mtp"
C_COMPOSITE_EXTENDER: Final = "composite_extender_not_ngram"
C_INVALID_EXTENSION_POLICY: Final = "invalid_extension_policy"
C_INVALID_WINDOW_POLICY: Final = "invalid_window_policy"
C_NATIVE_MTP_WINDOW_WIDE: Final = "native_mtp_window_wider_than_one"
C_INVALID_DRAFT_MODEL: Final = "invalid_draft_model"
C_IGNORED_UNKNOWN_STRATEGY_TYPE: Final = "ignored_unknown_strategy_type"
C_UNSUPPORTED_DEFAULT_STRATEGY_TYPE: Final = "unsupported_default_strategy_type"
C_MISSING_STRATEGY_TYPE: Final = "missing_strategy_type"
# writer inference (ModelError codes)
C_INCONSISTENT_NEXTN: Final = "inconsistent_nextn_evidence"
C_UNSUPPORTED_NEXTN_DEPTH: Final = "unsupported_nextn_depth"
C_INVALID_NEXTN_METADATA: Final = "invalid_nextn_metadata"
C_INVALID_LAYER_COUNT: Final = "invalid_layer_count"
# operator overrides and plans (UsageError codes)
C_INVALID_SPECULATIVE_CONFIG: Final = "invalid_speculative_config"
C_UNDECLARED_STRATEGY: Final = "undeclared_speculative_strategy"
C_MTP_UNAVAILABLE: Final = "native_mtp_unavailable"
C_BOUND_WIDENED: Final = "speculative_bound_widened"
C_INVALID_OPERATOR_BOUND: Final = "invalid_speculative_bound"
C_NGRAM_BOUNDS_REQUIRED: Final = "ngram_bounds_required"
C_UNSUPPORTED_STRATEGY_TYPE: Final = "unsupported_speculative_strategy_type"
# resolver inputs
C_INVALID_RESOLVER_INPUT: Final = "invalid_policy_resolver_input"
