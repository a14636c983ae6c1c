"""The phase resolver: which attention path one request phase takes, and why.

Spec "Policy Resolution": an explicit override first, then the package policy and thresholds,
then the runtime's built-in default for the architecture, then a named correctness fallback
when the preferred path is unsupported. The resolver is a pure function of its inputs; the
decision record carries every input that changed the outcome, and one structured JSON line is
logged on ``skippy.generation`` whenever the package recommendation was not used
("Generation Defaults": consumers SHOULD log the final resolved policy and the package
recommendation that was overridden; a fallback MUST emit its reason).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from skippy.generation import vocab as v
from skippy.generation.errors import PolicyInputError
from skippy.generation.evidence import as_int
from skippy.generation.schema import GenerationPolicy, GenerationThresholds

LOGGER_NAME = "skippy.generation"
LOG_EVENT = "generation_policy_decision"

RequestPhase = Literal["decode", "prefill", "short_prefill", "long_prefill", "verify"]
Source = Literal["override", "package", "runtime_default", "correctness_fallback"]
PackagePathStatus = Literal["used", "overridden", "rejected", "absent"]

# What "auto" means, per phase, when no runtime default settles it: the first executable path
# not rejected by a threshold. The order follows the glm-dsa-v1 phase intent ("Policy
# Resolution"): compact selected-KV flash for decode, dense below the short-prefill threshold,
# chunked sparse for long prefill; verify spans are short, so they start like short prefill.
AUTO_ORDER: Mapping[str, tuple[str, ...]] = {
    v.PHASE_DECODE: (v.PATH_COMPACT_FLASH, v.PATH_DENSE, v.PATH_DIRECT_SPARSE),
    v.PHASE_SHORT_PREFILL: (v.PATH_DENSE, v.PATH_SPARSE_CHUNKED, v.PATH_DIRECT_SPARSE),
    v.PHASE_LONG_PREFILL: (v.PATH_SPARSE_CHUNKED, v.PATH_DIRECT_SPARSE, v.PATH_DENSE),
    v.PHASE_VERIFY: (v.PATH_DENSE, v.PATH_COMPACT_FLASH, v.PATH_DIRECT_SPARSE),
}
# Step 4: the correctness fallback chain. Dense only within the dense-mask budget ("forcing a
# sparse fallback"); the named "fallback" path is the runtime's reference path and always runs.
CORRECTNESS_FALLBACK_ORDER: tuple[str, ...] = (v.PATH_DENSE, v.PATH_DIRECT_SPARSE, v.PATH_FALLBACK)


# --- arithmetic ("Policy Resolution": first-order estimates) --------------------------------------
def dense_mask_bytes(n_tokens: int, visible_kv: int) -> int:
    """Bytes of a dense float sparse mask: tokens x visible_kv x 4."""
    return n_tokens * visible_kv * v.DENSE_MASK_ELEMENT_BYTES


def indexshare_sideband_bytes(n_tokens: int, top_k: int) -> int:
    """Bytes of the shared IndexShare top-k sideband: tokens x top_k x 4."""
    return n_tokens * top_k * v.INDEXSHARE_ELEMENT_BYTES


def hidden_activation_bytes(n_tokens: int, hidden_width: int, activation_bytes: int) -> int:
    """Bytes of hidden activations crossing a stage boundary: tokens x width x dtype bytes."""
    return n_tokens * hidden_width * activation_bytes


# --- inputs ---------------------------------------------------------------------------------------
def _positive(name: str, value: int, minimum: int) -> None:
    if as_int(value) is None or value < minimum:
        raise PolicyInputError(
            f"{name} must be an integer >= {minimum}, got {value!r}",
            code=v.C_INVALID_RESOLVER_INPUT,
        )


def _check_path(name: str, value: str | None, allowed: frozenset[str]) -> None:
    if value is not None and value not in allowed:
        raise PolicyInputError(
            f"{name} {value!r} is not one of {', '.join(sorted(allowed))}",
            code=v.C_INVALID_RESOLVER_INPUT,
        )


@dataclass(frozen=True)
class RequestShape:
    """The request's shape: tokens in this step, visible KV rows, IndexShare top-k if any."""

    n_tokens: int
    n_kv: int
    top_k: int | None = None

    def __post_init__(self) -> None:
        _positive("n_tokens", self.n_tokens, 1)
        _positive("n_kv", self.n_kv, 0)
        if self.top_k is not None:
            _positive("top_k", self.top_k, 1)


@dataclass(frozen=True)
class BackendCapabilities:
    """The executable semantic paths a backend declares (never kernel names)."""

    backend: str
    paths: frozenset[str]

    def __post_init__(self) -> None:
        if not self.backend:
            raise PolicyInputError("backend name is empty", code=v.C_INVALID_RESOLVER_INPUT)
        for p in self.paths:
            _check_path("backend path", p, v.EXECUTABLE_PATHS)

    def supports(self, path: str) -> bool:
        return path == v.PATH_FALLBACK or path in self.paths


@dataclass(frozen=True)
class RuntimeDefaults:
    """The runtime's built-in policy for one architecture (step 3), with its own thresholds.

    A phase left as None has no runtime opinion; package thresholds win over these.
    """

    arch: str
    decode: str | None = v.PATH_AUTO
    short_prefill: str | None = v.PATH_AUTO
    long_prefill: str | None = v.PATH_AUTO
    verify: str | None = v.PATH_AUTO
    short_prefill_max_tokens: int | None = None
    compact_flash_min_kv: int | None = None
    dense_mask_max_bytes: int | None = None

    def __post_init__(self) -> None:
        for phase in v.PHASES:
            _check_path(f"runtime default {phase}", getattr(self, phase), v.PATH_VALUES)
        for name in v.THRESHOLD_FIELDS:
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name), 0)

    def path_for(self, phase: str) -> str | None:
        value: str | None = getattr(self, phase)
        return value


@dataclass(frozen=True)
class PhaseOverride:
    """An explicit request/runtime override for experiments (step 1); ``source`` names it."""

    source: str
    decode: str | None = None
    short_prefill: str | None = None
    long_prefill: str | None = None
    verify: str | None = None

    def __post_init__(self) -> None:
        for phase in v.PHASES:
            _check_path(f"override {phase}", getattr(self, phase), v.PATH_VALUES)

    def path_for(self, phase: str) -> str | None:
        value: str | None = getattr(self, phase)
        return value


# --- the decision record --------------------------------------------------------------------------
@dataclass(frozen=True)
class AppliedThreshold:
    """One threshold comparison that shaped the decision."""

    name: str
    value: int
    source: Literal["package", "runtime_default"]
    observed: int  # the request-side quantity compared against ``value``
    outcome: str  # e.g. "short_prefill", "rejected compact-flash"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "source": self.source,
            "observed": self.observed,
            "outcome": self.outcome,
        }


@dataclass(frozen=True)
class Rejection:
    """A candidate path that was not taken, with a stable reason code."""

    source: Source
    path: str
    code: Literal[
        "backend_unsupported", "below_compact_flash_min_kv", "dense_mask_over_budget", "auto_empty"
    ]
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"source": self.source, "path": self.path, "code": self.code, "detail": self.detail}


@dataclass(frozen=True)
class PolicyDecision:
    """The selected path for one request phase and every input that explains it."""

    profile: str | None
    requested_phase: str
    phase: str
    backend: str
    n_tokens: int
    n_kv: int
    top_k: int | None
    dense_mask_bytes: int
    indexshare: str | None
    indexshare_sideband_bytes: int | None
    selected_path: str
    selected_source: Source
    selected_from: str | None  # the policy value that produced it ("auto" expands to a path)
    package_path: str | None
    package_path_status: PackagePathStatus
    override_path: str | None
    override_source: str | None
    runtime_default_path: str | None
    selected_threshold: AppliedThreshold | None
    thresholds_applied: tuple[AppliedThreshold, ...] = field(default=())
    rejections: tuple[Rejection, ...] = field(default=())
    fallback_reason: str | None = None
    arch: str | None = None  # the architecture whose runtime default took part (step 3)

    @property
    def package_recommendation_used(self) -> bool:
        return self.package_path_status == "used"

    @property
    def dense_mask_bytes_avoided(self) -> int:
        """Dense sparse-mask bytes not allocated because another path was selected."""
        return 0 if self.selected_path == v.PATH_DENSE else self.dense_mask_bytes

    @property
    def should_log(self) -> bool:
        """Log when a package recommendation existed and was not used, on any correctness
        fallback, and when an explicit override could not be honoured."""
        return (
            self.package_path_status in ("overridden", "rejected")
            or self.selected_source == "correctness_fallback"
            or (self.override_path is not None and self.selected_source != "override")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "arch": self.arch,
            "requested_phase": self.requested_phase,
            "phase": self.phase,
            "backend": self.backend,
            "n_tokens": self.n_tokens,
            "n_kv": self.n_kv,
            "top_k": self.top_k,
            "dense_mask_bytes": self.dense_mask_bytes,
            "dense_mask_bytes_avoided": self.dense_mask_bytes_avoided,
            "indexshare": self.indexshare,
            "indexshare_sideband_bytes": self.indexshare_sideband_bytes,
            "selected_path": self.selected_path,
            "selected_source": self.selected_source,
            "selected_from": self.selected_from,
            "package_path": self.package_path,
            "package_path_status": self.package_path_status,
            "package_recommendation_used": self.package_recommendation_used,
            "override_path": self.override_path,
            "override_source": self.override_source,
            "runtime_default_path": self.runtime_default_path,
            "selected_threshold": (
                self.selected_threshold.to_dict() if self.selected_threshold else None
            ),
            "thresholds_applied": [t.to_dict() for t in self.thresholds_applied],
            "rejections": [r.to_dict() for r in self.rejections],
            "fallback_reason": self.fallback_reason,
        }

    def log_message(self) -> str:
        """The one structured line: JSON with an ``event`` key, sorted keys, no newlines."""
        return json.dumps({"event": LOG_EVENT, **self.to_dict()}, sort_keys=True)


def log_decision(decision: PolicyDecision, logger: logging.Logger | None = None) -> bool:
    """Emit the decision line if ``decision.should_log``; return whether it was emitted.

    Correctness fallbacks log at WARNING, overrides and threshold rejections at INFO.
    """
    if not decision.should_log:
        return False
    log = logger or logging.getLogger(LOGGER_NAME)
    level = logging.WARNING if decision.selected_source == "correctness_fallback" else logging.INFO
    log.log(level, "%s", decision.log_message())
    return True


# --- the resolver ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Threshold:
    value: int
    source: Literal["package", "runtime_default"]


def _effective_thresholds(
    package: GenerationThresholds | None, runtime: RuntimeDefaults
) -> dict[str, _Threshold | None]:
    out: dict[str, _Threshold | None] = {}
    for name in v.THRESHOLD_FIELDS:
        pkg = getattr(package, name) if package is not None else None
        rt = getattr(runtime, name)
        if pkg is not None:
            out[name] = _Threshold(pkg, "package")
        elif rt is not None:
            out[name] = _Threshold(rt, "runtime_default")
        else:
            out[name] = None
    return out


def _classify(
    requested: str, shape: RequestShape, th: Mapping[str, _Threshold | None]
) -> tuple[str, AppliedThreshold | None]:
    if requested != v.PHASE_PREFILL:
        return requested, None
    limit = th[v.TH_SHORT_PREFILL_MAX_TOKENS]
    if limit is None:
        # No threshold anywhere: treat the prompt as long so no dense mask is assumed safe.
        return v.PHASE_LONG_PREFILL, None
    phase = v.PHASE_SHORT_PREFILL if shape.n_tokens <= limit.value else v.PHASE_LONG_PREFILL
    return phase, AppliedThreshold(
        v.TH_SHORT_PREFILL_MAX_TOKENS, limit.value, limit.source, shape.n_tokens, phase
    )


def resolve_phase(
    phase: RequestPhase,
    shape: RequestShape,
    *,
    capabilities: BackendCapabilities,
    runtime_default: RuntimeDefaults,
    policy: GenerationPolicy | None = None,
    thresholds: GenerationThresholds | None = None,
    override: PhaseOverride | None = None,
    emit_log: bool = True,
    logger: logging.Logger | None = None,
) -> PolicyDecision:
    """Select the attention path for one request phase and record why.

    ``phase`` is decode, short_prefill, long_prefill, verify, or ``prefill`` (classified by
    ``short_prefill_max_tokens``: at or below is short). Candidates, in order: the explicit
    ``override`` for the phase (it bypasses package thresholds, not backend capability), the
    package ``policy`` path with the effective thresholds, the ``runtime_default`` path, then
    the correctness fallback chain (dense within the mask budget, direct-sparse, ``fallback``).
    ``auto`` expands to the first path of ``AUTO_ORDER`` the backend runs and no threshold
    rejects. Effective thresholds are the package's, else the runtime default's.

    The only side effect is the decision line (``log_decision``) when ``emit_log`` is true.
    """
    if phase != v.PHASE_PREFILL and phase not in v.PHASES:
        raise PolicyInputError(f"unknown request phase {phase!r}", code=v.C_INVALID_RESOLVER_INPUT)
    th = _effective_thresholds(thresholds, runtime_default)
    eff_phase, classified = _classify(phase, shape, th)
    mask = dense_mask_bytes(shape.n_tokens, shape.n_kv)
    applied: list[AppliedThreshold] = [classified] if classified else []
    rejections: list[Rejection] = []
    rejecting: dict[int, AppliedThreshold] = {}  # rejection index -> threshold that caused it

    def threshold_rejects(path: str, source: Source) -> bool:
        if path == v.PATH_COMPACT_FLASH:
            t = th[v.TH_COMPACT_FLASH_MIN_KV]
            if t is not None and shape.n_kv < t.value:
                a = AppliedThreshold(
                    v.TH_COMPACT_FLASH_MIN_KV, t.value, t.source, shape.n_kv, f"rejected {path}"
                )
                applied.append(a)
                rejecting[len(rejections)] = a
                rejections.append(
                    Rejection(
                        source,
                        path,
                        "below_compact_flash_min_kv",
                        f"n_kv {shape.n_kv} < compact_flash_min_kv {t.value}",
                    )
                )
                return True
        if path == v.PATH_DENSE:
            t = th[v.TH_DENSE_MASK_MAX_BYTES]
            if t is not None and mask > t.value:
                a = AppliedThreshold(
                    v.TH_DENSE_MASK_MAX_BYTES, t.value, t.source, mask, f"rejected {path}"
                )
                applied.append(a)
                rejecting[len(rejections)] = a
                rejections.append(
                    Rejection(
                        source,
                        path,
                        "dense_mask_over_budget",
                        f"dense mask {mask} bytes > dense_mask_max_bytes {t.value}",
                    )
                )
                return True
        return False

    def usable(path: str, source: Source, *, check_thresholds: bool) -> bool:
        if not capabilities.supports(path):
            rejections.append(
                Rejection(
                    source,
                    path,
                    "backend_unsupported",
                    f"backend {capabilities.backend} does not support {path}",
                )
            )
            return False
        return not (check_thresholds and threshold_rejects(path, source))

    def pick(value: str, source: Source, *, check_thresholds: bool) -> str | None:
        if value != v.PATH_AUTO:
            return value if usable(value, source, check_thresholds=check_thresholds) else None
        for path in AUTO_ORDER[eff_phase]:
            if usable(path, source, check_thresholds=check_thresholds):
                return path
        rejections.append(
            Rejection(source, v.PATH_AUTO, "auto_empty", f"no {eff_phase} path is usable")
        )
        return None

    override_path = override.path_for(eff_phase) if override else None
    package_path = policy.path_for(eff_phase) if policy else None
    runtime_path = runtime_default.path_for(eff_phase)
    candidates: list[tuple[Source, str]] = []
    if override_path is not None:
        candidates.append(("override", override_path))
    if package_path is not None:
        candidates.append(("package", package_path))
    if runtime_path is not None:
        candidates.append(("runtime_default", runtime_path))

    selected: str | None = None
    source: Source = "correctness_fallback"
    selected_from: str | None = None
    for cand_source, value in candidates:
        selected = pick(value, cand_source, check_thresholds=cand_source != "override")
        if selected is not None:
            source, selected_from = cand_source, value
            break
    if selected is None:
        for path in CORRECTNESS_FALLBACK_ORDER:
            if usable(path, "correctness_fallback", check_thresholds=True):
                selected, selected_from = path, None
                break
    if selected is None:  # unreachable: PATH_FALLBACK is always supported
        raise RuntimeError("correctness fallback chain produced no path")

    status: PackagePathStatus
    if package_path is None:
        status = "absent"
    elif source == "package":
        status = "used"
    elif source == "override":
        status = "overridden"
    else:
        status = "rejected"

    pkg_rejections = [r for r in rejections if r.source == "package"]
    fallback_reason: str | None = None
    if status == "rejected":
        why = "; ".join(r.detail for r in pkg_rejections) or "not usable"
        fallback_reason = f"package path {package_path} not used: {why}"
    elif source == "correctness_fallback":
        why = "; ".join(r.detail for r in rejections) or "no candidate path"
        fallback_reason = f"no preferred path usable ({why})"
    elif source == "runtime_default" and rejections:
        fallback_reason = "; ".join(r.detail for r in rejections)

    # The deciding threshold: the last one that rejected a higher-priority candidate, else the
    # short/long classification.
    deciding = [rejecting[i] for i in sorted(rejecting)]
    selected_threshold = deciding[-1] if deciding else classified

    decision = PolicyDecision(
        profile=policy.profile if policy else None,
        requested_phase=phase,
        phase=eff_phase,
        backend=capabilities.backend,
        n_tokens=shape.n_tokens,
        n_kv=shape.n_kv,
        top_k=shape.top_k,
        dense_mask_bytes=mask,
        indexshare=policy.indexshare if policy else None,
        indexshare_sideband_bytes=(
            indexshare_sideband_bytes(shape.n_tokens, shape.top_k)
            if shape.top_k is not None
            else None
        ),
        selected_path=selected,
        selected_source=source,
        selected_from=selected_from,
        package_path=package_path,
        package_path_status=status,
        override_path=override_path,
        override_source=override.source if override and override_path is not None else None,
        runtime_default_path=runtime_path,
        selected_threshold=selected_threshold,
        thresholds_applied=tuple(dict.fromkeys(applied)),  # same comparison once, in order
        rejections=tuple(rejections),
        fallback_reason=fallback_reason,
        arch=runtime_default.arch,
    )
    if emit_log:
        log_decision(decision, logger)
    return decision
