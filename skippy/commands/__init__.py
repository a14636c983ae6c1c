"""The command table: subcommand -> the module that implements it.

Nothing here imports a command module. ``skippy.cli`` builds the argparse tree from this table
and imports only the module of the command being run (or whose ``--help`` is asked), so
``--help``, ``--version`` and light commands such as ``inspect`` never pay for the hub client,
numpy, gguf or llama.cpp. Each module exposes ``register(subparsers)``, which declares its
commands' arguments (cheap) and a handler; the handler imports the library it needs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommandInfo:
    module: str  # imported only when this command runs
    summary: str  # one line for the top-level --help


_PRODUCER = "skippy.commands.producer"
_CONSUMER = "skippy.commands.consumer"

COMMANDS: dict[str, CommandInfo] = {
    "write-package": CommandInfo(
        _PRODUCER, "split a GGUF (or a hub coordinate) into a layer package"
    ),
    "inspect": CommandInfo(_PRODUCER, "describe a GGUF, a split set or a package directory"),
    "plan": CommandInfo(_PRODUCER, "split layers into stages and size each stage"),
    "validate-package": CommandInfo(_PRODUCER, "check a package byte for byte against its source"),
    "verify-package-v2": CommandInfo(
        _PRODUCER, "prove a schema-2 package source-complete against its source GGUF"
    ),
    "preflight": CommandInfo(_CONSUMER, "check a package directory without its source model"),
    "select": CommandInfo(_CONSUMER, "list the validated parts a stage loads"),
    "fetch": CommandInfo(_CONSUMER, "download and verify only the parts a stage needs"),
    "materialize": CommandInfo(_CONSUMER, "compose a stage's parts into one GGUF (a cache)"),
    "run": CommandInfo(
        "skippy.commands.runtime", "load a package's stages and generate from a prompt"
    ),
    "policy": CommandInfo(
        "skippy.commands.phases", "explain the execution path chosen for a request phase"
    ),
}
