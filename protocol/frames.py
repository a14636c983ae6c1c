"""Frame codec: ``type u8 | flags u8 | stream id u32 | length u32 | payload`` (big endian).

A record's plaintext is a whole number of frames; ``decode_frames`` parses one plaintext and
raises only ``ProtocolError``. Payload-specific layouts (window increments, reset reasons, the
subprotocol open envelope) are encoded and decoded here too, so ``streams.py`` sees values.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack

from protocol import constants as c
from protocol.errors import ProtocolError

_HEADER = struct.Struct(">BBII")
_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")


@dataclass(frozen=True)
class Frame:
    type: int
    stream_id: int
    payload: bytes | memoryview = b""
    flags: int = 0


def encode_frame(ftype: int, stream_id: int, payload: bytes | memoryview = b"") -> bytes:
    return _HEADER.pack(ftype, 0, stream_id, len(payload)) + bytes(payload)


def frame_header(ftype: int, stream_id: int, length: int) -> bytes:
    return _HEADER.pack(ftype, 0, stream_id, length)


def decode_frames(plaintext: bytes, limits: c.Limits = c.DEFAULT_LIMITS) -> list[Frame]:
    """Every frame of one record's plaintext; payloads are zero-copy views into it."""
    view = memoryview(plaintext)
    frames: list[Frame] = []
    pos, end = 0, len(view)
    if end == 0:
        raise ProtocolError("malformed_frame", "an empty record carries no frame")
    while pos < end:
        if end - pos < c.FRAME_HEADER_BYTES:
            raise ProtocolError("malformed_frame", "a record ends inside a frame header")
        ftype, flags, sid, length = _HEADER.unpack_from(view, pos)
        pos += c.FRAME_HEADER_BYTES
        if ftype not in c.FRAME_TYPES:
            raise ProtocolError("unknown_frame_type", f"frame type {ftype:#x} is not defined")
        if flags != 0:
            raise ProtocolError("malformed_frame", f"frame flags {flags:#x} are reserved")
        limit = limits.max_frame_payload if ftype == c.FRAME_DATA else limits.max_control_payload
        if length > limit:
            raise ProtocolError(
                "frame_too_large",
                f"a frame of type {ftype:#x} declares {length} bytes (max {limit})",
            )
        if length > end - pos:
            raise ProtocolError("malformed_frame", "a frame's payload runs past its record")
        frames.append(Frame(ftype, sid, view[pos : pos + length]))
        pos += length
    return frames


# --- records: u16 length | Noise ciphertext, 1..N per WebSocket message --------------------------
def split_records(
    message: bytes | bytearray | memoryview, limits: c.Limits = c.DEFAULT_LIMITS
) -> list[memoryview]:
    """The ciphertext records of one WebSocket message (bounded count and sizes)."""
    if len(message) > limits.max_ws_message_bytes:
        raise ProtocolError(
            "message_too_large",
            f"a link message of {len(message)} bytes exceeds {limits.max_ws_message_bytes}",
        )
    view = memoryview(message)
    out: list[memoryview] = []
    pos, end = 0, len(view)
    while pos < end:
        if end - pos < c.RECORD_LENGTH_BYTES:
            raise ProtocolError("malformed_record", "a link message ends inside a record length")
        (length,) = _U16.unpack_from(view, pos)
        pos += c.RECORD_LENGTH_BYTES
        if length < c.NOISE_TAG_BYTES or length > end - pos:
            raise ProtocolError("malformed_record", f"a record declares {length} bytes")
        out.append(view[pos : pos + length])
        pos += length
        if len(out) > limits.max_records_per_message:
            raise ProtocolError(
                "message_too_large",
                f"a link message holds more than {limits.max_records_per_message} records",
            )
    if not out:
        raise ProtocolError("malformed_record", "an empty link message")
    return out


def record_prefix(ciphertext_len: int) -> bytes:
    return _U16.pack(ciphertext_len)


# --- payload layouts -------------------------------------------------------------------------
def encode_window(increment: int) -> bytes:
    return _U32.pack(increment)


def decode_window(payload: bytes | memoryview) -> int:
    if len(payload) != c.WINDOW_PAYLOAD_BYTES:
        raise ProtocolError("malformed_frame", "a window update carries exactly 4 bytes")
    (increment,) = _U32.unpack(payload)
    if increment == 0:
        raise ProtocolError("malformed_frame", "a window update of 0 bytes")
    return int(increment)


def encode_reason(code: str, reason: str, limits: c.Limits = c.DEFAULT_LIMITS) -> bytes:
    packed: bytes = msgpack.packb(
        [code[: limits.max_reason_chars], reason[: limits.max_reason_chars]]
    )
    return packed


def decode_reason(
    payload: bytes | memoryview, limits: c.Limits = c.DEFAULT_LIMITS
) -> tuple[str, str]:
    """A reset/goaway reason: ``[code, text]``; an empty payload means no reason given."""
    if len(payload) == 0:
        return "unspecified", ""
    value = unpack_bounded(bytes(payload), limits)
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, str) and len(v) <= limits.max_reason_chars for v in value)
    ):
        raise ProtocolError("malformed_frame", "a reason is [code, text] of bounded strings")
    return value[0], value[1]


def unpack_bounded(data: bytes, limits: c.Limits = c.DEFAULT_LIMITS) -> object:
    """msgpack with every length bounded (no huge preallocations from a 5-byte header)."""
    n = max(len(data), 1)
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=min(n, 4096),
            max_map_len=min(n, 1024),
            max_ext_len=0,
        )
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        raise ProtocolError("malformed_message", f"not a valid msgpack value: {exc}") from None


# --- the STREAM_SUBPROTOCOL open payload ---------------------------------------------------------
@dataclass(frozen=True)
class SubprotocolOpen:
    """``u16 length | msgpack {gen, name, major} | kind u8`` (mesh-llm's envelope shape)."""

    name: str
    major: int
    kind: int
    gen: int = c.ENVELOPE_GEN

    def encode(self) -> bytes:
        env: bytes = msgpack.packb({"gen": self.gen, "name": self.name, "major": self.major})
        return bytes([c.STREAM_SUBPROTOCOL]) + _U16.pack(len(env)) + env + bytes([self.kind])


def decode_open(
    payload: bytes | memoryview, limits: c.Limits = c.DEFAULT_LIMITS
) -> SubprotocolOpen:
    """Parse an OPEN frame's payload; only STREAM_SUBPROTOCOL streams exist today."""
    data = bytes(payload)
    if not data:
        raise ProtocolError("malformed_open", "an OPEN frame without a stream type", fatal=False)
    if data[0] != c.STREAM_SUBPROTOCOL:
        raise ProtocolError("unknown_stream_type", f"stream type {data[0]:#x}", fatal=False)
    if len(data) < 1 + c.ENVELOPE_LENGTH_BYTES:
        raise ProtocolError("malformed_open", "a subprotocol open without an envelope", fatal=False)
    (length,) = _U16.unpack_from(data, 1)
    start = 1 + c.ENVELOPE_LENGTH_BYTES
    if length > limits.max_envelope_bytes or len(data) != start + length + 1:
        raise ProtocolError(
            "malformed_open", "the envelope length does not match the OPEN payload", fatal=False
        )
    try:
        env = unpack_bounded(data[start : start + length], limits)
    except ProtocolError as exc:
        raise ProtocolError("malformed_open", exc.message, fatal=False) from None
    fields = {"gen", "name", "major"}
    if not isinstance(env, dict) or set(env) != fields:
        raise ProtocolError(
            "malformed_open", f"an envelope has exactly {sorted(fields)}", fatal=False
        )
    gen, name, major = env["gen"], env["name"], env["major"]
    if (
        not isinstance(gen, int)
        or isinstance(gen, bool)
        or not isinstance(major, int)
        or isinstance(major, bool)
        or not isinstance(name, str)
        or not 0 < len(name) <= 64
    ):
        raise ProtocolError("malformed_open", "envelope field types are wrong", fatal=False)
    if gen != c.ENVELOPE_GEN:
        raise ProtocolError("unsupported_envelope", f"envelope generation {gen}", fatal=False)
    return SubprotocolOpen(name=name, major=major, kind=data[-1], gen=gen)
