"""Hostile peers against a real node on loopback: each case ends with no crash, bounded state,
and the node's other links unaffected."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshtools import (
    FAST,
    address_of,
    identity,
    settings,
    topology_node,
    topology_of,
    wait_for,
    with_peers,
)
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url

from mesh_node.errors import LinkClosed, StreamReset, StreamStalled
from mesh_node.node import MeshNode
from mesh_node.peers import InboundStream
from protocol import constants as pc
from protocol import frames as f
from protocol.handshake import Handshake, SecureChannel
from protocol.messages import Hello
from protocol.streams import Multiplexer

MIB = 1024 * 1024


@asynccontextmanager
async def raw_peer(
    node: MeshNode, key: Ed25519PrivateKey | None = None, expected: bytes | None = None
) -> AsyncIterator[tuple[WebSocketConnection, SecureChannel, Multiplexer]]:
    """A hand-driven peer: a real handshake, then whatever bytes the test wants to send."""
    key = key or Ed25519PrivateKey.generate()
    assert node.listen_url is not None
    async with open_websocket_url(node.listen_url, max_message_size=4 * MIB) as ws:
        hs = Handshake(initiator=True, identity=key, expected_peer=expected)
        await ws.send_message(hs.start())
        reply = hs.receive(await ws.get_message())
        assert reply is not None and hs.channel is not None
        await ws.send_message(reply)
        yield ws, hs.channel, Multiplexer(initiator=True)


def link_to(node: MeshNode, peer_key: Ed25519PrivateKey):
    member = node._members.get(peer_key.public_key().public_bytes_raw().hex())
    return None if member is None else member.link


async def wait_closed(ws: WebSocketConnection) -> None:
    with trio.fail_after(5):
        while True:
            try:
                await ws.get_message()
            except ConnectionClosed:
                return


@asynccontextmanager
async def pair(tmp_path) -> AsyncIterator[tuple[MeshNode, MeshNode, trio.Nursery]]:
    """A node under attack and a good peer whose link must survive."""
    async with trio.open_nursery() as n:
        # the victim's stream kinds are the tests' own, beside the control kind
        victim = topology_node(settings(tmp_path, "victim"), identity(), stage_host=False)
        await n.start(victim.run)
        good = topology_node(with_peers(settings(tmp_path, "good"), victim), identity())
        await n.start(good.run)
        await wait_for(lambda: len(victim.peers(connected_only=True)) == 1)
        yield victim, good, n
        n.cancel_scope.cancel()


async def assert_good_link_alive(victim: MeshNode, good: MeshNode) -> None:
    stream = await good.open_stream(victim.node_id, pc.KIND_CONTROL)
    await stream.aclose()
    (p,) = [p for p in victim.peers() if p.node_id == good.node_id]
    assert p.connected


async def test_dialing_an_address_whose_node_proves_another_id_fails_closed(tmp_path):
    async with pair(tmp_path) as (victim, good, n):
        impostor_target = address_of(victim)
        wrong = type(impostor_target)(impostor_target.host, impostor_target.port, "ab" * 32)
        dialer = topology_node(settings(tmp_path, "dialer", peers=(wrong,)), identity())
        await n.start(dialer.run)
        await trio.sleep(FAST["heartbeat_interval_s"] * 5)  # several dial attempts
        assert dialer.peers() == []  # never a member
        assert dialer.node_id not in {p.node_id for p in victim.peers()}  # never revealed
        await assert_good_link_alive(victim, good)


@pytest.mark.parametrize(
    ("record", "code"),
    [
        (struct.pack(">BBII", pc.FRAME_DATA, 0, 1, pc.MAX_FRAME_PAYLOAD + 1), "frame_too_large"),
        (
            struct.pack(">BBII", pc.FRAME_MESSAGE, 0, 0, 40 * 1024) + b"x" * 40 * 1024,
            "frame_too_large",
        ),
        (f.encode_frame(pc.FRAME_MESSAGE, 0, b"\xc1\x92garbage"), "malformed_message"),
        (
            f.encode_frame(pc.FRAME_MESSAGE, 0, Hello("ws://x:1", {}, 1).encode()[:-3]),
            "malformed_message",
        ),
        (struct.pack(">BBII", 0x44, 0, 0, 0), "unknown_frame_type"),
    ],
    ids=[
        "oversize-data-frame",
        "oversize-control-frame",
        "not-msgpack",
        "truncated-msgpack",
        "unknown-frame",
    ],
)
async def test_protocol_violations_close_only_that_link(tmp_path, record, code):
    key = Ed25519PrivateKey.generate()
    async with pair(tmp_path) as (victim, good, _), raw_peer(victim, key) as (ws, channel, _mux):
        await wait_for(lambda: link_to(victim, key) is not None)
        link = link_to(victim, key)
        await ws.send_message(channel.seal([record]))
        await wait_closed(ws)
        assert link is not None and link.close_reason is not None
        assert link.close_reason[0] == code
        assert link.mux.stream_ids() == []
        await assert_good_link_alive(victim, good)


async def test_an_oversize_websocket_message_closes_only_that_link(tmp_path):
    key = Ed25519PrivateKey.generate()
    async with pair(tmp_path) as (victim, good, _), raw_peer(victim, key) as (ws, _c, _m):
        # Refused at its header: the close can come while the message is still being sent.
        with contextlib.suppress(ConnectionClosed):
            await ws.send_message(b"\x00" * (pc.DEFAULT_LIMITS.max_ws_message_bytes + 1))
        await wait_closed(ws)
        assert ws.closed is not None and ws.closed.code == 1009  # RFC 6455: message too big
        await assert_good_link_alive(victim, good)


async def test_a_tampered_byte_in_transit_kills_the_link(tmp_path):
    """A TCP proxy between two real nodes flips one byte deep inside the encrypted traffic."""
    got_data = trio.Event()

    async def sink(inbound: InboundStream) -> None:
        while await inbound.stream.receive_some():
            got_data.set()

    async with trio.open_nursery() as n:
        victim = topology_node(settings(tmp_path, "victim"), identity(), stage_host=False)
        victim.register_subprotocol(pc.KIND_TRANSPORT, sink)
        await n.start(victim.run)
        target = address_of(victim)
        flipped = trio.Event()

        async def proxy(client: trio.SocketStream) -> None:
            upstream = await trio.open_tcp_stream(target.host, target.port)
            seen = 0

            async def forward(src: trio.abc.Stream, dst: trio.abc.Stream, tamper: bool) -> None:
                nonlocal seen
                while data := await src.receive_some(65536):
                    if tamper and not flipped.is_set() and seen + len(data) > 300_000:
                        pos = max(0, 300_000 - seen)
                        data = data[:pos] + bytes([data[pos] ^ 0x04]) + data[pos + 1 :]
                        flipped.set()
                    if tamper:
                        seen += len(data)
                    await dst.send_all(data)

            async with client, upstream, trio.open_nursery() as pn:
                pn.start_soon(forward, client, upstream, True)
                pn.start_soon(forward, upstream, client, False)

        listeners = await n.start(trio.serve_tcp, proxy, 0)
        port = listeners[0].socket.getsockname()[1]
        via_proxy = type(target)("127.0.0.1", port, victim.node_id)
        sender = topology_node(settings(tmp_path, "sender", peers=(via_proxy,)), identity())
        await n.start(sender.run)
        await wait_for(lambda: len(sender.peers(connected_only=True)) == 1)
        link = victim._members[sender.node_id].link
        stream = await sender.open_stream(victim.node_id, pc.KIND_TRANSPORT)
        with pytest.raises((LinkClosed, StreamReset)):
            for _ in range(64):
                await stream.send_all(b"q" * 65536)
                await trio.sleep(0)
            await wait_for(lambda: link is not None and link.closed.is_set())
            await stream.send_all(b"after")  # the link is gone
        assert flipped.is_set() and got_data.is_set()
        assert link is not None and link.close_reason is not None
        assert link.close_reason[0] == "decrypt_failed"
        n.cancel_scope.cancel()


async def test_a_stream_flood_is_refused_beyond_the_limit_and_state_stays_bounded(tmp_path):
    key = Ed25519PrivateKey.generate()
    async with pair(tmp_path) as (victim, good, _), raw_peer(victim, key) as (ws, channel, mux):
        await wait_for(lambda: link_to(victim, key) is not None)
        opens = [
            f.encode_frame(
                pc.FRAME_OPEN,
                2 * i + 1,
                # A real kind (control): an unknown one is refused whatever the limit says.
                f.SubprotocolOpen("skippy-stage", 2, pc.KIND_CONTROL).encode(),
            )
            for i in range(2000)
        ]
        resets = accepts = 0
        for start in range(0, len(opens), 1000):
            record = b"".join(opens[start : start + 1000])
            await ws.send_message(
                channel.seal([record[i : i + 60000] for i in range(0, len(record), 60000)])
            )
        with trio.fail_after(5):
            while resets + accepts < 2000:
                for pt in channel.open(await ws.get_message()):
                    frames = f.decode_frames(pt)
                    resets += sum(1 for fr in frames if fr.type == pc.FRAME_RESET)
                    accepts += sum(1 for fr in frames if fr.type == pc.FRAME_ACCEPT)
        assert accepts <= pc.DEFAULT_LIMITS.max_streams_per_link  # the per-link stream limit
        link = link_to(victim, key)
        assert link is not None and not link.closed.is_set()
        assert len(link.mux.stream_ids()) <= pc.DEFAULT_LIMITS.max_streams_per_link
        await assert_good_link_alive(victim, good)
        del mux


async def test_a_peer_that_never_reads_is_dropped_and_memory_stays_bounded(tmp_path):
    key = Ed25519PrivateKey.generate()
    outcome: list[BaseException] = []

    async def firehose(inbound: InboundStream) -> None:
        try:
            while True:
                await inbound.stream.send_all(b"f" * MIB)
        except BaseException as exc:  # stalled, or cancelled with its link: either ends it
            outcome.append(exc)
            raise

    async def keep_pinging(ws: WebSocketConnection, channel: SecureChannel) -> None:
        # Alive (heartbeats keep coming) but never reading: only the stall can catch it.
        pinger = Multiplexer(initiator=True)
        while True:
            pinger.ping(b"01234567")
            await ws.send_message(channel.seal([pinger.next_record() or b""]))
            await trio.sleep(FAST["heartbeat_interval_s"])

    async with pair(tmp_path) as (victim, good, _), raw_peer(victim, key) as (ws, channel, mux):
        victim.register_subprotocol(pc.KIND_TRANSPORT, firehose)
        await wait_for(lambda: link_to(victim, key) is not None)
        link = link_to(victim, key)
        mux.open_stream(f.SubprotocolOpen("skippy-stage", 2, pc.KIND_TRANSPORT))
        await ws.send_message(channel.seal([mux.next_record() or b""]))
        async with trio.open_nursery() as pn:
            pn.start_soon(keep_pinging, ws, channel)
            # ... and from now on this peer never reads its socket again.
            await wait_for(lambda: bool(outcome), timeout_s=10)
            assert link is not None
            queued = sum(len(c) for s in link.mux._streams.values() for c in s.queued)
            assert queued <= pc.DEFAULT_LIMITS.stream_window_bytes
            assert link.mux.control_backlog() <= pc.DEFAULT_LIMITS.max_control_backlog_bytes
            assert isinstance(outcome[0], StreamStalled) or (
                link.close_reason is not None and link.close_reason[0] == "peer_not_reading"
            ), (outcome, link.close_reason)
            await assert_good_link_alive(victim, good)
            pn.cancel_scope.cancel()


async def test_a_half_open_handshake_is_dropped_after_the_handshake_timeout(tmp_path):
    async with pair(tmp_path) as (victim, good, _):
        assert victim.listen_url is not None
        host, port = victim.listen_url.removeprefix("ws://").rsplit(":", 1)
        silent = await trio.open_tcp_stream(host, int(port))  # not even a WebSocket upgrade
        async with open_websocket_url(victim.listen_url) as ws:
            hs = Handshake(initiator=True, identity=Ed25519PrivateKey.generate())
            await ws.send_message(hs.start())  # message 1, then silence
            await ws.get_message()  # the node's message 2
            await assert_good_link_alive(victim, good)  # served meanwhile
            await wait_closed(ws)  # dropped after handshake_timeout_s
        with trio.fail_after(5):
            while await silent.receive_some(1024):
                pass
        await silent.aclose()
        assert [p.node_id for p in victim.peers()] == [good.node_id]


async def test_a_silent_peer_is_detected_as_lost_by_heartbeats(tmp_path):
    key = Ed25519PrivateKey.generate()
    async with pair(tmp_path) as (victim, good, _), raw_peer(victim, key) as (ws, channel, mux):
        mux.send_link_message(Hello(None, {}, 0).encode())
        await ws.send_message(channel.seal([mux.next_record() or b""]))
        await wait_for(lambda: victim.peer(key.public_key().public_bytes_raw().hex()) is not None)
        link = link_to(victim, key)
        async with victim.subscribe() as events:
            with trio.fail_after(5):
                event = await events.receive()  # we answer no pings and send nothing
        assert event.node_id == key.public_key().public_bytes_raw().hex()  # type: ignore[union-attr]
        assert link is not None and link.close_reason is not None
        assert link.close_reason[0] == "peer_lost"
        await assert_good_link_alive(victim, good)


async def test_a_peer_without_the_stage_bundle_is_never_placed(tmp_path):
    key = Ed25519PrivateKey.generate()
    async with pair(tmp_path) as (victim, good, _), raw_peer(victim, key) as (ws, channel, mux):
        partial = {pc.FEATURE_SKIPPY_STAGE: (pc.BIT_CONTROL, pc.BIT_STATUS)}
        mux.send_link_message(Hello(None, partial, 1 << 40).encode())
        await ws.send_message(channel.seal([mux.next_record() or b""]))
        raw_id = key.public_key().public_bytes_raw().hex()
        await wait_for(lambda: victim.peer(raw_id) is not None)
        capable = {n.node_id for n in topology_of(victim).capable_nodes(include_self=True)}
        assert capable == {victim.node_id, good.node_id}


async def test_a_dialer_survives_peers_that_hang_up_or_speak_garbage(tmp_path):
    from trio_websocket import serve_websocket

    async def hang_up(request) -> None:
        ws = await request.accept()
        await ws.aclose()

    async def garbage(request) -> None:
        ws = await request.accept()
        await ws.get_message()
        await ws.send_message(b"\x00" * 100)  # not a Noise message 2
        await trio.sleep(1)

    async with pair(tmp_path) as (victim, good, n):
        bad = []
        for handler in (hang_up, garbage):
            server = await n.start(
                lambda task_status, h=handler: serve_websocket(
                    h, "127.0.0.1", 0, None, task_status=task_status
                )
            )
            bad.append(type(address_of(victim))("127.0.0.1", server.port, "cd" * 32))
        dialer = topology_node(
            settings(tmp_path, "dialer", peers=(*bad, address_of(victim))), identity()
        )
        await n.start(dialer.run)
        await wait_for(lambda: len(dialer.peers(connected_only=True)) >= 1)
        await trio.sleep(FAST["heartbeat_interval_s"] * 5)  # several failed redials
        assert {p.node_id for p in dialer.peers(connected_only=True)} >= {victim.node_id}
        assert "cd" * 32 not in {p.node_id for p in dialer.peers()}
        await assert_good_link_alive(victim, good)


async def test_a_link_failing_while_its_node_shuts_down_leaves_as_its_own_error():
    """A dial whose link fails (here: ConnectionClosed) at the moment its node is cancelled
    must leave as that error (which the dial loop handles, then sees the cancellation) or as
    a cancellation, never as a group of the error and a Cancelled: such a group escaped the
    dial loop's error handling and crashed the node's shutdown (a CI failure of the dialer
    test above)."""
    from trio_websocket import serve_websocket

    from mesh_node.budget import PeerMemory
    from mesh_node.websocket import ConnectionClosed as LinkWebSocketClosed
    from mesh_node.websocket import WebSocketSettings, connect
    from protocol.ws_close import CloseReason

    async def silent(request) -> None:
        await request.accept()
        await trio.sleep_forever()

    settings = WebSocketSettings(max_message_bytes=MIB, handshake_s=5, disconnect_s=0.2)
    async with trio.open_nursery() as n:
        server = await n.start(
            lambda task_status: serve_websocket(
                silent, "127.0.0.1", 0, None, task_status=task_status
            )
        )
        with trio.CancelScope() as shutdown, pytest.raises(LinkWebSocketClosed):
            async with connect("127.0.0.1", server.port, PeerMemory(16 * MIB), settings):
                await trio.sleep(0.05)
                shutdown.cancel()  # the node shuts down ...
                raise LinkWebSocketClosed(CloseReason(1000))  # ... as the link fails
        n.cancel_scope.cancel()


async def test_a_fragmented_message_with_a_ping_between_its_frames_is_taken_and_answered(tmp_path):
    """A peer may fragment a message and send control frames between its fragments
    (RFC 6455 5.4): the node takes the message (its mux ping is answered), and the link's
    WebSocket pings are still answered after it."""
    from protocol import streams as ev
    from protocol.ws_frames import frame_header, mask_in_place

    def masked(b0: int, payload: bytes) -> bytes:
        key = b"\x11\x22\x33\x44"
        head = bytearray(frame_header(len(payload), key))
        head[0] = b0
        body = bytearray(payload)
        mask_in_place(body, 0, key)
        return bytes(head) + bytes(body)

    key = Ed25519PrivateKey.generate()
    async with pair(tmp_path) as (victim, good, _), raw_peer(victim, key) as (ws, channel, mux):
        await wait_for(lambda: link_to(victim, key) is not None)
        mux.ping(b"frag-pin")
        message = channel.seal([mux.next_record() or b""])
        half = len(message) // 2
        ws_ping = masked(0x89, b"ws-ping")
        stream = ws._stream  # the client's own socket stream: frames written as they are
        await stream.send_all(
            masked(0x02, message[:half]) + ws_ping + masked(0x80, message[half:])
        )
        with trio.fail_after(5):
            pongs = []
            while not pongs:
                for plaintext in channel.open(await ws.get_message()):
                    pongs += [e for e in mux.receive(plaintext) if isinstance(e, ev.PongReceived)]
        assert pongs[0].opaque == b"frag-pin"
        with trio.fail_after(5):
            await ws.ping(b"after")  # trio-websocket's own ping, answered by the node
        await assert_good_link_alive(victim, good)
