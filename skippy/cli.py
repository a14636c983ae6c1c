"""``skippy-model-package``: a thin CLI over the library, commands imported on dispatch.

The argparse tree comes from the command table (``skippy.commands.COMMANDS``); only the module
of the command being run is imported, so ``--help``, ``--version`` and light commands start in
tens of milliseconds. This module parses arguments, calls the handler, renders text
or ``--json`` (one JSON document on stdout, always with ``ok``) and maps errors to exit codes
through one table: 0 ok, 1 invalid package/model, 2 bad usage or unreadable input, 130/143
interrupted by SIGINT/SIGTERM. A user error never prints a traceback, and nothing printed for a
human carries a control or bidi character from a manifest or a file name.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

from skippy import progress
from skippy.commands import COMMANDS, CommandInfo
from skippy.commands.output import CommandResult, Handler, add_common_flags, terminal_text
from skippy.errors import EXIT_USAGE, InputUnreadable, Interrupted, SkippyError
from skippy.findings import Finding

PROG = "skippy-model-package"
DESCRIPTION = "Write, check, select and run layer packages."
DISTRIBUTION = "skippy-mesh"  # the name pyproject.toml installs under
# errno names that mean "this input cannot be read" (others, e.g. ENOSPC, are I/O failures).
_READ_ERRNOS = frozenset({"ENOENT", "EACCES", "ENOTDIR", "ELOOP", "EPERM"})
_GLOBAL_FLAGS = frozenset({"-v", "--verbose", "--json", "--version", "-h", "--help"})

_json_usage_errors = False  # set by main() from the argv it parses


class _BadUsage(Exception):
    """Raised by ``_Parser.error`` after it printed the error; main() returns 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as ``error [usage]: ...`` (or a JSON document with
    ``--json``) and exit 2, like every other error of ours."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse takes "-1..2" for an option (only "-1" and "-1.5" look like numbers to it),
        # so `--layers -1..2` failed inside argparse; a value starting "-<digit>" is a value,
        # and parse_layer_range says why it is wrong. (No option of ours starts "-<digit>".)
        self._negative_number_matcher = re.compile(r"^-\d")

    def error(self, message: str) -> Any:
        err = SkippyError(message, code="usage", remediation=f"see `{self.prog} --help`")
        _render_error(err, _json_usage_errors)
        raise _BadUsage(message)


class _VersionAction(argparse.Action):
    """``--version``: the package's own constant (the installed metadata is built from it)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("help", "print the version and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from skippy import __version__ as v  # a constant: importlib.metadata costs ~40 ms

        print(f"{parser.prog} {v}")
        parser.exit()


class _Registrar:
    """What a command module's ``register`` receives: ``add_parser`` with the global flags on
    every command and, for a program with a command table, the table's summary (a command
    missing from the table is a programming error)."""

    def __init__(self, sub: Any, table: Mapping[str, CommandInfo] | None) -> None:
        self._sub = sub
        self._table = table
        self.added: set[str] = set()

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if self._table is not None:
            info = self._table.get(name)
            if info is None:
                raise RuntimeError(f"command {name!r} is missing from skippy.commands.COMMANDS")
            kwargs["help"] = info.summary
            kwargs.setdefault("description", info.summary)
        # "resolve": a module may still add --json itself (add_json_flag) after add_common_flags.
        p: argparse.ArgumentParser = self._sub.add_parser(
            name, conflict_handler="resolve", **kwargs
        )
        add_common_flags(p)
        self.added.add(name)
        return p


def build_parser(
    load: Iterable[str] = (),
    *,
    prog: str = PROG,
    description: str = DESCRIPTION,
    modules: Sequence[ModuleType] | None = None,
) -> argparse.ArgumentParser:
    """The argparse tree. Without ``modules`` it is skippy-model-package's, from the command
    table: the commands named in ``load`` get their full argument declarations (their modules
    are imported), every other command only its name and summary. With ``modules`` (a second
    console script, e.g. skippy-quantize) every command of those modules is declared."""
    parser = _Parser(prog=prog, description=description)
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show library logs on stderr (any position)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document on stdout (any position)"
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    if modules is not None:
        registrar = _Registrar(sub, None)
        for module in modules:
            module.register(registrar)
        return parser
    registrar = _Registrar(sub, COMMANDS)
    to_import = dict.fromkeys(COMMANDS[name].module for name in load if name in COMMANDS)
    for module_path in to_import:
        importlib.import_module(module_path).register(registrar)
    for name, info in COMMANDS.items():
        if name not in registrar.added:  # declared when it runs; named here for --help
            sub.add_parser(name, help=info.summary)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv``: the first token that is not a global flag."""
    for token in argv:
        if token == "--":
            return None
        if token in _GLOBAL_FLAGS or token.startswith("-"):
            continue
        return token
    return None


def _render_error(err: SkippyError | Interrupted, as_json: bool) -> None:
    findings: list[Finding] = list(getattr(err, "findings", None) or [])
    if as_json:
        if not findings:  # every failure carries findings, at least the error itself
            findings = [Finding(err.code, err.message, remediation=err.remediation)]
        out: dict[str, Any] = {"ok": False, "error": err.to_dict()}
        out["findings"] = [f.to_dict() for f in findings]
        print(json.dumps(out, indent=2, default=str))
        return
    lines = [f"error [{err.code}]: {err.message}"]
    for f in findings:
        if f.message != err.message.split(": ", 1)[-1]:
            lines.append(f"  - [{f.code}] {f.message}")
    if err.remediation:
        lines.append(f"hint: {err.remediation}")
    sys.stderr.write(terminal_text("\n".join(lines)) + "\n")


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM raise ``Interrupted`` in the main thread, so every ``finally`` on
    the way up runs (hidden partial files are removed) before we exit 130 or 143. A second
    signal during that cleanup exits at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        if fired:
            os._exit(128 + signum)
        fired.append(signum)
        raise Interrupted(signum, signal.Signals(signum).name)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _run(handler: Handler, args: argparse.Namespace, as_json: bool) -> int:
    try:
        result = handler(args)
    except SkippyError as err:
        _render_error(err, as_json)
        return err.exit_code
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
    _render_result(result, as_json)
    return result.exit_code


def _render_result(result: CommandResult, as_json: bool) -> None:
    try:
        if as_json:
            doc = {"ok": result.exit_code == 0, **result.data}
            print(json.dumps(doc, indent=2, default=str))
        else:
            if result.text:
                print(terminal_text(result.text))
            for w in result.warnings:
                sys.stderr.write(terminal_text(f"warning: {w}") + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(
    argv: Sequence[str] | None = None,
    *,
    prog: str = PROG,
    description: str = DESCRIPTION,
    modules: Sequence[ModuleType] | None = None,
) -> int:
    """Run one command. ``prog``/``description``/``modules``: a second console script
    (skippy-quantize) shares this parser, rendering and exit codes."""
    global _json_usage_errors
    args_list = list(sys.argv[1:] if argv is None else argv)
    _json_usage_errors = "--json" in args_list
    command = _command_in(args_list)
    parser = build_parser(
        [command] if command is not None else [],
        prog=prog,
        description=description,
        modules=modules,
    )
    try:
        args = parser.parse_args(args_list)
    except _BadUsage:
        return EXIT_USAGE
    as_json = bool(args.json)
    # Bars for people watching: a terminal, and no JSON to keep clean.
    progress.configure(enabled=not as_json and sys.stderr.isatty())
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        with _interruptible():
            return _run(args.handler, args, as_json)
    except KeyboardInterrupt as exc:  # Interrupted, or Ctrl-C off the main thread
        err = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT, "SIGINT")
        _render_error(err, as_json)
        return err.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
