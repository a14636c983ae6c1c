"""A minimal HTTP shell for the API: one starlette app on hypercorn's trio worker, in the
node's own trio run (the handlers call the split directly; no second loop, no thread).

Stand-in until the node's one app (issue #12, ``mesh_node.http``) lands: then the API's
routes join that app and this module goes.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.routing import BaseRoute

from skippy.config import HostPort
from skippy.errors import UsageError

log = logging.getLogger("mesh_node.serving.http")


def _check_bind(bind: HostPort) -> None:
    """A clear ``http_bind_failed`` (exit 2) for an address we cannot listen on."""
    try:
        family = socket.AF_INET6 if ":" in bind.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bind.host, bind.port))
    except OSError as exc:
        raise UsageError(
            f"cannot listen for HTTP on {bind}: {exc.strerror or exc}",
            code="http_bind_failed",
            remediation="choose another address or port (port 0: any free one)",
        ) from None


def build_app(routes: Sequence[BaseRoute]) -> Starlette:
    return Starlette(routes=list(routes))


async def serve_http(
    app: Starlette, bind: HostPort, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``app`` on ``bind`` until cancelled; ``task_status`` gets ``http://host:port``."""
    _check_bind(bind)
    config = Config()
    host = f"[{bind.host}]" if ":" in bind.host else bind.host
    config.bind = [f"{host}:{bind.port}"]
    config.accesslog = None
    config.errorlog = log
    config.graceful_timeout = 1.0
    config.keep_alive_timeout = 5.0

    async def started(task_status: trio.TaskStatus[list[str]]) -> None:
        await serve(app, config, task_status=task_status)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(started)
        task_status.started(binds[0])
