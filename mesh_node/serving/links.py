"""Frames over one mesh stream (the I/O shell around ``skippy.stage.stage_frames``).

``FrameReader`` turns a stream's bytes into frames (the decoder refuses anything malformed);
``ChainSender`` sends a session's frames downstream with at most ``max_inflight`` frames not
yet acknowledged (early acknowledgement of prefill chunks: the receiver acks a chunk when it
takes it, before computing it, so the sender computes the next chunk while this one crosses the
link; a decode frame is acked once its output is on its way, since a session's next decode
frame waits for the token anyway), and measures each acknowledged frame's round trip (the
per-hop figure: for a decode frame it includes the receiving stage's step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import trio

from mesh_node.link import MeshStream
from skippy.stage import stage_frames as t

RTT_SAMPLES = 256  # per-hop latency samples kept (the most recent)


@dataclass
class HopStats:
    """Acknowledged frames on one hop: round trips (s) of the most recent, bytes sent."""

    rtts_s: deque[float] = field(default_factory=lambda: deque(maxlen=RTT_SAMPLES))
    decode_rtts_s: deque[float] = field(default_factory=lambda: deque(maxlen=RTT_SAMPLES))
    frames: int = 0
    bytes_sent: int = 0


class FrameReader:
    """Whole frames from a stream; ``None`` at the peer's clean end of stream. A malformed
    frame raises ``TransportError`` (the caller resets the stream with its code)."""

    def __init__(self, stream: MeshStream, decoder: t.FrameDecoder) -> None:
        self.stream = stream
        self.decoder = decoder
        self._pending: deque[t.Frame] = deque()

    async def next(self) -> t.Frame | None:
        while not self._pending:
            data = await self.stream.receive_some()
            if not data:
                self.decoder.eof()
                return None
            self._pending.extend(self.decoder.feed(data))
        return self._pending.popleft()


class ChainSender:
    """A session's frames to the next stage, under the in-flight cap."""

    def __init__(self, stream: MeshStream, max_inflight: int, stats: HopStats | None = None):
        self.stream = stream
        self.max_inflight = max_inflight
        self._slots = trio.Semaphore(max_inflight, max_value=max_inflight)
        self._sent: deque[tuple[float, bool]] = deque()  # (send time, decode?) awaiting ack
        self.stats = stats or HopStats()

    async def send(self, data: bytes) -> None:
        """A frame the receiver does not acknowledge (BEGIN, FREE)."""
        await self.stream.send_all(data)

    async def send_activations(self, data: bytes, *, decode: bool) -> None:
        """An activations frame: waits for a free in-flight slot first. A free slot is
        taken without a scheduler pass (``acquire`` always yields), so a decode frame goes
        out before the loop runs other tasks; ``send_all`` yields once it is written."""
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            await self._slots.acquire()
        self._sent.append((trio.current_time(), decode))
        await self.stream.send_all(data)
        self.stats.frames += 1
        self.stats.bytes_sent += len(data)

    async def read_acks(self) -> None:
        """Release a slot per ACK until the receiver ends its side; anything but ACK frames
        from downstream is a protocol violation."""
        reader = FrameReader(self.stream, t.FrameDecoder(width=0))
        while (frame := await reader.next()) is not None:
            if frame.kind is not t.Kind.ACK or not self._sent:
                raise t.TransportError(
                    f"a {frame.kind.name} frame where an ACK was due", code="transport_unexpected"
                )
            sent, decode = self._sent.popleft()
            rtt = trio.current_time() - sent
            self.stats.rtts_s.append(rtt)
            if decode:
                self.stats.decode_rtts_s.append(rtt)
            self._slots.release()

    async def finish(self) -> None:
        """FREE is sent by the caller; end our side."""
        await self.stream.send_eof()
