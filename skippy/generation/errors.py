"""Errors raised by ``skippy.generation``; each subclasses the shared hierarchy in skippy.errors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from skippy.errors import ManifestError, ModelError, UsageError
from skippy.findings import Finding


class GenerationManifestError(ManifestError):
    """A manifest's ``generation`` object breaks a rule (raised by ``parse_generation``).

    ``code`` and ``path`` are those of the first error finding; ``findings`` holds them all.
    """

    code = "invalid_generation"

    def __init__(self, message: str, *, findings: Sequence[Finding] = (), **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.findings = list(findings)


class GenerationEvidenceError(ModelError):
    """The source GGUF carries inconsistent evidence for a generation default (writer)."""

    code = "inconsistent_generation_evidence"


class SpeculativeConfigError(UsageError):
    """An operator speculative-decoding setting is malformed or asks for the impossible."""

    code = "invalid_speculative_config"


class PolicyInputError(UsageError):
    """A policy-resolver input (request shape, backend capabilities, override) is malformed."""

    code = "invalid_policy_resolver_input"
