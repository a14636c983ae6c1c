"""Link messages framed by mesh_node/ws_frames.py (issue #25 item 4) are the frames wsproto
writes and reads: checked against wsproto itself, both sides (masked and unmasked), at every
length class of RFC 6455 section 5.2."""

from __future__ import annotations

import pytest
from wsproto.connection import Connection, ConnectionType
from wsproto.events import BytesMessage
from wsproto.frame_protocol import FrameProtocol

from mesh_node.ws_frames import frame, frame_header, mask_in_place


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


async def test_a_real_trio_websocket_pair_attaches_and_carries_frames_both_ways() -> None:
    import trio
    from trio_websocket import open_websocket_url, serve_websocket

    from mesh_node.ws_frames import DirectSender

    got: list[bytes] = []

    async def handler(request: object) -> None:
        ws = await request.accept()  # type: ignore[attr-defined]
        got.append(await ws.get_message())  # the client's masked frame
        sender = DirectSender.attach(ws)
        assert sender is not None and not sender.masked
        await sender.send(frame([b"down", b"-" * 70000], 70004, masked=False))
        await ws.get_message()

    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve_websocket, handler, "127.0.0.1", 0, None)
        port = server.port
        async with open_websocket_url(f"ws://127.0.0.1:{port}/") as ws:
            sender = DirectSender.attach(ws)
            assert sender is not None and sender.masked
            await sender.send(frame([b"up", b"+" * 300], 302, masked=True))
            assert await ws.get_message() == b"down" + b"-" * 70000
            await ws.send_message(b"done")
        nursery.cancel_scope.cancel()
    assert got == [b"up" + b"+" * 300]
