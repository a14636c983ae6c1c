"""Binary WebSocket messages of a link, framed here and written straight to the connection's
stream (issue #25 item 4: the link near the machine).

trio-websocket sends a message through wsproto, which copies a 1 MiB payload five times on
its way to the socket (``bytearray(payload)``, ``header + payload``, ``bytearray(...)`` and two
``data += ...`` into fresh ``bytes``) and, on the dialer's side, masks it in pure Python
(~1.8 ms/MiB measured). A link's writer already joins its Noise records into one buffer, so it
joins the frame header in front of them in the same pass, masks (dialer only) in place with
numpy, and writes that buffer under trio-websocket's own send lock. The bytes on the wire are
exactly the RFC 6455 binary frame wsproto would write (FIN, no RSV bits, no extensions are
negotiated on links), so nothing is versioned: a peer cannot tell the difference.

This reaches into trio-websocket's connection (its stream, send lock, close reason and wsproto
state). ``DirectSender.attach`` checks that all of it is there and that no extension was
negotiated, and returns None otherwise: the link then sends through ``send_message``.

``send_now`` (issues #21/#25: the per-hop cost of a decode frame) writes a message without a
scheduler pass: when nobody holds the send lock and nothing is left over, one non-blocking
``send`` on the socket from the calling task, so a small frame leaves when its sender queues
it instead of after the link's writer task has been woken, taken the lock and written (two
or three passes of trio's scheduler, ~30 µs of Python each). What the kernel does not take
at once is kept (``unsent``) and written by the link's writer before anything else, so the
byte stream is exactly what ``send`` would have written, in the same order.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection
from wsproto.connection import ConnectionState

from protocol.handshake import SecureChannel

# RFC 6455 section 5.2: FIN + opcode 2 (binary); payload length 7 bits, 126 + u16 or 127 + u64.
_FIN_BINARY: Final = 0x82
_MASK_BIT: Final = 0x80
_U16: Final = struct.Struct(">H")
_U64: Final = struct.Struct(">Q")
MASK_KEY_BYTES: Final = 4


def frame_header(payload_len: int, mask_key: bytes | None = None) -> bytes:
    """The header of one unfragmented binary frame of ``payload_len`` bytes (RFC 6455 5.2),
    with the masking key appended when the frame is masked (a client's frames, 5.3)."""
    if payload_len < 0:
        raise ValueError("a negative payload length")
    mask = _MASK_BIT if mask_key is not None else 0
    if payload_len <= 125:
        head = bytes((_FIN_BINARY, mask | payload_len))
    elif payload_len <= 0xFFFF:
        head = bytes((_FIN_BINARY, mask | 126)) + _U16.pack(payload_len)
    else:
        head = bytes((_FIN_BINARY, mask | 127)) + _U64.pack(payload_len)
    if mask_key is None:
        return head
    if len(mask_key) != MASK_KEY_BYTES:
        raise ValueError("a masking key is 4 bytes")
    return head + mask_key


def mask_in_place(buf: bytearray, start: int, key: bytes) -> None:
    """XOR ``buf[start:]`` with the repeated 4-byte ``key`` (RFC 6455 5.3; its own inverse)."""
    n = len(buf) - start
    words = n // 4
    if words:
        view = np.frombuffer(buf, dtype=np.uint8, count=words * 4, offset=start).view(np.uint32)
        view ^= np.frombuffer(key, dtype=np.uint32)[0]
    for i in range(words * 4, n):
        buf[start + i] ^= key[i % 4]


def _frame_with(
    payload_len: int, masked: bool, write: Callable[[bytearray, int], object]
) -> bytearray:
    """One binary frame of ``payload_len`` bytes in one buffer: its header, then the payload
    ``write(buf, at)`` puts at ``at``, masked in place for a client's frame."""
    key = os.urandom(MASK_KEY_BYTES) if masked else None
    head = frame_header(payload_len, key)
    buf = bytearray(len(head) + payload_len)
    buf[: len(head)] = head
    write(buf, len(head))
    if key is not None:
        mask_in_place(buf, len(head), key)
    return buf


def frame(parts: list[bytes], payload_len: int, *, masked: bool) -> bytearray:
    """One binary frame carrying ``parts`` joined (``payload_len`` bytes in all)."""

    def write(buf: bytearray, at: int) -> None:
        view = memoryview(buf)
        for part in parts:
            view[at : at + len(part)] = part
            at += len(part)

    return _frame_with(payload_len, masked, write)


def sealed_frame(
    channel: SecureChannel, records: list[bytes], *, masked: bool
) -> tuple[bytearray, int]:
    """One binary frame carrying ``records`` sealed by ``channel``, encrypted straight into
    the frame's buffer (``SecureChannel.seal_into``: no ciphertext allocated, nothing joined);
    with its payload's size. ``frame_too_large`` before any nonce is used."""
    size = channel.sealed_size(records)
    return _frame_with(size, masked, lambda buf, at: channel.seal_into(records, buf, at)), size


class DirectSender:
    """Writes a link's binary messages as whole frames on ``ws``'s stream (see the module)."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self.masked: bool = bool(ws.is_client)
        # The connection's socket for ``send_now`` (None: only ``send``, through trio).
        self._sock = _raw_socket(ws._stream)
        # The tail of a message ``send_now`` began: written first by ``send``/``flush``.
        self.unsent: memoryview | None = None

    @classmethod
    def attach(cls, ws: WebSocketConnection) -> DirectSender | None:
        """A sender for ``ws``, or None where its internals are not what this was written for
        (another trio-websocket version, or an extension that would change the frames)."""
        raw: Any = ws
        try:
            proto = raw._wsproto.connection._proto
            ok = (
                hasattr(raw, "_stream")
                and hasattr(raw, "_stream_lock")
                and hasattr(raw, "_close_reason")
                and hasattr(raw, "_abort_web_socket")
                and not proto.extensions
                and isinstance(raw.is_client, bool)
            )
        except AttributeError:
            return None
        return cls(ws) if ok else None

    def can_send_now(self) -> bool:
        """``send_now`` may write: nobody is sending on the connection (the lock is free and
        nothing is left over), and it is open."""
        ws = self._ws
        return (
            self._sock is not None
            and self.unsent is None
            and not ws._stream_lock.locked()
            and not ws._close_reason
            and ws._wsproto.state is ConnectionState.OPEN
        )

    def send_now(self, data: bytearray) -> bool:
        """Write ``data``, one whole frame (``frame``, ``sealed_frame``, masked as
        ``self.masked`` says), from this task, without waiting (callers check
        ``can_send_now`` first, in the same scheduler step). True if the kernel took all of
        it; else the rest is ``unsent`` and the caller has ``flush`` called (a broken
        connection is reported there, by trio's own send)."""
        if self._sock is None or self.unsent is not None:
            raise RuntimeError("send_now without can_send_now in the same scheduler step")
        try:
            sent = self._sock.send(data)
        except OSError:  # full (BlockingIOError) or broken: ``flush`` retries and reports
            sent = 0
        if sent == len(data):
            return True
        self.unsent = memoryview(data)[sent:]
        return False

    async def flush(self) -> None:
        """Write what ``send_now`` left over; raises what ``send_message`` would."""
        if self.unsent is None:
            return
        ws = self._ws
        async with ws._stream_lock:
            try:
                await ws._stream.send_all(self.unsent)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await ws._abort_web_socket()
                raise ConnectionClosed(ws._close_reason) from None
            self.unsent = None

    async def send(self, data: bytearray) -> None:
        """Send ``data``, one whole frame (as ``send_now``); raises what ``send_message``
        would."""
        await self.flush()
        ws = self._ws
        if ws._close_reason:
            raise ConnectionClosed(ws._close_reason)
        if ws._wsproto.state is not ConnectionState.OPEN:
            # Closing: let trio-websocket and wsproto say so (wsproto sends no message in any
            # state but OPEN, so what is passed never reaches the wire).
            await ws.send_message(b"")
            return
        async with ws._stream_lock:
            try:
                await ws._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await ws._abort_web_socket()
                raise ConnectionClosed(ws._close_reason) from None


def _raw_socket(stream: Any) -> socket.socket | None:
    """The non-blocking socket under a trio ``SocketStream`` (or a ``BudgetedStream`` over
    one, ``mesh_node.transport``), or None for any other stream."""
    inner = getattr(stream, "inner", stream)
    if not isinstance(inner, trio.SocketStream):
        return None
    sock = getattr(inner.socket, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None
