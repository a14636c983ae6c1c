"""Findings: the data validators return instead of raising on the first problem.

``validate-package`` and ``preflight`` collect every finding so a publisher sees the whole
picture at once; ``raise_for_findings`` turns them into one typed error for code paths that
must stop (a stage about to load).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from skippy.errors import PackageInvalid, SkippyError

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    code: str
    message: str
    severity: Severity = "error"
    path: str | None = None
    remediation: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "severity": self.severity,
            "code": self.code,
            "message": self.message,
        }
        if self.path is not None:
            out["path"] = self.path
        if self.remediation is not None:
            out["remediation"] = self.remediation
        return out

    @classmethod
    def from_error(cls, err: SkippyError) -> Finding:
        return cls(code=err.code, message=err.message, path=err.path, remediation=err.remediation)


def summarize(findings: Iterable[Finding]) -> dict[str, Any]:
    """Counts for a report's ``summary``: errors, warnings, and findings per code (most first)."""
    items = list(findings)
    by_code: dict[str, int] = {}
    for f in items:
        by_code[f.code] = by_code.get(f.code, 0) + 1
    return {
        "errors": sum(1 for f in items if f.severity == "error"),
        "warnings": sum(1 for f in items if f.severity == "warning"),
        "by_code": dict(sorted(by_code.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def errors_only(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]


def raise_for_findings(findings: Iterable[Finding], what: str) -> None:
    """Raise ``PackageInvalid`` carrying every error finding, if there is any."""
    errs = errors_only(findings)
    if errs:
        first = errs[0]
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        raise PackageInvalid(
            f"{what}: {first.message}{more}",
            errs,
            code=first.code,
            path=first.path,
            remediation=first.remediation,
        )
