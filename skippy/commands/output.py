"""What every command shares: the result type, the ``--json`` flag, findings as text lines and
the exit code for a verdict. ``skippy.cli`` renders results; command modules build them. Living
here (not in ``skippy.cli``) keeps the arrows one way: cli -> commands -> skippy."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from skippy.errors import EXIT_INVALID, EXIT_OK
from skippy.findings import Finding


@dataclass
class CommandResult:
    data: dict[str, Any]
    text: str
    exit_code: int = EXIT_OK
    warnings: list[str] = field(default_factory=list)


Handler = Callable[[argparse.Namespace], CommandResult]


def finding_lines(findings: Sequence[Finding]) -> list[str]:
    """Findings as indented text lines, with the hint under each error that has one."""
    lines = []
    for f in findings:
        lines.append(f"  {f.severity}: [{f.code}] {f.message}" + (f" ({f.path})" if f.path else ""))
        if f.remediation and f.severity == "error":
            lines.append(f"      hint: {f.remediation}")
    return lines


def add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def exit_for(valid: bool) -> int:
    return EXIT_OK if valid else EXIT_INVALID
