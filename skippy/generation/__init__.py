"""Package generation defaults: schema checks, writer inference, the phase resolver and the
speculative-decoding plan (spec "Generation Defaults", "Execution Policy", "Policy Resolution",
"Speculative Decoding"). See docs/generation.md.

Everything here is a pure function of its inputs except the one structured decision line the
resolver logs on the ``skippy.generation`` logger.
"""

# The package's names load their modules on first use (PEP 562): a light command that needs
# only ``skippy.generation.vocab`` (the planner's NextN tail) does not pay ~40 ms for the
# schema, the resolver and the speculative plan.
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skippy.generation.errors import (
        GenerationEvidenceError,
        GenerationManifestError,
        PolicyInputError,
        SpeculativeConfigError,
    )
    from skippy.generation.infer import infer_generation
    from skippy.generation.resolver import (
        AppliedThreshold,
        BackendCapabilities,
        PhaseOverride,
        PolicyDecision,
        Rejection,
        RequestShape,
        RuntimeDefaults,
        dense_mask_bytes,
        hidden_activation_bytes,
        indexshare_sideband_bytes,
        log_decision,
        resolve_phase,
    )
    from skippy.generation.schema import (
        ExtensionPolicy,
        GenerationPolicy,
        GenerationSpec,
        GenerationThresholds,
        NativeMtpSource,
        NgramSource,
        SpeculativeDecoding,
        SpeculativeStrategy,
        WindowPolicy,
        check_generation,
        parse_generation,
    )
    from skippy.generation.speculative import (
        SpeculativeOverrides,
        SpeculativePlan,
        SpeculativeSettings,
        load_speculative_overrides,
        resolve_speculative_plan,
    )

_LAZY: dict[str, str] = {
    "GenerationEvidenceError": "skippy.generation.errors",
    "GenerationManifestError": "skippy.generation.errors",
    "PolicyInputError": "skippy.generation.errors",
    "SpeculativeConfigError": "skippy.generation.errors",
    "infer_generation": "skippy.generation.infer",
    "AppliedThreshold": "skippy.generation.resolver",
    "BackendCapabilities": "skippy.generation.resolver",
    "PhaseOverride": "skippy.generation.resolver",
    "PolicyDecision": "skippy.generation.resolver",
    "Rejection": "skippy.generation.resolver",
    "RequestShape": "skippy.generation.resolver",
    "RuntimeDefaults": "skippy.generation.resolver",
    "dense_mask_bytes": "skippy.generation.resolver",
    "hidden_activation_bytes": "skippy.generation.resolver",
    "indexshare_sideband_bytes": "skippy.generation.resolver",
    "log_decision": "skippy.generation.resolver",
    "resolve_phase": "skippy.generation.resolver",
    "ExtensionPolicy": "skippy.generation.schema",
    "GenerationPolicy": "skippy.generation.schema",
    "GenerationSpec": "skippy.generation.schema",
    "GenerationThresholds": "skippy.generation.schema",
    "NativeMtpSource": "skippy.generation.schema",
    "NgramSource": "skippy.generation.schema",
    "SpeculativeDecoding": "skippy.generation.schema",
    "SpeculativeStrategy": "skippy.generation.schema",
    "WindowPolicy": "skippy.generation.schema",
    "check_generation": "skippy.generation.schema",
    "parse_generation": "skippy.generation.schema",
    "SpeculativeOverrides": "skippy.generation.speculative",
    "SpeculativePlan": "skippy.generation.speculative",
    "SpeculativeSettings": "skippy.generation.speculative",
    "load_speculative_overrides": "skippy.generation.speculative",
    "resolve_speculative_plan": "skippy.generation.speculative",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AppliedThreshold",
    "BackendCapabilities",
    "ExtensionPolicy",
    "GenerationEvidenceError",
    "GenerationManifestError",
    "GenerationPolicy",
    "GenerationSpec",
    "GenerationThresholds",
    "NativeMtpSource",
    "NgramSource",
    "PhaseOverride",
    "PolicyDecision",
    "PolicyInputError",
    "Rejection",
    "RequestShape",
    "RuntimeDefaults",
    "SpeculativeConfigError",
    "SpeculativeDecoding",
    "SpeculativeOverrides",
    "SpeculativePlan",
    "SpeculativeSettings",
    "SpeculativeStrategy",
    "WindowPolicy",
    "check_generation",
    "dense_mask_bytes",
    "hidden_activation_bytes",
    "indexshare_sideband_bytes",
    "infer_generation",
    "load_speculative_overrides",
    "log_decision",
    "parse_generation",
    "resolve_phase",
    "resolve_speculative_plan",
]
