"""The ``generation`` object: every rule as a finding, and a typed read-only model.

``check_generation`` reports every problem at once (spec "Generation Defaults", "Execution
Policy", "Speculative Decoding"); ``parse_generation`` runs it, raises on errors, and returns a
``GenerationSpec`` of frozen value objects that the resolver and the speculative plan take.
Unknown policy values are never mapped onto a supported path ("Generation Defaults": consumers
MUST NOT silently reinterpret unknown policy values); unknown threshold fields are hints and
only produce a warning.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from skippy.findings import Finding, Severity, errors_only
from skippy.generation import vocab as v
from skippy.generation.errors import GenerationManifestError
from skippy.generation.evidence import (
    as_int,
    glm_dsa_missing_evidence,
    holds_nextn,
    layer_base_names,
    nextn_parts,
)

LayerTensorNames = Callable[[int], Collection[str]]
_EMPTY: Mapping[str, Any] = MappingProxyType({})


# --- typed model ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class GenerationPolicy:
    """``generation.policy`` ("Execution Policy"). A phase left out has no package path."""

    profile: str
    decode: str | None = None
    short_prefill: str | None = None
    long_prefill: str | None = None
    verify: str | None = None
    indexshare: str | None = None
    experimental: Mapping[str, str] = field(default_factory=lambda: _EMPTY)

    def path_for(self, phase: str) -> str | None:
        """The package path for one of ``vocab.PHASES``."""
        if phase not in v.PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        value: str | None = getattr(self, phase)
        return value

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {v.PROFILE: self.profile}
        for phase in v.PHASES:
            if getattr(self, phase) is not None:
                out[phase] = getattr(self, phase)
        if self.indexshare is not None:
            out[v.INDEXSHARE] = self.indexshare
        if self.experimental:
            out[v.EXPERIMENTAL] = dict(self.experimental)
        return out


@dataclass(frozen=True)
class GenerationThresholds:
    """``generation.thresholds``; units are in the names' contract ("Threshold units")."""

    short_prefill_max_tokens: int | None = None  # tokens
    compact_flash_min_kv: int | None = None  # KV rows
    dense_mask_max_bytes: int | None = None  # bytes

    def to_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in v.THRESHOLD_FIELDS if getattr(self, k) is not None}


@dataclass(frozen=True)
class WindowPolicy:
    """A strategy's verify-window policy. Omitted fields keep the legacy fixed window of 1."""

    mode: str = v.WINDOW_FIXED
    initial_window: int = v.LEGACY_WINDOW
    min_window: int = v.LEGACY_WINDOW
    max_window: int = v.LEGACY_WINDOW
    pipeline_depth: int = v.LEGACY_WINDOW

    def __post_init__(self) -> None:
        values = (self.initial_window, self.min_window, self.max_window, self.pipeline_depth)
        if min(values) < 1 or not self.min_window <= self.initial_window <= self.max_window:
            raise ValueError(f"inconsistent window policy {self}")

    def to_dict(self) -> dict[str, Any]:
        return {
            v.WP_DEFAULT: self.mode,
            v.WP_INITIAL: self.initial_window,
            v.WP_MIN: self.min_window,
            v.WP_MAX: self.max_window,
            v.WP_PIPELINE_DEPTH: self.pipeline_depth,
        }


@dataclass(frozen=True)
class NativeMtpSource:
    """A native MTP/NextN proposal source ("Native MTP strategy rules")."""

    layer_indices: tuple[int, ...]
    prediction_depth: int = v.SUPPORTED_PREDICTION_DEPTH
    type: Literal["native-mtp"] = "native-mtp"

    def to_dict(self) -> dict[str, Any]:
        return {
            v.TYPE: self.type,
            v.PREDICTION_DEPTH: self.prediction_depth,
            v.LAYER_INDICES: list(self.layer_indices),
        }


@dataclass(frozen=True)
class NgramSource:
    """A request-local N-gram proposer (ngram-cache or ngram-suffix)."""

    type: Literal["ngram-cache", "ngram-suffix"]
    ngram_min: int
    ngram_max: int
    max_proposal_tokens: int
    history_scope: Literal["request"] = "request"

    def __post_init__(self) -> None:
        problems = ngram_problems(
            self.type, self.ngram_min, self.ngram_max, self.max_proposal_tokens, self.history_scope
        )
        if problems:
            raise ValueError(problems[0][2])

    def to_dict(self) -> dict[str, Any]:
        return {
            v.TYPE: self.type,
            v.NGRAM_MIN: self.ngram_min,
            v.NGRAM_MAX: self.ngram_max,
            v.MAX_PROPOSAL_TOKENS: self.max_proposal_tokens,
            v.HISTORY_SCOPE: self.history_scope,
        }


Proposer = NativeMtpSource | NgramSource


@dataclass(frozen=True)
class ExtensionPolicy:
    """A composite strategy's bounds on the adaptive N-gram tail after the MTP prefix."""

    max_tokens: int
    initial_tokens: int | None = None
    tail_backoff_proposals: int | None = None

    def to_dict(self) -> dict[str, int]:
        out = {v.EXT_MAX_TOKENS: self.max_tokens}
        if self.initial_tokens is not None:
            out[v.EXT_INITIAL_TOKENS] = self.initial_tokens
        if self.tail_backoff_proposals is not None:
            out[v.EXT_TAIL_BACKOFF_PROPOSALS] = self.tail_backoff_proposals
        return out


@dataclass(frozen=True)
class SpeculativeStrategy:
    """One entry of ``speculative_decoding.strategies`` with its proposer references resolved.

    ``recognised`` is False for a type this runtime does not know; such a strategy is kept
    only so tools can show it ("Consumers that do not recognize a strategy type MUST ignore it
    unless it is the declared default").
    """

    id: str
    type: str
    recognised: bool = True
    source: Proposer | None = None  # native-mtp / ngram-* strategies
    source_ref: str | None = None  # the proposer id, when referenced rather than inline
    primary: NativeMtpSource | None = None  # composite
    primary_ref: str | None = None
    extender: NgramSource | None = None  # composite
    extender_ref: str | None = None
    extension: ExtensionPolicy | None = None  # composite
    window: WindowPolicy | None = None  # as declared; None when omitted
    draft_model: str | None = None  # draft-model

    @property
    def effective_window(self) -> WindowPolicy:
        """The declared window, or the legacy fixed window of 1 when it was omitted."""
        return self.window if self.window is not None else WindowPolicy()


@dataclass(frozen=True)
class SpeculativeDecoding:
    """``generation.speculative_decoding`` ("Speculative Decoding")."""

    default: str
    proposers: Mapping[str, Proposer]
    strategies: Mapping[str, SpeculativeStrategy]

    def native_mtp_sources(self) -> list[tuple[str, NativeMtpSource]]:
        """Every native-MTP source, as (where, source): strategies first, then proposers."""
        out: list[tuple[str, NativeMtpSource]] = []
        for sid, s in self.strategies.items():
            if s.type == v.NATIVE_MTP and isinstance(s.source, NativeMtpSource):
                out.append((f"{v.SD_STRATEGIES}.{sid}", s.source))
        for pid, p in self.proposers.items():
            if isinstance(p, NativeMtpSource):
                out.append((f"{v.SD_PROPOSERS}.{pid}", p))
        return out


@dataclass(frozen=True)
class GenerationSpec:
    """A validated ``generation`` object; every part is optional ("generation is optional")."""

    policy: GenerationPolicy | None = None
    thresholds: GenerationThresholds | None = None
    speculative: SpeculativeDecoding | None = None


# --- shared rule helpers --------------------------------------------------------------------------
def ngram_problems(
    ptype: str, ngram_min: object, ngram_max: object, max_proposal_tokens: object, scope: object
) -> list[tuple[str, str, str]]:
    """Every N-gram proposer rule broken, as ``(code, field, message)`` ("Speculative Decoding").

    Shared by the manifest checker and the operator plan for plain GGUF models.
    """
    out: list[tuple[str, str, str]] = []
    lo, hi = as_int(ngram_min), as_int(ngram_max)
    for name, raw, val in ((v.NGRAM_MIN, ngram_min, lo), (v.NGRAM_MAX, ngram_max, hi)):
        if val is None or val < 1:
            out.append(
                (v.C_INVALID_NGRAM_BOUNDS, name, f"{name} must be an integer >= 1, got {raw!r}")
            )
    if lo is not None and hi is not None and lo >= 1 and hi >= 1:
        if lo > hi:
            out.append(
                (
                    v.C_INVALID_NGRAM_BOUNDS,
                    v.NGRAM_MIN,
                    f"ngram_min {lo} is greater than ngram_max {hi}; the match range needs "
                    "ngram_min <= ngram_max",
                )
            )
        if ptype == v.NGRAM_CACHE and hi > v.NGRAM_CACHE_MAX_WINDOW:
            out.append(
                (
                    v.C_NGRAM_CACHE_WINDOW,
                    v.NGRAM_MAX,
                    f"ngram-cache ngram_max {hi} exceeds {v.NGRAM_CACHE_MAX_WINDOW}, llama.cpp's "
                    "cache match-window limit",
                )
            )
        if ptype == v.NGRAM_SUFFIX and not (lo >= v.NGRAM_SUFFIX_MIN and hi <= v.NGRAM_SUFFIX_MAX):
            out.append(
                (
                    v.C_NGRAM_SUFFIX_BOUNDS,
                    v.NGRAM_MIN if lo < v.NGRAM_SUFFIX_MIN else v.NGRAM_MAX,
                    f"ngram-suffix needs {v.NGRAM_SUFFIX_MIN} <= ngram_min <= ngram_max <= "
                    f"{v.NGRAM_SUFFIX_MAX}, got {lo}..{hi}",
                )
            )
    mpt = as_int(max_proposal_tokens)
    if mpt is None or mpt < 1:
        out.append(
            (
                v.C_INVALID_MAX_PROPOSAL_TOKENS,
                v.MAX_PROPOSAL_TOKENS,
                f"max_proposal_tokens must be an integer >= 1, got {max_proposal_tokens!r}",
            )
        )
    if scope != v.HISTORY_SCOPE_REQUEST:
        out.append(
            (
                v.C_INVALID_HISTORY_SCOPE,
                v.HISTORY_SCOPE,
                f'{ptype} must use history_scope "request" (got {scope!r}): a history proposer '
                "never observes another request's tokens",
            )
        )
    return out


def backend_tokens(name: str) -> set[str]:
    """Backend/kernel words in a field name (``metal_nsg`` -> {"metal", "nsg"})."""
    return {t for t in v.FIELD_TOKEN_SPLIT_RE.split(name.lower()) if t in v.BACKEND_TOKENS}


_PORTABLE_HINT = (
    "record the execution family as generation.policy.profile, per-phase choices under "
    "generation.policy (decode, short_prefill, long_prefill, verify, indexshare, experimental) "
    "and numeric limits under generation.thresholds; backends advertise capabilities to the "
    "resolver instead"
)


# --- the checker ----------------------------------------------------------------------------------
class _Checker:
    def __init__(self, layer_count: int, layer_tensor_names: LayerTensorNames | None) -> None:
        self.layer_count = layer_count
        self.layer_tensor_names = layer_tensor_names
        self.findings: list[Finding] = []
        self.nextn_check_skipped = False
        self._layer_cache: dict[int, set[str]] = {}

    def add(
        self,
        code: str,
        message: str,
        path: str,
        *,
        severity: Severity = "error",
        remediation: str | None = None,
    ) -> None:
        self.findings.append(Finding(code, message, severity, path, remediation))

    def layer_names(self, index: int) -> set[str]:
        """Base names of tensors held by layer ``index``'s artifact (needs layer_tensor_names)."""
        if index not in self._layer_cache:
            if self.layer_tensor_names is None:
                raise RuntimeError("layer_names needs layer_tensor_names")  # internal misuse
            names = layer_base_names(self.layer_tensor_names(index))
            self._layer_cache[index] = names.get(index, set())
        return self._layer_cache[index]

    # generation -----------------------------------------------------------------------------------
    def generation(
        self, gen: Mapping[str, Any], metadata: Mapping[str, Any] | None, arch: str | None
    ) -> None:
        for key in gen:
            path = f"{v.GENERATION}.{key}"
            if key in v.GENERATION_FIELDS:
                continue
            if backend_tokens(str(key)):
                self.add(
                    v.C_BACKEND_SPECIFIC_FIELD,
                    f"{path} is backend-specific tuning, which does not belong in the manifest",
                    path,
                    remediation=_PORTABLE_HINT,
                )
            else:
                self.add(
                    v.C_UNSUPPORTED_GENERATION_FIELD,
                    f"{path} is not a generation field (generation holds only policy, "
                    "thresholds and speculative_decoding; no model-family or backend objects)",
                    path,
                    remediation=_PORTABLE_HINT,
                )
        if v.POLICY in gen:
            self.policy(gen[v.POLICY], metadata, arch)
        if v.THRESHOLDS in gen:
            self.thresholds(gen[v.THRESHOLDS])
        if v.SPECULATIVE in gen:
            self.speculative(gen[v.SPECULATIVE])
        if self.nextn_check_skipped:
            self.add(
                v.C_NEXTN_CHECK_SKIPPED,
                "package artifacts not available: native MTP layer_indices were not checked for "
                "NextN tensors",
                f"{v.GENERATION}.{v.SPECULATIVE}",
                severity="info",
            )

    # policy ("Execution Policy") ------------------------------------------------------------------
    def policy(self, pol: object, metadata: Mapping[str, Any] | None, arch: str | None) -> None:
        base = f"{v.GENERATION}.{v.POLICY}"
        if not isinstance(pol, Mapping):
            self.add(v.C_POLICY_NOT_OBJECT, f"{base} must be a JSON object", base)
            return
        profile = pol.get(v.PROFILE)
        if profile is None:
            self.add(
                v.C_MISSING_PROFILE,
                f"{base}.profile is required: it names the policy family and version",
                f"{base}.{v.PROFILE}",
            )
        elif not isinstance(profile, str) or profile not in v.KNOWN_PROFILES:
            self.add(
                v.C_UNSUPPORTED_PROFILE,
                f"policy profile {profile!r} is not supported by this runtime "
                f"(known: {', '.join(sorted(v.KNOWN_PROFILES))})",
                f"{base}.{v.PROFILE}",
                remediation="use a known profile, or a runtime that implements this one",
            )
        for phase in v.PHASES:
            if phase in pol:
                value = pol[phase]
                if not isinstance(value, str) or value not in v.PATH_VALUES:
                    self.add(
                        v.C_UNSUPPORTED_POLICY_VALUE,
                        f"{base}.{phase} value {value!r} is not a supported path "
                        f"(known: {', '.join(sorted(v.PATH_VALUES))}); it is not mapped to "
                        "another path",
                        f"{base}.{phase}",
                    )
        if v.INDEXSHARE in pol:
            value = pol[v.INDEXSHARE]
            if not isinstance(value, str) or value not in v.INDEXSHARE_VALUES:
                self.add(
                    v.C_UNSUPPORTED_POLICY_VALUE,
                    f"{base}.indexshare value {value!r} is not supported "
                    f"(known: {', '.join(sorted(v.INDEXSHARE_VALUES))})",
                    f"{base}.{v.INDEXSHARE}",
                )
        if v.EXPERIMENTAL in pol:
            self.experimental(pol[v.EXPERIMENTAL], f"{base}.{v.EXPERIMENTAL}")
        known = {v.PROFILE, v.INDEXSHARE, v.EXPERIMENTAL, *v.PHASES}
        for key in pol:
            if key in known:
                continue
            path = f"{base}.{key}"
            if backend_tokens(str(key)):
                self.add(
                    v.C_BACKEND_SPECIFIC_FIELD,
                    f"{path} is backend-specific; policy fields are portable semantics",
                    path,
                    remediation=_PORTABLE_HINT,
                )
            else:
                self.add(
                    v.C_UNSUPPORTED_POLICY_FIELD,
                    f"{path} is not a supported policy field; policy fields describe execution "
                    "semantics and are not ignored",
                    path,
                    remediation=_PORTABLE_HINT,
                )
        if profile == v.PROFILE_GLM_DSA_V1 and self.layer_tensor_names is not None:
            self.profile_evidence(f"{base}.{v.PROFILE}", metadata, arch)

    def experimental(self, exp: object, base: str) -> None:
        if not isinstance(exp, Mapping):
            self.add(v.C_UNSUPPORTED_POLICY_VALUE, f"{base} must be a JSON object", base)
            return
        for key, value in exp.items():
            path = f"{base}.{key}"
            if key not in v.EXPERIMENTAL_SWITCHES:
                code = (
                    v.C_BACKEND_SPECIFIC_FIELD
                    if backend_tokens(str(key))
                    else v.C_UNSUPPORTED_EXPERIMENTAL_SWITCH
                )
                self.add(
                    code,
                    f"experimental switch {key!r} is not supported "
                    f"(known: {', '.join(sorted(v.EXPERIMENTAL_SWITCHES))})",
                    path,
                )
            elif not isinstance(value, str) or value not in v.EXPERIMENTAL_VALUES:
                self.add(
                    v.C_UNSUPPORTED_EXPERIMENTAL_VALUE,
                    f"{path} value {value!r} is not supported "
                    f"(known: {', '.join(sorted(v.EXPERIMENTAL_VALUES))})",
                    path,
                    remediation="keep experiments evidence-gated; a path that graduates becomes "
                    "a new profile version",
                )

    def profile_evidence(
        self, path: str, metadata: Mapping[str, Any] | None, arch: str | None
    ) -> None:
        per_layer = {i: self.layer_names(i) for i in range(self.layer_count)}
        nextn_layers = [i for i, names in per_layer.items() if nextn_parts(names)]
        top_k: object = None
        check_top_k = metadata is not None and arch is not None
        if check_top_k and metadata is not None and arch is not None:
            top_k = metadata.get(f"{arch}.{v.INDEXER_TOP_K_KEY}")
        missing = glm_dsa_missing_evidence(
            per_layer=per_layer,
            layer_count=self.layer_count,
            nextn_layers=nextn_layers,
            indexer_top_k=top_k,
            check_top_k=check_top_k,
        )
        for item in missing:
            self.add(
                v.C_PROFILE_EVIDENCE_MISSING,
                f"profile {v.PROFILE_GLM_DSA_V1} requires {item}",
                path,
                remediation="rewrite the package from a GLM-DSA source, or drop the profile",
            )

    # thresholds -----------------------------------------------------------------------------------
    def thresholds(self, th: object) -> None:
        base = f"{v.GENERATION}.{v.THRESHOLDS}"
        if not isinstance(th, Mapping):
            self.add(v.C_THRESHOLDS_NOT_OBJECT, f"{base} must be a JSON object", base)
            return
        for key, value in th.items():
            path = f"{base}.{key}"
            if key in v.THRESHOLD_FIELDS:
                n = as_int(value)
                if n is None or n < 0:
                    self.add(
                        v.C_INVALID_THRESHOLD,
                        f"{path} must be a non-negative integer, got {value!r}",
                        path,
                    )
            elif backend_tokens(str(key)):
                self.add(
                    v.C_BACKEND_SPECIFIC_FIELD,
                    f"{path} is named for a backend detail; thresholds are named for the "
                    "resolver decision they inform",
                    path,
                    remediation=_PORTABLE_HINT,
                )
            else:
                self.add(
                    v.C_IGNORED_UNKNOWN_THRESHOLD,
                    f"unknown threshold {key!r} is ignored (thresholds are resolver hints)",
                    path,
                    severity="warning",
                )

    # speculative decoding ("Speculative Decoding") ------------------------------------------------
    def speculative(self, sd: object) -> None:
        base = f"{v.GENERATION}.{v.SPECULATIVE}"
        if not isinstance(sd, Mapping):
            self.add(v.C_SPECULATIVE_NOT_OBJECT, f"{base} must be a JSON object", base)
            return
        for key in sd:
            if key not in v.SD_FIELDS:
                self.add(
                    v.C_IGNORED_SPECULATIVE_FIELD,
                    f"unknown field {key!r} in {base} is ignored",
                    f"{base}.{key}",
                    severity="warning",
                )
        proposers = self.proposers(sd.get(v.SD_PROPOSERS), f"{base}.{v.SD_PROPOSERS}")
        strategies = sd.get(v.SD_STRATEGIES)
        spath = f"{base}.{v.SD_STRATEGIES}"
        default = sd.get(v.SD_DEFAULT)
        dpath = f"{base}.{v.SD_DEFAULT}"
        if not isinstance(strategies, Mapping) or not strategies:
            self.add(
                v.C_MISSING_STRATEGIES,
                f"{spath} must be a non-empty object of strategy id to configuration",
                spath,
            )
            strategies = {}
        if not isinstance(default, str) or not default:
            self.add(
                v.C_MISSING_DEFAULT,
                f"{dpath} must be a non-empty strategy id",
                dpath,
            )
            default = None
        elif default == v.STRATEGY_DISABLED:
            self.add(
                v.C_DISABLED_NOT_PACKAGE_STRATEGY,
                '"disabled" is a runtime/operator baseline, not a package strategy',
                dpath,
                remediation="omit speculative_decoding to publish no speculation default",
            )
        elif default not in strategies:
            self.add(
                v.C_UNKNOWN_DEFAULT_STRATEGY,
                f"default strategy {default!r} is not declared under {spath}",
                dpath,
            )
        for sid, strat in strategies.items():
            self.strategy(str(sid), strat, proposers, f"{spath}.{sid}", is_default=sid == default)

    def proposers(self, props: object, base: str) -> dict[str, str | None]:
        """Validate proposers; return ``{id: type}`` (type None when unusable)."""
        types: dict[str, str | None] = {}
        if props is None:
            return types
        if not isinstance(props, Mapping):
            self.add(v.C_INVALID_ENTRY, f"{base} must be a JSON object", base)
            return types
        for pid, prop in props.items():
            path = f"{base}.{pid}"
            if not isinstance(prop, Mapping):
                self.add(v.C_INVALID_ENTRY, f"{path} must be a JSON object", path)
                types[str(pid)] = None
                continue
            ptype = prop.get(v.TYPE)
            if not isinstance(ptype, str) or ptype not in v.PROPOSER_TYPES:
                self.add(
                    v.C_UNSUPPORTED_PROPOSER_TYPE,
                    f"proposer type {ptype!r} is not supported "
                    f"(known: {', '.join(sorted(v.PROPOSER_TYPES))})",
                    f"{path}.{v.TYPE}",
                )
                types[str(pid)] = None
                continue
            types[str(pid)] = ptype
            self.source(ptype, prop, path)
        return types

    def source(self, ptype: str, obj: Mapping[str, Any], path: str) -> None:
        if ptype == v.NATIVE_MTP:
            self.native_mtp(obj, path)
        else:
            for code, fld, message in ngram_problems(
                ptype,
                obj.get(v.NGRAM_MIN),
                obj.get(v.NGRAM_MAX),
                obj.get(v.MAX_PROPOSAL_TOKENS),
                obj.get(v.HISTORY_SCOPE),
            ):
                self.add(code, message, f"{path}.{fld}")

    def native_mtp(self, obj: Mapping[str, Any], path: str) -> None:
        depth = obj.get(v.PREDICTION_DEPTH)
        if as_int(depth) != v.SUPPORTED_PREDICTION_DEPTH:
            self.add(
                v.C_UNSUPPORTED_PREDICTION_DEPTH,
                f"native-mtp prediction_depth must be {v.SUPPORTED_PREDICTION_DEPTH} for the "
                f"current native MTP runtime, got {depth!r}",
                f"{path}.{v.PREDICTION_DEPTH}",
            )
        lpath = f"{path}.{v.LAYER_INDICES}"
        raw = obj.get(v.LAYER_INDICES)
        if not isinstance(raw, list) or not raw:
            self.add(
                v.C_INVALID_LAYER_INDICES,
                f"native-mtp layer_indices must be a non-empty list of layer indices, got {raw!r}",
                lpath,
            )
            return
        seen: set[int] = set()
        for pos, item in enumerate(raw):
            ipath = f"{lpath}[{pos}]"
            index = as_int(item)
            if index is None:
                self.add(
                    v.C_INVALID_LAYER_INDICES, f"layer index {item!r} is not an integer", ipath
                )
                continue
            if index in seen:
                self.add(v.C_INVALID_LAYER_INDICES, f"layer index {index} is repeated", ipath)
                continue
            seen.add(index)
            if not 0 <= index < self.layer_count:
                self.add(
                    v.C_LAYER_INDEX_OUT_OF_RANGE,
                    f"layer index {index} is outside the package's layers 0..{self.layer_count}",
                    ipath,
                )
            elif self.layer_tensor_names is None:
                self.nextn_check_skipped = True
            elif not holds_nextn(self.layer_names(index)):
                have = sorted(nextn_parts(self.layer_names(index)))
                self.add(
                    v.C_MTP_LAYER_MISSING_NEXTN,
                    f"layer {index}'s artifact does not hold the NextN/MTP tensors "
                    f"blk.{index}.nextn.{{{','.join(sorted(v.NEXTN_REQUIRED_PARTS))}}} "
                    f"(found nextn parts: {have or 'none'})",
                    ipath,
                    remediation="point layer_indices at the layer holding blk.N.nextn.* tensors, "
                    "or drop the native-mtp source",
                )

    def strategy(
        self,
        sid: str,
        strat: object,
        proposers: Mapping[str, str | None],
        path: str,
        *,
        is_default: bool,
    ) -> None:
        if sid == v.STRATEGY_DISABLED:
            self.add(
                v.C_DISABLED_NOT_PACKAGE_STRATEGY,
                '"disabled" is a runtime/operator baseline and cannot be declared as a package '
                "strategy",
                path,
            )
        if not isinstance(strat, Mapping):
            self.add(v.C_INVALID_ENTRY, f"{path} must be a JSON object", path)
            return
        stype = strat.get(v.TYPE)
        if not isinstance(stype, str) or not stype:
            self.add(v.C_MISSING_STRATEGY_TYPE, f"{path}.type must be a strategy type", path)
            return
        if stype not in v.STRATEGY_TYPES:
            # "Consumers that do not recognize a strategy type MUST ignore it unless it is the
            # declared default for a request they are trying to serve": the package stays
            # usable (speculation disabled, other strategies, policy); only a plan that selects
            # this strategy fails (resolve_speculative_plan: unsupported_speculative_strategy_type).
            if is_default:
                self.add(
                    v.C_UNSUPPORTED_DEFAULT_STRATEGY_TYPE,
                    f"default strategy {sid!r} has type {stype!r}, which this runtime does not "
                    "support; serving it (auto) is refused, other strategies still apply",
                    f"{path}.{v.TYPE}",
                    severity="warning",
                )
            else:
                self.add(
                    v.C_IGNORED_UNKNOWN_STRATEGY_TYPE,
                    f"strategy {sid!r} of unknown type {stype!r} is ignored",
                    f"{path}.{v.TYPE}",
                    severity="info",
                )
            return
        if stype in v.PROPOSER_TYPES:
            self.proposer_strategy(stype, strat, proposers, path)
        elif stype == v.COMPOSITE:
            self.composite(strat, proposers, path)
        elif stype == v.DRAFT_MODEL:
            model = strat.get(v.DRAFT_MODEL_FIELD)
            if not isinstance(model, str) or not model:
                self.add(
                    v.C_INVALID_DRAFT_MODEL,
                    "a draft-model strategy needs a non-empty draft_model reference",
                    f"{path}.{v.DRAFT_MODEL_FIELD}",
                )
        if v.WINDOW_POLICY in strat:
            window = self.window_policy(strat[v.WINDOW_POLICY], f"{path}.{v.WINDOW_POLICY}")
            if stype == v.NATIVE_MTP and window is not None and window.max_window > 1:
                self.add(
                    v.C_NATIVE_MTP_WINDOW_WIDE,
                    "native MTP window_policy should stay fixed at 1 until runtimes support "
                    f"wider native MTP heads (max_window {window.max_window})",
                    f"{path}.{v.WINDOW_POLICY}",
                    severity="warning",
                )

    def proposer_strategy(
        self, stype: str, strat: Mapping[str, Any], proposers: Mapping[str, str | None], path: str
    ) -> None:
        ref = strat.get(v.PROPOSER)
        fields = v.NATIVE_MTP_FIELDS if stype == v.NATIVE_MTP else v.NGRAM_FIELDS
        inline = [f for f in fields if f in strat]
        if ref is not None and inline:
            self.add(
                v.C_AMBIGUOUS_STRATEGY_SOURCE,
                f"strategy references proposer {ref!r} and also declares {', '.join(inline)} "
                "inline; use one source",
                path,
            )
            return
        if ref is None:
            self.source(stype, strat, path)
            return
        self.reference(
            ref,
            proposers,
            f"{path}.{v.PROPOSER}",
            expect={stype},
            code=v.C_STRATEGY_PROPOSER_MISMATCH,
            role=f"a {stype} strategy",
        )

    def reference(
        self,
        ref: object,
        proposers: Mapping[str, str | None],
        path: str,
        *,
        expect: Collection[str],
        code: str,
        role: str,
    ) -> None:
        if not isinstance(ref, str) or ref not in proposers:
            self.add(
                v.C_UNKNOWN_PROPOSER_REFERENCE,
                f"{ref!r} is not a declared proposer id",
                path,
            )
            return
        ptype = proposers[ref]
        if ptype is not None and ptype not in expect:
            self.add(
                code,
                f"proposer {ref!r} has type {ptype}, but {role} needs "
                f"{' or '.join(sorted(expect))}",
                path,
            )

    def composite(
        self, strat: Mapping[str, Any], proposers: Mapping[str, str | None], path: str
    ) -> None:
        self.reference(
            strat.get(v.PRIMARY),
            proposers,
            f"{path}.{v.PRIMARY}",
            expect={v.NATIVE_MTP},
            code=v.C_COMPOSITE_PRIMARY,
            role="a composite primary",
        )
        self.reference(
            strat.get(v.EXTENDER),
            proposers,
            f"{path}.{v.EXTENDER}",
            expect=v.NGRAM_TYPES,
            code=v.C_COMPOSITE_EXTENDER,
            role="a composite extender",
        )
        epath = f"{path}.{v.EXTENSION_POLICY}"
        ext = strat.get(v.EXTENSION_POLICY)
        if not isinstance(ext, Mapping):
            self.add(
                v.C_INVALID_EXTENSION_POLICY,
                "a composite strategy needs an extension_policy object with a positive max_tokens",
                epath,
            )
            return
        if v.EXT_MAX_TOKENS not in ext:
            self.add(
                v.C_INVALID_EXTENSION_POLICY,
                "extension_policy.max_tokens is required: it bounds the adaptive N-gram tail",
                f"{epath}.{v.EXT_MAX_TOKENS}",
            )
        for name in v.EXTENSION_FIELDS:
            if name in ext and (as_int(ext[name]) or 0) < 1:
                self.add(
                    v.C_INVALID_EXTENSION_POLICY,
                    f"extension_policy.{name} must be a positive integer, got {ext[name]!r}",
                    f"{epath}.{name}",
                )
        lo, hi = as_int(ext.get(v.EXT_INITIAL_TOKENS)), as_int(ext.get(v.EXT_MAX_TOKENS))
        if lo is not None and hi is not None and 1 <= hi < lo:
            self.add(
                v.C_INVALID_EXTENSION_POLICY,
                f"extension_policy.initial_tokens {lo} exceeds max_tokens {hi}",
                f"{epath}.{v.EXT_INITIAL_TOKENS}",
            )

    def window_policy(self, wp: object, path: str) -> WindowPolicy | None:
        if not isinstance(wp, Mapping):
            self.add(v.C_INVALID_WINDOW_POLICY, f"{path} must be a JSON object", path)
            return None
        ok = True
        mode = wp.get(v.WP_DEFAULT, v.WINDOW_FIXED)
        if not isinstance(mode, str) or mode not in v.WINDOW_MODES:
            self.add(
                v.C_INVALID_WINDOW_POLICY,
                f"window_policy.default {mode!r} is not one of {', '.join(sorted(v.WINDOW_MODES))}",
                f"{path}.{v.WP_DEFAULT}",
            )
            ok = False
        for name in (v.WP_INITIAL, v.WP_MIN, v.WP_MAX, v.WP_PIPELINE_DEPTH):
            if name in wp and (as_int(wp[name]) or 0) < 1:
                self.add(
                    v.C_INVALID_WINDOW_POLICY,
                    f"window_policy.{name} must be a positive integer, got {wp[name]!r}",
                    f"{path}.{name}",
                )
                ok = False
        if not ok:
            return None
        lo = as_int(wp.get(v.WP_MIN))
        hi = as_int(wp.get(v.WP_MAX))
        init = as_int(wp.get(v.WP_INITIAL))
        if lo is not None and hi is not None and lo > hi:
            self.add(
                v.C_INVALID_WINDOW_POLICY,
                f"window_policy.min_window {lo} exceeds max_window {hi}",
                f"{path}.{v.WP_MIN}",
            )
            return None
        eff_lo = lo if lo is not None else v.LEGACY_WINDOW
        eff_hi = hi if hi is not None else max(eff_lo, init if init is not None else eff_lo)
        if init is not None and not eff_lo <= init <= eff_hi:
            self.add(
                v.C_INVALID_WINDOW_POLICY,
                f"window_policy.initial_window {init} is outside [{eff_lo}, {eff_hi}]",
                f"{path}.{v.WP_INITIAL}",
            )
            return None
        return build_window(wp)


def check_generation(
    generation: Mapping[str, Any] | None,
    *,
    layer_count: int,
    layer_tensor_names: LayerTensorNames | None = None,
    metadata: Mapping[str, Any] | None = None,
    arch: str | None = None,
) -> list[Finding]:
    """Every schema, policy and speculative-decoding rule broken by ``generation``, as findings.

    ``layer_tensor_names(i)`` returns the tensor names held by layer ``i``'s artifact; when it
    is None (artifacts not at hand) the NextN and profile-evidence cross-checks are skipped and
    one info finding says so. ``metadata``/``arch`` (the package's shared GGUF metadata) add the
    IndexShare metadata check for ``glm-dsa-v1``. ``Finding.path`` is the manifest JSON path.
    """
    raw: object = generation  # a caller may hand over any decoded JSON value
    if raw is None:
        return []
    if not isinstance(raw, Mapping):
        return [
            Finding(
                v.C_GENERATION_NOT_OBJECT,
                "generation must be a JSON object",
                "error",
                v.GENERATION,
            )
        ]
    checker = _Checker(layer_count, layer_tensor_names)
    checker.generation(raw, metadata, arch)
    return checker.findings


# --- typed construction ---------------------------------------------------------------------------
def build_window(wp: Mapping[str, Any]) -> WindowPolicy:
    """A WindowPolicy from a checked mapping; omitted bounds follow the given ones."""
    lo = as_int(wp.get(v.WP_MIN))
    hi = as_int(wp.get(v.WP_MAX))
    init = as_int(wp.get(v.WP_INITIAL))
    lo = lo if lo is not None else v.LEGACY_WINDOW
    hi = hi if hi is not None else max(lo, init if init is not None else lo)
    init = init if init is not None else lo
    depth = as_int(wp.get(v.WP_PIPELINE_DEPTH))
    return WindowPolicy(
        mode=str(wp.get(v.WP_DEFAULT, v.WINDOW_FIXED)),
        initial_window=init,
        min_window=lo,
        max_window=hi,
        pipeline_depth=depth if depth is not None else v.LEGACY_WINDOW,
    )


def _build_source(ptype: str, obj: Mapping[str, Any]) -> Proposer:
    if ptype == v.NATIVE_MTP:
        return NativeMtpSource(
            layer_indices=tuple(int(i) for i in obj[v.LAYER_INDICES]),
            prediction_depth=int(obj[v.PREDICTION_DEPTH]),
        )
    return NgramSource(
        type=v.NGRAM_CACHE if ptype == v.NGRAM_CACHE else v.NGRAM_SUFFIX,
        ngram_min=int(obj[v.NGRAM_MIN]),
        ngram_max=int(obj[v.NGRAM_MAX]),
        max_proposal_tokens=int(obj[v.MAX_PROPOSAL_TOKENS]),
    )


def _build_speculative(sd: Mapping[str, Any]) -> SpeculativeDecoding:
    proposers: dict[str, Proposer] = {
        str(pid): _build_source(str(p[v.TYPE]), p)
        for pid, p in (sd.get(v.SD_PROPOSERS) or {}).items()
    }
    strategies: dict[str, SpeculativeStrategy] = {}
    for sid, s in sd[v.SD_STRATEGIES].items():
        stype = str(s[v.TYPE])
        if stype not in v.STRATEGY_TYPES:
            strategies[sid] = SpeculativeStrategy(id=sid, type=stype, recognised=False)
            continue
        window = build_window(s[v.WINDOW_POLICY]) if v.WINDOW_POLICY in s else None
        if stype in v.PROPOSER_TYPES:
            ref = s.get(v.PROPOSER)
            source = proposers[ref] if ref is not None else _build_source(stype, s)
            strategies[sid] = SpeculativeStrategy(
                id=sid, type=stype, source=source, source_ref=ref, window=window
            )
        elif stype == v.COMPOSITE:
            primary, extender = proposers[s[v.PRIMARY]], proposers[s[v.EXTENDER]]
            ext = s[v.EXTENSION_POLICY]
            if not (isinstance(primary, NativeMtpSource) and isinstance(extender, NgramSource)):
                raise TypeError(f"strategy {sid!r} was not checked before building")
            strategies[sid] = SpeculativeStrategy(
                id=sid,
                type=stype,
                primary=primary,
                primary_ref=s[v.PRIMARY],
                extender=extender,
                extender_ref=s[v.EXTENDER],
                extension=ExtensionPolicy(
                    max_tokens=int(ext[v.EXT_MAX_TOKENS]),
                    initial_tokens=as_int(ext.get(v.EXT_INITIAL_TOKENS)),
                    tail_backoff_proposals=as_int(ext.get(v.EXT_TAIL_BACKOFF_PROPOSALS)),
                ),
                window=window,
            )
        else:
            strategies[sid] = SpeculativeStrategy(
                id=sid, type=stype, window=window, draft_model=str(s[v.DRAFT_MODEL_FIELD])
            )
    return SpeculativeDecoding(
        default=str(sd[v.SD_DEFAULT]),
        proposers=MappingProxyType(proposers),
        strategies=MappingProxyType(strategies),
    )


def parse_generation(
    generation: Mapping[str, Any] | None,
    *,
    layer_count: int,
    layer_tensor_names: LayerTensorNames | None = None,
    metadata: Mapping[str, Any] | None = None,
    arch: str | None = None,
) -> GenerationSpec:
    """Check ``generation`` and return it as a ``GenerationSpec``.

    Raises ``GenerationManifestError`` (a ManifestError) carrying every error finding when any
    rule is broken; warnings and infos do not stop parsing. ``None`` gives an empty spec.
    """
    findings = check_generation(
        generation,
        layer_count=layer_count,
        layer_tensor_names=layer_tensor_names,
        metadata=metadata,
        arch=arch,
    )
    errs = errors_only(findings)
    if errs:
        first = errs[0]
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        raise GenerationManifestError(
            f"invalid generation defaults: {first.message}{more}",
            findings=errs,
            code=first.code,
            path=first.path,
            remediation=first.remediation,
        )
    if generation is None:
        return GenerationSpec()
    policy = None
    if v.POLICY in generation:
        pol = generation[v.POLICY]
        policy = GenerationPolicy(
            profile=str(pol[v.PROFILE]),
            decode=pol.get(v.PHASE_DECODE),
            short_prefill=pol.get(v.PHASE_SHORT_PREFILL),
            long_prefill=pol.get(v.PHASE_LONG_PREFILL),
            verify=pol.get(v.PHASE_VERIFY),
            indexshare=pol.get(v.INDEXSHARE),
            experimental=MappingProxyType(dict(pol.get(v.EXPERIMENTAL) or {})),
        )
    thresholds = None
    if v.THRESHOLDS in generation:
        th = generation[v.THRESHOLDS]
        thresholds = GenerationThresholds(**{k: as_int(th.get(k)) for k in v.THRESHOLD_FIELDS})
    speculative = None
    if v.SPECULATIVE in generation:
        speculative = _build_speculative(generation[v.SPECULATIVE])
    return GenerationSpec(policy=policy, thresholds=thresholds, speculative=speculative)
