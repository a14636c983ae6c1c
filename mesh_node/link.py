"""One authenticated link: WebSocket + Noise channel + stream multiplexer (the I/O shell).

The protocol decisions are all in ``protocol/`` (sans-IO); this module moves bytes and wakes
tasks. Each link runs in its own nursery (reader, writer, heartbeat, and the handler tasks of
the streams its peer opened), so a link's failure or a handler's crash never touches another
link. Memory per link is bounded: the WebSocket parses no further than the message taken, each
stream buffers at most its receive window (the peer cannot exceed it without killing the link),
sends queue at most the peer's credit, and control frames at most ``max_control_backlog_bytes``.
"""

from __future__ import annotations

import logging
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from mesh_node.budget import PeerMemory
from mesh_node.budgeted_tcp import LinkTransport
from mesh_node.errors import LinkClosed, StreamRefused, StreamReset, StreamStalled
from mesh_node.websocket import ConnectionClosed, WebSocket, WebSocketSettings
from protocol import constants as pc
from protocol import streams as ev
from protocol.errors import ProtocolError
from protocol.frames import SubprotocolOpen
from protocol.handshake import Handshake, PeerIdentity, SecureChannel
from protocol.messages import MessageReader, frame_message
from protocol.streams import Multiplexer
from protocol.ws_frames import FrameRefused, sealed_frame

RTT_WINDOW = 16  # heartbeat RTT samples kept per link (min-RTT for planning)
log = logging.getLogger("mesh_node.link")
_PING = struct.Struct(">Q")
# What one ``receive_some()`` without a limit returns at most: several records' worth.
RECEIVE_SOME_BYTES = 1024 * 1024
# The reset code of a stream closed before the peer's end of stream (``MeshStream.aclose``).
CLOSED_EARLY = "closed"
# A ``send_all`` of at most this much onto an idle link is written by the sending task itself
# (``Link.send_now``); larger ones (bulk) go through the writer task, as before.
SEND_NOW_BYTES = 64 * 1024


@dataclass(frozen=True)
class LinkTimeouts:
    handshake_s: float
    idle_s: float  # a send (stream credit or socket write) stalled this long fails
    heartbeat_interval_s: float
    peer_loss_s: float
    disconnect_s: float = 1.0  # how long a closing WebSocket waits for the peer's close


def websocket_settings(limits: pc.Limits, timeouts: LinkTimeouts) -> WebSocketSettings:
    """Both ends' WebSocket: messages bounded by the protocol's record batch, the opening
    handshake within the link's handshake timeout, short close waits."""
    return WebSocketSettings(
        max_message_bytes=limits.max_ws_message_bytes,
        handshake_s=timeouts.handshake_s,
        disconnect_s=timeouts.disconnect_s,
    )


async def secure_handshake(
    ws: WebSocket, hs: Handshake, timeout_s: float
) -> tuple[PeerIdentity, SecureChannel]:
    """Run the Noise XX exchange over ``ws``; raise ``ProtocolError`` or ``trio.TooSlowError``."""
    with trio.fail_after(timeout_s):
        if hs.initiator:
            await ws.send_message(hs.start())
        while not hs.complete:
            reply = hs.receive(bytes(await ws.get_message()))
            if reply is not None:
                await ws.send_message(reply)
    assert hs.peer is not None and hs.channel is not None  # complete implies both (typing)
    return hs.peer, hs.channel


class MeshStream(trio.abc.HalfCloseableStream):
    """A multiplexed stream under flow control: ``send_all`` waits for the peer's credit,
    ``receive_some`` returns ``b""`` at the peer's end of stream. ``reset(code, reason)``
    aborts both directions and tells the peer why. Also ``send_message``/``receive_message``
    for length-prefixed messages (bounded by ``Limits.max_stream_message_bytes``)."""

    def __init__(self, link: Link, stream_id: int, open_: SubprotocolOpen) -> None:
        self._link = link
        self.stream_id = stream_id
        self.open = open_
        # Views into decrypted records (``protocol.streams.DataReceived``), at most the
        # stream's receive window of them.
        self._chunks: deque[bytes | memoryview] = deque()
        self._eof = False
        self._closed = False
        self._error: Exception | None = None
        # The peer reset the stream after its end of stream: this side may send no more, and
        # still reads what came, to the end (``_on_reset``).
        self._send_error: Exception | None = None
        self._readable = trio.lowlevel.ParkingLot()
        self._writable = trio.lowlevel.ParkingLot()
        self._accepted = trio.Event()
        self._reader = MessageReader(link.limits)
        self._pending: deque[bytes] = deque()
        self._sending = False
        self._held = 0  # bytes taken from the node's peer-memory budget (mesh_node.budget)

    # --- the node's peer-memory budget ---------------------------------------------------------
    def _take(self, nbytes: int) -> bool:
        budget = self._link.budget
        if budget is not None and not budget.take(self._link.budget_key, nbytes):
            return False
        self._held += nbytes
        return True

    def _give(self, nbytes: int) -> None:
        nbytes = min(nbytes, self._held)
        self._held -= nbytes
        if self._link.budget is not None:
            self._link.budget.give(self._link.budget_key, nbytes)

    def _over_budget(self) -> None:
        self.reset("memory_budget", "this node holds too much for its peers; retry later")

    # --- called by the link ------------------------------------------------------------------
    def _on_data(self, data: bytes | memoryview) -> None:
        if self._error is not None or self._closed:
            self._link.mux.consumed(self.stream_id, len(data))
            return
        if not self._take(len(data)):  # before it is buffered
            self._over_budget()
            return
        self._chunks.append(data)
        self._readable.unpark_all()

    def _on_end(self) -> None:
        self._eof = True
        self._readable.unpark_all()

    def _on_reset(self, error: Exception) -> None:
        """The peer reset the stream. After the peer's end of stream what it sent stays
        readable, to the end, and only this side's sending fails: a peer that finished its
        answer and closed before reading this side's end (``finish_then_reset``). Before it,
        both directions fail and the unread data is dropped."""
        if self._eof and self._error is None:
            if self._send_error is None:
                self._send_error = error
            self._writable.unpark_all()
            return
        self._fail(error)

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        if not isinstance(error, LinkClosed):
            # A reset stream is never read again: release what it held now. (A closed
            # link's streams keep what arrived before the close; the link's end releases
            # its whole share of the budget.)
            self._chunks.clear()
            self._reader = MessageReader(self._link.limits)
            self._give(self._held)
        self._accepted.set()
        self._readable.unpark_all()
        self._writable.unpark_all()

    def _on_credit(self) -> None:
        self._writable.unpark_all()

    # --- trio.abc.HalfCloseableStream -------------------------------------------------------
    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        self._sending = True
        try:
            # A small send onto an idle link leaves from this task (``Link.send_now``).
            idle = len(data) <= SEND_NOW_BYTES and not self._link.mux.has_output()
            view = memoryview(data)
            while view:
                self._check_open()
                mux = self._link.mux
                room = mux.send_capacity(self.stream_id)
                if room == 0:
                    with trio.move_on_after(self._link.timeouts.idle_s) as scope:
                        await self._writable.park()
                    if scope.cancelled_caught:
                        self.reset("stalled", "no flow-control credit within the idle timeout")
                        raise StreamStalled(
                            f"the peer granted no credit for {self._link.timeouts.idle_s:g} s"
                        )
                    continue
                chunk, view = view[:room], view[room:]
                # Queued until the writer sends it: copy unless the caller's buffer is
                # immutable (after send_all returns, the caller may reuse a bytearray).
                mux.send_data(self.stream_id, chunk if isinstance(data, bytes) else bytes(chunk))
                if idle:
                    idle = False
                    self._link.send_now()
                else:
                    self._link.wake_writer()
            await trio.lowlevel.checkpoint()
        finally:
            self._sending = False

    async def wait_send_all_might_not_block(self) -> None:
        while (
            self._error is None
            and self._send_error is None
            and self._link.mux.send_capacity(self.stream_id) == 0
        ):
            await self._writable.park()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        readable, parked = await self._wait_readable()
        if not readable:
            await trio.lowlevel.checkpoint()
            return b""
        data = self._take_chunks(RECEIVE_SOME_BYTES if max_bytes is None else max_bytes)
        self._give(len(data))
        self._grant(len(data))
        await self._link.take_turn(parked=parked)
        return data

    def _take_chunks(self, most: int) -> bytes:
        """Up to ``most`` buffered bytes in one object (one call and one scheduler
        pass per ~1 MiB instead of per 64 KiB record; the one copy there always was)."""
        first = self._chunks.popleft()
        if len(first) >= most or not self._chunks:
            if len(first) > most:
                view = memoryview(first)
                self._chunks.appendleft(view[most:])
                first = view[:most]
            return bytes(first)  # the same object when it already is ``bytes``
        parts, size = [first], len(first)
        while self._chunks and size < most:
            chunk = self._chunks.popleft()
            if size + len(chunk) > most:
                view = memoryview(chunk)
                self._chunks.appendleft(view[most - size :])
                chunk = view[: most - size]
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)

    async def receive_views(self) -> list[memoryview]:
        """Every chunk received so far, as read-only views into the decrypted records (no
        copy; at least one, waiting if need be), or ``[]`` at the peer's end of stream. One
        call per batch instead of one per 64 KiB record: the bulk receiver's interface."""
        readable, parked = await self._wait_readable()
        if not readable:
            await trio.lowlevel.checkpoint()
            return []
        views = [memoryview(chunk) for chunk in self._chunks]
        self._chunks.clear()
        nbytes = sum(len(v) for v in views)
        self._give(nbytes)
        self._grant(nbytes)
        await self._link.take_turn(parked=parked)
        return views

    async def _wait_readable(self) -> tuple[bool, bool]:
        """Until a chunk is buffered (True) or the peer ended the stream (False); and
        whether this task parked for it (a checkpoint already taken)."""
        parked = False
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._eof:
                return False, parked
            if self._closed:
                raise trio.ClosedResourceError("stream closed")
            await self._readable.park()
            parked = True
        return True, parked

    def _grant(self, nbytes: int) -> None:
        """Give ``nbytes`` of credit back; the writer wakes only when an update is due."""
        # The clock and the link's RTT let the window grow to the bandwidth-delay product.
        now, rtt = trio.current_time(), self._link.rtt_s
        if self._link.mux.consumed(self.stream_id, nbytes, now_s=now, rtt_s=rtt):
            self._link.wake_writer()

    async def send_eof(self) -> None:
        if self._send_error is not None and self._error is None and not self._closed:
            await trio.lowlevel.checkpoint()  # the peer reads no more: nothing left to end
            return
        self._check_open()
        self._link.mux.send_eof(self.stream_id)
        self._link.wake_writer()
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._chunks.clear()
            self._give(self._held)
            mux = self._link.mux
            if self._error is None and mux.has_stream(self.stream_id):
                if not self._eof:
                    # This side's answer (its queued data and FIN) still goes out when it
                    # ended its side; the RESET follows it (``finish_then_reset``).
                    why = "the stream was closed early"
                    if not mux.finish_then_reset(self.stream_id, CLOSED_EARLY, why):
                        mux.reset_stream(self.stream_id, CLOSED_EARLY, why)
                else:
                    mux.send_eof(self.stream_id)
                self._link.wake_writer()
            self._link.forget_stream(self.stream_id)
        await trio.lowlevel.checkpoint()

    def reset(self, code: str, reason: str) -> None:
        """Abort the stream in both directions; the peer sees ``code`` and ``reason``."""
        if self._error is None:
            self._link.mux.reset_stream(self.stream_id, code, reason)
            self._link.wake_writer()
            self._fail(StreamReset(f"stream reset locally: {code}: {reason}", actual=code))
        self._link.forget_stream(self.stream_id)

    # --- messages ----------------------------------------------------------------------------
    async def send_message(self, payload: bytes) -> None:
        try:
            framed = frame_message(payload, self._link.limits)
        except ProtocolError as exc:
            raise StreamReset(exc.message, code="message_too_large") from None
        await self.send_all(framed)

    async def receive_message(self) -> bytes | None:
        """The next length-prefixed message, or ``None`` at a clean end of stream."""
        while True:
            if self._pending:
                return self._pending.popleft()
            data = await self.receive_some()
            if not data:
                if self._reader.buffered:
                    raise StreamReset("the stream ended inside a message", code="truncated_message")
                return None
            before = self._reader.buffered
            try:
                self._pending.extend(self._reader.feed(data))
            except ProtocolError as exc:
                self.reset(exc.code, exc.message)
                raise StreamReset(exc.message, code=exc.code) from None
            # A partly received message is held for the peer too: account for it.
            grown = self._reader.buffered - before
            if grown > 0 and not self._take(grown):
                self._over_budget()
                raise StreamReset("over the node's peer-memory budget", code="memory_budget")
            if grown < 0:
                self._give(-grown)

    def _check_open(self) -> None:
        """Before sending: the stream is neither failed nor closed, and the peer still reads."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise trio.ClosedResourceError("stream closed")
        if self._send_error is not None:
            raise self._send_error


StreamHandler = Callable[[MeshStream], Awaitable[None]]
# What the node answers to a peer's OPEN: a handler to run, or (code, reason) to refuse it.
StreamDecision = tuple[str, str] | StreamHandler


class Link:
    """An authenticated, encrypted, multiplexed connection to one peer."""

    def __init__(
        self,
        ws: WebSocket,
        channel: SecureChannel,
        peer: PeerIdentity,
        *,
        initiator: bool,
        limits: pc.Limits,
        timeouts: LinkTimeouts,
        on_stream: Callable[[Link, SubprotocolOpen], StreamDecision],
        on_message: Callable[[Link, bytes], None],
        budget: PeerMemory | None = None,
    ) -> None:
        self.ws = ws
        self.channel = channel
        self.peer = peer
        self.node_id = peer.node_id.hex()
        self.initiator = initiator
        self.limits = limits
        self.timeouts = timeouts
        self.mux = Multiplexer(initiator=initiator, limits=limits)
        self._on_stream = on_stream
        self._on_message = on_message
        self._streams: dict[int, MeshStream] = {}
        # Streams the peer opened, with the cancel scope of the handler serving each.
        self._inbound: dict[int, trio.CancelScope] = {}
        self.budget = budget
        # The transport's account (its reads) is the link's: one share per peer.
        self.transport: LinkTransport = ws.stream
        self.budget_key = self.transport.key
        self.budget_peak = 0  # the most this link held of the budget (known once it closed)
        self._output = trio.lowlevel.ParkingLot()
        self._nursery: trio.Nursery | None = None
        self.closed = trio.Event()
        self.close_reason: tuple[str, str] | None = None
        self._ws_close_code = 1000  # the WebSocket close frame's code (RFC 6455 7.4.1)
        self.last_received = trio.current_time()
        self.rtt_s: float | None = None
        # The recent samples; their minimum is the link's latency without the
        # scheduling delays a loaded peer adds to some pongs (what cost planning uses).
        self._rtt_samples: deque[float] = deque(maxlen=RTT_WINDOW)
        # WebSocket message bytes after the handshake (records, encrypted): link throughput
        # for the status page and /metrics. Only this link's tasks touch them (one thread).
        self.bytes_received = 0
        self.bytes_sent = 0
        self._ping_sent: dict[int, float] = {}
        self._ping_seq = 0
        self._write_in_flight = False

    # --- lifecycle ---------------------------------------------------------------------------
    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the link until it closes; never raises for a peer's misbehaviour."""
        if self.budget is not None:
            self.budget.open(self.budget_key)
            self.budget.on_pressure(self.budget_key, self.shed_memory)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._reader)
                nursery.start_soon(self._writer)
                nursery.start_soon(self._heartbeat)
                task_status.started()
        except Exception:  # a bug in this link's code must not take the node down
            log.exception("link %s failed", self.node_id[:12])
            self.close_reason = self.close_reason or ("internal_error", "see the node's log")
        finally:
            self._nursery = None
            reason = self.close_reason or ("shutdown", "the node is shutting down")
            self.close_reason = reason
            error = LinkClosed(f"link to {self.node_id[:12]} closed: {reason[0]}: {reason[1]}")
            for stream in list(self._streams.values()):
                stream._fail(error)
            self._streams.clear()
            if self.budget is not None:
                self.budget_peak = self.budget.close(self.budget_key)
            self.closed.set()
            with trio.CancelScope(shield=True), trio.move_on_after(self.timeouts.disconnect_s):
                await self._say_goodbye(reason)
                await self.ws.aclose(code=self._ws_close_code)

    async def _say_goodbye(self, reason: tuple[str, str]) -> None:
        """Tell the peer why we leave (best effort: the socket may be gone or stalled)."""
        if self._write_in_flight or reason[0] in (
            "connection_closed",
            "peer_going_away",
            "peer_not_reading",
        ):
            return
        try:
            self.mux.go_away(*reason)
            records: list[bytes] = []
            while (record := self.mux.next_record()) is not None and len(records) < 4:
                records.append(record)
            if records:
                await self.ws.send_message(self.channel.seal(records))
        except (ConnectionClosed, ProtocolError, trio.BrokenResourceError):
            pass

    def close(self, code: str, reason: str) -> None:
        """Tear the link down (GOAWAY is sent best-effort by the writer's last pass)."""
        if self.close_reason is None:
            self.close_reason = (code, reason)
            log.info("link %s closing: %s: %s", self.node_id[:12], code, reason)
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def shed_memory(self) -> int:
        """The node needs room for a fairer peer (``PeerMemory._preempt``): reset the stream
        holding the most of the budget (``memory_budget``); the bytes released."""
        holding = [stream for stream in self._streams.values() if stream._held > 0]
        if not holding:
            return 0
        stream = max(holding, key=lambda s: s._held)
        released = stream._held
        stream._over_budget()
        return released

    def wake_writer(self) -> None:
        self._output.unpark_all()

    def _next_records(self) -> list[bytes]:
        """The multiplexer's queued records, as many as one WebSocket message carries."""
        records: list[bytes] = []
        while len(records) < self.limits.max_records_per_message:
            record = self.mux.next_record()
            if record is None:
                break
            records.append(record)
        return records

    def send_now(self) -> None:
        """Seal and write what the multiplexer has queued from this task, without a
        scheduler pass (``WebSocket.send_now``), when the writer is idle and the socket
        free; else (or for what the kernel did not take) wake the writer:
        a decode frame leaves when it is queued. The records are sealed in the order the
        writer would seal them, so nonces and bytes on the wire are the same."""
        ws = self.ws
        if self._write_in_flight or self.close_reason is not None or not ws.can_send_now():
            self.wake_writer()
            return
        records = self._next_records()
        if not records:
            return
        try:
            data, size = sealed_frame(self.channel, records, masked=ws.masked)
        except ProtocolError as exc:
            self.close(exc.code, exc.message)
            return
        self.bytes_sent += size
        if not ws.send_now(data):
            # Sealed but not all written: nothing else (not even a goodbye) may go first.
            self._write_in_flight = True
            self.wake_writer()
        elif self.mux.has_output():
            self.wake_writer()

    def forget_stream(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)
        self._inbound.pop(stream_id, None)

    def reset_inbound(self, code: str, reason: str) -> int:
        """Reset every stream the peer opened and stop the handlers serving them (e.g. its
        trust ended)."""
        stopped = 0
        for sid, scope in list(self._inbound.items()):
            stream = self._streams.get(sid)
            if stream is not None:
                stream.reset(code, reason)
            scope.cancel()
            stopped += 1
        self._inbound.clear()
        return stopped

    # --- streams -----------------------------------------------------------------------------
    async def open_stream(self, open_: SubprotocolOpen) -> MeshStream:
        """Open a stream and wait for the peer to accept it (``StreamRefused`` otherwise)."""
        if self.close_reason is not None:
            raise LinkClosed(f"link to {self.node_id[:12]} is closed")
        try:
            sid = self.mux.open_stream(open_)
        except ProtocolError as exc:
            raise StreamRefused(
                exc.message, code="stream_limit" if exc.code == "stream_limit" else "stream_refused"
            ) from None
        stream = MeshStream(self, sid, open_)
        self._streams[sid] = stream
        self.wake_writer()
        with trio.move_on_after(self.timeouts.handshake_s) as scope:
            await stream._accepted.wait()
        if scope.cancelled_caught:
            stream.reset("timeout", "no accept within the handshake timeout")
            raise StreamRefused("the peer did not accept the stream in time", actual="timeout")
        if stream._error is not None:
            self._streams.pop(sid, None)
            raise stream._error
        return stream

    # --- tasks -------------------------------------------------------------------------------
    async def _reader(self) -> None:
        try:
            while True:
                message = await self.ws.get_message()
                self.last_received = trio.current_time()
                self.bytes_received += len(message)
                await self._yield_to_others(per_record=False)  # before the work, not after
                for i, plaintext in enumerate(self.channel.open(message)):
                    if i:
                        await self._yield_to_others(per_record=True)
                    for event in self.mux.receive(plaintext):
                        self._dispatch(event)
                if self.mux.has_output():
                    self.wake_writer()
        except trio.BrokenResourceError:
            self.close("connection_closed", "the connection broke")
        except ConnectionClosed as exc:
            why = exc.reason
            text = f"{why.code} {why.reason}".strip()
            self.close("connection_closed", text or "the peer closed the connection")
        except ProtocolError as exc:
            log.warning("link %s: protocol violation: %s", self.node_id[:12], exc)
            if isinstance(exc, FrameRefused):  # the WebSocket's own close code (1002, 1009)
                self._ws_close_code = exc.close_code
            self.close(exc.code, exc.message)

    async def _yield_to_others(self, *, per_record: bool) -> None:
        """An untrusted peer's message is handled in its turn (``PeerMemory.take_turn``: one
        stranger's item per batch of the scheduler), and while strangers press on the budget
        (a flood) one record per turn, so that many of them delay an honest link by about
        one record, not by a batch of everyone's messages (honest-link RTT).
        Trusted peers never wait."""
        transport = self.transport
        if transport.trusted:
            return
        if per_record and not transport.budget.under_pressure():
            return
        await transport.budget.take_turn(transport.key)

    async def take_turn(self, *, parked: bool = False) -> None:
        """A checkpoint; for an untrusted peer, its turn (``_yield_to_others``): where a
        stream's reader hands data to its handler. A trusted peer's reader that ``parked``
        for the data has had its checkpoint (one scheduler pass less per
        frame); a stranger's always waits its turn."""
        transport = self.transport
        if transport.trusted:
            if not parked:
                await trio.lowlevel.checkpoint()
        else:
            await transport.budget.take_turn(transport.key)

    def _dispatch(self, event: ev.Event) -> None:
        if isinstance(event, ev.DataReceived):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream._on_data(event.data)
            else:  # closed locally: nobody will read it, give the credit back
                self.mux.consumed(event.stream_id, len(event.data))
        elif isinstance(event, ev.StreamOpenRequested):
            self._on_open(event.stream_id, event.open)
        elif isinstance(event, ev.StreamAccepted):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream._accepted.set()
        elif isinstance(event, ev.CreditAvailable):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream._on_credit()
        elif isinstance(event, ev.StreamEnded):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream._on_end()
        elif isinstance(event, ev.StreamReset):
            stream = self._streams.pop(event.stream_id, None)
            if stream is not None:
                why = f"{event.code}: {event.reason}"
                if stream._accepted.is_set():
                    stream._on_reset(StreamReset(why, actual=event.code))
                else:
                    stream._fail(StreamRefused(why, actual=event.code))
        elif isinstance(event, ev.StreamOpenRefused):
            log.info("link %s: refused a stream: %s", self.node_id[:12], event.code)
        elif isinstance(event, ev.PongReceived):
            (seq,) = _PING.unpack(event.opaque)
            sent = self._ping_sent.pop(seq, None)
            if sent is not None:
                self.rtt_s = trio.current_time() - sent
                self._rtt_samples.append(self.rtt_s)
        elif isinstance(event, ev.LinkMessageReceived):
            self._on_message(self, event.payload)
        elif isinstance(event, ev.GoAwayReceived):
            self.close("peer_going_away", f"{event.code}: {event.reason}")

    @property
    def rtt_min_s(self) -> float | None:
        """The least of the last ``RTT_WINDOW`` heartbeat RTTs (``None`` before the first)."""
        return min(self._rtt_samples) if self._rtt_samples else None

    def _on_open(self, stream_id: int, open_: SubprotocolOpen) -> None:
        if not self.mux.has_stream(stream_id):
            return  # opened and reset by the peer in one record: nothing to accept
        decision = self._on_stream(self, open_)
        if isinstance(decision, tuple):
            code, reason = decision
            self.mux.reset_stream(stream_id, code, reason)
            return
        self.mux.accept_stream(stream_id)
        stream = MeshStream(self, stream_id, open_)
        stream._accepted.set()
        self._streams[stream_id] = stream
        self._inbound[stream_id] = trio.CancelScope()
        assert self._nursery is not None  # dispatch runs inside run()'s nursery
        self._nursery.start_soon(self._run_handler, decision, stream)

    async def _run_handler(self, handler: StreamHandler, stream: MeshStream) -> None:
        scope = self._inbound.get(stream.stream_id) or trio.CancelScope()
        try:
            with scope:
                async with stream:
                    await handler(stream)
        except (LinkClosed, StreamReset, StreamRefused, StreamStalled) as exc:
            log.info("link %s stream %d ended: %s", self.node_id[:12], stream.stream_id, exc)
        except trio.TooSlowError:  # a peer that went quiet: expected, one line, no traceback
            # A flood's streams time out together: a stranger's is reset in its turn.
            await self._yield_to_others(per_record=False)
            log.warning(
                "link %s stream %d: the peer sent nothing in time; stream reset",
                self.node_id[:12],
                stream.stream_id,
            )
            stream.reset("timeout", "nothing received in time")
        except Exception as exc:  # a handler bug must not take the link (or node) down
            log.exception(
                "link %s: handler for stream %d failed", self.node_id[:12], stream.stream_id
            )
            stream.reset("handler_error", type(exc).__name__)

    async def _writer(self) -> None:
        try:
            ws = self.ws
            while True:
                while not self.mux.has_output() and ws.unsent is None:
                    await self._output.park()
                if ws.unsent is not None:
                    # The rest of a message ``send_now`` began (``_write_in_flight`` is set).
                    with trio.move_on_after(self.timeouts.idle_s) as scope:
                        await ws.flush()
                    if scope.cancelled_caught:
                        self.close("peer_not_reading", "a write stalled past the idle timeout")
                        return
                    self._write_in_flight = False
                records = self._next_records()
                if not records:
                    await trio.lowlevel.checkpoint()
                    continue
                data, size = sealed_frame(self.channel, records, masked=ws.masked)
                # Between seal (nonces used) and a complete send, a cancelled write would leave
                # a gap the peer rightly rejects: no goodbye may follow an interrupted write.
                self._write_in_flight = True
                with trio.move_on_after(self.timeouts.idle_s) as scope:
                    await ws.send(data)
                self._write_in_flight = False
                if scope.cancelled_caught:
                    self.close("peer_not_reading", "a write stalled past the idle timeout")
                    return
                self.bytes_sent += size
        except (ConnectionClosed, trio.BrokenResourceError):
            self.close("connection_closed", "the peer closed the connection")
        except ProtocolError as exc:
            self.close(exc.code, exc.message)

    def _last_heard(self) -> float:
        """When the peer last sent something, as far as we know: while our transport waits
        for budget room its bytes wait in the kernel, which is not silence."""
        return max(self.last_received, self.transport.waited_at)

    async def _heartbeat(self) -> None:
        first = True  # ping at once: the RTT sizes stream windows from the start
        while True:
            if not first:
                await trio.sleep(self.timeouts.heartbeat_interval_s)
            first = False
            silent = trio.current_time() - self._last_heard()
            if silent > self.timeouts.peer_loss_s:
                self.close("peer_lost", f"nothing received for {silent:.1f} s")
                return
            self._ping_seq += 1
            self._ping_sent = {self._ping_seq: trio.current_time()}  # only the latest matters
            try:
                self.mux.ping(_PING.pack(self._ping_seq))
            except ProtocolError as exc:
                self.close(exc.code, exc.message)
                return
            self.wake_writer()
