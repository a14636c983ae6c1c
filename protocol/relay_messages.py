"""The relay's circuit setup messages (sans-IO): what a dialer asks of a relay, what the relay
offers the target, and their answers. After an ``ok`` the stream carries the two ends' bytes
(an ordinary WebSocket and Noise handshake), which the relay copies without reading.

Each message is one length-prefixed msgpack map on the stream (``messages.frame_message``):

- dialer -> relay (kind ``KIND_CIRCUIT_CONNECT``): ``{t: "connect", gen, target: <32 bytes>}``;
- relay -> target (kind ``KIND_CIRCUIT_INCOMING``): ``{t: "incoming", gen, source: <32 bytes>}``;
- either answer: ``{t: "ok", gen}`` or ``{t: "refused", gen, code, reason}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import msgpack

from protocol import constants as c
from protocol.errors import ProtocolError
from protocol.frames import unpack_bounded

MAX_CODE_CHARS: Final = 64


@dataclass(frozen=True)
class CircuitConnect:
    target: bytes  # the node id the dialer wants to reach


@dataclass(frozen=True)
class CircuitIncoming:
    source: bytes  # the node id of the dialer, as the relay authenticated it


@dataclass(frozen=True)
class CircuitOk:
    pass


@dataclass(frozen=True)
class CircuitRefused:
    code: str
    reason: str


CircuitMessage = CircuitConnect | CircuitIncoming | CircuitOk | CircuitRefused


def encode(message: CircuitMessage) -> bytes:
    doc: dict[str, object] = {"gen": c.MESSAGE_GEN}
    if isinstance(message, CircuitConnect):
        doc.update(t="connect", target=message.target)
    elif isinstance(message, CircuitIncoming):
        doc.update(t="incoming", source=message.source)
    elif isinstance(message, CircuitOk):
        doc.update(t="ok")
    else:
        doc.update(t="refused", code=message.code, reason=message.reason)
    out: bytes = msgpack.packb(doc, use_bin_type=True)
    return out


def _fail(message: str) -> ProtocolError:
    return ProtocolError("bad_circuit_message", message)


def _node_id(value: object, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != c.KEY_BYTES:
        raise _fail(f"{what} must be {c.KEY_BYTES} bytes")
    return value


def _text(value: object, what: str, most: int) -> str:
    if not isinstance(value, str) or len(value) > most:
        raise _fail(f"{what} must be a string of at most {most} characters")
    return value


def decode(payload: bytes, limits: c.Limits = c.DEFAULT_LIMITS) -> CircuitMessage:
    """One setup message; ``ProtocolError`` (code ``bad_circuit_message``) for anything else."""
    if len(payload) > limits.max_control_payload:
        raise ProtocolError("message_too_large", f"a circuit message of {len(payload)} bytes")
    data = unpack_bounded(payload, limits)
    if not isinstance(data, dict) or data.get("gen") != c.MESSAGE_GEN:
        raise _fail(f"a circuit message is a map of generation {c.MESSAGE_GEN}")
    kind = data.get("t")
    keys = {
        "connect": {"t", "gen", "target"},
        "incoming": {"t", "gen", "source"},
        "ok": {"t", "gen"},
        "refused": {"t", "gen", "code", "reason"},
    }.get(kind if isinstance(kind, str) else "")
    if keys is None or set(data) != keys:
        raise _fail(f"unknown circuit message or fields: {kind!r}")
    if kind == "connect":
        return CircuitConnect(_node_id(data["target"], "target"))
    if kind == "incoming":
        return CircuitIncoming(_node_id(data["source"], "source"))
    if kind == "ok":
        return CircuitOk()
    return CircuitRefused(
        _text(data["code"], "code", MAX_CODE_CHARS),
        _text(data["reason"], "reason", limits.max_reason_chars),
    )
