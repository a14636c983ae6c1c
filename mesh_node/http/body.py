"""Request bodies with bounds: what a stranger can make the node hold.

One ``BodyReader`` per app. A body is read only after the route admitted the request (ready,
queue space), and then only when a body slot is free (``max_concurrent_bodies``) and the
node-wide budget of buffered body bytes (``max_buffered_body_bytes``) holds its declared
``Content-Length`` (a chunked body is charged as it arrives); each piece must come within
``body_read_timeout_s`` and the whole body within ``body_deadline_s`` (408), at most
``max_body_bytes`` (413). Refusals before a byte is read are 503 with ``Retry-After``.
A refusal mid-body closes the connection (the rest of the body is never read).

The bytes go into one ``bytearray`` (above glibc's mmap threshold for big bodies, so a freed
body goes back to the kernel rather than staying in the heap: RSS returns after a flood).
``parse_json`` bounds the parse (``skippy.serving.openai.decode_json``) and runs it in a
thread for bodies over ``INLINE_JSON_BYTES`` so a 16 MiB body cannot stall the event loop.
"""

from __future__ import annotations

from typing import Any, Final

import trio
from starlette.requests import Request

from mesh_node.settings import HttpSettings
from skippy.serving.openai import ApiError, decode_json

INLINE_JSON_BYTES: Final = 64 * 1024  # smaller bodies parse on the loop (~0.1 ms)
RETRY_AFTER_BODIES_S: Final = 1


class BodyReader:
    def __init__(self, settings: HttpSettings) -> None:
        self.settings = settings
        self.open = 0  # bodies being read
        self.buffered = 0  # bytes charged to those bodies

    def _refuse_busy(self, why: str) -> ApiError:
        return ApiError(
            f"the node is reading too many request bodies ({why}); retry shortly",
            code="server_busy",
            status=503,
            kind="service_unavailable",
            headers={"retry-after": str(RETRY_AFTER_BODIES_S)},
        )

    async def read(self, request: Request) -> bytearray:
        s = self.settings
        declared = _content_length(request)
        if declared is not None and declared > s.max_body_bytes:
            raise _too_large(s.max_body_bytes)
        if self.open >= s.max_concurrent_bodies:
            raise self._refuse_busy(f"{self.open} at once, the limit")
        charged = declared or 0
        if self.buffered + charged > s.max_buffered_body_bytes:
            raise self._refuse_busy(f"{self.buffered} bytes buffered")
        self.open += 1
        self.buffered += charged
        body = bytearray()
        try:
            with trio.move_on_after(s.body_deadline_s) as deadline:
                async for chunk in _pieces(request, s.body_read_timeout_s):
                    if len(body) + len(chunk) > s.max_body_bytes:
                        raise _too_large(s.max_body_bytes)
                    if declared is None:  # chunked: charge as it arrives
                        if self.buffered + len(chunk) > s.max_buffered_body_bytes:
                            raise _closing(self._refuse_busy("buffered bytes"))
                        self.buffered += len(chunk)
                        charged += len(chunk)
                    body += chunk
            if deadline.cancelled_caught:
                raise _timeout(f"the body did not arrive within {s.body_deadline_s:g} s")
        finally:
            self.open -= 1
            self.buffered -= charged
        return body

    async def parse_json(self, data: bytearray) -> Any:
        depth = self.settings.max_json_depth
        if len(data) <= INLINE_JSON_BYTES:
            return decode_json(data, depth)
        return await trio.to_thread.run_sync(decode_json, data, depth)


class ClientGone(Exception):
    """The client closed the connection before its body arrived."""


async def _pieces(request: Request, timeout_s: float) -> Any:
    receive = request.receive
    while True:
        with trio.move_on_after(timeout_s) as idle:
            message = await receive()
        if idle.cancelled_caught:
            raise _timeout(f"no body bytes for {timeout_s:g} s")
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return


def _content_length(request: Request) -> int | None:
    raw = request.headers.get("content-length")
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 20:
        raise ApiError("Content-Length is not a number", code="invalid_request")
    return int(raw)


def _closing(err: ApiError) -> ApiError:
    err.headers = {**err.headers, "connection": "close"}
    return err


def _too_large(limit: int) -> ApiError:
    return _closing(
        ApiError(
            f"the request body is larger than {limit} bytes",
            code="request_too_large",
            status=413,
        )
    )


def _timeout(message: str) -> ApiError:
    return _closing(ApiError(message, code="request_timeout", status=408))

