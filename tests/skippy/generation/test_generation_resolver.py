"""The phase resolver: the spec's worked numbers, the resolution order, and the decision record.

Numbers come from "Policy Resolution" (first-order estimates) and the IndexShare paragraph;
the order from "Consumers resolve generation policy in this order"; the record fields from
"Policy resolution telemetry SHOULD include ...".
"""

from __future__ import annotations

import json
import logging

import pytest
from spec_examples import GLM_DSA_V1_GENERATION

from skippy.errors import UsageError
from skippy.generation import (
    BackendCapabilities,
    GenerationPolicy,
    GenerationThresholds,
    PhaseOverride,
    PolicyDecision,
    RequestShape,
    RuntimeDefaults,
    dense_mask_bytes,
    hidden_activation_bytes,
    indexshare_sideband_bytes,
    parse_generation,
    resolve_phase,
)
from skippy.generation.resolver import RequestPhase

KiB, MiB, GiB = 1024, 1024**2, 1024**3
K128 = 128 * 1024  # "128k visible KV" / "a full 128k-token window"

# The glm-dsa-v1 package defaults exactly as the spec's manifest example declares them.
SPEC = parse_generation(GLM_DSA_V1_GENERATION, layer_count=1)
POLICY, THRESHOLDS = SPEC.policy, SPEC.thresholds
ALL_PATHS = frozenset({"dense", "direct-sparse", "compact-flash", "sparse-chunked"})
FULL = BackendCapabilities("cuda", ALL_PATHS)
# "a backend that lacks compact selected-KV attention"
NO_COMPACT = BackendCapabilities("metal", ALL_PATHS - {"compact-flash"})
RUNTIME = RuntimeDefaults("glm-dsa")  # every phase "auto", no thresholds of its own


# --- worked numbers -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tokens", "visible_kv", "expected"),
    [
        (1, K128, 512 * KiB),  # "At 128k visible KV: 512 KiB/token"
        (128, K128, 64 * MiB),  # "64 MiB for a 128-token chunk"
        (512, K128, 256 * MiB),  # "256 MiB for 512 tokens"
        (2048, K128, 1 * GiB),  # "1 GiB for a 2048-token chunk"
    ],
)
def test_dense_mask_bytes(tokens: int, visible_kv: int, expected: int) -> None:
    assert dense_mask_bytes(tokens, visible_kv) == expected


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        (1, 3 * KiB),  # "Width 768: 3 KiB/token"
        (128, 384 * KiB),  # "384 KiB for a 128-token chunk"
        (512, 1536 * KiB),  # "1.5 MiB for 512 tokens"
        (2048, 6 * MiB),  # "6 MiB for 2048 tokens"
        (K128, 384 * MiB),  # "384 MiB for a full 128k-token window"
    ],
)
def test_indexshare_sideband_bytes(tokens: int, expected: int) -> None:
    assert indexshare_sideband_bytes(tokens, 768) == expected


@pytest.mark.parametrize(("dtype_bytes", "expected"), [(2, 12 * KiB), (4, 24 * KiB)])
def test_hidden_activation_bytes(dtype_bytes: int, expected: int) -> None:
    # "GLM-5.2 width 6144: 12 KiB/token at f16 or 24 KiB/token at f32"
    assert hidden_activation_bytes(1, 6144, dtype_bytes) == expected


def test_record_carries_the_worked_numbers() -> None:
    d = resolve_phase(
        "long_prefill",
        RequestShape(n_tokens=128, n_kv=K128, top_k=768),
        capabilities=FULL,
        runtime_default=RUNTIME,
        policy=POLICY,
        thresholds=THRESHOLDS,
    )
    assert (d.dense_mask_bytes, d.indexshare_sideband_bytes) == (64 * MiB, 384 * KiB)
    assert d.selected_path == "sparse-chunked" and d.dense_mask_bytes_avoided == 64 * MiB


# --- package policy as written (glm-dsa-v1 phase intent) ------------------------------------------
@pytest.mark.parametrize(
    ("phase", "shape", "path"),
    [
        ("decode", RequestShape(1, 1024, 768), "compact-flash"),
        ("short_prefill", RequestShape(16, 256), "dense"),
        ("long_prefill", RequestShape(8192, K128, 768), "sparse-chunked"),
        # "Selects the short-prefill policy when the prompt/window is at or below this size"
        ("prefill", RequestShape(2048, 2048), "dense"),
        ("prefill", RequestShape(2049, 2049), "sparse-chunked"),
    ],
)
def test_package_recommendation_is_used_on_a_capable_backend(
    phase: str, shape: RequestShape, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="skippy.generation"):
        d = resolve_phase(
            phase,  # type: ignore[arg-type]
            shape,
            capabilities=FULL,
            runtime_default=RUNTIME,
            policy=POLICY,
            thresholds=THRESHOLDS,
        )
    assert (d.selected_path, d.selected_source, d.package_path_status) == (path, "package", "used")
    assert d.package_recommendation_used and d.fallback_reason is None
    assert caplog.records == []  # recommendation used: nothing to log


@pytest.mark.parametrize(("tokens", "phase"), [(2048, "short_prefill"), (2049, "long_prefill")])
def test_prefill_classification_records_the_threshold(tokens: int, phase: str) -> None:
    d = resolve_phase(
        "prefill",
        RequestShape(tokens, tokens),
        capabilities=FULL,
        runtime_default=RUNTIME,
        policy=POLICY,
        thresholds=THRESHOLDS,
    )
    assert (d.requested_phase, d.phase) == ("prefill", phase)
    assert d.selected_threshold is not None
    t = d.selected_threshold
    assert (t.name, t.value, t.source, t.observed) == (
        "short_prefill_max_tokens",
        2048,
        "package",
        tokens,
    )


def test_dense_mask_budget_is_inclusive() -> None:
    # 512 tokens over 128k visible KV is exactly 256 MiB: within a 256 MiB budget.
    d = resolve_phase(
        "short_prefill",
        RequestShape(512, K128),
        capabilities=FULL,
        runtime_default=RUNTIME,
        policy=POLICY,
        thresholds=THRESHOLDS,
    )
    assert d.selected_path == "dense" and d.package_recommendation_used


def test_dense_mask_over_budget_rejects_the_package_path(caplog: pytest.LogCaptureFixture) -> None:
    # 2048 tokens is still "short" (at the threshold), but the dense mask over 128k visible KV
    # is 1 GiB, above dense_mask_max_bytes = 256 MiB: "forcing a sparse fallback".
    with caplog.at_level(logging.INFO, logger="skippy.generation"):
        d = resolve_phase(
            "prefill",
            RequestShape(2048, K128, 768),
            capabilities=FULL,
            runtime_default=RUNTIME,
            policy=POLICY,
            thresholds=THRESHOLDS,
        )
    assert d.phase == "short_prefill" and d.package_path == "dense"
    assert d.package_path_status == "rejected"
    assert d.selected_path != "dense" and d.dense_mask_bytes_avoided == 1 * GiB
    assert d.selected_threshold is not None
    assert (d.selected_threshold.name, d.selected_threshold.observed) == (
        "dense_mask_max_bytes",
        GiB,
    )
    assert d.fallback_reason is not None and "dense" in d.fallback_reason
    (record,) = caplog.records
    line = json.loads(record.getMessage())
    assert line["package_path"] == "dense" and line["selected_path"] == d.selected_path


@pytest.mark.parametrize(("n_kv", "expected"), [(0, False), (1, True), (4096, True)])
def test_compact_flash_min_kv(n_kv: int, expected: bool) -> None:
    # "Rejects compact selected-KV flash below the minimum useful KV history" (min 1 row)
    d = resolve_phase(
        "decode",
        RequestShape(1, n_kv),
        capabilities=FULL,
        runtime_default=RUNTIME,
        policy=POLICY,
        thresholds=THRESHOLDS,
    )
    assert (d.selected_path == "compact-flash") is expected
    if not expected:
        assert d.rejections[0].code == "below_compact_flash_min_kv"


# --- resolution order -----------------------------------------------------------------------------
def test_explicit_override_wins_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    override = PhaseOverride(source="cli", decode="direct-sparse")
    with caplog.at_level(logging.INFO, logger="skippy.generation"):
        d = resolve_phase(
            "decode",
            RequestShape(1, 1024),
            capabilities=FULL,
            runtime_default=RUNTIME,
            policy=POLICY,
            thresholds=THRESHOLDS,
            override=override,
        )
    assert (d.selected_path, d.selected_source) == ("direct-sparse", "override")
    assert (d.package_path, d.package_path_status) == ("compact-flash", "overridden")
    assert d.override_source == "cli"
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert json.loads(record.getMessage())["package_path_status"] == "overridden"


def test_override_bypasses_package_thresholds_for_experiments() -> None:
    d = resolve_phase(
        "long_prefill",
        RequestShape(2048, K128),
        capabilities=FULL,
        runtime_default=RUNTIME,
        policy=POLICY,
        thresholds=THRESHOLDS,
        override=PhaseOverride(source="env", long_prefill="dense"),
    )
    assert (d.selected_path, d.selected_source) == ("dense", "override")


def test_override_for_another_phase_does_not_apply() -> None:
    d = resolve_phase(
        "decode",
        RequestShape(1, 1024),
        capabilities=FULL,
        runtime_default=RUNTIME,
        policy=POLICY,
        override=PhaseOverride(source="cli", long_prefill="dense"),
    )
    assert d.package_recommendation_used and d.override_path is None


def test_unsupported_override_falls_to_the_package_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="skippy.generation"):
        d = resolve_phase(
            "decode",
            RequestShape(1, 1024),
            capabilities=NO_COMPACT,
            runtime_default=RUNTIME,
            policy=GenerationPolicy(profile="glm-dsa-v1", decode="dense"),
            override=PhaseOverride(source="cli", decode="compact-flash"),
        )
    assert (d.selected_path, d.selected_source) == ("dense", "package")
    assert d.rejections[0].code == "backend_unsupported" and d.rejections[0].source == "override"
    assert len(caplog.records) == 1


def test_package_beats_runtime_default() -> None:
    d = resolve_phase(
        "decode",
        RequestShape(1, 1024),
        capabilities=FULL,
        runtime_default=RuntimeDefaults("glm-dsa", decode="dense"),
        policy=POLICY,
        thresholds=THRESHOLDS,
    )
    assert (d.selected_path, d.runtime_default_path) == ("compact-flash", "dense")


def test_unsupported_package_path_falls_back_to_runtime_default_and_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # "the runtime may still fall back from compact-flash to dense on a backend that lacks
    # compact selected-KV attention, but it must log that fallback"
    with caplog.at_level(logging.INFO, logger="skippy.generation"):
        d = resolve_phase(
            "decode",
            RequestShape(1, 1024, 768),
            capabilities=NO_COMPACT,
            runtime_default=RuntimeDefaults("glm-dsa", decode="dense"),
            policy=POLICY,
            thresholds=THRESHOLDS,
        )
    assert (d.selected_path, d.selected_source) == ("dense", "runtime_default")
    assert (d.package_path, d.package_path_status) == ("compact-flash", "rejected")
    assert d.fallback_reason is not None
    assert "compact-flash" in d.fallback_reason and "metal" in d.fallback_reason
    (record,) = caplog.records
    assert record.name == "skippy.generation"


def test_correctness_fallback_when_no_preferred_path_runs(caplog: pytest.LogCaptureFixture) -> None:
    # A backend with only the named correctness fallback
    bare = BackendCapabilities("cpu", frozenset({"fallback"}))
    with caplog.at_level(logging.INFO, logger="skippy.generation"):
        d = resolve_phase(
            "decode",
            RequestShape(1, 1024),
            capabilities=bare,
            runtime_default=RuntimeDefaults("glm-dsa", decode="compact-flash"),
            policy=POLICY,
            thresholds=THRESHOLDS,
        )
    assert (d.selected_path, d.selected_source) == ("fallback", "correctness_fallback")
    assert d.fallback_reason is not None
    (record,) = caplog.records
    assert record.levelno == logging.WARNING


def test_correctness_fallback_prefers_dense_within_budget_and_never_over_it() -> None:
    only_dense = BackendCapabilities("vulkan", frozenset({"dense"}))
    small = resolve_phase(
        "long_prefill",
        RequestShape(128, 1024),
        capabilities=only_dense,
        runtime_default=RuntimeDefaults("glm-dsa", long_prefill="sparse-chunked"),
        policy=POLICY,
        thresholds=THRESHOLDS,
    )
    assert (small.selected_path, small.selected_source) == ("dense", "correctness_fallback")
    huge = resolve_phase(
        "long_prefill",
        RequestShape(2048, K128),
        capabilities=only_dense,
        runtime_default=RuntimeDefaults("glm-dsa", long_prefill="sparse-chunked"),
        policy=POLICY,
        thresholds=THRESHOLDS,
    )
    assert (huge.selected_path, huge.selected_source) == ("fallback", "correctness_fallback")


def test_without_package_policy_the_runtime_default_is_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="skippy.generation"):
        d = resolve_phase(
            "decode",
            RequestShape(1, 64),
            capabilities=FULL,
            runtime_default=RuntimeDefaults("llama", decode="dense"),
        )
    assert (d.selected_path, d.package_path_status, d.profile) == ("dense", "absent", None)
    assert caplog.records == []


def test_runtime_thresholds_apply_only_where_the_package_has_none() -> None:
    runtime = RuntimeDefaults("glm-dsa", dense_mask_max_bytes=1 * MiB, compact_flash_min_kv=4096)
    # package sets dense_mask_max_bytes (256 MiB) but not compact_flash_min_kv
    package = GenerationThresholds(dense_mask_max_bytes=256 * MiB)
    d = resolve_phase(
        "short_prefill",
        RequestShape(128, 8192),  # 4 MiB mask: over the runtime's 1 MiB, under the package's
        capabilities=FULL,
        runtime_default=runtime,
        policy=POLICY,
        thresholds=package,
    )
    assert d.selected_path == "dense"
    d = resolve_phase(
        "decode",
        RequestShape(1, 1024),
        capabilities=FULL,
        runtime_default=runtime,
        policy=POLICY,
        thresholds=package,
    )
    assert d.package_path_status == "rejected"
    assert d.selected_threshold is not None
    t = d.selected_threshold
    assert (t.name, t.value, t.source) == ("compact_flash_min_kv", 4096, "runtime_default")


def test_auto_never_selects_an_unsupported_or_rejected_path() -> None:
    all_auto = GenerationPolicy(
        profile="glm-dsa-v1",
        decode="auto",
        short_prefill="auto",
        long_prefill="auto",
        verify="auto",
    )
    for caps in (FULL, NO_COMPACT, BackendCapabilities("x", frozenset({"sparse-chunked"}))):
        phases: tuple[RequestPhase, ...] = ("decode", "short_prefill", "long_prefill", "verify")
        for phase in phases:
            for shape in (RequestShape(1, 0), RequestShape(16, 4096), RequestShape(2048, K128)):
                d = resolve_phase(
                    phase,
                    shape,
                    capabilities=caps,
                    runtime_default=RUNTIME,
                    policy=all_auto,
                    thresholds=THRESHOLDS,
                )
                assert caps.supports(d.selected_path)
                if d.selected_path == "dense":
                    assert d.dense_mask_bytes <= 256 * MiB
                if d.selected_path == "compact-flash":
                    assert shape.n_kv >= 1


# --- the decision record and the log line ---------------------------------------------------------
TELEMETRY_FIELDS = {
    # "phase, backend, n_tokens, n_kv, top_k, estimated dense-mask bytes, selected threshold,
    # selected path, fallback path, and fallback reason" plus the package profile
    "profile",
    "phase",
    "backend",
    "n_tokens",
    "n_kv",
    "top_k",
    "dense_mask_bytes",
    "selected_threshold",
    "selected_path",
    "package_path",
    "package_path_status",
    "fallback_reason",
    "indexshare",
}


def _fallback_decision(**kw: object) -> PolicyDecision:
    return resolve_phase(
        "decode",
        RequestShape(1, 1024, 768),
        capabilities=NO_COMPACT,
        runtime_default=RuntimeDefaults("glm-dsa", decode="dense"),
        policy=POLICY,
        thresholds=THRESHOLDS,
        **kw,  # type: ignore[arg-type]
    )


def test_decision_record_fields_and_values() -> None:
    d = _fallback_decision(emit_log=False)
    record = d.to_dict()
    assert set(record) >= TELEMETRY_FIELDS
    assert record["profile"] == "glm-dsa-v1" and record["backend"] == "metal"
    assert (record["n_tokens"], record["n_kv"], record["top_k"]) == (1, 1024, 768)
    assert record["dense_mask_bytes"] == 1 * 1024 * 4
    assert record["indexshare"] == "required"
    assert json.loads(json.dumps(record)) == record  # JSON-ready for --json


def test_log_line_is_one_json_line_with_the_record(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="skippy.generation"):
        d = _fallback_decision()
    (record,) = caplog.records
    message = record.getMessage()
    assert "\n" not in message
    line = json.loads(message)
    assert line.pop("event") == "generation_policy_decision"
    assert line == json.loads(json.dumps(d.to_dict()))


def test_emit_log_false_keeps_resolution_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="skippy.generation"):
        d = _fallback_decision(emit_log=False)
    assert d.should_log and caplog.records == []


def test_resolution_is_deterministic() -> None:
    assert _fallback_decision(emit_log=False) == _fallback_decision(emit_log=False)


# --- input validation -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "build",
    [
        lambda: RequestShape(0, 10),
        lambda: RequestShape(1, -1),
        lambda: RequestShape(1, 10, top_k=0),
        lambda: BackendCapabilities(
            "metal", frozenset({"mul_mv_id"})
        ),  # kernel names are not paths
        lambda: BackendCapabilities("metal", frozenset({"auto"})),
        lambda: BackendCapabilities("", frozenset()),
        lambda: RuntimeDefaults("glm-dsa", decode="flash"),
        lambda: PhaseOverride(source="cli", verify="sparse"),
    ],
)
def test_malformed_resolver_inputs_are_usage_errors(build: object) -> None:
    with pytest.raises(UsageError) as info:
        build()  # type: ignore[operator]
    assert info.value.code == "invalid_policy_resolver_input"


def test_unknown_request_phase_is_rejected() -> None:
    with pytest.raises(UsageError):
        resolve_phase(
            "embed",  # type: ignore[arg-type]
            RequestShape(1, 1),
            capabilities=FULL,
            runtime_default=RUNTIME,
        )
