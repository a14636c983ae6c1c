"""generation schema: the spec's own examples pass; every rule has a (mutation, code, path) row.

Each row starts from a spec example and breaks exactly one rule quoted from the spec sections
"Generation Defaults", "Execution Policy" and "Speculative Decoding".
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection
from typing import Any

import pytest

from skippy.errors import ManifestError
from skippy.findings import Finding
from skippy.generation import (
    GenerationManifestError,
    NativeMtpSource,
    NgramSource,
    check_generation,
    parse_generation,
)

LAYERS = 48  # the spec examples point native MTP at layer 47

# The "Manifest Schema" example's generation object, verbatim.
SPEC_MANIFEST_GENERATION: dict[str, Any] = {
    "policy": {
        "profile": "glm-dsa-v1",
        "decode": "compact-flash",
        "short_prefill": "dense",
        "long_prefill": "sparse-chunked",
        "verify": "auto",
        "indexshare": "required",
        "experimental": {
            "selected_row_flash": "evidence-gated",
            "moe_weighted_down": "evidence-gated",
            "moe_merged_shared_gate_up": "evidence-gated",
        },
    },
    "thresholds": {
        "short_prefill_max_tokens": 2048,
        "compact_flash_min_kv": 1,
        "dense_mask_max_bytes": 268435456,
    },
    "speculative_decoding": {
        "default": "mtp",
        "strategies": {
            "mtp": {
                "type": "native-mtp",
                "prediction_depth": 1,
                "layer_indices": [47],
                "window_policy": {
                    "default": "fixed",
                    "initial_window": 1,
                    "min_window": 1,
                    "max_window": 1,
                    "pipeline_depth": 1,
                },
            }
        },
    },
}

# The "Speculative Decoding" proposers example, verbatim.
SPEC_PROPOSERS_EXAMPLE: dict[str, Any] = {
    "default": "mtp-cache",
    "proposers": {
        "mtp": {"type": "native-mtp", "prediction_depth": 1, "layer_indices": [47]},
        "cache": {
            "type": "ngram-cache",
            "ngram_min": 2,
            "ngram_max": 4,
            "max_proposal_tokens": 10,
            "history_scope": "request",
        },
    },
    "strategies": {
        "mtp-cache": {
            "type": "composite",
            "primary": "mtp",
            "extender": "cache",
            "extension_policy": {"max_tokens": 8},
        }
    },
}

# A full product menu ("stable strategy ids: mtp, ngram-cache, ngram-suffix, mtp-cache,
# mtp-suffix"), built as the spec describes: N-gram-only names use proposer, composites use the
# MTP proposer as primary and the matching N-gram proposer as extender.
FULL_MENU: dict[str, Any] = {
    "default": "mtp",
    "proposers": {
        "mtp": {"type": "native-mtp", "prediction_depth": 1, "layer_indices": [47]},
        "cache": {
            "type": "ngram-cache",
            "ngram_min": 1,
            "ngram_max": 4,
            "max_proposal_tokens": 10,
            "history_scope": "request",
        },
        "suffix": {
            "type": "ngram-suffix",
            "ngram_min": 3,
            "ngram_max": 64,
            "max_proposal_tokens": 16,
            "history_scope": "request",
        },
    },
    "strategies": {
        "mtp": {"type": "native-mtp", "proposer": "mtp"},
        "ngram-cache": {"type": "ngram-cache", "proposer": "cache"},
        "ngram-suffix": {"type": "ngram-suffix", "proposer": "suffix"},
        "mtp-cache": {
            "type": "composite",
            "primary": "mtp",
            "extender": "cache",
            "extension_policy": {"initial_tokens": 2, "max_tokens": 8, "tail_backoff_proposals": 4},
        },
        "mtp-suffix": {
            "type": "composite",
            "primary": "mtp",
            "extender": "suffix",
            "extension_policy": {"max_tokens": 8},
        },
    },
}


def nextn_layers(*layers: int) -> Callable[[int], Collection[str]]:
    """Artifacts where only ``layers`` hold blk.N.nextn.{eh_proj,enorm,hnorm}."""

    def names(i: int) -> list[str]:
        out = [f"blk.{i}.attn_norm.weight"]
        if i in layers:
            out += [f"blk.{i}.nextn.{p}.weight" for p in ("eh_proj", "enorm", "hnorm")]
        return out

    return names


def glm_dsa_artifacts(nextn: int) -> Callable[[int], Collection[str]]:
    """A GLM-DSA-shaped package: split MLA attention everywhere, routed + shared experts,
    lightning-indexer tensors on every other layer (Full layers), NextN in layer ``nextn``."""

    def names(i: int) -> list[str]:
        out = [f"blk.{i}.{t}.weight" for t in ("attn_kv_a_mqa", "attn_k_b", "attn_v_b")]
        out += [
            f"blk.{i}.ffn_{p}_{s}.weight" for p in ("gate", "up", "down") for s in ("exps", "shexp")
        ]
        if i % 2 == 0:
            out += [f"blk.{i}.indexer.{t}.weight" for t in ("k_norm", "proj", "attn_k", "attn_q_b")]
        return [*out, *nextn_layers(nextn)(i)]

    return names


def codes(findings: list[Finding], severity: str | None = None) -> set[str]:
    return {f.code for f in findings if severity is None or f.severity == severity}


def with_sd(sd: dict[str, Any]) -> dict[str, Any]:
    return {"speculative_decoding": sd}


# --- the spec's examples are valid ----------------------------------------------------------------
@pytest.mark.parametrize(
    "generation",
    [SPEC_MANIFEST_GENERATION, with_sd(SPEC_PROPOSERS_EXAMPLE), with_sd(FULL_MENU), {}],
    ids=["manifest-example", "proposers-example", "full-menu", "empty"],
)
def test_spec_examples_have_no_errors(generation: dict[str, Any]) -> None:
    findings = check_generation(
        generation,
        layer_count=LAYERS,
        layer_tensor_names=glm_dsa_artifacts(47),
        metadata={"glm-dsa.attention.indexer.top_k": 768},
        arch="glm-dsa",
    )
    assert findings == []


def test_absent_generation_is_valid_and_empty() -> None:
    assert check_generation(None, layer_count=LAYERS) == []
    spec = parse_generation(None, layer_count=LAYERS)
    assert spec.policy is None and spec.thresholds is None and spec.speculative is None


def test_generation_must_be_an_object() -> None:
    findings = check_generation(["policy"], layer_count=LAYERS)  # type: ignore[arg-type]
    assert [(f.code, f.path) for f in findings] == [("generation_not_object", "generation")]


# --- policy and thresholds ("Execution Policy") ---------------------------------------------------
def _policy(**changes: Any) -> dict[str, Any]:
    g = copy.deepcopy(SPEC_MANIFEST_GENERATION)
    del g["speculative_decoding"]
    for key, value in changes.items():
        if value is None:
            del g["policy"][key]
        else:
            g["policy"][key] = value
    return g


POLICY_ERRORS = [
    # "Unknown profiles, phase values, or experimental policy switches should be reported as
    # unsupported" -- never mapped to another path.
    (_policy(profile="glm-dsa-v2"), "unsupported_policy_profile", "generation.policy.profile"),
    (_policy(profile=None), "missing_policy_profile", "generation.policy.profile"),
    (_policy(decode="flash"), "unsupported_policy_value", "generation.policy.decode"),
    (_policy(decode="Dense"), "unsupported_policy_value", "generation.policy.decode"),
    (_policy(short_prefill=1), "unsupported_policy_value", "generation.policy.short_prefill"),
    (_policy(long_prefill="chunked"), "unsupported_policy_value", "generation.policy.long_prefill"),
    (_policy(verify="sparse"), "unsupported_policy_value", "generation.policy.verify"),
    (_policy(indexshare="recompute"), "unsupported_policy_value", "generation.policy.indexshare"),
    (
        _policy(experimental={"fused_topk": "evidence-gated"}),
        "unsupported_experimental_switch",
        "generation.policy.experimental.fused_topk",
    ),
    (
        _policy(experimental={"selected_row_flash": "on"}),
        "unsupported_experimental_value",
        "generation.policy.experimental.selected_row_flash",
    ),
    (_policy(prefill="dense"), "unsupported_policy_field", "generation.policy.prefill"),
    # "Kernel names, Metal/CUDA dispatch choices, simdgroup tuning ... should not become
    # manifest fields"
    (
        _policy(metal_kernel="mul_mv_id"),
        "backend_specific_generation_field",
        "generation.policy.metal_kernel",
    ),
    (
        _policy(experimental={"cuda_graphs": "evidence-gated"}),
        "backend_specific_generation_field",
        "generation.policy.experimental.cuda_graphs",
    ),
    ({"policy": "glm-dsa-v1"}, "generation_policy_not_object", "generation.policy"),
]


@pytest.mark.parametrize(("generation", "code", "path"), POLICY_ERRORS)
def test_policy_rules(generation: dict[str, Any], code: str, path: str) -> None:
    findings = check_generation(generation, layer_count=LAYERS)
    assert (code, path, "error") in {(f.code, f.path, f.severity) for f in findings}


@pytest.mark.parametrize(
    "path_value", ["auto", "dense", "direct-sparse", "compact-flash", "sparse-chunked", "fallback"]
)
def test_every_semantic_path_value_is_accepted_for_every_phase(path_value: str) -> None:
    g = _policy(
        decode=path_value, short_prefill=path_value, long_prefill=path_value, verify=path_value
    )
    assert check_generation(g, layer_count=LAYERS) == []


# "Do not add model-family-specific sub-objects such as generation.glm_dsa" and "They should
# not become manifest fields such as generation.metal or generation.glm_dsa".
@pytest.mark.parametrize(
    ("key", "code"),
    [
        ("metal", "backend_specific_generation_field"),
        ("cuda", "backend_specific_generation_field"),
        ("glm_dsa", "unsupported_generation_field"),
        ("kernels", "backend_specific_generation_field"),
    ],
)
def test_family_and_backend_objects_are_rejected_pointing_at_portable_fields(
    key: str, code: str
) -> None:
    findings = check_generation({key: {"decode": "compact-flash"}}, layer_count=LAYERS)
    (f,) = findings
    assert (f.code, f.path, f.severity) == (code, f"generation.{key}", "error")
    assert f.remediation is not None
    for pointer in ("profile", "generation.policy", "generation.thresholds"):
        assert pointer in f.remediation


THRESHOLD_ROWS = [
    # units are tokens, KV rows and bytes: non-negative integers
    ({"short_prefill_max_tokens": -1}, "invalid_threshold", "error"),
    ({"compact_flash_min_kv": 1.5}, "invalid_threshold", "error"),
    ({"dense_mask_max_bytes": "256MiB"}, "invalid_threshold", "error"),
    ({"dense_mask_max_bytes": True}, "invalid_threshold", "error"),
    # "Numeric threshold fields are hints and may be ignored": an unknown one is a note
    ({"verify_max_tokens": 64}, "ignored_unknown_threshold", "warning"),
    # ... unless it is named for a backend detail
    ({"metal_nsg": 4}, "backend_specific_generation_field", "error"),
]


@pytest.mark.parametrize(("thresholds", "code", "severity"), THRESHOLD_ROWS)
def test_threshold_rules(thresholds: dict[str, Any], code: str, severity: str) -> None:
    findings = check_generation({"thresholds": thresholds}, layer_count=LAYERS)
    (key,) = thresholds
    assert [(f.code, f.severity, f.path) for f in findings] == [
        (code, severity, f"generation.thresholds.{key}")
    ]


def test_zero_thresholds_are_valid() -> None:
    zeros = {"short_prefill_max_tokens": 0, "compact_flash_min_kv": 0, "dense_mask_max_bytes": 0}
    assert check_generation({"thresholds": zeros}, layer_count=LAYERS) == []


# --- speculative decoding ("Speculative Decoding") ------------------------------------------------
SD = "generation.speculative_decoding"


def _menu(edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    sd = copy.deepcopy(FULL_MENU)
    edit(sd)
    return with_sd(sd)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(sd: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = sd
        for p in parents:
            node = node[p]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return edit


_DELETE = object()

SPECULATIVE_ERRORS: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    # default: non-empty and a declared strategy; disabled is not a package strategy
    ("default-missing", _set("default", _DELETE), "missing_speculative_default", f"{SD}.default"),
    ("default-empty", _set("default", ""), "missing_speculative_default", f"{SD}.default"),
    (
        "default-undeclared",
        _set("default", "mtp-eagle"),
        "unknown_default_strategy",
        f"{SD}.default",
    ),
    (
        "default-disabled",
        _set("default", "disabled"),
        "disabled_is_not_a_package_strategy",
        f"{SD}.default",
    ),
    (
        "strategy-disabled",
        _set("strategies.disabled", {"type": "native-mtp", "proposer": "mtp"}),
        "disabled_is_not_a_package_strategy",
        f"{SD}.strategies.disabled",
    ),
    ("no-strategies", _set("strategies", {}), "missing_speculative_strategies", f"{SD}.strategies"),
    # supported proposer types
    (
        "proposer-type",
        _set("proposers.cache.type", "ngram-lookahead"),
        "unsupported_proposer_type",
        f"{SD}.proposers.cache.type",
    ),
    # native-mtp: prediction_depth must be 1; layer_indices non-empty, inside layer_count
    (
        "depth-2",
        _set("proposers.mtp.prediction_depth", 2),
        "unsupported_prediction_depth",
        f"{SD}.proposers.mtp.prediction_depth",
    ),
    (
        "depth-missing",
        _set("proposers.mtp.prediction_depth", _DELETE),
        "unsupported_prediction_depth",
        f"{SD}.proposers.mtp.prediction_depth",
    ),
    (
        "layers-empty",
        _set("proposers.mtp.layer_indices", []),
        "invalid_mtp_layer_indices",
        f"{SD}.proposers.mtp.layer_indices",
    ),
    (
        "layers-not-int",
        _set("proposers.mtp.layer_indices", ["47"]),
        "invalid_mtp_layer_indices",
        f"{SD}.proposers.mtp.layer_indices[0]",
    ),
    (
        "layer-out-of-range",
        _set("proposers.mtp.layer_indices", [LAYERS]),
        "mtp_layer_index_out_of_range",
        f"{SD}.proposers.mtp.layer_indices[0]",
    ),
    (
        "layer-negative",
        _set("proposers.mtp.layer_indices", [-1]),
        "mtp_layer_index_out_of_range",
        f"{SD}.proposers.mtp.layer_indices[0]",
    ),
    # ... and pointing at layers whose artifacts hold NextN/MTP tensors
    (
        "layer-without-nextn",
        _set("proposers.mtp.layer_indices", [46]),
        "mtp_layer_missing_nextn_tensors",
        f"{SD}.proposers.mtp.layer_indices[0]",
    ),
    # N-gram proposers: ngram_min <= ngram_max, both >= 1, max_proposal_tokens >= 1
    (
        "ngram-min>max",
        lambda sd: sd["proposers"]["cache"].update(ngram_min=4, ngram_max=3),
        "invalid_ngram_bounds",
        f"{SD}.proposers.cache.ngram_min",
    ),
    (
        "ngram-min-0",
        _set("proposers.cache.ngram_min", 0),
        "invalid_ngram_bounds",
        f"{SD}.proposers.cache.ngram_min",
    ),
    (
        "ngram-max-missing",
        _set("proposers.cache.ngram_max", _DELETE),
        "invalid_ngram_bounds",
        f"{SD}.proposers.cache.ngram_max",
    ),
    (
        "max-proposal-0",
        _set("proposers.cache.max_proposal_tokens", 0),
        "invalid_max_proposal_tokens",
        f"{SD}.proposers.cache.max_proposal_tokens",
    ),
    (
        "max-proposal-missing",
        _set("proposers.suffix.max_proposal_tokens", _DELETE),
        "invalid_max_proposal_tokens",
        f"{SD}.proposers.suffix.max_proposal_tokens",
    ),
    # ngram-cache ngram_max <= 4 (llama.cpp's cache match-window limit)
    (
        "cache-max-5",
        _set("proposers.cache.ngram_max", 5),
        "ngram_cache_window_too_wide",
        f"{SD}.proposers.cache.ngram_max",
    ),
    # ngram-suffix 3 <= ngram_min <= ngram_max <= 64
    (
        "suffix-min-2",
        _set("proposers.suffix.ngram_min", 2),
        "ngram_suffix_bounds_out_of_range",
        f"{SD}.proposers.suffix.ngram_min",
    ),
    (
        "suffix-max-65",
        _set("proposers.suffix.ngram_max", 65),
        "ngram_suffix_bounds_out_of_range",
        f"{SD}.proposers.suffix.ngram_max",
    ),
    # both history proposers require history_scope "request"
    (
        "cache-scope",
        _set("proposers.cache.history_scope", "session"),
        "invalid_history_scope",
        f"{SD}.proposers.cache.history_scope",
    ),
    (
        "suffix-scope",
        _set("proposers.suffix.history_scope", _DELETE),
        "invalid_history_scope",
        f"{SD}.proposers.suffix.history_scope",
    ),
    # composite: native-mtp primary, N-gram extender, extension_policy with positive bounds
    (
        "primary-ngram",
        _set("strategies.mtp-cache.primary", "cache"),
        "composite_primary_not_native_mtp",
        f"{SD}.strategies.mtp-cache.primary",
    ),
    (
        "extender-mtp",
        _set("strategies.mtp-cache.extender", "mtp"),
        "composite_extender_not_ngram",
        f"{SD}.strategies.mtp-cache.extender",
    ),
    (
        "extender-unknown",
        _set("strategies.mtp-cache.extender", "lookup"),
        "unknown_proposer_reference",
        f"{SD}.strategies.mtp-cache.extender",
    ),
    (
        "ext-missing",
        _set("strategies.mtp-cache.extension_policy", _DELETE),
        "invalid_extension_policy",
        f"{SD}.strategies.mtp-cache.extension_policy",
    ),
    (
        "ext-max-0",
        _set("strategies.mtp-cache.extension_policy.max_tokens", 0),
        "invalid_extension_policy",
        f"{SD}.strategies.mtp-cache.extension_policy.max_tokens",
    ),
    (
        "ext-max-missing",
        _set("strategies.mtp-suffix.extension_policy.max_tokens", _DELETE),
        "invalid_extension_policy",
        f"{SD}.strategies.mtp-suffix.extension_policy.max_tokens",
    ),
    (
        "ext-initial>max",
        _set("strategies.mtp-cache.extension_policy.initial_tokens", 9),
        "invalid_extension_policy",
        f"{SD}.strategies.mtp-cache.extension_policy.initial_tokens",
    ),
    (
        "ext-backoff-neg",
        _set("strategies.mtp-cache.extension_policy.tail_backoff_proposals", -1),
        "invalid_extension_policy",
        f"{SD}.strategies.mtp-cache.extension_policy.tail_backoff_proposals",
    ),
    # strategy types must match their proposer's type
    (
        "type-mismatch",
        _set("strategies.ngram-cache.proposer", "suffix"),
        "strategy_proposer_type_mismatch",
        f"{SD}.strategies.ngram-cache.proposer",
    ),
    (
        "mtp-on-ngram",
        _set("strategies.mtp.proposer", "cache"),
        "strategy_proposer_type_mismatch",
        f"{SD}.strategies.mtp.proposer",
    ),
    (
        "proposer-unknown",
        _set("strategies.mtp.proposer", "nextn"),
        "unknown_proposer_reference",
        f"{SD}.strategies.mtp.proposer",
    ),
    (
        "source-twice",
        _set("strategies.mtp.layer_indices", [47]),
        "ambiguous_strategy_source",
        f"{SD}.strategies.mtp",
    ),
    (
        "no-type",
        _set("strategies.mtp.type", _DELETE),
        "missing_strategy_type",
        f"{SD}.strategies.mtp",
    ),
    # window_policy: positive values, min <= max, initial within [min, max], positive depth
    (
        "window-0",
        _set("strategies.ngram-cache.window_policy", {"max_window": 0}),
        "invalid_window_policy",
        f"{SD}.strategies.ngram-cache.window_policy.max_window",
    ),
    (
        "window-min>max",
        _set("strategies.ngram-cache.window_policy", {"min_window": 4, "max_window": 2}),
        "invalid_window_policy",
        f"{SD}.strategies.ngram-cache.window_policy.min_window",
    ),
    (
        "window-initial",
        _set(
            "strategies.ngram-cache.window_policy",
            {"initial_window": 5, "min_window": 1, "max_window": 4},
        ),
        "invalid_window_policy",
        f"{SD}.strategies.ngram-cache.window_policy.initial_window",
    ),
    (
        "window-depth-0",
        _set("strategies.mtp.window_policy", {"pipeline_depth": 0}),
        "invalid_window_policy",
        f"{SD}.strategies.mtp.window_policy.pipeline_depth",
    ),
    (
        "window-mode",
        _set("strategies.mtp.window_policy", {"default": "elastic"}),
        "invalid_window_policy",
        f"{SD}.strategies.mtp.window_policy.default",
    ),
    # draft-model strategies are recognised (and need their model)
    (
        "draft-no-model",
        _set("strategies.draft", {"type": "draft-model"}),
        "invalid_draft_model",
        f"{SD}.strategies.draft.draft_model",
    ),
]


@pytest.mark.parametrize(
    ("edit", "code", "path"),
    [row[1:] for row in SPECULATIVE_ERRORS],
    ids=[row[0] for row in SPECULATIVE_ERRORS],
)
def test_speculative_rules(edit: Callable[[dict[str, Any]], None], code: str, path: str) -> None:
    findings = check_generation(
        _menu(edit), layer_count=LAYERS, layer_tensor_names=nextn_layers(47)
    )
    assert (code, path, "error") in {(f.code, f.path, f.severity) for f in findings}, findings


def test_every_speculative_error_row_reports_only_errors_it_names() -> None:
    # Guard against rows passing by accident: the unedited menu is clean, so every error a row
    # reports comes from its one edit.
    assert (
        check_generation(
            with_sd(FULL_MENU), layer_count=LAYERS, layer_tensor_names=nextn_layers(47)
        )
        == []
    )


NOTES = [
    # "Consumers that do not recognize a strategy type MUST ignore it unless it is the default"
    (
        lambda sd: sd["strategies"].update(eagle={"type": "eagle3"}),
        "ignored_unknown_strategy_type",
        "info",
        f"{SD}.strategies.eagle.type",
    ),
    # ... and when it is the default, the package is still usable (disabled, other strategies,
    # policy): only a request served with that default fails, at plan time.
    (
        lambda sd: sd.update(
            default="eagle", strategies={**sd["strategies"], "eagle": {"type": "eagle3"}}
        ),
        "unsupported_default_strategy_type",
        "warning",
        f"{SD}.strategies.eagle.type",
    ),
    # "window_policy SHOULD be fixed to 1 until runtimes support wider native MTP heads"
    (
        _set("strategies.mtp.window_policy", {"default": "adaptive", "max_window": 3}),
        "native_mtp_window_wider_than_one",
        "warning",
        f"{SD}.strategies.mtp.window_policy",
    ),
    (_set("sidecar", {}), "ignored_speculative_field", "warning", f"{SD}.sidecar"),
]


@pytest.mark.parametrize(("edit", "code", "severity", "path"), NOTES)
def test_speculative_notes_are_not_errors(
    edit: Callable[[dict[str, Any]], None], code: str, severity: str, path: str
) -> None:
    findings = check_generation(
        _menu(edit), layer_count=LAYERS, layer_tensor_names=nextn_layers(47)
    )
    assert [(f.code, f.severity, f.path) for f in findings] == [(code, severity, path)]


def test_draft_model_strategy_is_recognised() -> None:
    edit = _set(
        "strategies.draft",
        {
            "type": "draft-model",
            "draft_model": "org/draft:Q8_0",
            "window_policy": {"default": "adaptive", "min_window": 1, "max_window": 6},
        },
    )
    generation = _menu(edit)
    assert (
        check_generation(generation, layer_count=LAYERS, layer_tensor_names=nextn_layers(47)) == []
    )
    sd = parse_generation(generation, layer_count=LAYERS).speculative
    assert sd is not None
    strategy = sd.strategies["draft"]
    assert (strategy.recognised, strategy.draft_model) == (True, "org/draft:Q8_0")
    assert strategy.window is not None and strategy.window.max_window == 6


def test_inline_ngram_strategy_is_checked_like_a_proposer() -> None:
    inline = {
        "type": "ngram-suffix",
        "ngram_min": 2,
        "ngram_max": 8,
        "max_proposal_tokens": 4,
        "history_scope": "request",
    }
    findings = check_generation(
        with_sd({"default": "s", "strategies": {"s": inline}}), layer_count=LAYERS
    )
    assert [(f.code, f.path) for f in findings] == [
        ("ngram_suffix_bounds_out_of_range", f"{SD}.strategies.s.ngram_min")
    ]


def test_nextn_cross_check_is_skipped_with_an_info_without_artifacts() -> None:
    findings = check_generation(SPEC_MANIFEST_GENERATION, layer_count=LAYERS)
    assert [(f.code, f.severity) for f in findings] == [("nextn_check_skipped", "info")]


def test_nextn_cross_check_needs_the_required_nextn_tensors() -> None:
    def partial(i: int) -> list[str]:  # shared_head_norm alone is not the NextN block
        return [f"blk.{i}.nextn.shared_head_norm.weight"] if i == 47 else []

    findings = check_generation(
        with_sd(SPEC_MANIFEST_GENERATION["speculative_decoding"]),
        layer_count=LAYERS,
        layer_tensor_names=partial,
    )
    assert codes(findings) == {"mtp_layer_missing_nextn_tensors"}


# --- profile evidence against artifacts ("Generation Defaults": writers SHOULD only emit a
# profile after they have validated the artifact shape that profile requires) ----------------------
def _glm_layer(i: int, *, indexer: bool = True, attention: bool = True) -> list[str]:
    names = [
        f"blk.{i}.ffn_{p}_{s}.weight" for p in ("gate", "up", "down") for s in ("exps", "shexp")
    ]
    if attention:
        names += [f"blk.{i}.{t}.weight" for t in ("attn_kv_a_mqa", "attn_k_b", "attn_v_b")]
    if indexer:
        names += [f"blk.{i}.indexer.{t}.weight" for t in ("k_norm", "proj", "attn_k", "attn_q_b")]
    return names


def test_glm_dsa_profile_is_checked_against_artifacts() -> None:
    g = {"policy": SPEC_MANIFEST_GENERATION["policy"]}
    assert check_generation(g, layer_count=4, layer_tensor_names=_glm_layer) == []
    md = {"glm-dsa.attention.indexer.top_k": 768}
    assert (
        check_generation(
            g, layer_count=4, layer_tensor_names=_glm_layer, metadata=md, arch="glm-dsa"
        )
        == []
    )

    def no_attention(i: int) -> list[str]:
        return _glm_layer(i, attention=i != 2)

    findings = check_generation(g, layer_count=4, layer_tensor_names=no_attention)
    assert [(f.code, f.path) for f in findings] == [
        ("profile_evidence_missing", "generation.policy.profile")
    ]
    findings = check_generation(
        g, layer_count=4, layer_tensor_names=_glm_layer, metadata={}, arch="glm-dsa"
    )
    assert codes(findings) == {"profile_evidence_missing"}


# --- parse_generation -----------------------------------------------------------------------------
def test_parse_raises_a_manifest_error_with_every_error() -> None:
    bad = _menu(_set("proposers.mtp.prediction_depth", 2))
    bad["policy"] = {"profile": "glm-dsa-v9"}
    with pytest.raises(ManifestError) as info:
        parse_generation(bad, layer_count=LAYERS)
    err = info.value
    assert isinstance(err, GenerationManifestError)
    assert {f.code for f in err.findings} == {
        "unsupported_policy_profile",
        "unsupported_prediction_depth",
    }
    assert err.code == err.findings[0].code and err.path == err.findings[0].path


def test_parse_builds_the_typed_model_from_the_spec_examples() -> None:
    spec = parse_generation(SPEC_MANIFEST_GENERATION, layer_count=LAYERS)
    assert spec.policy is not None and spec.thresholds is not None and spec.speculative is not None
    assert (spec.policy.decode, spec.policy.path_for("long_prefill")) == (
        "compact-flash",
        "sparse-chunked",
    )
    assert spec.thresholds.dense_mask_max_bytes == 256 * 1024 * 1024
    mtp = spec.speculative.strategies["mtp"]
    assert mtp.source == NativeMtpSource(layer_indices=(47,))
    assert spec.policy.to_dict() == SPEC_MANIFEST_GENERATION["policy"]
    assert spec.thresholds.to_dict() == SPEC_MANIFEST_GENERATION["thresholds"]

    menu = parse_generation(with_sd(SPEC_PROPOSERS_EXAMPLE), layer_count=LAYERS).speculative
    assert menu is not None
    composite = menu.strategies["mtp-cache"]
    assert composite.primary == NativeMtpSource(layer_indices=(47,))
    assert composite.extender == NgramSource("ngram-cache", 2, 4, 10)
    assert composite.extension is not None and composite.extension.max_tokens == 8
    # window_policy.pipeline_depth: "Omission preserves the legacy depth of 1"
    assert composite.window is None and composite.effective_window.pipeline_depth == 1


def test_parse_keeps_unknown_non_default_strategies_unrecognised() -> None:
    generation = _menu(lambda sd: sd["strategies"].update(eagle={"type": "eagle3"}))
    sd = parse_generation(generation, layer_count=LAYERS).speculative
    assert sd is not None and sd.strategies["eagle"].recognised is False
