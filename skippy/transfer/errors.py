"""Errors of peer artifact transfer, in the one hierarchy (``skippy.errors``).

Integrity failures of received bytes reuse ``IntegrityError`` (``artifact_sha256_mismatch``,
``artifact_size_mismatch``) so a caller handles a corrupt peer download exactly like a
corrupt hub download.
"""

from __future__ import annotations

from skippy.errors import EXIT_USAGE, SkippyError


class ArtifactWireError(SkippyError, ValueError):
    """Bytes from a peer are not a valid artifact request or response. The only error that
    decoding untrusted bytes raises; ``code`` says which rule failed."""

    code = "artifact_wire_invalid"
    exit_code = EXIT_USAGE


class TransferRefused(SkippyError):
    """The serving peer answered ``accepted: false``; ``message`` is what it said (one generic
    ``artifact unavailable`` for authorization refusals)."""

    code = "artifact_refused"
    exit_code = EXIT_USAGE


class InstallBusy(SkippyError, BlockingIOError):
    """Another fetch of the same artifact on this node holds its install lock."""

    code = "artifact_install_busy"
    exit_code = EXIT_USAGE


class PartialChanged(SkippyError, OSError):
    """A resumable partial changed while it was being opened (someone else writes it)."""

    code = "partial_changed"
    exit_code = EXIT_USAGE
