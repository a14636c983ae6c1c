"""The TCP stream under a link's WebSocket, with its reads taken from the node's peer-memory
budget (issue #19 item 3; ``mesh_node.budget``).

trio-websocket keeps what it reads (its receive buffer, wsproto's frame buffer, the parts of
a message, the queued message) until the link's reader takes the message: a few MiB per link
that nothing counted, ~3 MiB per hostile link in the issue's attack. Here every read is
reserved from the budget before it happens (a read waits while the account has no room: the
bytes stay in the kernel and TCP pushes back on the peer) and given back once the link's
reader has taken the message out of the WebSocket (``delivered``). Before the Noise handshake
completes, an account may hold at most ``PENDING_CAP_BYTES`` (the handshake's messages are
<= 2 KiB).

Accounting is by the WebSocket frame sizes an honest peer sends (one frame per message, as
trio-websocket does; the upgrade's HTTP head is not counted: h11 parses it at once), so an
idle honest link holds exactly nothing; a peer that fragments messages or sends WebSocket
pings only over-counts itself (its own share shrinks until its link closes).

Issue #25 item 4: a link's stream parses its WebSocket frames itself (``mesh_node.ws_receive``:
~10x less CPU per byte than wsproto). Binary messages go to the link's reader through
``next_message`` (views of the bytes read where one read holds a frame), never through
wsproto; what ``receive_some`` returns to trio-websocket is the upgrade's HTTP head and whole
control frames only, so trio-websocket still answers pings and runs the closing handshake. The
queue of messages is bounded, so a link's reader that stops taking them stops the reads
(TCP pushes back on the peer), as trio-websocket's own one-message queue did.
"""

from __future__ import annotations

import errno
import math
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from itertools import count
from typing import Final

import trio
from trio_websocket import WebSocketConnection, WebSocketServer, wrap_client_stream

from mesh_node.budget import PeerMemory
from mesh_node.ws_receive import FrameRefused, FrameTap

PENDING_CAP_BYTES: Final = 64 * 1024
# trio-websocket's receive buffer (its 4 KiB default caps loopback throughput, runtime-facts.md).
READ_BYTES: Final = 1024 * 1024
# Before the handshake, and for untrusted peers while strangers press on the budget.
SMALL_READ_BYTES: Final = 64 * 1024
CLOSING_READ_BYTES: Final = 4096
STALL_POLL_S: Final = 0.25  # while a read waits for room, how often the socket is looked at
# Messages parsed but not yet taken by the link's reader (views into reads the budget holds).
MESSAGE_QUEUE: Final = 16
# Linux tcp_states.h: CLOSE (reset, or both closed), CLOSE_WAIT (the peer's FIN arrived),
# LAST_ACK.
_TCP_PEER_GONE: Final = frozenset({7, 8, 9})
_ids = count(1)


def frame_overhead(payload_bytes: int, *, masked: bool) -> int:
    """Header bytes of one WebSocket frame carrying ``payload_bytes`` (RFC 6455 5.2)."""
    extended = 0 if payload_bytes < 126 else 2 if payload_bytes < 65536 else 8
    return 2 + extended + (4 if masked else 0)


class BudgetedStream(trio.abc.HalfCloseableStream):
    """A ``trio.SocketStream`` whose received bytes are held against ``budget`` until the
    WebSocket above it has delivered them (``delivered``)."""

    def __init__(
        self,
        inner: trio.SocketStream,
        budget: PeerMemory,
        *,
        server: bool,
        accepted: AcceptedTransports | None = None,
        max_message_bytes: int | None = None,
    ) -> None:
        self.inner = inner
        self._accepted = accepted
        self.claimed = False  # an owner (the node's accept or dial) closes the account
        self.budget = budget
        self.key = id(self)
        self.name = f"transport-{next(_ids)}"  # trio-websocket's ``remote`` for this stream
        self.server = server  # a server receives masked frames (RFC 6455 5.3)
        self.held = 0  # read from the socket, not yet delivered as a message
        self.cap: int | None = PENDING_CAP_BYTES
        self.read_bytes = SMALL_READ_BYTES
        self.trusted = False
        self._in_head, self._head_tail = True, b""
        self.waited_at = -math.inf  # trio clock: the last time a read waited for room
        # The frames, parsed here (None: every byte goes to trio-websocket, as for a stream
        # not under a link); ``_head`` counts the HTTP head's bytes in the last read.
        self.tap = (
            FrameTap(server=server, max_message_bytes=max_message_bytes)
            if max_message_bytes is not None
            else None
        )
        self._head = 0
        self._held_by_read = 0  # what the last read added to ``held``
        self._refused: FrameRefused | None = None
        self._ended = False
        self._dropping = False  # the link's reader is gone: messages are dropped, not queued
        self._send_messages, self._messages = trio.open_memory_channel[
            bytes | bytearray | memoryview
        ](MESSAGE_QUEUE)
        # The non-blocking socket under trio's (``_receive_now``; None: trio's reads only).
        raw = getattr(inner.socket, "_sock", None)
        self._sock: socket.socket | None = raw if isinstance(raw, socket.socket) else None
        try:
            host, port, *_ = inner.socket.getpeername()
            self.peer_address, self.peer_port = str(host), int(port)
        except (OSError, ValueError):
            self.peer_address, self.peer_port = "?", 0
        budget.open(self.key)

    def __repr__(self) -> str:
        return self.name

    def established(self, *, trusted: bool) -> None:
        """The handshake completed: no pending cap; the peer's pool from now on."""
        self.cap = None
        self.set_trusted(trusted)

    def set_trusted(self, trusted: bool) -> None:
        """The peer's pool (its reads' size: ``_read_size``)."""
        self.trusted = trusted
        self.read_bytes = READ_BYTES
        self.budget.set_trusted(self.key, trusted)

    def _read_size(self) -> int:
        """While strangers press on the budget (``PeerMemory.under_pressure``), or other
        strangers wait for their turn (``mesh_node.turns``), an untrusted peer's bytes are read in
        small steps, so that a flood from many of them cannot hold the event loop for long
        between two turns of an honest link (parsing a 1 MiB read took ~5 ms of CPU here);
        otherwise (a lone stranger, and trusted peers always) 1 MiB, for throughput."""
        turns = self.budget.turns
        if not self.trusted and (self.budget.under_pressure() or turns.others_waiting(self.key)):
            return SMALL_READ_BYTES
        return self.read_bytes

    def delivered(self, payload_bytes: int) -> None:
        """The WebSocket handed one message of ``payload_bytes`` to its reader."""
        n = min(self.held, payload_bytes + frame_overhead(payload_bytes, masked=self.server))
        self.held -= n
        self.budget.give(self.key, n)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """What trio-websocket reads: with the tap, the HTTP head and control frames only
        (reading on while a read holds nothing else); its messages go to ``next_message``."""
        tap = self.tap
        if tap is None or self._ended:
            if self._refused is not None:
                return await self._drop_until_end(max_bytes)
            return await self._read(max_bytes)
        while True:
            data = await self._read(max_bytes)
            if not data:
                self._end()
                return b""
            out: list[bytes | bytearray | memoryview] = [data[: self._head]] if self._head else []
            try:
                if self._head < len(data):
                    for is_message, payload in tap.feed(data[self._head :]):
                        if not is_message:
                            out.append(payload)
                        elif not self._dropping:
                            try:
                                await self._send_messages.send(payload)
                            except trio.BrokenResourceError:  # ``stop_messages`` meanwhile
                                self.delivered(len(payload))
                        else:
                            self.delivered(len(payload))
            except FrameRefused as exc:
                self._refused = exc
                self._end()
                if out:  # what came before the refused frame (the head, control frames)
                    return b"".join(out)
                # The link closes (its reader raises the refusal): until the connection
                # ends, what the peer sends is read and dropped, so that its writes finish
                # and it reads the close frame the link sends (1002, 1009), as wsproto's
                # refusals did, rather than a reset.
                return await self._drop_until_end(max_bytes)
            if tap.closed:  # a close frame: no message after it; the handshake is wsproto's
                self._end()
            if out:
                return b"".join(out)

    async def _drop_until_end(self, max_bytes: int | None) -> bytes:
        """Read and drop until the connection ends (the link closing it); ``b""``."""
        while await self._read(max_bytes):
            self.held -= self._held_by_read
            self.budget.give(self.key, self._held_by_read)
        return b""

    def stop_messages(self) -> None:
        """The link's reader is done: messages still queued or arriving are dropped (their
        bytes given back), control frames still pass, so the closing handshake completes
        however much the peer had sent."""
        self._dropping = True
        while True:
            try:
                payload = self._messages.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            self.delivered(len(payload))
        self._messages.close()

    def _end(self) -> None:
        """No more messages: the link's reader learns why (``next_message``)."""
        self._ended = True
        self._send_messages.close()

    async def next_message(self) -> bytes | bytearray | memoryview:
        """The next binary message (the tap's): ``FrameRefused`` for a refused frame,
        ``trio.EndOfChannel`` when the connection ended or closed (trio-websocket's
        ``get_message`` then says how)."""
        try:
            return await self._messages.receive()
        except trio.EndOfChannel:
            if self._refused is not None:
                raise self._refused from None
            raise

    async def _read(self, max_bytes: int | None) -> bytes:
        """One read from the socket, reserved from the budget first."""
        self._head = 0  # set again below when the read holds the upgrade's HTTP head
        self._held_by_read = 0
        size = self._read_size()
        want = min(max_bytes or size, size)
        if self.cap is not None:
            while self.cap is not None and self.held >= self.cap:
                # Nothing will be delivered until the peer sends a whole small message:
                # a pending handshake never needs more; its deadline ends it.
                if self._peer_closed():
                    return b""
                await trio.sleep(STALL_POLL_S)
            if self.cap is not None:
                want = min(want, self.cap - self.held)
        # Reserve only once there is something to read: an idle link holds nothing.
        if self.inner.socket.fileno() < 0:  # closed under us (epoll refuses fd -1)
            raise trio.ClosedResourceError("the connection is closed")
        await trio.lowlevel.wait_readable(self.inner.socket)
        # Room now (the usual case) is taken without a second scheduler pass: the wait was
        # the checkpoint (issues #21/#25: the per-hop cost of a small frame).
        reserved = self.budget.take_some_now(self.key, want)
        while reserved < 0:
            with trio.move_on_after(STALL_POLL_S):
                reserved = await self.budget.take_some(self.key, want)
            if reserved < 0:
                # The peer is not silent: we are not reading (the link's heartbeat asks).
                self.waited_at = trio.current_time()
                if self._peer_closed():
                    # Its close is not read either: look at the socket's state instead,
                    # so that a peer that left releases its share now.
                    return b""
        if reserved == 0:
            # The link ended and released its account: only its closing handshake is left
            # to read (bounded by the disconnect timeout), in small reads.
            return await self.inner.receive_some(CLOSING_READ_BYTES)
        try:
            if not self.trusted and await self.budget.take_turn(self.key):
                self.waited_at = trio.current_time()  # queued behind strangers: not silence
            data = self._receive_now(reserved)
            if data is None:
                data = await self.inner.receive_some(reserved)
        except BaseException:
            self.budget.give(self.key, reserved)
            raise
        http = self._http_head_bytes(data)  # parsed at once by h11 (bounded there): not held
        self._head = http
        self.budget.give(self.key, reserved - len(data) + http)
        self.held += len(data) - http
        self._held_by_read = len(data) - http
        await self.budget.pace(self.key, len(data))
        return data

    def _receive_now(self, max_bytes: int) -> bytes | None:
        """What the socket holds (the wait above said it is readable), read without the
        scheduler pass trio's ``receive_some`` takes after its read; None if nothing is there
        after all (then trio's read waits). Errors as trio's stream reports them."""
        if self._sock is None:
            return None
        try:
            return self._sock.recv(max_bytes)
        except BlockingIOError:
            return None
        except OSError as exc:
            if exc.errno in (errno.EBADF, errno.ENOTSOCK):
                raise trio.ClosedResourceError("the connection is closed") from None
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc

    def _http_head_bytes(self, data: bytes) -> int:
        """How many of ``data``'s bytes belong to the upgrade's HTTP head (the request, or
        the response on a dialer), so that an idle link holds exactly nothing."""
        if not self._in_head:
            return 0
        joined = self._head_tail + data
        end = joined.find(b"\r\n\r\n")
        if end < 0:
            self._head_tail = joined[-3:]
            return len(data)
        self._in_head = False
        return end + 4 - len(self._head_tail)

    def _peer_closed(self) -> bool:
        """The peer closed or reset the connection (Linux ``TCP_INFO``; elsewhere unknown:
        the link's peer-loss timeout ends it)."""
        try:
            info = self.inner.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)
        except (OSError, AttributeError):
            return False
        return bool(info) and info[0] in _TCP_PEER_GONE

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    def claim(self) -> None:
        """The node serves this connection: it closes the account when the link is done
        (so the link learns how much it held; trio-websocket may close the stream first)."""
        self.claimed = True

    async def aclose(self) -> None:
        if self._accepted is not None:
            self._accepted.forget(self)
        if self.claimed:
            self.budget.give(self.key, self.held)  # the transport buffers are gone
        else:
            self.budget.close(self.key)
        self.held = 0
        await self.inner.aclose()


class AcceptedTransports:
    """Accepted connections not yet claimed by the node, by name (``repr``: what
    trio-websocket reports as a request's remote endpoint for a stream it cannot look into)."""

    def __init__(self) -> None:
        self._by_name: dict[str, BudgetedStream] = {}

    def add(self, stream: BudgetedStream) -> None:
        self._by_name[stream.name] = stream

    def forget(self, stream: BudgetedStream) -> None:
        self._by_name.pop(stream.name, None)

    def claim(self, name: str) -> BudgetedStream | None:
        stream = self._by_name.pop(name, None)
        if stream is not None:
            stream.claim()
        return stream

    def __len__(self) -> int:
        return len(self._by_name)


class BudgetedListener(trio.abc.Listener[BudgetedStream]):
    """Accepted TCP connections, each wrapped in a ``BudgetedStream`` from the moment it is
    accepted (before the upgrade), and listed in ``accepted`` until the node claims it."""

    def __init__(
        self,
        inner: trio.SocketListener,
        budget: PeerMemory,
        accepted: AcceptedTransports,
        max_message_bytes: int | None = None,
    ) -> None:
        self.inner = inner
        self.budget = budget
        self.accepted = accepted
        self.max_message_bytes = max_message_bytes  # the tap's limit (None: no tap)

    @property
    def port(self) -> int:
        return int(self.inner.socket.getsockname()[1])

    async def accept(self) -> BudgetedStream:
        inner = await self.inner.accept()
        stream = BudgetedStream(
            inner,
            self.budget,
            server=True,
            accepted=self.accepted,
            max_message_bytes=self.max_message_bytes,
        )
        self.accepted.add(stream)
        return stream

    async def aclose(self) -> None:
        await self.inner.aclose()


async def budgeted_listeners(
    host: str,
    port: int,
    budget: PeerMemory,
    accepted: AcceptedTransports,
    max_message_bytes: int | None = None,
) -> list[BudgetedListener]:
    listeners = await trio.open_tcp_listeners(port, host=host)
    return [
        BudgetedListener(listener, budget, accepted, max_message_bytes) for listener in listeners
    ]


def websocket_server(
    handler: Callable[..., object],
    listeners: list[BudgetedListener],
    nursery: trio.Nursery,
    opts: dict[str, object],
) -> WebSocketServer:
    # Any trio Listener works (it only calls accept and aclose); the type hint is narrower.
    return WebSocketServer(
        handler,  # type: ignore[arg-type]
        listeners,  # type: ignore[arg-type]
        handler_nursery=nursery,
        **opts,  # type: ignore[arg-type]
    )


@asynccontextmanager
async def budgeted_websocket(
    host: str, port: int, budget: PeerMemory, opts: dict[str, object]
) -> AsyncIterator[tuple[WebSocketConnection, BudgetedStream]]:
    """A client WebSocket to ``host:port`` over a ``BudgetedStream`` (closed on exit)."""
    connect_s = float(opts.get("connect_timeout", 10.0))  # type: ignore[arg-type]
    disconnect_s = float(opts.get("disconnect_timeout", 1.0))  # type: ignore[arg-type]
    ws_opts = {
        k: v for k, v in opts.items() if k not in ("connect_timeout", "disconnect_timeout")
    }
    with trio.fail_after(connect_s):
        sock = await trio.open_tcp_stream(host, port)
    limit = opts.get("max_message_size")
    stream = BudgetedStream(
        sock, budget, server=False, max_message_bytes=limit if isinstance(limit, int) else None
    )
    stream.claim()
    try:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(connect_s):
                ws = await wrap_client_stream(
                    nursery, stream, f"{host}:{port}", "/", **ws_opts  # type: ignore[arg-type]
                )
            try:
                yield ws, stream
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(disconnect_s):
                    await ws.aclose()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The WebSocket's reader task raises a refusal (429, 503) inside the nursery: the
        # caller sees it as open_websocket_url raised it, not wrapped in a group.
        cancelled, errors = group.split(trio.Cancelled)
        if cancelled is not None:
            # An outer scope is cancelling us (a node shutting down) while the link also
            # failed: the cancellation wins. Raised with the error, the group escaped the
            # dial loop's error handling and crashed the node's shutdown (seen in CI).
            raise cancelled from None
        if errors is not None and len(errors.exceptions) == 1:
            only = errors.exceptions[0]
            if isinstance(only, Exception):
                raise only from None
        raise
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        budget.close(stream.key)  # (a link over it closed it already, learning its peak)
