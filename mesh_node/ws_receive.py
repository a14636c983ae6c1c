"""A link's incoming WebSocket frames, taken off the socket here (issue #25 item 4: the link
near the machine; the receiving half of ``mesh_node.ws_frames``). Sans-IO: bytes in, messages
and control frames out.

trio-websocket hands every byte it reads to wsproto, which appends it to a buffer, copies each
frame's payload out of it, unmasks a client's frames in pure Python, and trio-websocket then
joins a message's parts: ~1.5-3 ms of CPU per MiB here, about what the link's own decryption,
demultiplexing and delivery cost together, and the largest single item on the receiving side
of a download. ``FrameTap`` parses RFC 6455 frames itself (section 5.2) from what the link's
``BudgetedStream`` reads: a binary message's payload is delivered as a view of the bytes read
when one read holds the whole frame, else joined once; a client's masking is undone in place
with numpy (section 5.3). Control frames (ping, pong, close) are passed on unchanged, whole, to
trio-websocket, which answers pings and runs the closing handshake as before; so the bytes
wsproto sees are a valid frame stream, and the connection's state stays trio-websocket's.

Refused, each a ``FrameRefused`` (the link closes; the tap parses nothing more): a frame with
a reserved bit set (no extension is negotiated on links), a reserved opcode, a control frame
that is fragmented or longer than 125 bytes, a frame masked the wrong way for its direction
(a server receives masked frames only, a client unmasked ones), a continuation frame with no
message begun or a new message before the last one ended, a text message (links carry binary
Noise records only), and a message longer than ``max_message_bytes`` (its length is checked
when its header arrives, before any of its payload is kept). After a close frame every later
byte is passed on as it is: the closing handshake is trio-websocket's.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from mesh_node.ws_frames import MASK_KEY_BYTES, mask_in_place
from protocol.errors import ProtocolError

# RFC 6455 section 5.2
_FIN: Final = 0x80
_RSV: Final = 0x70
_OPCODE: Final = 0x0F
_MASK: Final = 0x80
_LEN7: Final = 0x7F
OP_CONTINUATION: Final = 0x0
OP_TEXT: Final = 0x1
OP_BINARY: Final = 0x2
OP_CLOSE: Final = 0x8
OP_PING: Final = 0x9
OP_PONG: Final = 0xA
_CONTROL: Final = frozenset({OP_CLOSE, OP_PING, OP_PONG})
MAX_CONTROL_PAYLOAD: Final = 125
# A frame's piece in one read smaller than this is copied rather than kept as a view of the
# read: a view's own object (~180 bytes) must not outweigh the bytes it stands for.
MIN_VIEW_BYTES: Final = 4096
_U16: Final = struct.Struct(">H")
_U64: Final = struct.Struct(">Q")
CLOSE_PROTOCOL_ERROR: Final = 1002  # RFC 6455 section 7.4.1
CLOSE_TOO_BIG: Final = 1009


class FrameRefused(ProtocolError):
    """A frame the link cannot take: a ``ProtocolError`` (``code`` for the link's close reason)
    with the WebSocket close code the link sends (RFC 6455 section 7.4.1)."""

    def __init__(self, code: str, message: str, close_code: int = CLOSE_PROTOCOL_ERROR) -> None:
        super().__init__(code, message)
        self.close_code = close_code


@dataclass(frozen=True)
class _Header:
    fin: bool
    opcode: int
    mask_key: bytes | None
    length: int  # payload bytes
    size: int  # header bytes


def parse_header(buf: bytes | bytearray | memoryview, at: int) -> _Header | None:
    """The frame header at ``buf[at:]``, or None while it is incomplete. Refuses what the
    header alone shows to be wrong (reserved bits, reserved opcodes, a bad control frame)."""
    have = len(buf) - at
    if have < 2:
        return None
    b0, b1 = buf[at], buf[at + 1]
    if b0 & _RSV:
        raise FrameRefused("ws_protocol", "a WebSocket frame with a reserved bit set")
    opcode = b0 & _OPCODE
    if opcode not in (OP_CONTINUATION, OP_TEXT, OP_BINARY) and opcode not in _CONTROL:
        raise FrameRefused("ws_protocol", f"a WebSocket frame with reserved opcode {opcode}")
    fin = bool(b0 & _FIN)
    length = b1 & _LEN7
    size = 2
    if length == 126:
        if have < 4:
            return None
        (length,) = _U16.unpack_from(buf, at + 2)
        size = 4
    elif length == 127:
        if have < 10:
            return None
        (length,) = _U64.unpack_from(buf, at + 2)
        size = 10
    if opcode in _CONTROL and (not fin or length > MAX_CONTROL_PAYLOAD):
        raise FrameRefused("ws_protocol", "a fragmented or oversize WebSocket control frame")
    key = None
    if b1 & _MASK:
        if have < size + MASK_KEY_BYTES:
            return None
        key = bytes(buf[at + size : at + size + MASK_KEY_BYTES])
        size += MASK_KEY_BYTES
    return _Header(fin, opcode, key, length, size)


class FrameTap:
    """The frames of one connection, in order. ``server``: this end accepted the connection
    (its peer's frames are masked). Not thread-safe: one reader feeds it."""

    def __init__(self, *, server: bool, max_message_bytes: int) -> None:
        self.server = server
        self.max_message_bytes = max_message_bytes
        self.closed = False  # a close frame went by: later bytes pass through unparsed
        self._tail = bytearray()  # an incomplete header
        self._header: _Header | None = None  # the frame whose payload is arriving
        # Its payload so far (``_keep``): pieces of at least MIN_VIEW_BYTES as views of the
        # reads, smaller ones copied together; and a fragmented message's payload so far, in
        # one buffer. So what a peer makes this end hold is about its payload's bytes, however
        # finely it cuts its frames or trickles its TCP segments (a view is ~180 bytes of
        # Python object, a 1-byte read's included).
        self._parts: list[memoryview | bytearray] = []
        self._got = 0
        self._message = bytearray()
        self._in_message = False

    def feed(self, data: bytes) -> Iterator[tuple[bool, bytes | bytearray | memoryview]]:
        """Parse ``data`` (the next bytes read), lazily: (True, a binary message's payload) or
        (False, control-frame bytes for trio-websocket), in the order they came; one item at a
        time, so a read full of tiny frames never becomes a list of them. ``FrameRefused`` on
        a violation. Drain each generator before feeding the next read."""
        if self.closed:
            yield False, data
            return
        view = memoryview(data)
        at = 0
        while at < len(view):
            if self._header is None:
                if self._tail:  # finish the header begun in an earlier read
                    take = min(len(view) - at, 14 - len(self._tail))
                    self._tail += view[at : at + take]
                    header = parse_header(self._tail, 0)
                    if header is None:
                        at += take
                        continue
                    at += header.size - (len(self._tail) - take)
                    del self._tail[:]
                else:
                    header = parse_header(view, at)
                    if header is None:
                        self._tail += view[at:]
                        return
                    at += header.size
                self._begin(header)
            header = self._header
            assert header is not None
            take = min(len(view) - at, header.length - self._got)
            if take:
                self._keep(view[at : at + take], take == header.length)
                self._got += take
                at += take
            if self._got == header.length:
                done = self._finish(header)
                if done is not None:
                    yield done
                if header.opcode == OP_CLOSE:  # later bytes are the closing handshake's
                    if at < len(view):
                        yield False, view[at:]
                    return

    def _begin(self, header: _Header) -> None:
        masked = header.mask_key is not None
        if masked != self.server:
            raise FrameRefused(
                "ws_protocol",
                "an unmasked WebSocket frame from a client"
                if self.server
                else "a masked WebSocket frame from a server",
            )
        op = header.opcode
        if op == OP_TEXT:
            raise FrameRefused("malformed_record", "a text WebSocket message")
        if op == OP_CONTINUATION and not self._in_message:
            raise FrameRefused("ws_protocol", "a WebSocket continuation frame with no message")
        if op == OP_BINARY and self._in_message:
            raise FrameRefused("ws_protocol", "a WebSocket message began inside another")
        if op not in _CONTROL and len(self._message) + header.length > self.max_message_bytes:
            raise FrameRefused(
                "ws_message_too_big",
                f"a WebSocket message over {self.max_message_bytes} bytes",
                CLOSE_TOO_BIG,
            )
        self._header, self._parts, self._got = header, [], 0

    def _keep(self, piece: memoryview, whole: bool) -> None:
        """One read's part of the frame's payload (``whole``: all of it, so it is not kept
        past this read's parse)."""
        parts = self._parts
        if whole or len(piece) >= MIN_VIEW_BYTES:
            parts.append(piece)
        elif parts and isinstance(parts[-1], bytearray):
            parts[-1] += piece
        else:
            parts.append(bytearray(piece))

    def _finish(self, header: _Header) -> tuple[bool, bytes | bytearray | memoryview] | None:
        """The frame is complete: a control frame's bytes, a message, or None (a fragment)."""
        parts, self._header, self._parts, self._got = self._parts, None, [], 0
        if header.opcode in _CONTROL:
            if header.opcode == OP_CLOSE:
                self.closed = True
            return False, _header_bytes(header) + b"".join(parts)
        payload: bytes | bytearray | memoryview
        if header.mask_key is not None:
            payload = bytearray().join(parts)
            mask_in_place(payload, 0, header.mask_key)
        elif len(parts) == 1:
            payload = parts[0]  # a view of the read (no copy), or the small pieces' copy
        else:
            payload = b"".join(parts)
        if not header.fin or self._in_message:
            self._message += payload
            self._in_message = not header.fin
            if not header.fin:
                return None
            payload, self._message = self._message, bytearray()
        return True, payload


def _header_bytes(header: _Header) -> bytes:
    """A control frame's header as it came (its payload stays masked as it came too)."""
    b0 = (_FIN if header.fin else 0) | header.opcode
    mask = _MASK if header.mask_key is not None else 0
    if header.length < 126:
        head = bytes((b0, mask | header.length))
    elif header.length < 1 << 16:
        head = bytes((b0, mask | 126)) + _U16.pack(header.length)
    else:
        head = bytes((b0, mask | 127)) + _U64.pack(header.length)
    return head + (header.mask_key or b"")
