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
from skippy.findings import Finding, summarize
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


FINDINGS_PER_CODE = 5  # text output shows this many findings of one code unless --all


def finding_lines(findings: Sequence[Finding], *, show_all: bool = True) -> list[str]:
    """Findings as indented text lines: a summary by code first, then each finding with the
    hint under each error that has one; without ``show_all`` at most ``FINDINGS_PER_CODE``
    per code (validating against the wrong source yields thousands of one kind)."""
    if not findings:
        return []
    summary = summarize(findings)
    counts = ", ".join(f"{n} {code}" for code, n in summary["by_code"].items())
    head = [_plural(summary["errors"], "error"), _plural(summary["warnings"], "warning")]
    others = len(findings) - summary["errors"] - summary["warnings"]
    if others:
        head.append(f"{others} info")
    lines = [f"  {', '.join(head)}: {counts}"]
    shown: dict[str, int] = {}
    for f in findings:
        shown[f.code] = shown.get(f.code, 0) + 1
        if not show_all and shown[f.code] > FINDINGS_PER_CODE:
            continue
        where = f" ({f.path})" if f.path else ""
        lines.append(f"  {f.severity}: [{f.code}] {f.message}{where}")
        if f.remediation and f.severity == "error":
            lines.append(f"      hint: {f.remediation}")
    hidden = {code: n - FINDINGS_PER_CODE for code, n in shown.items() if n > FINDINGS_PER_CODE}
    if hidden and not show_all:
        more = ", ".join(f"{n} {code}" for code, n in hidden.items())
        lines.append(f"  ... and {more} more (--all lists every finding)")
    return lines


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def add_all_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--all",
        action="store_true",
        dest="show_all",
        help=f"list every finding (text output shows {FINDINGS_PER_CODE} per code)",
    )


def terminal_text(text: str) -> str:
    """``text`` with every control and bidi character shown as an escape (``\\x1b``,
    ``\\u202e``); newlines and tabs are kept. Applied by ``skippy.cli`` to everything it
    prints for a human."""
    return escape(text, keep_newlines=True)


def field_text(value: object) -> str:
    """One value from a manifest or a file, on one line: every control character escaped,
    newlines too, so a field cannot forge extra output lines."""
    return escape(str(value))
