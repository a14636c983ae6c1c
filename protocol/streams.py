"""The stream multiplexer: sans-IO state for many logical streams over one secure channel.

Feed it each record's plaintext (``receive``) and get events; call the stream methods and pull
plaintext records to encrypt (``next_record``). Per-stream credit flow control as in yamux
(and h2): each side may send a stream at most the receive window its peer granted; the reader
grants credit back as its application consumes (``consumed``). Outbound control frames (accept,
window updates, resets, pings, link messages) always go out before any data, so bulk streams
never delay heartbeats or credit. Every queue is bounded: data by the peer's credit, control by
``Limits.max_control_backlog_bytes`` (a peer that never reads ends up there and is dropped).

Stream ids: the link's initiator opens odd ids, the responder even ids, 0 is the link itself.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from protocol import constants as c
from protocol import frames as f
from protocol.errors import ProtocolError


# --- events ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamOpenRequested:
    stream_id: int
    open: f.SubprotocolOpen


@dataclass(frozen=True)
class StreamOpenRefused:
    """The peer's OPEN was malformed or over the limit; a RESET has already been queued."""

    stream_id: int
    code: str
    reason: str


@dataclass(frozen=True)
class StreamAccepted:
    stream_id: int


@dataclass(frozen=True)
class DataReceived:
    """``data`` is a read-only view into the record's decrypted plaintext (immutable bytes),
    not a copy, when the payload fills at least half its record (keeping it keeps that record
    alive); a smaller payload is a copy (``bytes``)."""

    stream_id: int
    data: bytes | memoryview


@dataclass(frozen=True)
class StreamEnded:
    """The peer half-closed the stream: no more data will arrive."""

    stream_id: int


@dataclass(frozen=True)
class StreamReset:
    stream_id: int
    code: str
    reason: str


@dataclass(frozen=True)
class CreditAvailable:
    stream_id: int


@dataclass(frozen=True)
class PongReceived:
    opaque: bytes


@dataclass(frozen=True)
class LinkMessageReceived:
    payload: bytes


@dataclass(frozen=True)
class GoAwayReceived:
    code: str
    reason: str


Event = (
    StreamOpenRequested
    | StreamOpenRefused
    | StreamAccepted
    | DataReceived
    | StreamEnded
    | StreamReset
    | CreditAvailable
    | PongReceived
    | LinkMessageReceived
    | GoAwayReceived
)


class StreamState(enum.Enum):
    OPENING = "opening"  # we sent OPEN, no ACCEPT yet
    PENDING = "pending"  # the peer sent OPEN, we have not accepted yet
    OPEN = "open"


@dataclass
class _Stream:
    stream_id: int
    local: bool  # opened by this side
    state: StreamState
    send_credit: int
    recv_window: int  # bytes the peer may still send before we grant more
    unacked: int = 0  # consumed by the application, not yet granted back
    window: int = 0  # the receive window we aim for (grows with the BDP)
    granted_at: float | None = None  # when the last window update was due, or reading began
    queued: deque[memoryview] = field(default_factory=deque)
    queued_bytes: int = 0
    fin_queued: bool = False
    fin_sent: bool = False
    fin_received: bool = False
    # ``finish_then_reset``: the RESET frame to send right after this side's FIN
    reset_after_fin: bytes | None = None


class Multiplexer:
    def __init__(self, *, initiator: bool, limits: c.Limits = c.DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._streams: dict[int, _Stream] = {}
        self._next_local = 1 if initiator else 2
        self._highest_remote = 0
        self._remote_parity = 0 if initiator else 1
        self._control: deque[bytes] = deque()
        self._control_bytes = 0
        self._window_due: dict[int, int] = {}  # coalesced window updates, sent as control
        # Streams that may have sendable data, in round-robin order (an ordered set).
        self._ready: dict[int, None] = {}
        self._going_away: tuple[str, str] | None = None
        self._view_min = 0  # see receive()

    # --- inspection ------------------------------------------------------------------------
    def stream_ids(self) -> list[int]:
        return list(self._streams)

    def live_streams(self, *, local: bool) -> int:
        return sum(1 for s in self._streams.values() if s.local == local)

    def send_capacity(self, stream_id: int) -> int:
        """Bytes ``send_data`` accepts now: the peer's credit minus what is already queued."""
        s = self._streams.get(stream_id)
        if s is None or s.state is not StreamState.OPEN or s.fin_queued:
            return 0
        return max(0, s.send_credit - s.queued_bytes)

    def has_stream(self, stream_id: int) -> bool:
        return stream_id in self._streams

    def control_backlog(self) -> int:
        return self._control_bytes

    # --- local actions ---------------------------------------------------------------------
    def open_stream(self, open_: f.SubprotocolOpen) -> int:
        if self._going_away is not None:
            raise ProtocolError("link_closing", "the link is going away", fatal=False)
        if self.live_streams(local=True) >= self.limits.max_streams_per_link:
            raise ProtocolError(
                "stream_limit",
                f"{self.limits.max_streams_per_link} streams are already open on this link",
                fatal=False,
            )
        sid = self._next_local
        self._next_local += 2
        self._streams[sid] = _Stream(
            sid,
            True,
            StreamState.OPENING,
            self.limits.stream_window_bytes,
            self.limits.stream_window_bytes,
        )
        self._queue_control(f.encode_frame(c.FRAME_OPEN, sid, open_.encode()))
        return sid

    def accept_stream(self, stream_id: int) -> None:
        s = self._require(stream_id)
        if s.state is not StreamState.PENDING:
            raise ProtocolError(
                "stream_state", f"stream {stream_id} is not awaiting accept", fatal=False
            )
        s.state = StreamState.OPEN
        self._queue_control(f.encode_frame(c.FRAME_ACCEPT, stream_id))

    def send_data(self, stream_id: int, data: bytes | memoryview) -> None:
        if not data:
            return
        s = self._require(stream_id)
        if len(data) > self.send_capacity(stream_id):
            raise ProtocolError(
                "flow_control", f"{len(data)} bytes exceed stream {stream_id}'s credit", fatal=False
            )
        view = memoryview(data)
        for start in range(0, len(view), self.limits.max_frame_payload):
            s.queued.append(view[start : start + self.limits.max_frame_payload])
        s.queued_bytes += len(view)
        self._ready[stream_id] = None

    def send_eof(self, stream_id: int) -> None:
        s = self._streams.get(stream_id)
        if s is None or s.fin_queued:
            return
        s.fin_queued = True
        self._ready[stream_id] = None

    def finish_then_reset(self, stream_id: int, code: str, reason: str) -> bool:
        """Close a stream whose FIN this side queued before the peer's end: what is queued
        and the FIN go out first, then a RESET (this side reads no more; the peer may stop
        sending). A RESET alone goes out ahead of queued data and drops it, and a receiver
        discards what it buffered: a handler that answered and closed before its requester's
        end of stream lost its answer. False, with nothing done (the caller resets), unless
        the FIN is queued. Nothing is ever queued past the peer's credit (``send_data``), so
        the stream ends with the writer's next records whatever the peer does."""
        s = self._streams.get(stream_id)
        if s is None or s.state is not StreamState.OPEN or not s.fin_queued:
            return False
        if s.fin_sent:  # everything is out already: the RESET can go at once
            self.reset_stream(stream_id, code, reason)
            return True
        s.reset_after_fin = f.encode_frame(
            c.FRAME_RESET, stream_id, f.encode_reason(code, reason, self.limits)
        )
        self._window_due.pop(stream_id, None)  # nothing more is read: no credit is granted
        self._ready[stream_id] = None
        return True

    def reset_stream(self, stream_id: int, code: str, reason: str) -> None:
        if self._streams.pop(stream_id, None) is None:
            return
        self._window_due.pop(stream_id, None)
        self._queue_control(
            f.encode_frame(c.FRAME_RESET, stream_id, f.encode_reason(code, reason, self.limits))
        )

    def consumed(
        self,
        stream_id: int,
        nbytes: int,
        *,
        now_s: float | None = None,
        rtt_s: float | None = None,
    ) -> bool:
        """The application read ``nbytes`` of the stream: grant them back (coalesced). True
        when a window update is now due (the caller wakes its writer only then).

        With ``now_s`` and the link's ``rtt_s`` the window adapts to the bandwidth-delay
        product (QUIC receivers' rule): when half a window was consumed within
        two round trips of the previous update, the window, not the link or the reader, was
        the bottleneck, so it doubles (up to ``Limits.stream_window_max_bytes``) and the
        update carries the extra credit. A reader that falls behind never grows it."""
        s = self._streams.get(stream_id)
        if s is None or s.fin_received or s.reset_after_fin is not None:
            return False  # nothing more will arrive, or be read: no credit needed
        s.unacked += nbytes
        window = s.window or self.limits.stream_window_bytes
        # Grant when half the window is consumed: few updates, and the sender never idles.
        if s.unacked < window // 2:
            if s.granted_at is None and now_s is not None:
                # Reading began: the first update compares with this (QUIC: the stream's
                # start), so a long link's window grows one round trip sooner.
                s.granted_at = now_s
            return False
        grant = s.unacked
        if now_s is not None and rtt_s is not None:
            if s.granted_at is not None and now_s - s.granted_at < 2 * rtt_s:
                grown = min(2 * window, max(window, self.limits.stream_window_max_bytes))
                grant += grown - window
                window = grown
            s.granted_at = now_s
        s.window = window
        s.recv_window += grant
        self._window_due[stream_id] = self._window_due.get(stream_id, 0) + grant
        s.unacked = 0
        return True

    def receive_window(self, stream_id: int) -> int:
        """The receive window this side aims for on a stream (0 for an unknown stream)."""
        s = self._streams.get(stream_id)
        return 0 if s is None else (s.window or self.limits.stream_window_bytes)

    def ping(self, opaque: bytes) -> None:
        if len(opaque) != c.PING_PAYLOAD_BYTES:
            raise ProtocolError("malformed_frame", "a ping carries 8 bytes", fatal=False)
        self._queue_control(f.encode_frame(c.FRAME_PING, c.LINK_STREAM_ID, opaque))

    def send_link_message(self, payload: bytes) -> None:
        if len(payload) > self.limits.max_control_payload:
            raise ProtocolError(
                "message_too_large", f"a link message of {len(payload)} bytes", fatal=False
            )
        self._queue_control(f.encode_frame(c.FRAME_MESSAGE, c.LINK_STREAM_ID, payload))

    def go_away(self, code: str, reason: str) -> None:
        if self._going_away is None:
            self._going_away = (code, reason)
            self._queue_control(
                f.encode_frame(c.FRAME_GOAWAY, c.LINK_STREAM_ID, f.encode_reason(code, reason))
            )

    # --- output ----------------------------------------------------------------------------
    def has_output(self) -> bool:
        if self._control or self._window_due:
            return True
        return any(self._sendable(sid) for sid in self._ready)

    def next_record(self) -> bytes | None:
        """One record's plaintext (control frames first, then data round robin), or None."""
        limit = c.MAX_RECORD_PLAINTEXT
        parts: list[bytes | memoryview] = []
        size = 0
        for sid, inc in list(self._window_due.items()):
            self._control.append(f.encode_frame(c.FRAME_WINDOW, sid, f.encode_window(inc)))
            self._control_bytes += c.FRAME_HEADER_BYTES + c.WINDOW_PAYLOAD_BYTES
        self._window_due.clear()
        while self._control and size + len(self._control[0]) <= limit:
            frame = self._control.popleft()
            self._control_bytes -= len(frame)
            parts.append(frame)
            size += len(frame)
        rounds = len(self._ready)
        while self._ready and rounds > 0 and size + c.FRAME_HEADER_BYTES < limit:
            rounds -= 1
            sid = next(iter(self._ready))
            del self._ready[sid]
            s = self._streams.get(sid)
            if s is None or s.state is not StreamState.OPEN:
                continue
            if s.queued and s.send_credit > 0:
                room = min(limit - size - c.FRAME_HEADER_BYTES, s.send_credit)
                chunk = s.queued[0]
                if len(chunk) > room:
                    s.queued[0] = chunk[room:]
                    chunk = chunk[:room]
                else:
                    s.queued.popleft()
                s.queued_bytes -= len(chunk)
                s.send_credit -= len(chunk)
                parts.append(f.frame_header(c.FRAME_DATA, sid, len(chunk)))
                parts.append(chunk)
                size += c.FRAME_HEADER_BYTES + len(chunk)
            if (
                not s.queued
                and s.fin_queued
                and not s.fin_sent
                and size + c.FRAME_HEADER_BYTES <= limit
            ):
                s.fin_sent = True
                parts.append(f.frame_header(c.FRAME_CLOSE, sid, 0))
                size += c.FRAME_HEADER_BYTES
                if s.reset_after_fin is not None:  # ``finish_then_reset``: the RESET next
                    del self._streams[sid]
                    self._window_due.pop(sid, None)
                    self._queue_control(s.reset_after_fin)
                else:
                    self._maybe_forget(s)
            elif self._sendable(sid):
                self._ready[sid] = None
        if not parts:
            return None
        return b"".join(parts)

    def _sendable(self, sid: int) -> bool:
        s = self._streams.get(sid)
        if s is None or s.state is not StreamState.OPEN:
            return False
        return bool(s.queued and s.send_credit > 0) or (
            s.fin_queued and not s.fin_sent and not s.queued
        )

    # --- input -----------------------------------------------------------------------------
    def receive(self, plaintext: bytes) -> list[Event]:
        """Events for one record's plaintext. Violations raise ``ProtocolError`` (fatal)."""
        events: list[Event] = []
        # A DATA payload of at least half the record is handed on as a view (no copy); a
        # smaller one is copied, so that buffered views never pin more than twice the bytes
        # the stream window admits (a record of 1 data byte and 64 KiB of other frames).
        self._view_min = (len(plaintext) + 1) // 2
        for frame in f.decode_frames(plaintext, self.limits):
            self._on_frame(frame, events)
        return events

    def _on_frame(self, frame: f.Frame, events: list[Event]) -> None:
        t, sid, payload = frame.type, frame.stream_id, frame.payload
        if t in (c.FRAME_PING, c.FRAME_PONG, c.FRAME_MESSAGE, c.FRAME_GOAWAY):
            if sid != c.LINK_STREAM_ID:
                raise ProtocolError("malformed_frame", f"link frame {t:#x} on stream {sid}")
            if t == c.FRAME_PING:
                if len(payload) != c.PING_PAYLOAD_BYTES:
                    raise ProtocolError("malformed_frame", "a ping carries 8 bytes")
                self._queue_control(f.encode_frame(c.FRAME_PONG, 0, payload))
            elif t == c.FRAME_PONG:
                if len(payload) != c.PING_PAYLOAD_BYTES:
                    raise ProtocolError("malformed_frame", "a pong carries 8 bytes")
                events.append(PongReceived(bytes(payload)))
            elif t == c.FRAME_MESSAGE:
                events.append(LinkMessageReceived(bytes(payload)))
            else:
                code, reason = f.decode_reason(payload, self.limits)
                events.append(GoAwayReceived(code, reason))
            return
        if sid == c.LINK_STREAM_ID:
            raise ProtocolError("malformed_frame", f"stream frame {t:#x} on the link id 0")
        if t == c.FRAME_OPEN:
            self._on_open(sid, payload, events)
            return
        s = self._streams.get(sid)
        if s is None:
            self._check_known_id(sid)
            return  # a late frame for a stream we already reset or finished: drop it
        if t == c.FRAME_DATA:
            # A violation confined to one stream resets that stream only; a
            # credit violation stays fatal (the peer's flow control is broken).
            if s.state is not StreamState.OPEN:
                self._stream_error(sid, f"data on stream {sid} before it is open", events)
                return
            if s.fin_received:
                self._stream_error(sid, f"data on stream {sid} after its end", events)
                return
            if len(payload) > s.recv_window:
                raise ProtocolError(
                    "flow_control",
                    f"stream {sid} received {len(payload)} bytes with {s.recv_window} of credit",
                )
            s.recv_window -= len(payload)
            if payload:
                data = payload if len(payload) >= self._view_min else bytes(payload)
                events.append(DataReceived(sid, data))
        elif t == c.FRAME_ACCEPT:
            if not s.local or s.state is not StreamState.OPENING or payload:
                self._stream_error(sid, f"unexpected ACCEPT for stream {sid}", events)
                return
            s.state = StreamState.OPEN
            events.append(StreamAccepted(sid))
            if s.queued or s.fin_queued:
                self._ready[sid] = None
        elif t == c.FRAME_WINDOW:
            inc = f.decode_window(payload)
            if s.send_credit + inc > 2**31:
                raise ProtocolError("flow_control", f"stream {sid}'s credit overflows")
            s.send_credit += inc
            self._ready[sid] = None
            events.append(CreditAvailable(sid))
        elif t == c.FRAME_CLOSE:
            if payload or s.fin_received or s.state is not StreamState.OPEN:
                self._stream_error(sid, f"unexpected CLOSE for stream {sid}", events)
                return
            s.fin_received = True
            events.append(StreamEnded(sid))
            self._maybe_forget(s)
        elif t == c.FRAME_RESET:
            code, reason = f.decode_reason(payload, self.limits)
            del self._streams[sid]
            self._window_due.pop(sid, None)
            events.append(StreamReset(sid, code, reason))

    def _on_open(self, sid: int, payload: bytes | memoryview, events: list[Event]) -> None:
        if sid % 2 != self._remote_parity or sid <= self._highest_remote:
            raise ProtocolError("stream_state", f"stream id {sid} cannot be opened by the peer")
        self._highest_remote = sid
        if self._going_away is not None:
            self._refuse(sid, "link_closing", "the link is going away", events)
            return
        if self.live_streams(local=False) >= self.limits.max_streams_per_link:
            self._refuse(
                sid,
                "stream_limit",
                f"at most {self.limits.max_streams_per_link} streams per link",
                events,
            )
            return
        try:
            open_ = f.decode_open(payload, self.limits)
        except ProtocolError as exc:
            self._refuse(sid, exc.code, exc.message, events)
            return
        self._streams[sid] = _Stream(
            sid,
            False,
            StreamState.PENDING,
            self.limits.stream_window_bytes,
            self.limits.stream_window_bytes,
        )
        events.append(StreamOpenRequested(sid, open_))

    def _stream_error(self, sid: int, reason: str, events: list[Event]) -> None:
        """A protocol error on one stream: reset it (both sides learn why); the link lives."""
        self.reset_stream(sid, "stream_state", reason)
        events.append(StreamReset(sid, "stream_state", reason))

    def _refuse(self, sid: int, code: str, reason: str, events: list[Event]) -> None:
        self._queue_control(
            f.encode_frame(c.FRAME_RESET, sid, f.encode_reason(code, reason, self.limits))
        )
        events.append(StreamOpenRefused(sid, code, reason))

    def _check_known_id(self, sid: int) -> None:
        local = sid % 2 != self._remote_parity
        if (local and sid >= self._next_local) or (not local and sid > self._highest_remote):
            raise ProtocolError("stream_state", f"frame for stream {sid}, which was never opened")

    def _maybe_forget(self, s: _Stream) -> None:
        if s.fin_sent and s.fin_received:
            self._streams.pop(s.stream_id, None)
            self._window_due.pop(s.stream_id, None)

    def _queue_control(self, frame: bytes) -> None:
        self._control.append(frame)
        self._control_bytes += len(frame)
        if self._control_bytes > self.limits.max_control_backlog_bytes:
            raise ProtocolError(
                "peer_not_reading",
                f"over {self.limits.max_control_backlog_bytes} bytes of control frames queued "
                "for a peer that does not read them",
            )

    def _require(self, stream_id: int) -> _Stream:
        s = self._streams.get(stream_id)
        if s is None:
            raise ProtocolError("stream_closed", f"stream {stream_id} is closed", fatal=False)
        return s
