"""The link's WebSocket (``mesh_node.websocket`` over ``protocol.ws_*``) against a stock RFC 6455
implementation, ``websockets`` (its threaded client and server), over real loopback
connections both ways: the opening handshake with a subprotocol, messages of every length
class, a fragmented message, pings answered, the closing handshake with its code and reason,
and the refusals (a text message, a message over the limit) seen by the other end as their
close codes."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio
from websockets.exceptions import ConnectionClosed as StockClosed
from websockets.sync.client import connect as stock_connect
from websockets.sync.server import ServerConnection, serve

from mesh_node.budget import PeerMemory
from mesh_node.budgeted_tcp import budgeted_listeners
from mesh_node.websocket import (
    ConnectionClosed,
    ConnectionRejected,
    WebSocket,
    WebSocketRequest,
    WebSocketSettings,
    connect,
    serve_websockets,
)
from protocol.ws_frames import CLOSE_PROTOCOL_ERROR, CLOSE_TOO_BIG, FrameRefused

LIMIT = 256 * 1024
SETTINGS = WebSocketSettings(max_message_bytes=LIMIT, handshake_s=10, disconnect_s=5)
SIZES = [0, 1, 125, 126, 65535, 65536, LIMIT]
TOKEN = "x-link-cipher"


@asynccontextmanager
async def our_server(
    serve_one: Callable[[WebSocket], object],
) -> AsyncIterator[tuple[str, list[object]]]:
    """Our listener; each accepted WebSocket is passed to ``serve_one`` and what it returns or
    raises is recorded."""
    outcomes: list[object] = []

    async def handler(request: WebSocketRequest) -> None:
        if "reject" in request.upgrade.target:
            await request.reject(429, b"too many")
            return
        ws = await request.accept(TOKEN if TOKEN in request.proposed_subprotocols else None)
        ws.stream.established(trusted=True)
        try:
            outcomes.append(await serve_one(ws))  # type: ignore[misc]
        except (ConnectionClosed, FrameRefused) as exc:
            outcomes.append(exc)
            code = exc.close_code if isinstance(exc, FrameRefused) else 1000
            with trio.move_on_after(SETTINGS.disconnect_s):
                await ws.aclose(code)

    budget = PeerMemory(64 << 20)
    async with trio.open_nursery() as nursery:
        listeners = await budgeted_listeners("127.0.0.1", 0, budget)
        await nursery.start(serve_websockets, handler, listeners, nursery, SETTINGS)
        yield f"ws://127.0.0.1:{listeners[0].port}", outcomes
        nursery.cancel_scope.cancel()


def received_close(exc: StockClosed) -> tuple[int | None, str]:
    """The close frame the stock end received: (code, reason), or (None, "") for none."""
    return (exc.rcvd.code, exc.rcvd.reason) if exc.rcvd is not None else (None, "")


async def echo(ws: WebSocket) -> None:
    while True:
        await ws.send_message(bytes(await ws.get_message()))


async def test_a_stock_client_talks_to_our_listener() -> None:
    def client(url: str) -> tuple[str | None, list[bytes], int | None, str]:
        with stock_connect(url + "/", subprotocols=[TOKEN], max_size=None) as ws:
            got = []
            for n in SIZES:
                ws.send(bytes([n % 251]) * n)
                got.append(ws.recv(timeout=10))
            ws.send([b"frag", b"mented", b""])  # one message in three frames
            got.append(ws.recv(timeout=10))
            ws.ping(b"stock ping").wait(timeout=10)  # answered by our reader
            ws.close(4001, "done here")
            code, reason = received_close(ws.close_exc)
            return ws.subprotocol, got, code, reason

    async with our_server(echo) as (url, outcomes):
        protocol, got, code, reason = await trio.to_thread.run_sync(client, url)
        with trio.fail_after(10):
            while not outcomes:
                await trio.sleep(0.01)
    assert protocol == TOKEN
    assert got == [bytes([n % 251]) * n for n in SIZES] + [b"fragmented"]
    assert (code, reason) == (4001, "")  # our answer echoes the code (RFC 6455 5.5.1)
    (closed,) = outcomes
    assert isinstance(closed, ConnectionClosed) and closed.reason.code == 4001
    assert closed.reason.reason == "done here"


@pytest.mark.parametrize(
    ("send", "code"),
    [
        (lambda ws: ws.send("text"), CLOSE_PROTOCOL_ERROR),  # links carry binary records only
        (lambda ws: ws.send(b"x" * (LIMIT + 1)), CLOSE_TOO_BIG),
    ],
    ids=["text", "over-the-limit"],
)
async def test_what_our_listener_refuses_a_stock_client_sees_as_its_close_code(send, code) -> None:
    def client(url: str) -> int | None:
        with stock_connect(url + "/", max_size=None) as ws:
            send(ws)
            with pytest.raises(StockClosed) as closed:
                ws.recv(timeout=10)
            return received_close(closed.value)[0]

    async with our_server(echo) as (url, outcomes):
        assert await trio.to_thread.run_sync(client, url) == code
        with trio.fail_after(10):
            while not outcomes:
                await trio.sleep(0.01)
    (refused,) = outcomes
    assert isinstance(refused, FrameRefused) and refused.close_code == code


async def test_a_stock_client_hears_our_refusal_of_the_upgrade() -> None:
    def client(url: str) -> int:
        from websockets.exceptions import InvalidStatus

        with pytest.raises(InvalidStatus) as err:
            stock_connect(url + "/reject")
        return err.value.response.status_code

    async with our_server(echo) as (url, _):
        assert await trio.to_thread.run_sync(client, url) == 429


@asynccontextmanager
async def stock_server(handler: Callable[[ServerConnection], None]) -> AsyncIterator[int]:
    """``websockets``' threaded server on a free port, running ``handler`` per connection."""

    def select(connection: ServerConnection, offered: list[str]) -> str | None:
        return TOKEN if TOKEN in offered else None

    server = serve(handler, "127.0.0.1", 0, select_subprotocol=select, max_size=None)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.socket.getsockname()[1]
    finally:
        server.shutdown()
        await trio.to_thread.run_sync(thread.join, 10)


async def test_our_dialer_talks_to_a_stock_listener() -> None:
    def handler(ws: ServerConnection) -> None:
        for _ in range(len(SIZES)):
            ws.send(ws.recv(timeout=10))
        ws.send([b"frag", b"mented"])
        ws.ping(b"stock ping").wait(timeout=10)  # answered by our reader, while it reads
        ws.send(b"after the ping")
        ws.close(4000, "bye now")

    budget = PeerMemory(64 << 20)
    got: list[bytes] = []
    async with (
        stock_server(handler) as port,
        connect("127.0.0.1", port, budget, SETTINGS, [TOKEN, "x-other"]) as ws,
    ):
        assert ws.subprotocol == TOKEN
        ws.stream.established(trusted=True)
        for n in SIZES:
            await ws.send_message(bytes([n % 7]) * n)
            got.append(bytes(await ws.get_message()))
        got.append(bytes(await ws.get_message()))
        got.append(bytes(await ws.get_message()))
        with pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
    assert got == [bytes([n % 7]) * n for n in SIZES] + [b"fragmented", b"after the ping"]
    assert (closed.value.reason.code, closed.value.reason.reason) == (4000, "bye now")
    assert ws.closed == closed.value.reason


async def test_our_dialer_closes_a_stock_listener_with_its_code() -> None:
    seen: list[tuple[int | None, str]] = []

    def handler(ws: ServerConnection) -> None:
        try:
            ws.recv(timeout=10)
        except StockClosed as exc:
            seen.append(received_close(exc))

    async with (
        stock_server(handler) as port,
        connect("127.0.0.1", port, PeerMemory(1 << 20), SETTINGS) as ws,
    ):
        with trio.fail_after(10):
            await ws.aclose(1008, "handshake failed")
    assert seen == [(1008, "handshake failed")]
    assert ws.closed is not None and ws.closed.code == 1008  # the listener's echo


async def test_a_stock_listener_that_refuses_the_upgrade_is_a_rejection() -> None:
    from websockets.datastructures import Headers
    from websockets.http11 import Response

    def refuse(connection: ServerConnection, request: object) -> Response:
        return Response(503, "Service Unavailable", Headers(), b"busy")

    server = serve(lambda ws: None, "127.0.0.1", 0, process_request=refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.socket.getsockname()[1]
        with pytest.raises(ConnectionRejected) as err:
            async with connect("127.0.0.1", port, PeerMemory(1 << 20), SETTINGS):
                pass
        assert err.value.status_code == 503
    finally:
        server.shutdown()
        await trio.to_thread.run_sync(thread.join, 10)


async def test_a_websocket_our_handler_leaves_open_is_closed_normally() -> None:
    """A handler that accepts and returns (the node refusing a duplicate link, or a link to
    itself) leaves no half-open connection: the peer gets a normal close (1000)."""

    async def leave(ws: WebSocket) -> str:
        return "left"

    def client(url: str) -> tuple[int | None, str]:
        with stock_connect(url + "/") as ws, pytest.raises(StockClosed) as closed:
            ws.recv(timeout=10)
        return received_close(closed.value)

    async with our_server(leave) as (url, outcomes):
        assert await trio.to_thread.run_sync(client, url) == (1000, "")
    assert outcomes == ["left"]
