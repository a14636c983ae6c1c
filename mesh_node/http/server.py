"""Serve the app with hypercorn's trio worker inside the node's trio run (no second loop, no
thread): the endpoints read node state directly."""

from __future__ import annotations

import logging
import socket
from functools import partial
from pathlib import Path

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.types import ASGIApp

from mesh_node.settings import HostPort
from skippy.errors import UsageError

log = logging.getLogger("mesh_node.http")
GRACEFUL_TIMEOUT_S = 1.0  # open page connections (the event stream) at shutdown


def bind_socket(bind: HostPort) -> socket.socket:
    """A listening-ready TCP socket on ``bind``; a clear ``http_bind_failed`` otherwise."""
    try:
        infos = socket.getaddrinfo(bind.host, bind.port, type=socket.SOCK_STREAM)
        family, type_, proto, _, address = infos[0]
        sock = socket.socket(family, type_, proto)
    except OSError as exc:
        raise UsageError(
            f"cannot listen for HTTP on {bind}: {exc.strerror or exc}", code="http_bind_failed"
        ) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UsageError(
            f"cannot listen for HTTP on {bind}: {exc.strerror or exc}",
            code="http_bind_failed",
            actual=str(bind),
            remediation="choose another port (or 0 for any free one)",
        ) from None
    return sock


def page_url(sock: socket.socket, scheme: str = "http") -> str:
    host, port = sock.getsockname()[:2]
    return f"{scheme}://[{host}]:{port}/" if ":" in host else f"{scheme}://{host}:{port}/"


async def serve_http(
    app: ASGIApp,
    bind: HostPort,
    *,
    tls: tuple[Path, Path] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``bind`` until cancelled; ``task_status`` gets the page's URL.
    ``tls`` (certificate, key): HTTPS on the same listener, by hypercorn's own TLS."""
    sock = bind_socket(bind)
    url = page_url(sock, "https" if tls else "http")
    config = Config()
    if tls is not None:
        config.certfile, config.keyfile = str(tls[0]), str(tls[1])
        try:
            config.create_ssl_context()  # a bad certificate or key: our clear error, now
        except (OSError, ValueError) as exc:
            sock.close()
            raise UsageError(
                f"cannot use the TLS certificate {tls[0]} and key {tls[1]}: {exc}",
                code="invalid_tls",
            ) from None
    # hypercorn adopts the socket we bound (so bind errors are ours, and clear).
    config.bind = [f"fd://{sock.fileno()}"]
    config.errorlog = log
    config.accesslog = None
    config.graceful_timeout = GRACEFUL_TIMEOUT_S
    config.include_server_header = False
    sock.detach()  # the descriptor now belongs to hypercorn's socket object
    async with trio.open_nursery() as nursery:
        # starlette's ASGIApp is hypercorn's ASGIFramework under another name
        await nursery.start(partial(serve, app, config))  # type: ignore[arg-type]
        task_status.started(url)
