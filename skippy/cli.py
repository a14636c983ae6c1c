"""``skippy-model-package``: a thin CLI over the library (STYLE 11).

Each command module registers its subcommands and returns a ``CommandResult``; this module
parses arguments, calls the handler, renders text or ``--json`` (one JSON document on stdout)
and maps errors to exit codes through one table: 0 ok, 1 invalid package/model, 2 bad usage
or unreadable input. A user error never prints a traceback.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from skippy.commands.output import Handler
from skippy.errors import EXIT_USAGE, InputUnreadable, SkippyError

PROG = "skippy-model-package"
# errno names that mean "this input cannot be read" (others, e.g. ENOSPC, are I/O failures).
_READ_ERRNOS = frozenset({"ENOENT", "EACCES", "ENOTDIR", "ELOOP", "EPERM"})


_json_usage_errors = False  # set by main() from the argv it parses


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as our code/exit 2 (and as JSON with --json)."""

    def error(self, message: str) -> Any:
        if _json_usage_errors:
            err = {"code": "bad_usage", "message": message}
            print(json.dumps({"ok": False, "error": err}))
        else:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(EXIT_USAGE)


DESCRIPTION = "Write, check, select and run layer packages."


def build_parser(
    prog: str = PROG,
    description: str = DESCRIPTION,
    modules: Sequence[ModuleType] | None = None,
) -> argparse.ArgumentParser:
    """The argument tree of ``prog`` over ``modules`` (default: skippy-model-package's); a
    second console script (skippy-quantize) shares this parser, rendering and exit codes."""
    if modules is None:
        from skippy.commands import COMMAND_MODULES

        modules = COMMAND_MODULES
    parser = _Parser(prog=prog, description=description)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for module in modules:
        module.register(sub)
    return parser


def _render_error(err: SkippyError, as_json: bool) -> None:
    if as_json:
        out: dict[str, Any] = {"ok": False, "error": err.to_dict()}
        findings = getattr(err, "findings", None)
        if findings:
            out["findings"] = [f.to_dict() for f in findings]
        print(json.dumps(out, indent=2, default=str))
        return
    sys.stderr.write(f"error [{err.code}]: {err.message}\n")
    for f in getattr(err, "findings", None) or []:
        if f.message != err.message.split(": ", 1)[-1]:
            sys.stderr.write(f"  - [{f.code}] {f.message}\n")
    if err.remediation:
        sys.stderr.write(f"hint: {err.remediation}\n")


def main(
    argv: Sequence[str] | None = None,
    *,
    prog: str = PROG,
    description: str = DESCRIPTION,
    modules: Sequence[ModuleType] | None = None,
) -> int:
    global _json_usage_errors
    args_list = list(sys.argv[1:] if argv is None else argv)
    _json_usage_errors = "--json" in args_list
    parser = build_parser(prog, description, modules)
    args = parser.parse_args(args_list)
    as_json = bool(getattr(args, "json", False))
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    handler: Handler = args.handler
    try:
        result = handler(args)
    except SkippyError as err:
        _render_error(err, as_json)
        return err.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except OSError as exc:  # an I/O failure we did not anticipate: still no traceback
        where = f": {exc.filename}" if exc.filename else ""
        name = errno.errorcode.get(exc.errno or 0, "")
        wrapped = InputUnreadable(
            f"{exc.strerror or exc}{where}",
            code="io_error" if name not in _READ_ERRNOS else "unreadable_input",
            actual=name or None,
        )
        _render_error(wrapped, as_json)
        return wrapped.exit_code
    try:
        if as_json:
            print(json.dumps(result.data, indent=2, default=str))
        else:
            if result.text:
                print(result.text)
            for w in result.warnings:
                sys.stderr.write(f"warning: {w}\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return result.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
