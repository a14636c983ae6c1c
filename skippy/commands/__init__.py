"""CLI command modules. Each exposes ``register(subparsers)``; handlers return CommandResult."""

from __future__ import annotations

from types import ModuleType

from skippy.commands import consumer, policy, producer, runtime

COMMAND_MODULES: tuple[ModuleType, ...] = (producer, consumer, runtime, policy)
