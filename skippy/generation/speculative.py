"""Operator speculative-decoding overrides and the one typed plan handed to the runtime.

Spec "Speculative Decoding": operators choose ``auto`` (package/runtime default), ``mtp``
(force the direct native-MTP control), ``disabled``, or a strategy id the selected package
declares, through ``speculative.strategy`` in config.toml (global, then per model entry) and
``--speculative-strategy`` for one serve invocation; precedence is CLI, model entry, global.
Operators may tighten bounds, never widen them beyond the package's values; for a plain GGUF
they may select a request-local ngram-cache or ngram-suffix proposer with valid bounds. An
N-gram proposer reads only the request's own tokens, so ``ngram-cache`` / ``ngram-suffix``
may be chosen for any layer package too: a package that declares that strategy id is served
its declaration (operators only tighten it), one that does not gets the request-local
proposer with the operator's bounds, else the runtime's (``RUNTIME_NGRAM_BOUNDS``). The
result is a ``SpeculativePlan``; the runtime boundary receives it and does not re-resolve it.

TOML shape read by ``load_speculative_overrides`` (the file itself is parsed elsewhere)::

    [speculative]                 # global defaults
    strategy = "auto"             # auto | mtp | disabled | ngram-cache | ngram-suffix
                                  # | <package strategy id>
    ngram_max = 3                 # optional bounds, see SpeculativeSettings

    [[models]]                    # per model entry, selected by name
    name = "acme/glm-5.2-GGUF:Q4_K_M"   # the package's model_id, exactly
    speculative = { strategy = "mtp-cache", extension_max_tokens = 4 }

``[models."<model_id>".speculative]`` (models as a table keyed by model_id) is accepted too.
An entry is selected when its name equals the served package's ``model_id``; when the config
has entries with speculative settings and none matches, the plan carries a note saying so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from skippy.generation import vocab as v
from skippy.generation.errors import SpeculativeConfigError
from skippy.generation.evidence import as_int
from skippy.generation.schema import (
    ExtensionPolicy,
    GenerationSpec,
    NativeMtpSource,
    NgramSource,
    SpeculativeDecoding,
    SpeculativeStrategy,
    WindowPolicy,
    ngram_problems,
)

PlanMode = Literal[
    "disabled", "native-mtp", "ngram-cache", "ngram-suffix", "composite", "draft-model"
]


# --- operator settings ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SpeculativeSettings:
    """One layer of operator settings: the global table, one model entry, or the CLI.

    Every field is optional; None means "not set at this layer". Bounds (all positive ints):
    ``ngram_min``/``ngram_max``/``max_proposal_tokens`` bound the N-gram proposer;
    ``extension_initial_tokens``/``extension_max_tokens`` bound a composite's N-gram tail;
    ``tail_backoff_proposals`` is the composite cooldown; ``max_window``/``pipeline_depth``
    bound the VerifyWindow.
    """

    strategy: str | None = None
    ngram_min: int | None = None
    ngram_max: int | None = None
    max_proposal_tokens: int | None = None
    extension_initial_tokens: int | None = None
    extension_max_tokens: int | None = None
    tail_backoff_proposals: int | None = None
    max_window: int | None = None
    pipeline_depth: int | None = None

    def __post_init__(self) -> None:
        if self.strategy is not None and (
            not isinstance(self.strategy, str) or not self.strategy.strip()
        ):
            raise SpeculativeConfigError(
                f"speculative strategy must be a non-empty string, got {self.strategy!r}",
                code=v.C_INVALID_SPECULATIVE_CONFIG,
                path=v.CFG_STRATEGY,
            )
        for name in v.CFG_BOUND_FIELDS:
            value = getattr(self, name)
            if value is not None and ((n := as_int(value)) is None or n < 1):
                raise SpeculativeConfigError(
                    f"speculative {name} must be a positive integer, got {value!r}",
                    code=v.C_INVALID_OPERATOR_BOUND,
                    path=name,
                )

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any], path: str) -> SpeculativeSettings:
        """Settings from one parsed TOML table; unknown keys are errors (typos must not pass)."""
        if not isinstance(table, Mapping):
            raise SpeculativeConfigError(
                f"{path} must be a table", code=v.C_INVALID_SPECULATIVE_CONFIG, path=path
            )
        unknown = sorted(str(k) for k in table if k not in v.CFG_FIELDS)
        if unknown:
            raise SpeculativeConfigError(
                f"unknown key(s) in {path}: {', '.join(unknown)}",
                code=v.C_INVALID_SPECULATIVE_CONFIG,
                path=f"{path}.{unknown[0]}",
                remediation=f"known keys: {', '.join(v.CFG_FIELDS)}",
            )
        try:
            return cls(**{str(k): val for k, val in table.items()})
        except SpeculativeConfigError as err:
            err.path = f"{path}.{err.path}"
            raise

    def bounds(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in v.CFG_BOUND_FIELDS if getattr(self, n) is not None}


@dataclass(frozen=True)
class SpeculativeOverrides:
    """The config file's speculative settings: global defaults plus per-model entries."""

    global_settings: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    models: Mapping[str, SpeculativeSettings] = field(default_factory=lambda: MappingProxyType({}))


def load_speculative_overrides(table: Mapping[str, Any]) -> SpeculativeOverrides:
    """Read ``[speculative]`` and the models' ``speculative`` tables from a parsed config.

    ``table`` is the whole parsed TOML document; other keys are left to their owners. Models
    are ``[[models]]`` entries identified by ``name`` or a ``[models.<name>]`` table, the name
    being the package's ``model_id`` (e.g. ``google/gemma-3-270m-GGUF:Q4_K_M``); a model
    entry without a ``speculative`` table contributes nothing.
    """
    raw_global = table.get(v.CFG_SPECULATIVE)
    global_settings = (
        SpeculativeSettings.from_mapping(raw_global, v.CFG_SPECULATIVE)
        if raw_global is not None
        else SpeculativeSettings()
    )
    models: dict[str, SpeculativeSettings] = {}
    raw_models = table.get(v.CFG_MODELS)
    entries: list[tuple[str, str | None, Any]] = []  # (path, name, entry)
    if raw_models is None:
        pass
    elif isinstance(raw_models, list):
        for pos, entry in enumerate(raw_models):
            name = entry.get(v.CFG_MODEL_NAME) if isinstance(entry, Mapping) else None
            entries.append((f"{v.CFG_MODELS}[{pos}]", name, entry))
    elif isinstance(raw_models, Mapping):
        entries = [(f"{v.CFG_MODELS}.{k}", str(k), e) for k, e in raw_models.items()]
    else:
        raise SpeculativeConfigError(
            "models must be an array of tables ([[models]]) or a table of named models",
            code=v.C_INVALID_SPECULATIVE_CONFIG,
            path=v.CFG_MODELS,
        )
    for path, name, entry in entries:
        if not isinstance(entry, Mapping):
            raise SpeculativeConfigError(
                f"{path} must be a table", code=v.C_INVALID_SPECULATIVE_CONFIG, path=path
            )
        raw = entry.get(v.CFG_SPECULATIVE)
        if raw is None:
            continue
        if not isinstance(name, str) or not name:
            raise SpeculativeConfigError(
                f"{path} sets speculative options but has no name to select it by",
                code=v.C_INVALID_SPECULATIVE_CONFIG,
                path=f"{path}.{v.CFG_MODEL_NAME}",
            )
        if name in models:
            raise SpeculativeConfigError(
                f"model entry {name!r} is declared twice",
                code=v.C_INVALID_SPECULATIVE_CONFIG,
                path=path,
            )
        models[name] = SpeculativeSettings.from_mapping(raw, f"{path}.{v.CFG_SPECULATIVE}")
    return SpeculativeOverrides(global_settings, MappingProxyType(models))


# --- the plan -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpeculativePlan:
    """The resolved, validated speculation plan for one served model."""

    mode: PlanMode
    requested: str  # the operator request after normalisation ("auto", "mtp", an id, ...)
    requested_source: str  # "cli", "model:<name>", "global" or "default"
    strategy_id: str | None = None  # the package strategy id (or "mtp"/ngram type for generic)
    package_default: str | None = None
    native_mtp: NativeMtpSource | None = None
    ngram: NgramSource | None = None
    extension: ExtensionPolicy | None = None
    window: WindowPolicy | None = None
    draft_model: str | None = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        need = {
            "disabled": (),
            "native-mtp": ("native_mtp", "window"),
            "ngram-cache": ("ngram", "window"),
            "ngram-suffix": ("ngram", "window"),
            "composite": ("native_mtp", "ngram", "extension", "window"),
            "draft-model": ("draft_model", "window"),
        }[self.mode]
        parts = ("native_mtp", "ngram", "extension", "window", "draft_model")
        wrong = [p for p in parts if (getattr(self, p) is not None) != (p in need)]
        if wrong:
            raise ValueError(f"{self.mode} plan has inconsistent parts: {', '.join(wrong)}")
        if self.ngram is not None and self.mode in v.NGRAM_TYPES and self.ngram.type != self.mode:
            raise ValueError(f"{self.mode} plan carries a {self.ngram.type} proposer")

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "requested": self.requested,
            "requested_source": self.requested_source,
            "strategy_id": self.strategy_id,
            "package_default": self.package_default,
            "native_mtp": self.native_mtp.to_dict() if self.native_mtp else None,
            "ngram": self.ngram.to_dict() if self.ngram else None,
            "extension": self.extension.to_dict() if self.extension else None,
            "window": self.window.to_dict() if self.window else None,
            "draft_model": self.draft_model,
            "notes": list(self.notes),
        }


# --- resolution -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Merged:
    strategy: str
    strategy_source: str
    bounds: Mapping[str, int]
    bound_sources: Mapping[str, str]


def _merge(
    overrides: SpeculativeOverrides, model: str | None, cli: SpeculativeSettings | None
) -> _Merged:
    layers: list[tuple[str, SpeculativeSettings]] = []
    if cli is not None:
        layers.append(("cli", cli))
    if model is not None and model in overrides.models:
        layers.append((f"model:{model}", overrides.models[model]))
    layers.append(("global", overrides.global_settings))
    strategy, strategy_source = v.STRATEGY_AUTO, "default"
    for source, layer in layers:
        if layer.strategy is not None:
            strategy, strategy_source = layer.strategy.strip(), source
            break
    bounds: dict[str, int] = {}
    sources: dict[str, str] = {}
    for source, layer in layers:
        for name, value in layer.bounds().items():
            if name not in bounds:
                bounds[name], sources[name] = value, source
    return _Merged(strategy, strategy_source, bounds, sources)


def _error(
    code: str, message: str, *, path: str | None = None, **kw: Any
) -> SpeculativeConfigError:
    return SpeculativeConfigError(message, code=code, path=path, **kw)


class _Bounds:
    """Applies operator bounds to package values; every bound used is remembered."""

    def __init__(self, merged: _Merged) -> None:
        self.merged = merged
        self.used: set[str] = set()

    def get(self, name: str) -> int | None:
        value = self.merged.bounds.get(name)
        if value is not None:
            self.used.add(name)
        return value

    def where(self, name: str) -> str:
        value, source = self.merged.bounds[name], self.merged.bound_sources[name]
        return f"{v.CFG_SPECULATIVE}.{name} = {value} ({source})"

    def at_most(self, name: str, package_value: int, what: str) -> int:
        """Operator value may only lower ``package_value``."""
        value = self.get(name)
        if value is None:
            return package_value
        if value > package_value:
            raise _error(
                v.C_BOUND_WIDENED,
                f"{self.where(name)} would widen the package's {what} of {package_value}; "
                "operators may only tighten package bounds",
                path=name,
                expected=f"<= {package_value}",
                actual=value,
            )
        return value

    def at_least(self, name: str, package_value: int, what: str) -> int:
        """Operator value may only raise ``package_value`` (narrowing a range from below)."""
        value = self.get(name)
        if value is None:
            return package_value
        if value < package_value:
            raise _error(
                v.C_BOUND_WIDENED,
                f"{self.where(name)} would widen the package's {what} of {package_value}; "
                "operators may only tighten package bounds",
                path=name,
                expected=f">= {package_value}",
                actual=value,
            )
        return value

    def unused_notes(self) -> list[str]:
        return [
            f"{self.where(n)} does not apply to this strategy and was ignored"
            for n in v.CFG_BOUND_FIELDS
            if n in self.merged.bounds and n not in self.used
        ]


def _tighten_ngram(src: NgramSource, b: _Bounds) -> NgramSource:
    lo = b.at_least(v.NGRAM_MIN, src.ngram_min, f"{src.type} ngram_min")
    hi = b.at_most(v.NGRAM_MAX, src.ngram_max, f"{src.type} ngram_max")
    mpt = b.at_most(v.MAX_PROPOSAL_TOKENS, src.max_proposal_tokens, "max_proposal_tokens")
    if lo > hi:
        raise _error(
            v.C_INVALID_OPERATOR_BOUND,
            f"tightened N-gram bounds are empty: ngram_min {lo} > ngram_max {hi}",
            path=v.NGRAM_MIN,
        )
    return replace(src, ngram_min=lo, ngram_max=hi, max_proposal_tokens=mpt)


def _tighten_window(window: WindowPolicy, b: _Bounds) -> WindowPolicy:
    hi = b.at_most(v.CFG_MAX_WINDOW, window.max_window, "verify window max_window")
    depth = b.at_most(v.CFG_PIPELINE_DEPTH, window.pipeline_depth, "verify pipeline_depth")
    return replace(
        window,
        max_window=hi,
        min_window=min(window.min_window, hi),
        initial_window=min(window.initial_window, hi),
        pipeline_depth=depth,
    )


def _tighten_extension(ext: ExtensionPolicy, b: _Bounds) -> ExtensionPolicy:
    hi = b.at_most(v.CFG_EXTENSION_MAX_TOKENS, ext.max_tokens, "extension max_tokens")
    init = ext.initial_tokens
    if init is not None:
        init = min(b.at_most(v.CFG_EXTENSION_INITIAL_TOKENS, init, "extension initial_tokens"), hi)
    else:
        init = b.get(v.CFG_EXTENSION_INITIAL_TOKENS)
    if init is not None and init > hi:
        raise _error(
            v.C_INVALID_OPERATOR_BOUND,
            f"extension initial_tokens {init} exceeds extension max_tokens {hi}",
            path=v.CFG_EXTENSION_INITIAL_TOKENS,
        )
    backoff = ext.tail_backoff_proposals
    if backoff is not None:
        # Cooldown tightens upwards: backing off for longer is the conservative direction.
        backoff = b.at_least(v.CFG_TAIL_BACKOFF_PROPOSALS, backoff, "tail_backoff_proposals")
    else:
        backoff = b.get(v.CFG_TAIL_BACKOFF_PROPOSALS)
    return ExtensionPolicy(max_tokens=hi, initial_tokens=init, tail_backoff_proposals=backoff)


def _plan_from_strategy(
    strategy: SpeculativeStrategy,
    merged: _Merged,
    requested: str,
    package_default: str | None,
    notes: list[str],
) -> SpeculativePlan:
    if not strategy.recognised:
        what = "the package's default strategy" if strategy.id == package_default else "strategy"
        raise _error(
            v.C_UNSUPPORTED_STRATEGY_TYPE,
            f"{what} {strategy.id!r} ({merged.strategy_source}: {requested}) has type "
            f"{strategy.type!r}, which this runtime cannot serve",
            path=v.CFG_STRATEGY,
            remediation="select disabled, mtp or another declared strategy with "
            "--speculative-strategy or speculative.strategy",
        )
    b = _Bounds(merged)
    common: dict[str, Any] = {
        "requested": requested,
        "requested_source": merged.strategy_source,
        "strategy_id": strategy.id,
        "package_default": package_default,
    }
    window = _tighten_window(strategy.effective_window, b)
    plan: SpeculativePlan
    if strategy.type == v.NATIVE_MTP and isinstance(strategy.source, NativeMtpSource):
        plan = SpeculativePlan(
            mode="native-mtp", native_mtp=strategy.source, window=window, **common
        )
    elif strategy.type in v.NGRAM_TYPES and isinstance(strategy.source, NgramSource):
        ngram = _tighten_ngram(strategy.source, b)
        plan = SpeculativePlan(mode=ngram.type, ngram=ngram, window=window, **common)
    elif (
        strategy.type == v.COMPOSITE
        and strategy.primary
        and strategy.extender
        and strategy.extension
    ):
        plan = SpeculativePlan(
            mode="composite",
            native_mtp=strategy.primary,
            ngram=_tighten_ngram(strategy.extender, b),
            extension=_tighten_extension(strategy.extension, b),
            window=window,
            **common,
        )
    elif strategy.type == v.DRAFT_MODEL and strategy.draft_model:
        plan = SpeculativePlan(
            mode="draft-model", draft_model=strategy.draft_model, window=window, **common
        )
    else:  # a checked GenerationSpec cannot produce this
        raise _error(
            v.C_UNSUPPORTED_STRATEGY_TYPE,
            f"strategy {strategy.id!r} is incomplete; parse the manifest with parse_generation",
            path=v.CFG_STRATEGY,
        )
    return replace(plan, notes=tuple(notes + b.unused_notes()))


def _force_mtp(sd: SpeculativeDecoding | None) -> SpeculativeStrategy | None:
    """The package's native-MTP control: strategy ``mtp`` if native, else its only MTP source."""
    if sd is None:
        return None
    named = sd.strategies.get(v.STRATEGY_MTP)
    if named is not None and named.type == v.NATIVE_MTP:
        return named
    sources = sd.native_mtp_sources()
    if not sources:
        return None
    distinct = {src for _, src in sources}
    if len(distinct) > 1:
        raise _error(
            v.C_MTP_UNAVAILABLE,
            "the package declares several different native MTP sources ("
            + ", ".join(where for where, _ in sources)
            + ') and no native-mtp strategy "mtp"; select one by its strategy id',
            path=v.CFG_STRATEGY,
        )
    # A reusable proposer alone has no window policy: the legacy fixed window of 1 applies.
    return SpeculativeStrategy(id=v.STRATEGY_MTP, type=v.NATIVE_MTP, source=sources[0][1])


def _generic_ngram_plan(
    kind: str, merged: _Merged, notes: list[str], *, package: bool
) -> SpeculativePlan:
    """A request-local N-gram plan that no package declares, built from operator bounds.

    A plain GGUF needs all three bounds from the operator (spec: "by supplying valid N-gram
    bounds") and keeps the legacy verify window of 1. A layer package that does not declare
    ``kind`` gets the runtime's bounds (``RUNTIME_NGRAM_BOUNDS``) for those the operator does
    not set, and an adaptive window whose ``max_window`` / ``pipeline_depth`` the operator may
    set: an N-gram proposer reads only the request's own tokens, nothing of the package."""
    required = (v.NGRAM_MIN, v.NGRAM_MAX, v.MAX_PROPOSAL_TOKENS)
    b = _Bounds(merged)
    given = {n: b.get(n) for n in required}
    defaults: Mapping[str, int] = v.RUNTIME_NGRAM_BOUNDS[kind] if package else {}
    missing = [n for n in required if given[n] is None and n not in defaults]
    if missing:
        raise _error(
            v.C_NGRAM_BOUNDS_REQUIRED,
            f"{kind} on a plain GGUF needs explicit bounds: set {', '.join(missing)} under "
            "[speculative] or the model entry",
            path=missing[0],
        )
    values: dict[str, int] = {}
    for n in required:
        value = given[n]
        values[n] = value if value is not None else defaults[n]
    lo, hi, mpt = (values[n] for n in required)
    filled = [f"{n} {values[n]}" for n in required if given[n] is None]
    problems = ngram_problems(kind, lo, hi, mpt, v.HISTORY_SCOPE_REQUEST)
    if problems:
        code, fld, message = problems[0]
        if filled:
            message += f" (the runtime's defaults: {', '.join(filled)})"
        raise _error(v.C_INVALID_OPERATOR_BOUND, message, path=fld, remediation=f"rule: {code}")
    ngram = NgramSource(
        type=v.NGRAM_CACHE if kind == v.NGRAM_CACHE else v.NGRAM_SUFFIX,
        ngram_min=lo,
        ngram_max=hi,
        max_proposal_tokens=mpt,
    )
    if package:
        notes.append(
            f"the package declares no {kind} strategy: a request-local {kind} proposer"
            + (f" with the runtime's {', '.join(filled)}" if filled else "")
        )
        window = _runtime_window(b)
    else:
        window = _tighten_window(WindowPolicy(), b)
    return SpeculativePlan(
        mode=ngram.type,
        requested=kind,
        requested_source=merged.strategy_source,
        strategy_id=kind,
        ngram=ngram,
        window=window,
        notes=tuple(notes + b.unused_notes()),
    )


def _runtime_window(b: _Bounds) -> WindowPolicy:
    """The runtime's adaptive verify window, with the operator's ``max_window`` and
    ``pipeline_depth`` in place of its own (no package value to tighten)."""
    hi = b.get(v.CFG_MAX_WINDOW) or v.RUNTIME_WINDOW_MAX
    return WindowPolicy(
        mode=v.WINDOW_ADAPTIVE,
        initial_window=min(v.RUNTIME_WINDOW_INITIAL, hi),
        min_window=min(v.RUNTIME_WINDOW_MIN, hi),
        max_window=hi,
        pipeline_depth=b.get(v.CFG_PIPELINE_DEPTH) or v.LEGACY_WINDOW,
    )


def _disabled(
    merged: _Merged, requested: str, default: str | None, notes: list[str]
) -> SpeculativePlan:
    extra = [
        f"{v.CFG_SPECULATIVE}.{n} ({merged.bound_sources[n]}) ignored: speculation is disabled"
        for n in v.CFG_BOUND_FIELDS
        if n in merged.bounds
    ]
    return SpeculativePlan(
        mode="disabled",
        requested=requested,
        requested_source=merged.strategy_source,
        package_default=default,
        notes=tuple(notes + extra),
    )


def _unmatched_model_entries(overrides: SpeculativeOverrides, model: str | None) -> list[str]:
    """A note when the config has model entries with speculative settings and none is the
    served model: a misspelt or outdated name must not be ignored silently."""
    if not overrides.models or (model is not None and model in overrides.models):
        return []
    names = ", ".join(repr(n) for n in sorted(overrides.models))
    served = f"the served model {model!r}" if model is not None else "an unnamed model"
    return [
        f"no model entry with speculative settings matches {served} (entries: {names}); an "
        f"entry's {v.CFG_MODEL_NAME} must be the package's model_id, so those settings were "
        "not applied"
    ]


def resolve_speculative_plan(
    *,
    package: GenerationSpec | None,
    overrides: SpeculativeOverrides | None = None,
    model: str | None = None,
    cli: SpeculativeSettings | None = None,
) -> SpeculativePlan:
    """The one speculation plan for serving ``model``.

    ``package`` is the selected layer package's parsed generation defaults
    (``parse_generation(manifest.generation, ...)``, an empty GenerationSpec when it has none),
    or None for a plain GGUF. ``overrides`` come from ``load_speculative_overrides``; ``model``
    (the package's ``model_id``) selects the model entry, and a note says when the config has
    entries with speculative settings but none is ``model``; ``cli`` carries
    ``--speculative-strategy`` (and any CLI bounds).
    Raises ``SpeculativeConfigError`` (a UsageError) for an undeclared strategy (other than
    ``ngram-cache`` / ``ngram-suffix``), a forced ``mtp`` without a native MTP source, widened
    bounds, or invalid N-gram bounds.
    """
    overrides = overrides or SpeculativeOverrides()
    merged = _merge(overrides, model, cli)
    requested = merged.strategy
    notes: list[str] = _unmatched_model_entries(overrides, model)
    if requested in v.LEGACY_STRATEGY_ALIASES:
        new = v.LEGACY_STRATEGY_ALIASES[requested]
        notes.append(
            f'speculative strategy "{requested}" ({merged.strategy_source}) is deprecated and '
            f'was normalized to "{new}"; use "{new}" in new configs'
        )
        requested = new
    sd = package.speculative if package is not None else None
    default = sd.default if sd is not None else None

    if requested == v.STRATEGY_DISABLED:
        return _disabled(merged, requested, default, notes)

    if package is None:  # plain GGUF: no package strategies exist
        if requested == v.STRATEGY_AUTO:
            notes.append("plain GGUF: no package speculation default; speculation disabled")
            return _disabled(merged, requested, None, notes)
        if requested in v.NGRAM_TYPES:
            return _generic_ngram_plan(requested, merged, notes, package=False)
        if requested == v.STRATEGY_MTP:
            raise _error(
                v.C_MTP_UNAVAILABLE,
                "mtp needs a layer package whose writer validated the native MTP tensors; a "
                "plain GGUF has none",
                path=v.CFG_STRATEGY,
            )
        raise _error(
            v.C_UNDECLARED_STRATEGY,
            f"speculative strategy {requested!r} ({merged.strategy_source}) names a package "
            "strategy, but the model is a plain GGUF; plain GGUFs accept auto, disabled, "
            "ngram-cache or ngram-suffix",
            path=v.CFG_STRATEGY,
        )

    if requested == v.STRATEGY_AUTO:
        if sd is None:
            notes.append("the package declares no speculation default; speculation disabled")
            return _disabled(merged, requested, None, notes)
        return _plan_from_strategy(sd.strategies[sd.default], merged, requested, default, notes)
    if requested == v.STRATEGY_MTP:
        strategy = _force_mtp(sd)
        if strategy is None:
            raise _error(
                v.C_MTP_UNAVAILABLE,
                "mtp was requested but the package declares no native-mtp proposer or strategy",
                path=v.CFG_STRATEGY,
            )
        return _plan_from_strategy(strategy, merged, requested, default, notes)
    if sd is None or requested not in sd.strategies:
        if requested in v.NGRAM_TYPES:  # needs nothing from the package (module docstring)
            return _generic_ngram_plan(requested, merged, notes, package=True)
        declared = ", ".join(sorted(sd.strategies)) if sd is not None else "none"
        raise _error(
            v.C_UNDECLARED_STRATEGY,
            f"speculative strategy {requested!r} ({merged.strategy_source}) is not declared by "
            f"the selected package (declared: {declared}); a named strategy cannot be invented "
            "outside its package",
            path=v.CFG_STRATEGY,
            remediation="use auto, disabled, mtp, ngram-cache, ngram-suffix or a declared "
            "strategy id",
        )
    return _plan_from_strategy(sd.strategies[requested], merged, requested, default, notes)
