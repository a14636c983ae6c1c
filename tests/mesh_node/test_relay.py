"""Relays (``mesh_node.relay``, ``mesh_node.circuit``): two nodes that only dial out link
through a relay node over real loopback sockets and run the same Noise handshake end to end
over the circuit; the relay carries ciphertext only (a relay that tampers with, replays or
drops circuit bytes breaks the link with a coded error, and never sees plaintext); policy,
limits, forged relayed addresses and a relay that disappears each end cleanly."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshtools import address_of, identity, settings, topology_node, topology_of, wait_for
from prometheus_client.exposition import generate_latest

from mesh_node.errors import LinkClosed, MeshError, PeerUnavailable, RelayRefused, StreamReset
from mesh_node.link import MeshStream
from mesh_node.metrics import node_registry
from mesh_node.node import MeshNode
from mesh_node.peers import InboundStream, PeerDown
from mesh_node.relay import (
    ASK_BURST,
    ASKS_PER_S,
    CircuitMeter,
    Forward,
    RelayService,
    circuit_refusal,
    forward_bytes,
    take_ask,
)
from mesh_node.settings import (
    NodeSettings,
    RelayedAddress,
    RelaySettings,
    parse_dial_address,
    parse_relayed_address,
    relay_settings,
)
from protocol import constants as pc
from protocol import relay_messages as wire
from protocol.errors import ProtocolError
from protocol.messages import Hello, PeerRecord, Peers, decode_link_message
from skippy.errors import UsageError
from skippy.package.plan import ModelSizes

ECHO = "relay-echo-test"
SIZES = ModelSizes(layer_bytes=(100,) * 6, metadata_bytes=10, embeddings_bytes=50, output_bytes=50)
SHA = "ab" * 32
REF = "hf://lab/pkg@" + "0" * 40
SECRET = b"plaintext-that-only-the-two-ends-may-read-" * 64
OPEN_RELAY = RelaySettings(enable=True, allow="any")


async def _echo(inbound: InboundStream) -> None:
    while data := await inbound.stream.receive_some():
        await inbound.stream.send_all(data)
    await inbound.stream.send_eof()


def relay_node(
    tmp: Path, name: str, relay: RelaySettings, forward: Forward = forward_bytes
) -> MeshNode:
    node = MeshNode(settings(tmp, name, relay=relay), identity())
    node.add_service(RelayService(node, forward=forward))
    return node


def relayed_node(tmp: Path, name: str, *relays: MeshNode, **kw: object) -> MeshNode:
    s: NodeSettings = settings(tmp, name, relays=tuple(address_of(r) for r in relays), **kw)
    node = MeshNode(s, identity())
    node.register_subprotocol(1, _echo, name=ECHO, major=1)
    node.add_service(RelayService(node))
    return node


async def echo_through(a: MeshNode, b: MeshNode, payload: bytes) -> bytes:
    stream = await a.open_stream(b.node_id, 1, name=ECHO, major=1)
    async with stream:
        await stream.send_all(payload)
        await stream.send_eof()
        got = bytearray()
        with trio.fail_after(5):
            while data := await stream.receive_some():
                got += data
    return bytes(got)


def relayed_via(a: MeshNode, b: MeshNode, relay: MeshNode) -> bool:
    info = a.peer(b.node_id)
    return info is not None and info.connected and info.relay == relay.node_id


# wait_for bounds below are for a loaded CI machine (nodes meet in well under a second here).


async def start_relay_trio(
    nursery: trio.Nursery, tmp: Path, relay: MeshNode
) -> tuple[MeshNode, MeshNode]:
    """The relay, then two relayed nodes that learn of each other through its gossip."""
    await nursery.start(relay.run)
    a = relayed_node(tmp, "a", relay)
    b = relayed_node(tmp, "b", relay)
    await nursery.start(a.run)
    await nursery.start(b.run)
    return a, b


class Recorder:
    """An honest relay that keeps a copy of every byte it forwards (what a relay can see)."""

    def __init__(self) -> None:
        self.seen = bytearray()

    async def __call__(self, src: MeshStream, dst: MeshStream, meter: CircuitMeter) -> None:
        while data := await src.receive_some():
            self.seen += data
            meter.allow(len(data))
            await dst.send_all(data)
        await dst.send_eof()


async def test_two_relayed_nodes_link_through_the_relay_and_it_sees_no_plaintext(
    tmp_path: Path,
) -> None:
    recorder = Recorder()
    relay = relay_node(tmp_path, "relay", OPEN_RELAY, recorder)
    async with trio.open_nursery() as nursery:
        a, b = await start_relay_trio(nursery, tmp_path, relay)
        # Neither was configured with the other: the relay's gossip named each one's relay.
        await wait_for(lambda: relayed_via(a, b, relay) and relayed_via(b, a, relay), timeout_s=15)
        assert await echo_through(a, b, SECRET) == SECRET
        assert await echo_through(b, a, b"the other way") == b"the other way"
        doc = a.status()
        entry = next(p for p in doc["peers"] if p["node_id"] == b.node_id)
        assert (entry["link"], entry["relay"]) == ("relayed", relay.node_id)
        direct = next(p for p in doc["peers"] if p["node_id"] == relay.node_id)
        assert (direct["link"], direct["relay"]) == ("direct", None)
        section = relay.status()["relay"]
        assert section["circuits_open"] >= 1 and section["bytes_forwarded"] > len(SECRET)
        metrics = generate_latest(node_registry(a.status, a.collectors())).decode()
        link = (
            f'mesh_node_peer_link{{link="relayed",peer="{b.node_id}",relay="{relay.node_id}"}} 1.0'
        )
        assert link in metrics
        relay_metrics = generate_latest(node_registry(relay.status, relay.collectors())).decode()
        assert "mesh_node_relay_forwarded_bytes_total" in relay_metrics
        opened = re.search(r"^mesh_node_relay_circuits_open (\S+)$", relay_metrics, re.M)
        assert opened is not None and float(opened.group(1)) >= 1
        assert SECRET[:48] not in recorder.seen  # ciphertext only
        assert len(recorder.seen) > len(SECRET)
        nursery.cancel_scope.cancel()


class Misbehaving:
    """A relay that forwards honestly until told, then alters, replays or drops one chunk."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.armed = False
        self.done = False

    async def __call__(self, src: MeshStream, dst: MeshStream, meter: CircuitMeter) -> None:
        while data := await src.receive_some():
            if self.armed and not self.done and len(data) > 64:
                self.done = True
                if self.mode == "tamper":
                    data = data[:-20] + bytes([data[-20] ^ 0x01]) + data[-19:]
                elif self.mode == "replay":
                    data = data + data
                else:  # drop
                    continue
            await dst.send_all(data)
        await dst.send_eof()


@pytest.mark.parametrize("mode", ["tamper", "replay", "drop"])
async def test_a_relay_that_tampers_replays_or_drops_breaks_the_link_with_a_coded_error(
    tmp_path: Path, mode: str
) -> None:
    bad = Misbehaving(mode)
    relay = relay_node(tmp_path, "relay", OPEN_RELAY, bad)
    async with trio.open_nursery() as nursery:
        a, b = await start_relay_trio(nursery, tmp_path, relay)
        await wait_for(lambda: relayed_via(a, b, relay) and relayed_via(b, a, relay), timeout_s=15)
        downs: list[PeerDown] = []

        async def watch(node: MeshNode) -> None:
            async with node.subscribe() as events:
                async for event in events:
                    if isinstance(event, PeerDown) and event.node_id in (a.node_id, b.node_id):
                        downs.append(event)

        nursery.start_soon(watch, a)
        nursery.start_soon(watch, b)
        await trio.sleep(0.05)
        bad.armed = True
        # The request fails as on any lost link (the link may already be gone when it starts:
        # the relay alters the first chunk that passes, a heartbeat's as well as the echo's).
        with pytest.raises((MeshError, trio.BrokenResourceError, trio.ClosedResourceError)):
            await echo_through(a, b, SECRET * 4)
        assert bad.done
        await wait_for(lambda: bool(downs), timeout_s=15)
        codes = {d.reason.split(":")[0] for d in downs}
        # The receiving end refuses what it cannot authenticate: a Noise record that fails
        # (decrypt_failed) or a WebSocket frame cut apart by a dropped or doubled chunk.
        assert codes & {"decrypt_failed", "ws_protocol", "malformed_record"}, codes
        nursery.cancel_scope.cancel()


async def test_a_stranger_is_refused_with_a_code_and_leaves_no_circuit(tmp_path: Path) -> None:
    relay = relay_node(tmp_path, "relay", RelaySettings(enable=True, allow="trusted"))
    async with trio.open_nursery() as nursery:
        a, b = await start_relay_trio(nursery, tmp_path, relay)
        await wait_for(lambda: all(relay.peer(n.node_id) is not None for n in (a, b)), timeout_s=15)
        with pytest.raises(RelayRefused) as caught:
            await a.service(RelayService).dial(RelayedAddress(address_of(relay), b.node_id))
        assert caught.value.actual == "relay_forbidden"
        section = relay.status()["relay"]
        assert section["circuits_open"] == 0 and section["circuits_total"] == 0
        assert section["refused"].get("relay_forbidden", 0) >= 1
        assert not relayed_via(a, b, relay)
        nursery.cancel_scope.cancel()


async def test_a_relay_at_its_circuit_limit_refuses_clearly(tmp_path: Path) -> None:
    relay = relay_node(tmp_path, "relay", replace(OPEN_RELAY, circuits=1))
    async with trio.open_nursery() as nursery:
        a, b = await start_relay_trio(nursery, tmp_path, relay)
        await wait_for(lambda: relayed_via(a, b, relay), timeout_s=15)
        c = relayed_node(tmp_path, "c", relay)
        await nursery.start(c.run)
        await wait_for(lambda: relay.peer(c.node_id) is not None, timeout_s=15)
        with pytest.raises(RelayRefused) as caught:
            await c.service(RelayService).dial(RelayedAddress(address_of(relay), a.node_id))
        assert caught.value.actual == "relay_busy"
        assert relay.status()["relay"]["circuits_open"] == 1
        nursery.cancel_scope.cancel()


async def test_a_relay_without_relaying_refuses_the_stream_kind(tmp_path: Path) -> None:
    relay = relay_node(tmp_path, "relay", RelaySettings())  # off by default
    async with trio.open_nursery() as nursery:
        a, b = await start_relay_trio(nursery, tmp_path, relay)
        await wait_for(lambda: all(relay.peer(n.node_id) is not None for n in (a, b)), timeout_s=15)
        info = relay.peer(a.node_id)
        assert info is not None
        relay_bits = a.peer(relay.node_id).features.get(pc.FEATURE_MESH_RELAY)  # type: ignore[union-attr]
        assert relay_bits == (pc.BIT_RELAYED,)
        with pytest.raises(Exception) as caught:
            await a.service(RelayService).dial(RelayedAddress(address_of(relay), b.node_id))
        assert getattr(caught.value, "code", None) == "stream_refused"
        nursery.cancel_scope.cancel()


async def test_a_forged_relayed_address_fails_the_handshake_closed(tmp_path: Path) -> None:
    """Gossip may say that X sits behind the relay, but the circuit reaches whoever the relay
    hands it to: the end-to-end handshake demands X's key, so an impostor is refused."""
    relay = relay_node(tmp_path, "relay", OPEN_RELAY)
    async with trio.open_nursery() as nursery:
        a, b = await start_relay_trio(nursery, tmp_path, relay)
        await wait_for(lambda: relayed_via(a, b, relay), timeout_s=15)
        # An id nobody holds: the relay has no such target.
        nobody = "ab" * 32
        with pytest.raises(RelayRefused) as caught:
            await a.service(RelayService).dial(RelayedAddress(address_of(relay), nobody))
        assert caught.value.actual == "relay_no_target"
        assert relay.status()["relay"]["circuits_open"] == 1  # a <-> b only
        nursery.cancel_scope.cancel()


class Impostor(RelayService):
    """A relay that hands every circuit to a node of its choice, whoever was asked for."""

    def __init__(self, node: MeshNode) -> None:
        super().__init__(node)
        self.hand_to: str | None = None

    async def _splice(self, source_stream: MeshStream, source: str, target: str) -> None:
        await super()._splice(source_stream, source, self.hand_to or target)


async def test_a_relay_that_hands_the_circuit_to_an_impostor_is_refused(tmp_path: Path) -> None:
    relay = MeshNode(settings(tmp_path, "relay", relay=OPEN_RELAY), identity())
    impostor = Impostor(relay)
    relay.add_service(impostor)
    async with trio.open_nursery() as nursery:
        a, b = await start_relay_trio(nursery, tmp_path, relay)
        await wait_for(lambda: relayed_via(a, b, relay), timeout_s=15)
        c = relayed_node(tmp_path, "c", relay)
        await nursery.start(c.run)
        await wait_for(lambda: relay.peer(c.node_id) is not None, timeout_s=15)
        impostor.hand_to = b.node_id  # c asks for a, the relay hands it b
        with pytest.raises(ProtocolError) as caught:
            await c.service(RelayService).dial(RelayedAddress(address_of(relay), a.node_id))
        assert caught.value.code == "identity_mismatch"
        nursery.cancel_scope.cancel()


async def test_a_relay_that_disappears_ends_the_relayed_link(tmp_path: Path) -> None:
    relay = relay_node(tmp_path, "relay", OPEN_RELAY)
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as relay_scope:
            async with trio.open_nursery() as relay_nursery:
                await relay_nursery.start(relay.run)
                a = relayed_node(tmp_path, "a", relay)
                b = relayed_node(tmp_path, "b", relay)
                await nursery.start(a.run)
                await nursery.start(b.run)
                await wait_for(
                    lambda: relayed_via(a, b, relay) and relayed_via(b, a, relay), timeout_s=15
                )
                relay_scope.cancel()  # the relay process is gone: no goodbye, no close
        await wait_for(lambda: not relayed_via(a, b, relay), timeout_s=15)
        with pytest.raises(PeerUnavailable):
            await a.open_stream(b.node_id, 1, name=ECHO, major=1)
        nursery.cancel_scope.cancel()


def test_circuit_refusal_decides_policy_limits_and_targets() -> None:
    s = RelaySettings(enable=True, allow="trusted", circuits=2, circuits_per_peer=1)
    src, dst = "aa" * 32, "bb" * 32
    ok: dict[str, Any] = dict(
        source=src,
        source_trusted=True,
        target=dst,
        target_trusted=True,
        target_accepts=True,
        open_total=0,
        open_by_peer={},
    )
    assert circuit_refusal(s, **ok) is None
    cases: dict[str, dict[str, Any]] = {
        "relay_forbidden": {"source_trusted": False},
        "relay_bad_target": {"target": src},
        "relay_no_target": {"target_trusted": None},
        "relay_busy": {"open_total": 2},
        "relay_peer_busy": {"open_by_peer": {dst: 1}},
    }
    for code, change in cases.items():
        refusal = circuit_refusal(s, **{**ok, **change})
        assert refusal is not None and refusal[0] == code, (code, refusal)
    assert circuit_refusal(replace(s, allow="any"), **{**ok, "source_trusted": False}) is None


def test_circuit_messages_round_trip_and_refuse_anything_else() -> None:
    for message in (
        wire.CircuitConnect(b"\x01" * 32),
        wire.CircuitIncoming(b"\x02" * 32),
        wire.CircuitOk(),
        wire.CircuitRefused("relay_busy", "full"),
    ):
        assert wire.decode(wire.encode(message)) == message
    import msgpack

    for bad in (
        {"t": "connect", "gen": 1, "target": b"short"},
        {"t": "connect", "gen": 1, "target": b"\x01" * 32, "extra": 1},
        {"t": "hello", "gen": 1},
        {"t": "ok", "gen": 2},
    ):
        with pytest.raises(ProtocolError) as caught:
            wire.decode(msgpack.packb(bad, use_bin_type=True))
        assert caught.value.code == "bad_circuit_message"


def test_relayed_addresses_and_relay_config_parse_or_refuse_clearly() -> None:
    rid, nid = "cd" * 32, "ef" * 32
    text = f"ws://203.0.113.5:7000#{rid}/relayed/{nid}"
    parsed = parse_relayed_address(text)
    assert (parsed.relay.host, parsed.relay.port, parsed.relay.node_id, parsed.node_id) == (
        "203.0.113.5",
        7000,
        rid,
        nid,
    )
    assert str(parsed) == text
    assert parse_dial_address(text) == parsed  # a peers entry may be a relayed address
    assert parse_dial_address(f"ws://h:1#{nid}").node_id == nid
    for bad in (f"ws://203.0.113.5:7000/relayed/{nid}", f"ws://h:1#{rid}/relayed/xyz"):
        with pytest.raises(UsageError):
            parse_relayed_address(bad)
    assert relay_settings(None) == RelaySettings()
    assert relay_settings({"enable": True, "allow": "any", "circuits": 3}).circuits == 3
    for bad_table in ({"enable": "yes"}, {"allow": "everyone"}, {"circuits": 0}, {"nope": 1}):
        with pytest.raises(UsageError):
            relay_settings(bad_table)


def test_old_peers_keep_working_gossip_and_hello_carry_relays_only_as_extensions() -> None:
    # A hello with relays decodes here; an older decoder would ignore the extension key.
    hello = Hello(listen="ws://10.0.0.2:7000", relays=(f"ws://1.2.3.4:7000#{'cd' * 32}",))
    decoded = decode_link_message(hello.encode())
    assert isinstance(decoded, Hello) and decoded.relays == hello.relays
    # A record without relays is byte-for-byte what older nodes send and accept.
    plain = Peers((PeerRecord(b"\x01" * 32, "ws://10.0.0.2:7000"),)).encode()
    assert b"relays" not in plain
    with_relays = Peers((PeerRecord(b"\x01" * 32, "ws://x:1", ("ws://r:2#" + "cd" * 32,)),))
    assert decode_link_message(with_relays.encode()) == with_relays


async def test_a_coordinator_and_two_workers_reachable_only_by_relay_agree_on_a_topology(
    tmp_path: Path,
) -> None:
    """Nobody is configured with anybody but the relay: the three find each other through its
    gossip, link through circuits (the relay serves trusted peers only: one owner), and the
    coordinator's signed topology is offered, verified and acknowledged over relayed links."""
    owner = Ed25519PrivateKey.generate()
    relay = MeshNode(settings(tmp_path, "relay", relay=RelaySettings(enable=True)), identity(owner))
    relay.add_service(RelayService(relay))
    async with trio.open_nursery() as nursery:
        await nursery.start(relay.run)
        nodes = []
        for name in ("coord", "w0", "w1"):
            s = settings(tmp_path, name, relays=(address_of(relay),))
            node = topology_node(s, identity(owner))
            node.add_service(RelayService(node))
            await nursery.start(node.run)
            nodes.append(node)
        coord, *workers = nodes
        await wait_for(
            lambda: all(relayed_via(x, y, relay) for x in nodes for y in nodes if x is not y),
            timeout_s=10,
        )
        active = await topology_of(coord).propose(package_ref=REF, manifest_sha256=SHA, sizes=SIZES)
        assert active.state == "active"
        assert active.acks == {w.node_id: "accepted" for w in workers}
        assert {s.node_id for s in active.topology.stages} == {n.node_id for n in nodes}
        for w in workers:
            got = topology_of(w).active
            assert got is not None and got.coordinator_id == coord.node_id
            assert got.topology == active.topology
        nursery.cancel_scope.cancel()


async def test_a_relayed_link_moves_to_another_relay_or_direct_when_its_relay_disappears(
    tmp_path: Path,
) -> None:
    async with trio.open_nursery() as nursery:
        scopes: dict[str, trio.CancelScope] = {}
        relays = []
        for name in ("r1", "r2"):
            relay = relay_node(tmp_path, name, OPEN_RELAY)
            scope = trio.CancelScope()

            async def run(node: MeshNode, cancel: trio.CancelScope, *, task_status: Any) -> None:
                with cancel:
                    await node.run(task_status=task_status)

            await nursery.start(run, relay, scope)
            scopes[relay.node_id] = scope
            relays.append(relay)
        a = relayed_node(tmp_path, "a", *relays)
        b = relayed_node(tmp_path, "b", *relays)
        await nursery.start(a.run)
        await nursery.start(b.run)

        def via() -> str | None:
            info = a.peer(b.node_id)
            return info.relay if info is not None and info.connected else None

        await wait_for(lambda: via() is not None, timeout_s=15)
        first = via()
        assert first in scopes
        scopes[first].cancel()  # that relay is gone

        def back() -> bool:
            # Linked again, both ends over the same route, and not through the lost relay:
            # the other relay, or a direct link (these nodes listen on loopback, so a dial of
            # a gossiped listen address may win the race; in the NAT lab it cannot).
            there, here = a.peer(b.node_id), b.peer(a.node_id)
            return (
                there is not None
                and here is not None
                and there.connected
                and here.connected
                and there.relay != first
                and there.relay == here.relay
            )

        await wait_for(back, timeout_s=15)
        try:
            echoed = await echo_through(a, b, b"still here")
        except LinkClosed:
            # Both ends dialled at once: the pair of links converges to one (the rule of any
            # simultaneous dial), and a request on the replaced one fails as on a lost link.
            await wait_for(back, timeout_s=15)
            echoed = await echo_through(a, b, b"still here")
        assert echoed == b"still here"
        nursery.cancel_scope.cancel()


async def test_a_peer_asking_for_circuits_in_a_loop_is_refused_quietly_past_its_rate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    relay = relay_node(tmp_path, "relay", RelaySettings(enable=True, allow="trusted"))
    async with trio.open_nursery() as nursery:
        a, b = await start_relay_trio(nursery, tmp_path, relay)
        await wait_for(lambda: all(relay.peer(n.node_id) is not None for n in (a, b)), timeout_s=15)
        caplog.clear()
        codes = []
        for _ in range(ASK_BURST + 30):
            try:
                await a.service(RelayService).dial(RelayedAddress(address_of(relay), b.node_id))
            except RelayRefused as exc:
                codes.append(exc.actual)
            except StreamReset as exc:
                codes.append(exc.actual)
        # The burst is decided (less what a's own dial loops asked while the nodes met), then,
        # the bucket refilling at its rate meanwhile, most asks are refused before any work.
        assert codes[: ASK_BURST // 2] == ["relay_forbidden"] * (ASK_BURST // 2), codes
        assert set(codes) == {"relay_forbidden", "relay_rate"}
        refused = relay.status()["relay"]["refused"]
        assert refused["relay_rate"] >= codes.count("relay_rate") >= 15  # (a's loops ask too)
        relay_lines = [r for r in caplog.records if r.name == "mesh_node.relay"]
        assert len(relay_lines) <= 1
        nursery.cancel_scope.cancel()


def test_the_ask_bucket_refills_at_its_rate() -> None:
    allowed, bucket = take_ask(None, 0.0)
    assert allowed
    assert bucket == (float(ASK_BURST - 1), 0.0)
    empty = (0.5, 10.0)
    assert not take_ask(empty, 10.0)[0]
    assert take_ask(empty, 10.0 + 1 / ASKS_PER_S)[0]
