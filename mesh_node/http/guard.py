"""The one gate every HTTP request passes before any route runs (§3, §5, §6).

In order: a request id (``X-Request-Id``, echoed); framing (``Content-Length`` with
``Transfer-Encoding``: 400 and the connection closed, RFC 9112 §6.1); the ``Origin`` (present
and neither this node's own nor in ``allowed_origins``: 403, so a page elsewhere cannot make a
browser start generations here); a CORS preflight from an allowed origin (answered here);
the API key (``Authorization: Bearer``; 401 with ``WWW-Authenticate: Bearer``); the body's
type (``/v1`` POSTs are ``application/json`` or 415). Then the app, and one access-log line
per request on ``mesh_node.http.access`` (never a key, a query string or a body).

``refusal`` decides (pure); ``Guard`` is the ASGI shell.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import trio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mesh_node.http.keys import ApiKeys

access_log = logging.getLogger("mesh_node.http.access")
REQUEST_ID_HEADER: Final = b"x-request-id"
ACCESS_SCOPE_KEY: Final = "mesh_node.access"  # the AccessRecord of a request, for the routes
_REQUEST_ID_RE: Final = re.compile(rb"^[A-Za-z0-9._:-]{1,64}$")
# Paths that need no key: the health check, and the page's shell (the same static HTML, JS
# and CSS for everyone; every byte of data it shows comes from /api, which needs the key).
OPEN_PATHS: Final = frozenset({"/health", "/"})
OPEN_PREFIXES: Final = ("/static/",)
JSON_TYPES: Final = frozenset({"application/json"})
PREFLIGHT_MAX_AGE_S: Final = 600
DRAIN_S: Final = 1.0  # a refused request's body: what already arrived, briefly
DRAIN_MAX_BYTES: Final = 64 * 1024
CORS_METHODS: Final = b"GET, POST, OPTIONS"
CORS_HEADERS: Final = b"authorization, content-type, x-request-id"


@dataclass(frozen=True)
class GuardPolicy:
    keys: ApiKeys = field(default_factory=ApiKeys)
    allowed_origins: frozenset[str] = frozenset()
    access_log: bool = True


@dataclass(frozen=True)
class Refusal:
    """An answer given instead of the app's: OpenAI's error body with ``code``."""

    status: int
    code: str
    message: str
    headers: tuple[tuple[bytes, bytes], ...] = ()
    close: bool = False  # close the connection after it (the framing cannot be trusted)

    def body(self) -> bytes:
        kind = "authentication_error" if self.status == 401 else "invalid_request_error"
        doc = {"error": {"message": self.message, "type": kind, "param": None, "code": self.code}}
        return json.dumps(doc).encode()


@dataclass
class AccessRecord:
    """What one access-log line says; the API adds the token counts."""

    request_id: str
    method: str
    path: str
    client: str
    started_s: float
    status: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    tokens_in: int | None = None
    tokens_out: int | None = None

    def line(self, now_s: float) -> str:
        fields = [
            f"method={self.method}",
            f"path={json.dumps(self.path)}",  # escaped: a path is the client's bytes
            f"status={self.status}",
            f"duration_ms={(now_s - self.started_s) * 1000:.1f}",
            f"bytes_in={self.bytes_in}",
            f"bytes_out={self.bytes_out}",
        ]
        if self.tokens_in is not None:
            fields.append(f"tokens_in={self.tokens_in}")
        if self.tokens_out is not None:
            fields.append(f"tokens_out={self.tokens_out}")
        fields += [f"request_id={self.request_id}", f"client={self.client}"]
        return "http " + " ".join(fields)


def _header(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def is_open_path(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def own_origin(scheme: str, headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    host = _header(headers, b"host")
    return None if host is None else f"{scheme}://{host.decode('latin-1').lower()}"


def origin_allowed(origin: str, own: str | None, allowed: frozenset[str]) -> bool:
    return origin.lower() == own or origin.lower() in allowed


def refusal(
    method: str,
    path: str,
    headers: Sequence[tuple[bytes, bytes]],
    scheme: str,
    policy: GuardPolicy,
) -> Refusal | None:
    """Why this request is refused before the app sees it (``None``: it is not)."""
    names = [k for k, _ in headers]
    if b"transfer-encoding" in names and b"content-length" in names:
        return Refusal(
            400,
            "conflicting_framing",
            "a request with both Content-Length and Transfer-Encoding is refused",
            close=True,
        )
    if names.count(b"content-length") > 1:
        return Refusal(400, "conflicting_framing", "more than one Content-Length", close=True)
    origin = _header(headers, b"origin")
    if origin is not None and not origin_allowed(
        origin.decode("latin-1"), own_origin(scheme, headers), policy.allowed_origins
    ):
        return Refusal(
            403,
            "origin_not_allowed",
            "requests from this origin are not allowed (a web page elsewhere cannot call this "
            "node; list browser clients in [http] allowed_origins)",
        )
    if method == "OPTIONS" and origin is not None:
        return None  # an allowed origin's CORS preflight: answered by the shell
    if policy.keys.required and not is_open_path(path):
        auth = _header(headers, b"authorization")
        if not policy.keys.accepts(None if auth is None else auth.decode("latin-1")):
            return Refusal(
                401,
                "invalid_api_key",
                "this node needs an API key: send Authorization: Bearer <key>"
                if auth is None
                else "the API key is not valid",
                headers=((b"www-authenticate", b"Bearer"),),
            )
    if method == "POST" and path.startswith("/v1/"):
        ctype = _header(headers, b"content-type")
        media = (ctype or b"").split(b";")[0].strip().lower().decode("latin-1")
        if media not in JSON_TYPES:
            return Refusal(
                415,
                "unsupported_media_type",
                "the request body must be sent as Content-Type: application/json",
            )
    return None


def request_id_of(headers: Sequence[tuple[bytes, bytes]]) -> str:
    """The client's ``X-Request-Id`` when it is a plain token, else a new one."""
    given = _header(headers, REQUEST_ID_HEADER)
    if given is not None and _REQUEST_ID_RE.match(given):
        return given.decode("ascii")
    return secrets.token_hex(8)


class Guard:
    """ASGI middleware: ``refusal``, CORS for allowed origins, request ids, the access log."""

    def __init__(self, app: ASGIApp, policy: GuardPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers", []))
        client = scope.get("client")
        record = AccessRecord(
            request_id=request_id_of(headers),
            method=str(scope.get("method", "")),
            path=str(scope.get("path", "")),
            client=f"{client[0]}:{client[1]}" if client else "-",
            started_s=time.monotonic(),
        )
        scope[ACCESS_SCOPE_KEY] = record
        scheme = str(scope.get("scheme", "http"))
        origin = _header(headers, b"origin")
        cors = origin is not None and origin.decode("latin-1").lower() in (
            self.policy.allowed_origins
        )
        extra: list[tuple[bytes, bytes]] = [(REQUEST_ID_HEADER, record.request_id.encode())]
        if cors and origin is not None:
            extra += [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]

        async def counted_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                record.bytes_in += len(message.get("body", b""))
            return message

        async def guarded_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = int(message["status"])
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            elif message["type"] == "http.response.body":
                record.bytes_out += len(message.get("body", b""))
            await send(message)

        try:
            refused = refusal(record.method, record.path, headers, scheme, self.policy)
            if refused is not None:
                if refused.close:
                    await _drain(receive)
                await _answer(guarded_send, refused)
            elif record.method == "OPTIONS" and cors:
                await _preflight(guarded_send)
            else:
                await self.app(scope, counted_receive, guarded_send)
        finally:
            if self.policy.access_log:
                access_log.info(record.line(time.monotonic()))


async def _drain(receive: Receive) -> None:
    """Take what hypercorn already parsed of a body we refuse (bounded), so that the server's
    own close after our answer does not race it (seen: a concurrent send on the socket)."""
    with trio.move_on_after(DRAIN_S):
        taken = 0
        while taken <= DRAIN_MAX_BYTES:
            message = await receive()
            taken += len(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body", False):
                return


async def _answer(send: Send, refused: Refusal) -> None:
    body = refused.body()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *refused.headers,
    ]
    if refused.close:
        headers.append((b"connection", b"close"))  # h11 then closes after this response
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _preflight(send: Send) -> None:
    headers = [
        (b"access-control-allow-methods", CORS_METHODS),
        (b"access-control-allow-headers", CORS_HEADERS),
        (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_S).encode()),
        (b"content-length", b"0"),
    ]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})
