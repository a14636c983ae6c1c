"""Link messages framed by ``protocol.ws_frames`` are the frames stock implementations write
and read: checked against wsproto, both sides (masked and unmasked), at every length class of
RFC 6455 section 5.2, and over real connections with trio-websocket, each way."""

from __future__ import annotations

import pytest
from wsproto.connection import Connection, ConnectionType
from wsproto.events import BytesMessage
from wsproto.frame_protocol import FrameProtocol

from protocol.ws_frames import frame, frame_header, mask_in_place


@pytest.mark.parametrize("n", [0, 1, 125, 126, 65535, 65536, (1 << 20) + 3])
@pytest.mark.parametrize("masked", [False, True])
def test_a_frame_reads_back_in_wsproto(n: int, masked: bool) -> None:
    payload = (bytes(range(251)) * (n // 251 + 1))[:n]
    parts = [payload[: n // 3], payload[n // 3 :]]
    # the receiving end: a server reads a client's (masked) frames, a client a server's
    receiver = Connection(ConnectionType.SERVER if masked else ConnectionType.CLIENT)
    receiver.receive_data(bytes(frame(parts, n, masked=masked)))
    got = b"".join(e.data for e in receiver.events() if isinstance(e, BytesMessage))
    assert got == payload


@pytest.mark.parametrize("n", [0, 100, 126, 70000])
def test_an_unmasked_header_is_wsprotos(n: int) -> None:
    payload = b"x" * n
    assert bytes(FrameProtocol(client=False, extensions=[]).send_data(payload)) == (
        frame_header(n) + payload
    )


def test_masking_is_its_own_inverse_and_leaves_the_header() -> None:
    buf = bytearray(b"HEAD" + bytes(range(256)) * 3 + b"abc")  # a tail that is not 4-aligned
    before = bytes(buf)
    mask_in_place(buf, 4, b"\x01\x02\x03\x04")
    assert buf[:4] == b"HEAD" and buf[4:] != before[4:]
    assert buf[4] == 0 ^ 1 and buf[5] == 1 ^ 2 and buf[-1] == ord("c") ^ (1, 2, 3, 4)[770 % 4]
    mask_in_place(buf, 4, b"\x01\x02\x03\x04")
    assert bytes(buf) == before


def test_bad_header_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        frame_header(-1)
    with pytest.raises(ValueError):
        frame_header(10, b"abc")


async def test_our_dialer_and_a_trio_websocket_listener_carry_messages_both_ways() -> None:
    """Interop with a stock implementation: our client (masked frames built here) against
    trio-websocket's server, then a normal close (1000) both ends agree on."""
    import trio
    from trio_websocket import serve_websocket

    from mesh_node.budget import PeerMemory
    from mesh_node.websocket import WebSocketSettings, connect

    got: list[bytes] = []
    closed: list[object] = []

    async def handler(request: object) -> None:
        ws = await request.accept(subprotocol="x-two")  # type: ignore[attr-defined]
        got.append(await ws.get_message())  # the client's masked frame
        with trio.fail_after(5):
            await ws.ping(b"are you there")  # answered by our reader
        await ws.send_message(b"down" + b"-" * 70000)
        try:
            await ws.get_message()
        except Exception:
            closed.append(ws.closed)

    settings = WebSocketSettings(max_message_bytes=1 << 20, handshake_s=5, disconnect_s=2)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve_websocket, handler, "127.0.0.1", 0, None)
        budget = PeerMemory(16 << 20)
        async with connect("127.0.0.1", server.port, budget, settings, ["x-one", "x-two"]) as ws:
            assert ws.is_client and ws.masked and ws.subprotocol == "x-two"
            ws.stream.established(trusted=True)  # past the pending cap (64 KiB), as a link is
            await ws.send(frame([b"up", b"+" * 300], 302, masked=True))
            assert bytes(await ws.get_message()) == b"down" + b"-" * 70000
        assert ws.closed is not None and ws.closed.code == 1000
        with trio.fail_after(5):
            while not closed:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert got == [b"up" + b"+" * 300]
    assert getattr(closed[0], "code", None) == 1000


async def test_a_trio_websocket_dialer_and_our_listener_carry_messages_both_ways() -> None:
    """Interop the other way: trio-websocket's client against our server (unmasked frames
    built here, the client's masked ones parsed here), its ping answered, its close echoed."""
    import trio
    from trio_websocket import open_websocket_url

    from mesh_node.budget import PeerMemory
    from mesh_node.budgeted_tcp import budgeted_listeners
    from mesh_node.websocket import (
        ConnectionClosed,
        WebSocketRequest,
        WebSocketSettings,
        serve_websockets,
    )

    got: list[bytes] = []
    closes: list[int] = []

    async def handler(request: WebSocketRequest) -> None:
        assert request.proposed_subprotocols == ("x-one",)
        ws = await request.accept(subprotocol="x-one")
        got.append(bytes(await ws.get_message()))
        await ws.send(frame([b"down", b"-" * 70000], 70004, masked=False))
        try:
            await ws.get_message()
        except ConnectionClosed as exc:
            closes.append(exc.reason.code)

    budget = PeerMemory(16 << 20)
    settings = WebSocketSettings(max_message_bytes=1 << 20, handshake_s=5, disconnect_s=2)
    async with trio.open_nursery() as nursery:
        listeners = await budgeted_listeners("127.0.0.1", 0, budget)
        await nursery.start(serve_websockets, handler, listeners, nursery, settings)
        url = f"ws://127.0.0.1:{listeners[0].port}/"
        async with open_websocket_url(url, subprotocols=["x-one"]) as ws:
            assert ws.subprotocol == "x-one"
            await ws.send_message(b"up" + b"+" * 300)
            assert await ws.get_message() == b"down" + b"-" * 70000
            with trio.fail_after(5):
                await ws.ping(b"ping from a stock client")
        assert ws.closed is not None and ws.closed.code == 1000  # our end echoed its close
        with trio.fail_after(5):
            while not closes:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert got == [b"up" + b"+" * 300] and closes == [1000]
