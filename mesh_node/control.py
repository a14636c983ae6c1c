"""The local control socket: ``data_dir/mesh-node.sock`` (mode 0600, in a 0700 folder).

One JSON request line in, one JSON response line out. Only processes of the node's user can
connect; it is how ``mesh-node status`` and ``mesh-node topology`` reach a running node.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import trio

from mesh_node.errors import MeshError, NodeNotRunning
from skippy.errors import SkippyError, UsageError

log = logging.getLogger("mesh_node.control")
MAX_REQUEST_BYTES = 64 * 1024
MAX_RESPONSE_BYTES = 16 * 1024 * 1024
REQUEST_TIMEOUT_S = 5.0
MAX_UNIX_PATH = 107  # sun_path holds 108 bytes including the NUL
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def _check_path(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_UNIX_PATH:
        raise UsageError(
            f"control socket path {path} is longer than {MAX_UNIX_PATH} bytes",
            code="control_socket_path_too_long",
            remediation="use a shorter data_dir",
        )


async def _connect(path: Path) -> trio.SocketStream:
    _check_path(path)
    try:
        return await trio.open_unix_socket(str(path))
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        raise NodeNotRunning(
            f"no running node answers on {path}",
            path=str(path),
            remediation="start it with: mesh-node run --config ...",
        ) from exc


async def serve_control(
    path: Path, handler: Handler, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    _check_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    if path.exists() or path.is_symlink():
        try:
            stream = await _connect(path)
        except NodeNotRunning:
            path.unlink()  # a stale socket from a node that did not shut down cleanly
        else:
            await stream.aclose()
            raise UsageError(
                f"another node is running with data_dir {path.parent}",
                code="data_dir_in_use",
                path=str(path.parent),
            )
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)  # the socket is created 0600, never briefly wider
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    try:
        async with trio.open_nursery() as nursery:
            task_status.started()

            async def serve(stream: trio.SocketStream) -> None:
                await _serve_one(stream, handler)

            await trio.serve_listeners(serve, [listener], handler_nursery=nursery)
    finally:
        with suppress(FileNotFoundError):
            path.unlink()


async def _serve_one(stream: trio.abc.Stream, handler: Handler) -> None:
    async with stream:
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                line = await _read_line(stream, MAX_REQUEST_BYTES)
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("a request is a JSON object")
            response = await handler(request)
        except SkippyError as exc:  # first: a UsageError is a ValueError too, keep its code
            response = {"ok": False, "error": exc.to_dict(), "exit_code": exc.exit_code}
        except (ValueError, trio.TooSlowError) as exc:
            response = {"ok": False, "error": {"code": "bad_request", "message": str(exc)}}
        with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(json.dumps(response, default=str).encode() + b"\n")


async def _read_line(stream: trio.abc.Stream, limit: int) -> bytes:
    buf = bytearray()
    while b"\n" not in buf:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        buf += chunk
        if len(buf) > limit:
            raise ValueError(f"message longer than {limit} bytes")
    return bytes(buf.split(b"\n", 1)[0])


async def request(path: Path, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Send one request to the node behind ``path``; raise the node's error if it failed."""
    stream = await _connect(path)
    async with stream:
        with trio.fail_after(timeout_s):
            await stream.send_all(json.dumps(payload).encode() + b"\n")
            line = await _read_line(stream, MAX_RESPONSE_BYTES)
    if not line:
        raise NodeNotRunning(f"the node behind {path} closed the connection", path=str(path))
    response = json.loads(line)
    if not isinstance(response, dict):
        raise MeshError("the node sent a malformed response", code="bad_response")
    if not response.get("ok", False):
        err = response.get("error") or {}
        error = MeshError(
            str(err.get("message", "the node refused the request")),
            code=str(err.get("code", "mesh_error")),
            expected=err.get("expected"),
            actual=err.get("actual"),
            path=err.get("path"),
            remediation=err.get("remediation"),
        )
        exit_code = response.get("exit_code")
        if isinstance(exit_code, int):
            error.exit_code = exit_code
        raise error
    return response
