"""The one error hierarchy.

Every user-facing failure is a ``SkippyError`` subclass with a stable snake_case ``code``,
an exit code (1: the package/model is invalid, 2: bad usage or unreadable input) and the
structured facts (path, expected, actual) a caller or ``--json`` renderer needs. Subclasses
also inherit the matching built-in so ordinary ``except ValueError`` code keeps working.
"""

from __future__ import annotations

from typing import Any

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2


class SkippyError(Exception):
    """Root of every error this project raises on purpose."""

    code: str = "skippy_error"
    exit_code: int = EXIT_INVALID

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        path: str | None = None,
        expected: Any = None,
        actual: Any = None,
        remediation: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.path = path
        self.expected = expected
        self.actual = actual
        self.remediation = remediation

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        for name in ("path", "expected", "actual", "remediation"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


class UsageError(SkippyError, ValueError):
    """The command line or configuration asks for something impossible."""

    code = "usage"
    exit_code = EXIT_USAGE


class InputUnreadable(SkippyError, OSError):
    """An input file or directory cannot be opened or read."""

    code = "unreadable_input"
    exit_code = EXIT_USAGE


class OutputExists(SkippyError, FileExistsError):
    """The destination already holds something we refuse to replace silently."""

    code = "output_exists"
    exit_code = EXIT_USAGE


class GGUFFormatError(SkippyError, ValueError):
    """A GGUF container violates the format or one of our bounds."""

    code = "gguf_invalid"


class ModelError(SkippyError, ValueError):
    """The GGUF is well-formed but not a model we can package (missing keys, odd tensors)."""

    code = "invalid_model"


class ManifestError(SkippyError, ValueError):
    """model-package.json is unreadable as a schema-1 layer-package manifest."""

    code = "invalid_manifest"


class UnsafePath(ManifestError):
    """A manifest or peer path is absolute, escapes its root, or has a forbidden component."""

    code = "unsafe_artifact_path"


class TopologyError(SkippyError, ValueError):
    """A split topology is malformed or does not cover its layers exactly once."""

    code = "invalid_topology"


class ArtifactMissing(SkippyError, FileNotFoundError):
    """A declared artifact is not on disk (or not in the local cache when offline)."""

    code = "missing_artifact"


class IntegrityError(SkippyError):
    """Bytes on disk or on the wire differ from what the manifest declares. ``paths`` names
    every corrupt file found (``path`` is the first), so a caller can evict them all."""

    code = "artifact_sha256_mismatch"

    def __init__(self, message: str, *, paths: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.paths = paths or ((self.path,) if self.path else ())


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: the command stops, cleans up its partial files and exits
    128 + the signal number (130, 143). A ``BaseException`` like ``KeyboardInterrupt``, so no
    ``except Exception`` (or ``except SkippyError``) on the way up can swallow it."""

    code = "interrupted"

    def __init__(
        self, signum: int, name: str, cleaned: str = "partial files were removed"
    ) -> None:
        super().__init__(f"interrupted by {name}")
        self.signum = signum
        self.message = f"interrupted by {name}; {cleaned}"
        self.exit_code = 128 + signum
        self.remediation: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "signal": self.signum}


class PackageInvalid(SkippyError):
    """A package failed validation; ``findings`` holds every problem found."""

    code = "package_invalid"

    def __init__(self, message: str, findings: list[Any], **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.findings = findings
