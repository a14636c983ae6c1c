"""The TCP stream under a link's WebSocket, with its reads taken from the node's peer-memory
budget (``mesh_node.budget``).

What a peer sends is held in this process from the moment it is read until the link's reader
has taken the message it belongs to (``mesh_node.websocket``'s frame parser keeps a message's
parts until it is whole): a few MiB per link that nothing would count otherwise. Here every
read is reserved from the budget before it happens (a read waits while the account has no
room: the bytes stay in the kernel and TCP pushes back on the peer) and given back once the
link's reader has taken the message (``delivered``). Before the Noise handshake completes, an
account may hold at most ``PENDING_CAP_BYTES`` (the handshake's messages are <= 2 KiB).

Accounting is by the WebSocket frame sizes an honest peer sends (one frame per message; the
upgrade's HTTP head is not counted: it is parsed at once, bounded), so an idle honest link
holds exactly nothing; a peer that fragments messages or sends WebSocket pings only
over-counts itself (its own share shrinks until its link closes).

The socket is also read and written without a scheduler pass where it can be
(``send_now``, ``_receive_now``: the per-hop cost of a small decode frame), through the
operating system's calls on the socket's file descriptor.
"""

from __future__ import annotations

import errno
import math
import os
import socket
from itertools import count
from typing import Final, Protocol

import trio

from mesh_node.budget import PeerMemory
from protocol.ws_frames import frame_overhead

PENDING_CAP_BYTES: Final = 64 * 1024
# A trusted link's reads (4 KiB reads cap loopback throughput at ~107 MB/s).
READ_BYTES: Final = 1024 * 1024
# Before the handshake, and for untrusted peers while strangers press on the budget.
SMALL_READ_BYTES: Final = 64 * 1024
CLOSING_READ_BYTES: Final = 4096
STALL_POLL_S: Final = 0.25  # while a read waits for room, how often the socket is looked at
# Linux tcp_states.h: CLOSE (reset, or both closed), CLOSE_WAIT (the peer's FIN arrived),
# LAST_ACK.
_TCP_PEER_GONE: Final = frozenset({7, 8, 9})
LISTEN_BACKLOG: Final = 0xFFFF  # trio's default; the kernel caps it at somaxconn
_ids = count(1)


class LinkTransport(Protocol):
    """What a link's WebSocket runs over: a ``BudgetedStream`` (TCP), or a relay's circuit
    (``mesh_node.circuit.CircuitStream``)."""

    key: int  # the link's account in ``budget``
    budget: PeerMemory
    trusted: bool
    waited_at: float  # trio clock: the last time a read waited for room (not the peer's silence)
    peer_address: str
    relay_id: str | None  # the relay's node id for a relayed circuit; None over TCP

    def established(self, *, trusted: bool) -> None: ...

    def claim(self) -> None: ...

    def set_trusted(self, trusted: bool) -> None: ...

    def delivered(self, payload_bytes: int) -> None: ...

    async def receive_some(self, max_bytes: int | None = None) -> bytes: ...

    async def drain(self) -> None: ...

    def send_now(self, data: bytes | bytearray | memoryview) -> int: ...

    async def send_all(self, data: bytes | bytearray | memoryview) -> None: ...

    async def aclose(self) -> None: ...


class BudgetedStream(trio.abc.HalfCloseableStream):
    """A ``trio.SocketStream`` whose received bytes are held against ``budget`` until the
    WebSocket above it has delivered them (``delivered``)."""

    def __init__(self, inner: trio.SocketStream, budget: PeerMemory, *, server: bool) -> None:
        self.inner = inner
        self.claimed = False  # an owner (the node's accept or dial) closes the account
        self.budget = budget
        self.key = id(self)
        self.name = f"transport-{next(_ids)}"
        self.server = server  # a server receives masked frames (RFC 6455 5.3)
        self.held = 0  # read from the socket, not yet delivered as a message
        self.cap: int | None = PENDING_CAP_BYTES
        self.read_bytes = SMALL_READ_BYTES
        self.trusted = False
        self.relay_id: str | None = None  # a direct connection
        self._in_head, self._head_tail = True, b""
        self.waited_at = -math.inf  # trio clock: the last time a read waited for room
        self._held_by_read = 0  # what the last read added to ``held``
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
        """One read from the socket, reserved from the budget first (``b""``: its end)."""
        return await self._read(max_bytes)

    async def drain(self) -> None:
        """Read and drop until the connection ends (a refused peer's, while the close frame
        sent to it is on its way: its writes finish and it reads the close, not a reset)."""
        while await self._read(None):
            self.held -= self._held_by_read
            self.budget.give(self.key, self._held_by_read)

    async def _read(self, max_bytes: int | None) -> bytes:
        """One read from the socket, reserved from the budget first."""
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
        # the checkpoint (the per-hop cost of a small frame).
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
        http = self._http_head_bytes(data)  # parsed at once (bounded there): not held
        self.budget.give(self.key, reserved - len(data) + http)
        self.held += len(data) - http
        self._held_by_read = len(data) - http
        await self.budget.pace(self.key, len(data))
        return data

    def _receive_now(self, max_bytes: int) -> bytes | None:
        """What the socket holds (the wait above said it is readable), read without the
        scheduler pass trio's ``receive_some`` takes after its read; None if nothing is there
        after all (then trio's read waits). Errors as trio's stream reports them."""
        fd = self.inner.socket.fileno()
        if fd < 0:
            raise trio.ClosedResourceError("the connection is closed")
        try:
            return os.read(fd, max_bytes)
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

    def send_now(self, data: bytes | bytearray | memoryview) -> int:
        """Write what the kernel takes of ``data`` at once, without waiting: the bytes taken
        (0 when the socket is full, closed or broken: ``send_all`` then waits, or reports
        the error as trio does)."""
        fd = self.inner.socket.fileno()
        if fd < 0:
            return 0
        try:
            return os.write(fd, data)
        except OSError:  # full (BlockingIOError) or broken: ``send_all`` retries and reports
            return 0

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    def claim(self) -> None:
        """The node serves this connection: it closes the account when the link is done
        (so the link learns how much it held; the WebSocket may close the stream first)."""
        self.claimed = True

    async def aclose(self) -> None:
        if self.claimed:
            self.budget.give(self.key, self.held)  # the transport buffers are gone
        else:
            self.budget.close(self.key)
        self.held = 0
        await self.inner.aclose()


class BudgetedListener(trio.abc.Listener[BudgetedStream]):
    """Accepted TCP connections, each wrapped in a ``BudgetedStream`` from the moment it is
    accepted (before the upgrade)."""

    def __init__(self, inner: trio.SocketListener, budget: PeerMemory) -> None:
        self.inner = inner
        self.budget = budget

    @property
    def port(self) -> int:
        return int(self.inner.socket.getsockname()[1])

    async def accept(self) -> BudgetedStream:
        return BudgetedStream(await self.inner.accept(), self.budget, server=True)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def budgeted_listeners(host: str, port: int, budget: PeerMemory) -> list[BudgetedListener]:
    """Listeners on ``host:port`` (as ``trio.open_tcp_listeners``), sharing the port with this
    node's direct dials (``SO_REUSEPORT``: ``mesh_node.hole_punch.open_direct`` dials from the
    listen port). A port another socket holds is still refused (``EADDRINUSE``): a plain bind
    is tried first, since sockets that all ask for port sharing would not conflict."""
    infos = await trio.socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    listeners: list[BudgetedListener] = []
    try:
        for family, kind, proto, _, sockaddr in infos:
            if port:
                with socket.socket(family, kind, proto) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    if family == socket.AF_INET6:
                        probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                    probe.bind(sockaddr)
            sock = trio.socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                await sock.bind(sockaddr)
                sock.listen(LISTEN_BACKLOG)
            except BaseException:
                sock.close()
                raise
            listeners.append(BudgetedListener(trio.SocketListener(sock), budget))
    except BaseException:
        for listener in listeners:
            await listener.aclose()
        raise
    return listeners
