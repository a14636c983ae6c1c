"""What every command shares: the result type, the global flags, findings as text lines, the
exit code for a verdict and the escaping of text bound for a terminal. ``skippy.cli`` renders
results; command modules build them. Living here (not in ``skippy.cli``) keeps the arrows one
way: cli -> commands -> skippy.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skippy.errors import EXIT_INVALID, EXIT_OK
from skippy.findings import Finding
from skippy.text import escape


@dataclass
class CommandResult:
    data: dict[str, Any]
    text: str
    exit_code: int = EXIT_OK
    warnings: list[str] = field(default_factory=list)


Handler = Callable[[argparse.Namespace], CommandResult]


def add_common_flags(p: argparse.ArgumentParser) -> None:
    """``--json`` and ``-v`` on a subcommand, so they work before or after it. SUPPRESS keeps a
    flag given before the command from being reset by the subcommand's default."""
    add_json_flag(p)
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show library logs (hub requests, llama.cpp, policy decisions) on stderr",
    )


def add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print one JSON document on stdout (errors too)",
    )


def path_arg(text: str) -> Path:
    """argparse ``type`` for a path: an empty string is a usage error, not the current folder
    (``Path("")`` is ``.``, so ``--out-dir ""`` once wrote into the working directory)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path names no file or folder")
    return Path(text)


def exit_for(valid: bool) -> int:
    return EXIT_OK if valid else EXIT_INVALID


def finding_lines(findings: Sequence[Finding]) -> list[str]:
    """Findings as indented text lines, with the hint under each error that has one."""
    lines = []
    for f in findings:
        lines.append(f"  {f.severity}: [{f.code}] {f.message}" + (f" ({f.path})" if f.path else ""))
        if f.remediation and f.severity == "error":
            lines.append(f"      hint: {f.remediation}")
    return lines


def terminal_text(text: str) -> str:
    """``text`` with every control and bidi character shown as an escape (``\\x1b``,
    ``\\u202e``); newlines and tabs are kept. Applied by ``skippy.cli`` to everything it
    prints for a human."""
    return escape(text, keep_newlines=True)


def field_text(value: object) -> str:
    """One value from a manifest or a file, on one line: every control character escaped,
    newlines too, so a field cannot forge extra output lines."""
    return escape(str(value))
