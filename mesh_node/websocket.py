"""A link's WebSocket (RFC 6455): the I/O shell over the sans-IO codec in ``protocol``
(``ws_upgrade`` for the opening handshake, ``ws_frames`` for frames, ``ws_close`` for the
closing handshake), on a budgeted TCP stream (``mesh_node.budgeted_tcp``).

Reading happens in the caller's task: ``get_message`` reads, parses, answers pings and the
peer's close frame, and returns the next binary message (a view of the bytes read where one
read held its whole frame); ``aclose`` runs the closing handshake. A link's reader always waits
in ``get_message``, so control frames are answered while the link lives, and nothing is parsed
ahead of what the link takes: a reader that stops taking messages stops the reads (TCP pushes
back on the peer).

Writing: every frame is built whole in one buffer (``protocol.ws_frames``) and written under one
lock, so frames never interleave. ``send_now`` writes a message from the calling task without
a scheduler pass when nothing else is being written (the per-hop cost of a small decode frame:
the writer task's wake-up and lock cost two or three passes of trio's scheduler, ~30 µs of
Python each); what the kernel does not take at once is kept (``unsent``) and written before
anything else, so the byte stream is what ``send`` would have written, in the same order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import trio

from mesh_node.budget import PeerMemory
from mesh_node.budgeted_tcp import BudgetedListener, BudgetedStream, LinkTransport
from protocol.ws_close import CloseReason, ClosingHandshake
from protocol.ws_frames import (
    CLOSE_ABNORMAL,
    CLOSE_NORMAL,
    OP_BINARY,
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    FrameParser,
    FrameRefused,
    Payload,
    frame,
)
from protocol.ws_upgrade import (
    KEY_BYTES,
    UpgradeRefused,
    UpgradeRequest,
    accept_response,
    client_request,
    head_end,
    new_key,
    parse_request,
    parse_response,
    reject_response,
)

_ENDED = "the connection ended without a close frame"


@dataclass(frozen=True)
class WebSocketSettings:
    max_message_bytes: int  # a longer message is refused (close code 1009)
    handshake_s: float  # the TCP connect and the opening handshake, each
    disconnect_s: float  # how long a closing WebSocket waits for the peer's close


class HandshakeError(Exception):
    """The opening handshake did not complete: there is no WebSocket."""


class ConnectionRejected(HandshakeError):
    """The listener answered the upgrade with an HTTP refusal (``status_code``: 429, 503...)."""

    def __init__(self, status_code: int) -> None:
        super().__init__(f"the peer refused the WebSocket upgrade (HTTP {status_code})")
        self.status_code = status_code


class ConnectionClosed(Exception):
    """The WebSocket is closed (``reason``: the close frame's code and text, or 1006 when the
    connection ended without one)."""

    def __init__(self, reason: CloseReason) -> None:
        super().__init__(f"{reason.code} {reason.reason}".strip())
        self.reason = reason


class WebSocket:
    """One open WebSocket over ``stream``: ``client`` for the end that dialed (its frames are
    masked)."""

    def __init__(
        self,
        stream: LinkTransport,
        *,
        client: bool,
        subprotocol: str | None,
        max_message_bytes: int,
        buffered: bytes = b"",
    ) -> None:
        self.stream = stream
        self.is_client = client
        self.masked = client  # RFC 6455 5.3: a client masks what it sends
        self.subprotocol = subprotocol
        self.closed: CloseReason | None = None  # set once the WebSocket is closed
        self.unsent: memoryview | None = None  # the tail of a message ``send_now`` began
        self._parser = FrameParser(server=not client, max_message_bytes=max_message_bytes)
        # The current read's frames not yet taken (a generator: parsed as they are taken).
        self._frames: Iterator[tuple[int, Payload]] | None = (
            self._parser.feed(buffered) if buffered else None
        )
        self._closing = ClosingHandshake()
        self._refused: FrameRefused | None = None
        self._broken = False
        self._send_lock = trio.Lock()

    # --- receiving ------------------------------------------------------------------------------
    async def get_message(self) -> Payload:
        """The next binary message. ``ConnectionClosed`` once the WebSocket closed (the peer's
        close frame, answered here, or the connection's end); ``FrameRefused`` (a
        ``ProtocolError``) for a frame the codec refused: the caller closes with its
        ``close_code``."""
        while True:
            if self._refused is not None:
                raise self._refused
            if self.closed is not None:
                raise ConnectionClosed(self.closed)
            frames = self._frames
            if frames is not None:
                try:
                    for opcode, payload in frames:
                        if opcode == OP_BINARY:
                            self.stream.delivered(len(payload))
                            return payload
                        await self._on_control(opcode, bytes(payload))
                except FrameRefused as exc:
                    self._refused, self._frames = exc, None
                    raise
                self._frames = None
            try:
                data = await self.stream.receive_some()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self._broken = True
                self.closed = CloseReason(CLOSE_ABNORMAL, _ENDED)
                raise ConnectionClosed(self.closed)
            self._frames = self._parser.feed(data)

    async def _on_control(self, opcode: int, payload: bytes) -> None:
        if opcode == OP_PING:
            if self._closing.sent is None:
                await self._write(
                    frame([payload], len(payload), masked=self.masked, opcode=OP_PONG)
                )
        elif opcode == OP_CLOSE:
            reason, answer = self._closing.receive(payload)
            self.closed = reason
            if answer is not None:
                # the peer may hang up once it said all it had to say
                with contextlib.suppress(ConnectionClosed):
                    await self._write(self._close_frame(answer))
            raise ConnectionClosed(reason)
        # a pong: links measure their round trips with their own pings (protocol.streams)

    # --- sending --------------------------------------------------------------------------------
    def _close_frame(self, payload: bytes) -> bytearray:
        return frame([payload], len(payload), masked=self.masked, opcode=OP_CLOSE)

    def _check_open(self) -> None:
        if self.closed is not None or self._broken:
            raise ConnectionClosed(self.closed or CloseReason(CLOSE_ABNORMAL, _ENDED))
        if self._closing.sent is not None:  # closing: no data after our close frame
            raise ConnectionClosed(self._closing.sent)

    async def _write(self, data: bytes | bytearray | memoryview) -> None:
        """Write one whole frame, after what ``send_now`` left over."""
        async with self._send_lock:
            try:
                if self.unsent is not None:
                    await self.stream.send_all(self.unsent)
                    self.unsent = None
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._broken = True
                self.closed = self.closed or CloseReason(CLOSE_ABNORMAL, _ENDED)
                raise ConnectionClosed(self.closed) from None

    def can_send_now(self) -> bool:
        """``send_now`` may write: nobody is writing (the lock is free and nothing is left
        over), and the WebSocket is open."""
        return (
            self.unsent is None
            and not self._send_lock.locked()
            and self.closed is None
            and self._closing.sent is None
            and not self._broken
        )

    def send_now(self, data: bytearray) -> bool:
        """Write ``data``, one whole frame (masked as ``self.masked`` says), from this task,
        without waiting (callers check ``can_send_now`` first, in the same scheduler step).
        True if the kernel took all of it; else the rest is ``unsent`` and the caller has
        ``flush`` called (a broken connection is reported there)."""
        if self.unsent is not None:
            raise RuntimeError("send_now without can_send_now in the same scheduler step")
        sent = self.stream.send_now(data)
        if sent == len(data):
            return True
        self.unsent = memoryview(data)[sent:]
        return False

    async def flush(self) -> None:
        """Write what ``send_now`` left over; ``ConnectionClosed`` if the connection broke."""
        if self.unsent is not None:
            async with self._send_lock:
                if self.unsent is not None:
                    try:
                        await self.stream.send_all(self.unsent)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        self._broken = True
                        self.closed = self.closed or CloseReason(CLOSE_ABNORMAL, _ENDED)
                        raise ConnectionClosed(self.closed) from None
                    self.unsent = None

    async def send(self, data: bytearray) -> None:
        """Send ``data``, one whole binary frame (``protocol.ws_frames.frame``,
        ``sealed_frame``); ``ConnectionClosed`` once the WebSocket is closing or closed."""
        self._check_open()
        await self._write(data)

    async def send_message(self, payload: bytes) -> None:
        """Send ``payload`` as one binary message."""
        await self.send(frame([payload], len(payload), masked=self.masked))

    # --- closing --------------------------------------------------------------------------------
    async def aclose(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        """Close: our close frame (``code``, ``reason``) unless the peer's came first, then
        the peer's answer (messages meanwhile are dropped; after a refused frame nothing is
        parsed, everything is dropped until the peer hangs up), then the TCP connection.
        Callers bound it (``WebSocketSettings.disconnect_s``)."""
        try:
            if not self._broken:
                payload = self._closing.start(code, reason)
                if payload is not None:
                    await self._write(self._close_frame(payload))
            while self._closing.received is None and not self._broken:
                if self._refused is not None:
                    await self.stream.drain()
                    break
                try:
                    await self.get_message()  # dropped: delivered back to the budget
                except FrameRefused:
                    continue
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            if self.closed is None:
                self.closed = self._closing.received or self._closing.sent
            with trio.CancelScope(shield=True):
                await self.stream.aclose()


# --- the opening handshake ----------------------------------------------------------------------
async def _read_head(stream: LinkTransport) -> tuple[bytes, bytes]:
    """The HTTP head the peer sends first, and the bytes after it (frames already sent)."""
    buf = bytearray()
    while (end := head_end(buf)) is None:
        data = await stream.receive_some()
        if not data:
            raise HandshakeError("the connection closed during the WebSocket upgrade")
        buf += data
    return bytes(buf[:end]), bytes(buf[end:])


class WebSocketRequest:
    """A dialer's valid upgrade request, for the node to accept or reject."""

    def __init__(
        self, stream: LinkTransport, upgrade: UpgradeRequest, buffered: bytes, max_bytes: int
    ) -> None:
        self.stream = stream
        self.upgrade = upgrade
        self._buffered = buffered
        self._max_message_bytes = max_bytes
        self.websocket: WebSocket | None = None  # once accepted

    @property
    def proposed_subprotocols(self) -> tuple[str, ...]:
        return self.upgrade.subprotocols

    async def accept(self, subprotocol: str | None = None) -> WebSocket:
        await self.stream.send_all(accept_response(self.upgrade, subprotocol))
        self.websocket = WebSocket(
            self.stream,
            client=False,
            subprotocol=subprotocol,
            max_message_bytes=self._max_message_bytes,
            buffered=self._buffered,
        )
        return self.websocket

    async def reject(self, status: int, body: bytes = b"") -> None:
        """Answer with ``status`` (the connection closes once the handler returns)."""
        await self.stream.send_all(reject_response(status, body))


async def _serve_connection(
    handler: Callable[[WebSocketRequest], Awaitable[object]],
    settings: WebSocketSettings,
    stream: BudgetedStream,
) -> None:
    """One accepted connection: its upgrade request (refused with its status when invalid,
    dropped when it does not come within ``handshake_s``), then ``handler``; a WebSocket the
    handler accepted and left open is closed (1000) when it returns."""
    try:
        request = None
        with trio.move_on_after(settings.handshake_s):
            try:
                head, rest = await _read_head(stream)
                upgrade = parse_request(head)
            except UpgradeRefused as exc:
                await stream.send_all(reject_response(exc.status, exc.message.encode()))
                return
            except (HandshakeError, trio.BrokenResourceError, trio.ClosedResourceError):
                return
            request = WebSocketRequest(stream, upgrade, rest, settings.max_message_bytes)
        if request is not None:
            try:
                await handler(request)
            finally:
                ws = request.websocket
                if ws is not None and ws.closed is None:
                    with trio.CancelScope(shield=True), trio.move_on_after(settings.disconnect_s):
                        await ws.aclose()
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def serve_websockets(
    handler: Callable[[WebSocketRequest], Awaitable[object]],
    listeners: list[BudgetedListener],
    nursery: trio.Nursery,
    settings: WebSocketSettings,
    *,
    task_status: trio.TaskStatus[list[BudgetedListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept connections on ``listeners`` until cancelled, each served in ``nursery``."""
    await trio.serve_listeners(
        partial(_serve_connection, handler, settings),
        listeners,
        handler_nursery=nursery,
        task_status=task_status,
    )


async def accept_over(stream: LinkTransport, settings: WebSocketSettings) -> WebSocketRequest:
    """The dialer's upgrade request on an already open ``stream`` (a relay's circuit), within
    ``handshake_s``. Raises ``trio.TooSlowError``, ``HandshakeError`` or ``UpgradeRefused``
    (after answering it with its status)."""
    with trio.fail_after(settings.handshake_s):
        head, rest = await _read_head(stream)
        try:
            upgrade = parse_request(head)
        except UpgradeRefused as exc:
            await stream.send_all(reject_response(exc.status, exc.message.encode()))
            raise
    return WebSocketRequest(stream, upgrade, rest, settings.max_message_bytes)


@asynccontextmanager
async def client_over(
    stream: LinkTransport,
    authority: str,
    settings: WebSocketSettings,
    subprotocols: Sequence[str] = (),
) -> AsyncIterator[WebSocket]:
    """A client WebSocket over an already open ``stream`` (TCP, or a relay's circuit); the
    WebSocket is closed on exit, the stream is the caller's. Raises ``trio.TooSlowError``,
    ``ConnectionRejected``, ``HandshakeError`` or ``UpgradeRefused``."""
    with trio.fail_after(settings.handshake_s):
        key = new_key(os.urandom(KEY_BYTES))
        await stream.send_all(client_request(authority, "/", key, subprotocols))
        head, rest = await _read_head(stream)
        answer = parse_response(head, key, subprotocols)
    if answer.status != 101:
        raise ConnectionRejected(answer.status)
    ws = WebSocket(
        stream,
        client=True,
        subprotocol=answer.subprotocol,
        max_message_bytes=settings.max_message_bytes,
        buffered=rest,
    )
    try:
        yield ws
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(settings.disconnect_s):
            await ws.aclose()


@asynccontextmanager
async def connect(
    host: str,
    port: int,
    budget: PeerMemory,
    settings: WebSocketSettings,
    subprotocols: Sequence[str] = (),
) -> AsyncIterator[WebSocket]:
    """A client WebSocket to ``host:port`` over a ``BudgetedStream`` (closed on exit).
    Raises ``OSError`` (no connection), ``trio.TooSlowError`` (past ``handshake_s``),
    ``ConnectionRejected`` (an HTTP refusal), ``HandshakeError`` or ``UpgradeRefused``."""
    with trio.fail_after(settings.handshake_s):
        sock = await trio.open_tcp_stream(host, port)
    stream = BudgetedStream(sock, budget, server=False)
    stream.claim()
    try:
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        async with client_over(stream, authority, settings, subprotocols) as ws:
            yield ws
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        budget.close(stream.key)  # (a link over it closed it already, learning its peak)
