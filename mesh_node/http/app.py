"""The node's one ASGI app (starlette, run by hypercorn's trio worker in the node's process).

Routes of the operator surface, all ``GET`` (``HEAD`` too); any other method is
answered 405 by starlette's router, so nothing here can change the node:

- ``/`` the status page, ``/static/*`` its assets (package data: works offline);
- ``/api/status`` the status document (``mesh_node.peers.status_document``, through
  ``view.public_status``);
- ``/api/events`` the same document as server-sent events: every ``PUSH_INTERVAL_S`` and soon
  after each node event (peer up/down, topology change);
- ``/metrics`` Prometheus exposition through prometheus_client (``mesh_node.metrics``);
- ``/health`` 200 ``{"status": "ok"}`` when the node can serve what it is for, else 503
  ``{"status": ..., "reason": ...}`` (llama-server's convention; the ``health`` callable).

Every request passes ``mesh_node.http.guard`` first (keys, origin, framing, access log).
Under ``/v1`` an unknown path or method is answered in OpenAI's error shape (404 / 405).

Other components add routes with ``build_app(node, routes=[...])`` (the OpenAI API
under ``/v1``); they may use other methods on their own paths.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from importlib import resources
from typing import Any, Protocol

import trio
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mesh_node.http.guard import Guard, GuardPolicy
from mesh_node.http.view import public_status
from mesh_node.metrics import node_registry
from skippy.errors import UsageError

PUSH_INTERVAL_S = 1.0  # the page's live update period
EVENT_SETTLE_S = 0.2  # after a node event, wait this long so a burst becomes one push
MAX_EVENT_STREAMS = 32  # open pages at once; beyond, 503 (the page then polls)
STATIC_PACKAGE = ("mesh_node.http", "static")
# The page's assets, served from memory (read once, a few KiB). Not starlette's StaticFiles:
# its FileResponse under hypercorn's ASGI 2.1 waits for ``http.disconnect`` after the body,
# so a ``Connection: close`` request was answered and then held open until the client gave
# up (measured: 15 s, the test client's timeout), and a keep-alive connection could carry no
# second request meanwhile.
STATIC_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".html": "text/html; charset=utf-8",
}
OWN_PATHS = ("/", "/api/status", "/api/events", "/metrics", "/static", "/health")
Health = Callable[[], tuple[int, dict[str, Any]]]  # (status, document) of /health
SECURITY_HEADERS = [
    # Everything the page needs comes from this origin: no CDN, fonts or inline code.
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]


class StatusSource(Protocol):
    """What the app reads of a node (``MeshNode`` is one)."""

    def status(self) -> dict[str, Any]: ...
    def collectors(self) -> Sequence[Collector]: ...
    def subscribe(self) -> AbstractAsyncContextManager[trio.MemoryReceiveChannel[Any]]: ...


def build_app(
    node: StatusSource,
    *,
    routes: Sequence[BaseRoute] = (),
    allowed_hosts: Sequence[str] = ("*",),
    policy: GuardPolicy | None = None,
    health: Health | None = None,
) -> Starlette:
    """The app: the operator surface plus ``routes`` from other components. A component
    route on one of the operator surface's paths is a programming error (``UsageError``)."""
    for route in routes:
        path = getattr(route, "path", None)
        if isinstance(path, str) and any(
            path == own or (own != "/" and path.startswith(own + "/")) for own in OWN_PATHS
        ):
            raise UsageError(f"route {path} would shadow the status page's own", code="bad_route")
    assets = _static_assets()
    page = assets["index.html"][0]
    registry = node_registry(node.status, node.collectors())
    streams = _Slots(MAX_EVENT_STREAMS)

    async def index(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8")

    async def static(request: Request) -> Response:
        found = assets.get(str(request.path_params["name"]))  # a name of ours, never a path
        if found is None:
            return PlainTextResponse("Not Found", status_code=404)
        return Response(found[0], media_type=found[1])

    async def api_status(request: Request) -> Response:
        return JSONResponse(public_status(node.status()))

    async def api_events(request: Request) -> Response:
        if not streams.take():
            return JSONResponse({"error": "too many open event streams; poll /api/status"}, 503)
        return _EventStream(node, streams)

    async def health_check(request: Request) -> Response:
        status, doc = health() if health is not None else (200, {"status": "ok"})
        retry = {"retry-after": str(doc["retry_after_s"])} if "retry_after_s" in doc else None
        return JSONResponse(doc, status_code=status, headers=retry)

    async def metrics(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(registry), headers={"content-type": content_type})

    own: list[BaseRoute] = [
        Route("/", index, methods=["GET"]),
        Route("/api/status", api_status, methods=["GET"]),
        Route("/api/events", api_events, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health_check, methods=["GET"]),
        Route("/static/{name}", static, methods=["GET"]),
    ]
    return Starlette(
        routes=[
            *own,
            *routes,
        ],
        middleware=[
            Middleware(Guard, policy=policy or GuardPolicy()),
            Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts)),
            Middleware(_SecurityHeaders),
        ],
        exception_handlers={HTTPException: _http_error},
    )


def _static_assets() -> dict[str, tuple[bytes, str]]:
    """Every file of the package's static directory: name -> (bytes, media type)."""
    folder = resources.files(STATIC_PACKAGE[0]).joinpath(STATIC_PACKAGE[1])
    out: dict[str, tuple[bytes, str]] = {}
    for entry in folder.iterdir():
        media = STATIC_TYPES.get("." + entry.name.rsplit(".", 1)[-1])
        if entry.is_file() and media is not None:
            out[entry.name] = (entry.read_bytes(), media)
    return out


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404/405: OpenAI's error body under ``/v1`` (clients parse it), plain
    text elsewhere."""
    assert isinstance(exc, HTTPException)  # registered for it (typing)
    headers = dict(exc.headers or {})
    if not request.url.path.startswith("/v1"):
        return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=headers)
    what = "no such endpoint" if exc.status_code == 404 else "method not allowed here"
    doc = {
        "error": {
            "message": f"{request.method} {request.url.path}: {what}",
            "type": "invalid_request_error",
            "param": None,
            "code": "not_found" if exc.status_code == 404 else "method_not_allowed",
        }
    }
    return JSONResponse(doc, status_code=exc.status_code, headers=headers)


class _SecurityHeaders:
    """Adds ``SECURITY_HEADERS`` to every response that does not set them itself."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in SECURITY_HEADERS if k not in present]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class _Slots:
    """A bound on open event streams (taken by the endpoint, released by the stream)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.open = limit, 0

    def take(self) -> bool:
        if self.open >= self.limit:
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1


class _EventStream(Response):
    """``text/event-stream`` of status documents until the client leaves or the node stops.

    A plain ASGI response rather than an async generator: trio cancel scopes and node
    subscriptions stay in one task, and the stream's slot is released in ``finally``."""

    def __init__(self, node: StatusSource, slots: _Slots) -> None:
        super().__init__(media_type="text/event-stream")
        self._node, self._slots = node, slots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"x-accel-buffering", b"no"),  # a reverse proxy must not hold events
                    ],
                }
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_until_disconnect, receive, nursery.cancel_scope)
                await self._push(send)
        finally:
            self._slots.release()

    async def _push(self, send: Send) -> None:
        while True:
            async with self._node.subscribe() as events:
                try:
                    while True:
                        doc = public_status(self._node.status())
                        body = f"data: {json.dumps(doc, separators=(',', ':'))}\n\n".encode()
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                        with trio.move_on_after(PUSH_INTERVAL_S):
                            await events.receive()
                            await trio.sleep(EVENT_SETTLE_S)
                            _drain(events)  # a burst of events is one push
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    continue  # fell too far behind the node's events: subscribe again


def _drain(events: trio.MemoryReceiveChannel[Any]) -> None:
    while True:
        try:
            events.receive_nowait()
        except trio.WouldBlock:
            return


async def _until_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
