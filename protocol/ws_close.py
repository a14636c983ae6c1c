"""The WebSocket closing handshake (RFC 6455 sections 5.5.1, 7), sans-IO: close frames' payloads
both ways, checked, and who has said what.

Each end sends one close frame at most. An end that receives a close frame it did not start
answers with one (echoing the code) and sends nothing after it; an end that started waits for
the answer, reading and dropping data until then. A close payload is empty or a 2-byte code and
a UTF-8 reason of at most 123 bytes. Codes 1005, 1006 and 1015 are never sent; a payload of
one byte, a code outside 1000-1003, 1007-1014 and 3000-4999, or a reason that is not UTF-8 is
refused (1002, 1007).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from protocol.ws_frames import (
    CLOSE_INVALID_DATA,
    CLOSE_NO_STATUS,
    CLOSE_NORMAL,
    MAX_CONTROL_PAYLOAD,
    FrameRefused,
)

_CODE: Final = struct.Struct(">H")
MAX_REASON_BYTES: Final = MAX_CONTROL_PAYLOAD - _CODE.size
# Section 7.4.1 and the IANA registry: codes an endpoint may put in a close frame.
_SENDABLE: Final = frozenset({1000, 1001, 1002, 1003, *range(1007, 1015)})


@dataclass(frozen=True)
class CloseReason:
    """Why a WebSocket closed: the code (1005: the close frame had none; 1006: the connection
    ended without one) and the peer's reason text."""

    code: int
    reason: str = ""


def sendable(code: int) -> bool:
    """Whether ``code`` may appear in a close frame (section 7.4)."""
    return code in _SENDABLE or 3000 <= code <= 4999


def close_payload(code: int, reason: str = "") -> bytes:
    """The payload of a close frame: ``code`` and ``reason``, cut to 123 bytes of UTF-8 on a
    character boundary. ``ValueError`` for a code no endpoint may send."""
    if not sendable(code):
        raise ValueError(f"close code {code} may not be sent (RFC 6455 section 7.4)")
    data = reason.encode("utf-8")
    if len(data) > MAX_REASON_BYTES:
        data = data[:MAX_REASON_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return _CODE.pack(code) + data


def parse_close(payload: bytes) -> CloseReason:
    """The code and reason in a received close frame's payload; ``FrameRefused`` for one a
    peer may not send."""
    if not payload:
        return CloseReason(CLOSE_NO_STATUS)
    if len(payload) < _CODE.size:
        raise FrameRefused("ws_protocol", "a WebSocket close frame with a 1-byte payload")
    (code,) = _CODE.unpack_from(payload)
    if not sendable(code):
        raise FrameRefused("ws_protocol", f"a WebSocket close frame with code {code}")
    try:
        reason = payload[_CODE.size :].decode("utf-8")
    except UnicodeDecodeError:
        raise FrameRefused(
            "ws_invalid_text", "a WebSocket close reason that is not UTF-8", CLOSE_INVALID_DATA
        ) from None
    return CloseReason(code, reason)


class ClosingHandshake:
    """One connection's closing handshake: which close frames went each way."""

    def __init__(self) -> None:
        self.sent: CloseReason | None = None
        self.received: CloseReason | None = None

    @property
    def done(self) -> bool:
        """Both close frames went: the TCP connection may go."""
        return self.sent is not None and self.received is not None

    def start(self, code: int, reason: str = "") -> bytes | None:
        """Our close frame's payload, or None when one was sent already."""
        if self.sent is not None:
            return None
        payload = close_payload(code, reason)
        self.sent = CloseReason(code, reason)
        return payload

    def receive(self, payload: bytes) -> tuple[CloseReason, bytes | None]:
        """The peer's close frame arrived (``FrameRefused`` if malformed): why, and our
        answer's payload (its code echoed), or None when ours went first."""
        received = self.received = parse_close(payload)
        code = received.code
        return received, self.start(CLOSE_NORMAL if code == CLOSE_NO_STATUS else code)
