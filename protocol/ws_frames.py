"""RFC 6455 WebSocket frames, both ways, sans-IO: the frames a link sends (built in one buffer,
masked in place) and a parser for the frames it receives (bytes in, messages and control frames
out). The opening handshake is ``protocol.ws_upgrade``, the closing one ``protocol.ws_close``;
``mesh_node.websocket`` moves the bytes.

Sending: a link's writer already joins its Noise records into one buffer, so the frame header
goes in front of them in the same pass and a dialer's frame is masked in place with numpy
(section 5.3): one buffer per message, written whole. Every data message is one unfragmented
frame (FIN, no RSV bits: links negotiate no extension).

Receiving (``FrameParser``): a binary message's payload is delivered as a view of the bytes read
when one read holds the whole frame, else joined once; a client's masking is undone in place.
Control frames (ping, pong, close) come out whole and unmasked. Refused, each a
``FrameRefused`` (the connection closes with its ``close_code``; the parser parses nothing
more): a frame with a reserved bit set, a reserved opcode, a control frame that is fragmented
or longer than 125 bytes, a frame masked the wrong way for its direction (a server receives
masked frames only, a client unmasked ones), a continuation frame with no message begun or a
new message before the last one ended, a text message where only binary ones are taken (or one
that is not UTF-8), and a message longer than ``max_message_bytes`` (checked when its header
arrives, before any of its payload is kept). After a close frame nothing more is parsed.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

import numpy as np

from protocol.errors import ProtocolError
from protocol.handshake import SecureChannel

# Section 5.2: the first two bytes of a frame.
FIN: Final = 0x80
RSV: Final = 0x70
OPCODE: Final = 0x0F
MASK_BIT: Final = 0x80
LEN7: Final = 0x7F
# Section 11.8: opcodes.
OP_CONTINUATION: Final = 0x0
OP_TEXT: Final = 0x1
OP_BINARY: Final = 0x2
OP_CLOSE: Final = 0x8
OP_PING: Final = 0x9
OP_PONG: Final = 0xA
CONTROL_OPCODES: Final = frozenset({OP_CLOSE, OP_PING, OP_PONG})
DATA_OPCODES: Final = frozenset({OP_CONTINUATION, OP_TEXT, OP_BINARY})
MAX_CONTROL_PAYLOAD: Final = 125  # section 5.5
MASK_KEY_BYTES: Final = 4
MAX_HEADER_BYTES: Final = 14  # 2 + 8 (64-bit length) + 4 (masking key)
# Section 7.4.1: the close codes this codec sends itself.
CLOSE_NORMAL: Final = 1000
CLOSE_PROTOCOL_ERROR: Final = 1002
CLOSE_UNSUPPORTED_DATA: Final = 1003
CLOSE_NO_STATUS: Final = 1005  # never on the wire: a close frame without a code
CLOSE_ABNORMAL: Final = 1006  # never on the wire: the connection ended without a close frame
CLOSE_INVALID_DATA: Final = 1007
CLOSE_POLICY: Final = 1008
CLOSE_TOO_BIG: Final = 1009
# A frame's piece in one read smaller than this is copied rather than kept as a view of the
# read: a view's own object (~180 bytes) must not outweigh the bytes it stands for.
MIN_VIEW_BYTES: Final = 4096
_U16: Final = struct.Struct(">H")
_U64: Final = struct.Struct(">Q")

Payload = bytes | bytearray | memoryview


class FrameRefused(ProtocolError):
    """A frame the connection cannot take: a ``ProtocolError`` (``code`` for the link's close
    reason) with the WebSocket close code to send (RFC 6455 section 7.4.1)."""

    def __init__(self, code: str, message: str, close_code: int = CLOSE_PROTOCOL_ERROR) -> None:
        super().__init__(code, message)
        self.close_code = close_code


# --- sending --------------------------------------------------------------------------------
def frame_header(
    payload_len: int, mask_key: bytes | None = None, *, opcode: int = OP_BINARY
) -> bytes:
    """The header of one unfragmented frame of ``payload_len`` bytes (section 5.2), with the
    masking key appended when the frame is masked (a client's frames, 5.3)."""
    if payload_len < 0:
        raise ValueError("a negative payload length")
    if opcode in CONTROL_OPCODES and payload_len > MAX_CONTROL_PAYLOAD:
        raise ValueError(f"a control frame carries at most {MAX_CONTROL_PAYLOAD} bytes")
    b0 = FIN | opcode
    mask = MASK_BIT if mask_key is not None else 0
    if payload_len <= 125:
        head = bytes((b0, mask | payload_len))
    elif payload_len <= 0xFFFF:
        head = bytes((b0, mask | 126)) + _U16.pack(payload_len)
    else:
        head = bytes((b0, mask | 127)) + _U64.pack(payload_len)
    if mask_key is None:
        return head
    if len(mask_key) != MASK_KEY_BYTES:
        raise ValueError("a masking key is 4 bytes")
    return head + mask_key


def mask_in_place(buf: bytearray, start: int, key: bytes) -> None:
    """XOR ``buf[start:]`` with the repeated 4-byte ``key`` (section 5.3; its own inverse)."""
    n = len(buf) - start
    words = n // 4
    if words:
        view = np.frombuffer(buf, dtype=np.uint8, count=words * 4, offset=start).view(np.uint32)
        view ^= np.frombuffer(key, dtype=np.uint32)[0]
    for i in range(words * 4, n):
        buf[start + i] ^= key[i % 4]


def _frame_with(
    payload_len: int, masked: bool, write: Callable[[bytearray, int], object], opcode: int
) -> bytearray:
    """One frame of ``payload_len`` bytes in one buffer: its header, then the payload
    ``write(buf, at)`` puts at ``at``, masked in place for a client's frame (a fresh random
    key per frame, as section 5.3 requires)."""
    key = os.urandom(MASK_KEY_BYTES) if masked else None
    head = frame_header(payload_len, key, opcode=opcode)
    buf = bytearray(len(head) + payload_len)
    buf[: len(head)] = head
    write(buf, len(head))
    if key is not None:
        mask_in_place(buf, len(head), key)
    return buf


def frame(
    parts: list[bytes], payload_len: int, *, masked: bool, opcode: int = OP_BINARY
) -> bytearray:
    """One frame carrying ``parts`` joined (``payload_len`` bytes in all)."""

    def write(buf: bytearray, at: int) -> None:
        view = memoryview(buf)
        for part in parts:
            view[at : at + len(part)] = part
            at += len(part)

    return _frame_with(payload_len, masked, write, opcode)


def sealed_frame(
    channel: SecureChannel, records: list[bytes], *, masked: bool
) -> tuple[bytearray, int]:
    """One binary frame carrying ``records`` sealed by ``channel``, encrypted straight into
    the frame's buffer (``SecureChannel.seal_into``: no ciphertext allocated, nothing joined);
    with its payload's size. ``frame_too_large`` before any nonce is used."""
    size = channel.sealed_size(records)
    write = lambda buf, at: channel.seal_into(records, buf, at)  # noqa: E731
    return _frame_with(size, masked, write, OP_BINARY), size


def frame_overhead(payload_bytes: int, *, masked: bool) -> int:
    """Header bytes of one frame carrying ``payload_bytes`` (section 5.2)."""
    extended = 0 if payload_bytes < 126 else 2 if payload_bytes < 65536 else 8
    return 2 + extended + (MASK_KEY_BYTES if masked else 0)


# --- receiving ------------------------------------------------------------------------------
@dataclass(frozen=True)
class FrameHeader:
    fin: bool
    opcode: int
    mask_key: bytes | None
    length: int  # payload bytes
    size: int  # header bytes


def parse_header(buf: Payload, at: int) -> FrameHeader | None:
    """The frame header at ``buf[at:]``, or None while it is incomplete. Refuses what the
    header alone shows to be wrong (reserved bits, reserved opcodes, a bad control frame)."""
    have = len(buf) - at
    if have < 2:
        return None
    b0, b1 = buf[at], buf[at + 1]
    if b0 & RSV:
        raise FrameRefused("ws_protocol", "a WebSocket frame with a reserved bit set")
    opcode = b0 & OPCODE
    if opcode not in DATA_OPCODES and opcode not in CONTROL_OPCODES:
        raise FrameRefused("ws_protocol", f"a WebSocket frame with reserved opcode {opcode}")
    fin = bool(b0 & FIN)
    length = b1 & LEN7
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
        if length >> 63:
            raise FrameRefused("ws_protocol", "a WebSocket frame length with its top bit set")
        size = 10
    if opcode in CONTROL_OPCODES and (not fin or length > MAX_CONTROL_PAYLOAD):
        raise FrameRefused("ws_protocol", "a fragmented or oversize WebSocket control frame")
    key = None
    if b1 & MASK_BIT:
        if have < size + MASK_KEY_BYTES:
            return None
        key = bytes(buf[at + size : at + size + MASK_KEY_BYTES])
        size += MASK_KEY_BYTES
    return FrameHeader(fin, opcode, key, length, size)


class FrameParser:
    """The frames of one connection, in order. ``server``: this end accepted the connection
    (its peer's frames are masked). ``text``: text messages are taken (checked as UTF-8);
    else one is refused. Not thread-safe: one reader feeds it."""

    def __init__(self, *, server: bool, max_message_bytes: int, text: bool = False) -> None:
        self.server = server
        self.max_message_bytes = max_message_bytes
        self.text = text
        self.closed = False  # a close frame went by: nothing after it is parsed
        self._tail = bytearray()  # an incomplete header
        self._header: FrameHeader | None = None  # the frame whose payload is arriving
        # Its payload so far (``_keep``): pieces of at least MIN_VIEW_BYTES as views of the
        # reads, smaller ones copied together; and a fragmented message's payload so far, in
        # one buffer. So what a peer makes this end hold is about its payload's bytes, however
        # finely it cuts its frames or trickles its TCP segments (a view is ~180 bytes of
        # Python object, a 1-byte read's included).
        self._parts: list[memoryview | bytearray] = []
        self._got = 0
        self._message = bytearray()
        self._message_opcode: int | None = None  # the fragmented message's (text or binary)

    def feed(self, data: Payload) -> Iterator[tuple[int, Payload]]:
        """Parse ``data`` (the next bytes read), lazily: ``(opcode, payload)`` for each whole
        message (``OP_BINARY``, or ``OP_TEXT`` with its UTF-8 bytes) and each control frame
        (``OP_PING``, ``OP_PONG``, ``OP_CLOSE`` with its unmasked payload), in the order they
        came; one at a time, so a read full of tiny frames never becomes a list of them.
        ``FrameRefused`` on a violation. Drain each generator before feeding the next read."""
        if self.closed:
            return
        view = memoryview(data)
        at = 0
        while at < len(view):
            header = self._header
            if header is None:
                if self._tail:  # finish the header begun in an earlier read
                    take = min(len(view) - at, MAX_HEADER_BYTES - len(self._tail))
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
            take = min(len(view) - at, header.length - self._got)
            if take:
                self._keep(view[at : at + take], take == header.length)
                self._got += take
                at += take
            if self._got == header.length:
                done = self._finish(header)
                if done is not None:
                    yield done
                if header.opcode == OP_CLOSE:  # nothing may follow a close frame
                    return

    def _begin(self, header: FrameHeader) -> None:
        masked = header.mask_key is not None
        if masked != self.server:
            raise FrameRefused(
                "ws_protocol",
                "an unmasked WebSocket frame from a client"
                if self.server
                else "a masked WebSocket frame from a server",
            )
        op = header.opcode
        if op == OP_TEXT and not self.text:
            raise FrameRefused("malformed_record", "a text WebSocket message")
        if op == OP_CONTINUATION and self._message_opcode is None:
            raise FrameRefused("ws_protocol", "a WebSocket continuation frame with no message")
        if op in (OP_TEXT, OP_BINARY) and self._message_opcode is not None:
            raise FrameRefused("ws_protocol", "a WebSocket message began inside another")
        if (
            op not in CONTROL_OPCODES
            and len(self._message) + header.length > self.max_message_bytes
        ):
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

    def _finish(self, header: FrameHeader) -> tuple[int, Payload] | None:
        """The frame is complete: a control frame, a message, or None (a fragment)."""
        parts, self._header, self._parts, self._got = self._parts, None, [], 0
        payload: Payload
        if header.mask_key is not None:
            payload = bytearray().join(parts)
            mask_in_place(payload, 0, header.mask_key)
        elif len(parts) == 1:
            payload = parts[0]  # a view of the read (no copy), or the small pieces' copy
        else:
            payload = b"".join(parts)
        op = header.opcode
        if op in CONTROL_OPCODES:
            if op == OP_CLOSE:
                self.closed = True
            return op, bytes(payload)
        if not header.fin or self._message_opcode is not None:
            if self._message_opcode is None:
                self._message_opcode = op
            self._message += payload
            if not header.fin:
                return None
            op, payload, self._message = self._message_opcode, self._message, bytearray()
            self._message_opcode = None
        if op == OP_TEXT:
            try:
                bytes(payload).decode("utf-8")
            except UnicodeDecodeError:
                raise FrameRefused(
                    "ws_invalid_text",
                    "a text WebSocket message that is not UTF-8",
                    CLOSE_INVALID_DATA,
                ) from None
        return op, payload
