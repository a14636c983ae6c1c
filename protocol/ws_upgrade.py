"""The WebSocket opening handshake (RFC 6455 section 4), sans-IO: the HTTP/1.1 upgrade request a
dialer sends, the listener's checks and answer (101, or a refusal with its status), and the
dialer's checks of that answer.

A link offers its cipher as a subprotocol (``protocol.link_cipher``) and no extension; an
extension a dialer offers is not taken, and an answer that names one, or a subprotocol that
was not offered, is refused. Heads are bounded (``MAX_HEAD_BYTES``): a peer cannot make an end
hold more before the handshake's deadline.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from protocol.errors import ProtocolError

GUID: Final = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # section 1.3
VERSION: Final = "13"
KEY_BYTES: Final = 16
MAX_HEAD_BYTES: Final = 16 * 1024
_END: Final = b"\r\n\r\n"
_REASONS: Final = {
    101: "Switching Protocols",
    400: "Bad Request",
    426: "Upgrade Required",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class UpgradeRefused(ProtocolError):
    """An upgrade head this end does not take: a ``ProtocolError`` (code ``ws_upgrade``) with
    the HTTP status a listener answers (400, 426 for another WebSocket version, 431)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__("ws_upgrade", message)
        self.status = status


@dataclass(frozen=True)
class UpgradeRequest:
    """A dialer's valid upgrade request, as the listener read it."""

    target: str
    host: str
    key: str
    subprotocols: tuple[str, ...]


@dataclass(frozen=True)
class UpgradeResponse:
    """The listener's answer as the dialer read it: ``status`` 101 with the ``subprotocol``
    it selected (None: none), or a refusal's status."""

    status: int
    subprotocol: str | None = None


def new_key(nonce: bytes) -> str:
    """A ``Sec-WebSocket-Key`` from 16 random bytes (section 4.1)."""
    if len(nonce) != KEY_BYTES:
        raise ValueError("a WebSocket key is 16 random bytes")
    return base64.b64encode(nonce).decode("ascii")


def accept_value(key: str) -> str:
    """The ``Sec-WebSocket-Accept`` that answers ``key`` (section 4.2.2)."""
    digest = hashlib.sha1((key + GUID).encode("ascii"), usedforsecurity=False).digest()
    return base64.b64encode(digest).decode("ascii")


def head_end(buf: bytes | bytearray) -> int | None:
    """Where the HTTP head in ``buf`` ends (the index after its blank line), or None while it
    is incomplete. ``UpgradeRefused`` (431) once it is over ``MAX_HEAD_BYTES``."""
    end = buf.find(_END, 0, MAX_HEAD_BYTES)
    if end >= 0:
        return end + len(_END)
    if len(buf) >= MAX_HEAD_BYTES:
        raise UpgradeRefused(f"an HTTP head over {MAX_HEAD_BYTES} bytes", 431)
    return None


def _parse_head(head: bytes) -> tuple[str, dict[str, list[str]]]:
    """The start line and the header fields (names lower-cased, values by name in order)."""
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise UpgradeRefused("an HTTP head that is not ASCII") from None
    lines = text.removesuffix("\r\n\r\n").split("\r\n")
    fields: dict[str, list[str]] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or " " in name:
            raise UpgradeRefused(f"a malformed HTTP header line {line[:40]!r}")
        fields.setdefault(name.lower(), []).append(value.strip())
    return lines[0], fields


def _tokens(fields: dict[str, list[str]], name: str) -> list[str]:
    """A comma-separated header's items, over all its lines."""
    return [t.strip() for value in fields.get(name, []) for t in value.split(",") if t.strip()]


def _one(fields: dict[str, list[str]], name: str) -> str | None:
    values = fields.get(name, [])
    if len(values) > 1:
        raise UpgradeRefused(f"the {name} header more than once")
    return values[0] if values else None


def _is_upgrade(fields: dict[str, list[str]]) -> bool:
    return "websocket" in (t.lower() for t in _tokens(fields, "upgrade")) and "upgrade" in (
        t.lower() for t in _tokens(fields, "connection")
    )


def client_request(host: str, target: str, key: str, subprotocols: Sequence[str]) -> bytes:
    """The dialer's upgrade request (section 4.1)."""
    lines = [
        f"GET {target} HTTP/1.1",
        f"Host: {host}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        f"Sec-WebSocket-Version: {VERSION}",
    ]
    if subprotocols:
        lines.append(f"Sec-WebSocket-Protocol: {', '.join(subprotocols)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")


def parse_request(head: bytes) -> UpgradeRequest:
    """The listener's reading of a dialer's head (section 4.2.1); ``UpgradeRefused`` with the
    status to answer."""
    start, fields = _parse_head(head)
    method, _, rest = start.partition(" ")
    target, _, version = rest.partition(" ")
    if method != "GET" or not target.startswith("/") or version != "HTTP/1.1":
        raise UpgradeRefused(f"not a WebSocket upgrade request: {start[:60]!r}")
    host = _one(fields, "host")
    if not host:
        raise UpgradeRefused("an upgrade request without a Host header")
    if not _is_upgrade(fields):
        raise UpgradeRefused("an HTTP request that does not ask for a WebSocket upgrade")
    if _one(fields, "sec-websocket-version") != VERSION:
        raise UpgradeRefused(f"a WebSocket version other than {VERSION}", 426)
    key = _one(fields, "sec-websocket-key") or ""
    try:
        valid = len(base64.b64decode(key, validate=True)) == KEY_BYTES
    except binascii.Error:
        valid = False
    if not valid:
        raise UpgradeRefused("a Sec-WebSocket-Key that is not 16 bytes in base64")
    protocols = tuple(_tokens(fields, "sec-websocket-protocol"))
    return UpgradeRequest(target, host, key, protocols)


def accept_response(request: UpgradeRequest, subprotocol: str | None) -> bytes:
    """The listener's 101 answer, selecting ``subprotocol`` (one the dialer offered, or None)."""
    if subprotocol is not None and subprotocol not in request.subprotocols:
        raise ValueError(f"subprotocol {subprotocol!r} was not offered")
    lines = [
        f"HTTP/1.1 101 {_REASONS[101]}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Accept: {accept_value(request.key)}",
    ]
    if subprotocol is not None:
        lines.append(f"Sec-WebSocket-Protocol: {subprotocol}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")


def reject_response(status: int, body: bytes = b"") -> bytes:
    """A refusal with ``status`` and a short text ``body``; the connection closes after it."""
    if not 400 <= status <= 599:
        raise ValueError(f"a refusal's status is 4xx or 5xx, not {status}")
    lines = [
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Refused')}",
        "Content-Type: text/plain; charset=utf-8",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if status == 426:
        lines.append(f"Sec-WebSocket-Version: {VERSION}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body


def parse_response(head: bytes, key: str, offered: Sequence[str]) -> UpgradeResponse:
    """The dialer's reading of the listener's answer to ``key`` (section 4.2.2): a 101 that
    completes the handshake, or the status of a refusal; ``UpgradeRefused`` for a head that
    breaks the protocol (a wrong accept value, an extension or subprotocol not offered)."""
    start, fields = _parse_head(head)
    version, _, rest = start.partition(" ")
    code = rest.partition(" ")[0]
    if version != "HTTP/1.1" or len(code) != 3 or not code.isdigit():
        raise UpgradeRefused(f"not an HTTP/1.1 response: {start[:60]!r}")
    status = int(code)
    if status != 101:
        return UpgradeResponse(status)
    if not _is_upgrade(fields):
        raise UpgradeRefused("a 101 answer that does not upgrade to WebSocket")
    if _one(fields, "sec-websocket-accept") != accept_value(key):
        raise UpgradeRefused("a Sec-WebSocket-Accept that does not answer our key")
    if _tokens(fields, "sec-websocket-extensions"):
        raise UpgradeRefused("a WebSocket extension we did not offer")
    selected = _one(fields, "sec-websocket-protocol")
    if selected is not None and selected not in offered:
        raise UpgradeRefused(f"subprotocol {selected[:40]!r} that we did not offer")
    return UpgradeResponse(101, selected)
