"""A small frame's way through the link stack without extra scheduler passes (
the per-hop cost of a decode frame): a message written from the sending task
(``WebSocket.send_now``) whose tail the kernel refused is completed before anything else; a
transport read that finds room in the budget and bytes in the socket takes them at once and
reports a broken connection as trio does. Real sockets; trio-websocket as the far end."""

from __future__ import annotations

import socket
import struct

import pytest
import trio
from trio_websocket import serve_websocket

from mesh_node.budget import PeerMemory
from mesh_node.budgeted_tcp import BudgetedStream
from mesh_node.websocket import WebSocketSettings, connect
from protocol.ws_frames import frame

# more than the socket buffers on loopback take: the receiver autotunes its buffer up to
# net.ipv4.tcp_rmem's max (32 MiB here) and the sender's holds up to 4 MiB
BIG = 48 << 20


SETTINGS = WebSocketSettings(max_message_bytes=2 * BIG, handshake_s=10, disconnect_s=2)


async def test_send_now_writes_whole_messages_and_flush_completes_a_refused_tail() -> None:
    got: list[bytes] = []
    read = trio.Event()

    async def handler(request: object) -> None:
        ws = await request.accept()  # type: ignore[attr-defined]
        got.append(await ws.get_message())  # the first small one
        await read.wait()  # the big one fills the socket buffers meanwhile
        got.append(await ws.get_message())
        got.append(await ws.get_message())
        await ws.send_message(b"done")

    big = bytes(range(256)) * (BIG // 256)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: serve_websocket(
                handler, "127.0.0.1", 0, None, task_status=task_status,
                max_message_size=2 * BIG,
            )
        )
        async with connect("127.0.0.1", server.port, PeerMemory(1 << 26), SETTINGS) as ws:
            assert ws.can_send_now()
            # the kernel took all of it
            assert ws.send_now(frame([b"small-", b"one"], 9, masked=True))
            assert ws.unsent is None
            assert not ws.send_now(frame([big[: BIG // 2], big[BIG // 2 :]], BIG, masked=True))
            assert ws.unsent is not None and 0 < len(ws.unsent) < BIG
            # Nothing may start before the tail is out, from this task or any other.
            assert not ws.can_send_now()
            read.set()
            await ws.flush()
            assert ws.unsent is None and ws.can_send_now()
            assert ws.send_now(frame([b"after"], 5, masked=True))
            assert await ws.get_message() == b"done"
        nursery.cancel_scope.cancel()
    assert got == [b"small-one", big, b"after"]


async def test_send_now_is_refused_while_another_task_is_writing() -> None:
    read = trio.Event()

    async def handler(request: object) -> None:
        ws = await request.accept()  # type: ignore[attr-defined]
        await read.wait()
        await ws.get_message()
        await ws.get_message()

    big = frame([bytes(BIG)], BIG, masked=True)
    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: serve_websocket(
                handler, "127.0.0.1", 0, None, task_status=task_status,
                max_message_size=2 * BIG,
            )
        )
        async with connect("127.0.0.1", server.port, PeerMemory(1 << 26), SETTINGS) as ws:
            async with trio.open_nursery() as writers:
                writers.start_soon(ws.send, big)  # stalls: the peer is not reading yet
                await trio.sleep(0.2)
                assert not ws.can_send_now()  # what a pong or a close would wait behind too
                read.set()
            assert ws.can_send_now()
            await ws.send_message(b"bye")
        nursery.cancel_scope.cancel()


def test_a_budget_reservation_without_waiting() -> None:
    budget = PeerMemory(1 << 20)
    budget.open(1)
    got = budget.take_some_now(1, 4096)
    assert got == 4096 and budget.held(1) == 4096
    room = budget.room(1)
    assert 0 < room < 1 << 30 and budget.take_some_now(1, 1 << 30) == room  # at most the room
    while budget.take_some_now(1, 1 << 20) > 0:  # until its share is used up
        pass
    assert budget.take_some_now(1, 1) == -1  # no room now: the caller waits (take_some)
    budget.close(1)
    assert budget.take_some_now(1, 1) == 0  # a closed account


async def _tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listeners[0].accept()
    await listeners[0].aclose()
    return client, server


async def test_a_readable_socket_is_read_at_once_and_a_reset_is_a_broken_resource() -> None:
    client, server = await _tcp_pair()
    budget = PeerMemory(1 << 20)
    stream = BudgetedStream(server, budget, server=True)
    stream.established(trusted=True)
    try:
        assert stream._receive_now(1024) is None  # nothing there: trio's read waits instead
        await client.send_all(b"frame")
        assert await stream.receive_some() == b"frame"
        # The peer resets the connection (SO_LINGER 0): reported as trio reports it.
        client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await client.aclose()
        with trio.fail_after(5):
            await trio.lowlevel.wait_readable(server.socket)  # the reset arrived
        with pytest.raises(trio.BrokenResourceError):
            stream._receive_now(1024)
    finally:
        await stream.aclose()


async def test_a_small_send_leaves_before_send_all_returns_and_bulk_keeps_its_order(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from meshtools import identity, settings, wait_for, with_peers

    from mesh_node.node import MeshNode
    from mesh_node.peers import InboundStream
    from protocol import constants as pc

    got = bytearray()

    async def sink(inbound: InboundStream) -> None:
        while data := await inbound.stream.receive_some():
            got.extend(data)

    owner = Ed25519PrivateKey.generate()
    slow = {"heartbeat_interval_s": 30.0, "peer_loss_timeout_s": 60.0}  # no pings meanwhile
    async with trio.open_nursery() as n:
        a = MeshNode(settings(tmp_path, "a", **slow), identity(owner))
        await n.start(a.run)
        b = MeshNode(with_peers(settings(tmp_path, "b", **slow), a), identity(owner))
        await n.start(b.run)
        a.register_subprotocol(pc.KIND_ARTIFACT_TRANSFER, sink)
        await wait_for(lambda: len(b.peers()) == 1 and b.peers()[0].peer.trusted)
        stream = await b.open_stream(a.node_id, pc.KIND_ARTIFACT_TRANSFER)
        await wait_for(lambda: b.peers()[0].bytes_sent > 0)
        frame = bytes(range(256)) * 10  # a decode frame's size (2.5 KiB)
        sent: list[bytes] = []
        for i in range(3):
            # The link is idle again once the peer has everything (the bulk before is out).
            await wait_for(lambda: len(got) == sum(map(len, sent)))
            before = b.peers()[0].bytes_sent
            await stream.send_all(frame)
            # Sealed and written by this task: no writer pass before send_all returned.
            assert b.peers()[0].bytes_sent - before >= len(frame)
            sent.append(frame)
            bulk = bytes([i]) * (1 << 20)  # through the writer task, between small sends
            await stream.send_all(bulk)
            sent.append(bulk)
        await stream.send_eof()
        want = b"".join(sent)
        await wait_for(lambda: len(got) >= len(want))
        assert bytes(got) == want
        await stream.aclose()
        n.cancel_scope.cancel()
