"""Package generation defaults: schema checks, writer inference, the phase resolver and the
speculative-decoding plan (spec "Generation Defaults", "Execution Policy", "Policy Resolution",
"Speculative Decoding"). See docs/generation.md.

Everything here is a pure function of its inputs except the one structured decision line the
resolver logs on the ``skippy.generation`` logger.
"""

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
