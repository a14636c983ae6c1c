"""Direct links for relayed peers (``mesh_node.hole_punch`` and the node core's upgrade): the
addresses a peer may make a node dial (pure), the hello's ``observed`` and ``direct`` keys, and
two nodes linked through a relay on loopback that go direct: a stream opened over the relay
goes on, new streams take the direct link, the relayed link stays as the fallback and carries
the peers when the direct link ends (no peer loss). An address that leads elsewhere fails the
handshake's identity check and takes nothing over."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import trio
from meshtools import address_of, identity, settings, wait_for, with_peers
from prometheus_client.exposition import generate_latest

from mesh_node import hole_punch
from mesh_node.budget import PeerMemory
from mesh_node.budgeted_tcp import budgeted_listeners
from mesh_node.link import MeshStream
from mesh_node.metrics import node_registry
from mesh_node.node import MeshNode
from mesh_node.peers import InboundStream, PeerDown
from mesh_node.relay import RelayService
from mesh_node.settings import HostPort, RelaySettings
from protocol import constants as pc
from protocol.errors import ProtocolError
from protocol.messages import Hello, decode_link_message

ECHO = "direct-echo-test"
OPEN_RELAY = RelaySettings(enable=True, allow="any")
# Not meshtools' fast timeouts: on a loaded machine a link lost to a late heartbeat would be a
# fall back (or a peer loss) these tests did not cause.
PATIENT = {
    "heartbeat_interval_s": 0.5,
    "peer_loss_timeout_s": 10.0,
    "idle_timeout_s": 10.0,
    "handshake_timeout_s": 5.0,
}


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("10.99.0.11:7401", ("10.99.0.11", 7401)),
        ("[2001:db8::1]:7", ("2001:db8::1", 7)),
        ("127.0.0.1:9", ("127.0.0.1", 9)),
        ("example.org:80", None),  # names: no resolver is asked on a peer's word
        ("0.0.0.0:7401", None),
        ("[::]:7401", None),
        ("224.0.0.251:5353", None),
        ("255.255.255.255:1", None),
        ("169.254.1.1:80", None),
        ("10.0.0.1:0", None),
        ("10.0.0.1:65536", None),
        ("10.0.0.1", None),
        ("10.0.0.1:-1", None),
        ("", None),
        (None, None),
    ],
)
def test_only_ip_literals_with_a_port_are_dialled(
    text: str | None, parsed: tuple[str, int] | None
) -> None:
    assert hole_punch.parse_host_port(text) == parsed


def test_a_node_offers_its_listen_port_at_the_addresses_observed_most_recent_first() -> None:
    observed = ["10.99.0.11", "2001:db8::5", "10.99.0.11", "0.0.0.0"]
    observed += [f"10.1.0.{i}" for i in range(9)]
    offered = hole_punch.offered_addresses(observed, 7401)
    assert offered[:2] == ("10.99.0.11:7401", "[2001:db8::5]:7401")
    assert len(offered) == pc.MAX_DIRECT_ADDRESSES and "0.0.0.0:7401" not in offered
    assert hole_punch.offered_addresses(observed, None) == ()


def test_dial_candidates_are_the_offered_addresses_then_the_listen_address() -> None:
    got = hole_punch.dial_candidates(
        ("10.99.0.11:7401", "bogus", "10.99.0.11:7401"), "ws://192.168.1.2:7401"
    )
    assert got == [("10.99.0.11", 7401), ("192.168.1.2", 7401)]
    assert hole_punch.dial_candidates((), "ws://0.0.0.0:7401") == []
    assert hole_punch.speaks_first("aa", "bb") and not hole_punch.speaks_first("bb", "aa")


def test_the_hello_carries_observed_and_direct_and_bounds_them() -> None:
    hello = Hello(listen=None, observed="10.99.0.11:40000", direct=("10.99.0.11:7401",))
    back = decode_link_message(hello.encode())
    assert isinstance(back, Hello)
    assert (back.observed, back.direct) == ("10.99.0.11:40000", ("10.99.0.11:7401",))
    plain = decode_link_message(Hello(listen=None).encode())
    assert isinstance(plain, Hello) and (plain.observed, plain.direct) == (None, ())
    too_many = Hello(listen=None, direct=tuple(f"10.0.0.{i}:1" for i in range(9)))
    with pytest.raises(ProtocolError):
        decode_link_message(too_many.encode())


async def _echo(inbound: InboundStream) -> None:
    while data := await inbound.stream.receive_some():
        await inbound.stream.send_all(data)
    await inbound.stream.send_eof()


def _relay(tmp: Path) -> MeshNode:
    node = MeshNode(settings(tmp, "relay", relay=OPEN_RELAY, **PATIENT), identity())
    node.add_service(RelayService(node))
    return node


def _relayed(tmp: Path, name: str, relay: MeshNode, host: str = "127.0.0.1") -> MeshNode:
    s = settings(tmp, name, listen=HostPort(host, 0), relays=(address_of(relay),), **PATIENT)
    node = MeshNode(s, identity())
    node.register_subprotocol(1, _echo, name=ECHO, major=1)
    node.add_service(RelayService(node))
    return node


async def _round_trip(stream: MeshStream, payload: bytes) -> bytes:
    await stream.send_all(payload)
    got = bytearray()
    with trio.fail_after(5):
        while len(got) < len(payload):
            got += await stream.receive_some()
    return bytes(got)


def _how(a: MeshNode, b: MeshNode) -> tuple[str | None, str | None] | None:
    info = a.peer(b.node_id)
    if info is None or not info.connected:
        return None
    return info.relay, info.fallback_relay


async def test_a_relayed_link_goes_direct_keeps_its_streams_and_falls_back_to_the_relay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first direct dial waits, so a stream can be opened over the relay first.
    monkeypatch.setattr(hole_punch, "UPGRADE_DELAYS_S", (2.0, 1.0))
    relay = _relay(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(relay.run)
        a, b = _relayed(tmp_path, "a", relay), _relayed(tmp_path, "b", relay)
        await nursery.start(a.run)
        await nursery.start(b.run)
        async with a.subscribe() as events:
            await wait_for(lambda: _how(a, b) == (relay.node_id, None), timeout_s=15)
            old = await a.open_stream(b.node_id, 1, name=ECHO, major=1)
            assert await _round_trip(old, b"over the relay") == b"over the relay"
            assert _how(a, b) == (relay.node_id, None)  # the stream is on the relayed link
            # Both learnt their loopback address from the relay and offered it.
            assert a.status()["direct"]["observed"] == ["127.0.0.1"]
            await wait_for(lambda: _how(a, b) == (None, relay.node_id), timeout_s=15)
            await wait_for(lambda: _how(b, a) == (None, relay.node_id), timeout_s=15)
            assert await _round_trip(old, b"still over the relay") == b"still over the relay"
            forwarded = relay.service(RelayService).status()["bytes_forwarded"]
            new = await a.open_stream(b.node_id, 1, name=ECHO, major=1)
            assert await _round_trip(new, b"direct" * 10000) == b"direct" * 10000
            # the new stream's 60 kB did not cross the relay (heartbeats do, a little)
            assert relay.service(RelayService).status()["bytes_forwarded"] - forwarded < 20000
            section = a.status()["direct"]
            assert section["enabled"] and section["attempts"] >= 1
            assert a.direct_counters["upgraded"] + b.direct_counters["upgraded"] >= 1
            doc = next(p for p in a.status()["peers"] if p["node_id"] == b.node_id)
            assert (doc["link"], doc["fallback_relay"]) == ("direct", relay.node_id)
            metrics = generate_latest(node_registry(a.status, a.collectors())).decode()
            assert f'mesh_node_peer_link{{link="direct",peer="{b.node_id}",relay=""}} 1.0' in (
                metrics
            )
            attempts = a.direct_counters["attempts"]
            assert f"mesh_node_direct_attempts_total {float(attempts)}" in metrics
            # The direct link ends: both are back on the relayed link, which still carries
            # the old stream, and nobody hears of a peer loss.
            direct = a._members[b.node_id].link
            assert direct is not None and direct.transport.relay_id is None
            direct.close("test", "the direct path broke")
            await wait_for(lambda: _how(a, b) == (relay.node_id, None), timeout_s=15)
            await wait_for(lambda: _how(b, a) == (relay.node_id, None), timeout_s=15)
            assert await _round_trip(old, b"after the fall") == b"after the fall"
            again = await a.open_stream(b.node_id, 1, name=ECHO, major=1)
            assert await _round_trip(again, b"relayed again") == b"relayed again"
            assert a.direct_counters["fallbacks"] == 1
            while True:
                try:
                    event = events.receive_nowait()
                except trio.WouldBlock:
                    break
                assert not (isinstance(event, PeerDown) and event.node_id == b.node_id), event
        for s in (old, new, again):
            await s.aclose()
        nursery.cancel_scope.cancel()


async def test_an_offered_address_that_leads_elsewhere_takes_nothing_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # b's offered address (127.0.0.2, its port) is where c listens: the dial reaches c, whose
    # handshake proves another id; the relayed link stays until b's real address answers.
    monkeypatch.setattr(hole_punch, "UPGRADE_DELAYS_S", (0.0,))
    relay = _relay(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(relay.run)
        b = _relayed(tmp_path, "b", relay)
        await nursery.start(b.run)
        assert b.listen_url is not None
        port = int(b.listen_url.rsplit(":", 1)[1])
        c_settings = settings(tmp_path, "c", listen=HostPort("127.0.0.2", port), **PATIENT)
        c = MeshNode(c_settings, identity())
        await nursery.start(c.run)
        # a forged observation, as a lying peer would report it (only a hint: it is offered)
        await wait_for(lambda: bool(b.status()["direct"]["observed"]), timeout_s=15)
        b._observed = {"127.0.0.2": None}
        a = _relayed(tmp_path, "a", relay, host="127.0.0.1")
        await nursery.start(a.run)
        await wait_for(lambda: _how(a, b) == (None, relay.node_id), timeout_s=15)
        await wait_for(lambda: a.direct_counters["failed"] >= 1, timeout_s=15)
        failures = a.status()["direct"]["recent_failures"]
        assert any("identity_mismatch" in f for f in failures), failures
        assert a.peer(c.node_id) is None  # the forged address gave c no link either
        nursery.cancel_scope.cancel()


async def test_the_listen_port_is_shared_with_direct_dials_and_refused_to_another_listener() -> (
    None
):
    budget = PeerMemory(1 << 20)
    (listener,) = await budgeted_listeners("127.0.0.1", 0, budget)
    other = (await budgeted_listeners("127.0.0.1", 0, budget))[0]
    try:
        with pytest.raises(OSError) as exc:  # another node on the same port: still refused
            await budgeted_listeners("127.0.0.1", listener.port, budget)
        assert exc.value.errno == errno.EADDRINUSE
        # a direct dial leaves from the listen port (what a port-keeping NAT maps)
        sock = await hole_punch.open_direct("127.0.0.1", other.port, listener.port, 2.0)
        async with sock:
            assert sock.socket.getsockname()[1] == listener.port
            accepted = await other.accept()
            assert accepted.peer_port == listener.port
            await accepted.aclose()
    finally:
        await listener.aclose()
        await other.aclose()


async def test_only_chosen_or_trusted_peers_tell_a_node_where_it_appears(tmp_path: Path) -> None:
    # two nodes of no owner (untrusted both ways): b dialled a, whom it chose (its peers); a
    # never chose b, so b's word on a's address is not taken
    async with trio.open_nursery() as nursery:
        a = MeshNode(settings(tmp_path, "a", **PATIENT), identity())
        await nursery.start(a.run)
        b = MeshNode(with_peers(settings(tmp_path, "b", **PATIENT), a), identity())
        await nursery.start(b.run)
        await wait_for(lambda: a.peer(b.node_id) is not None and b.peer(a.node_id) is not None)
        await wait_for(lambda: b.status()["direct"]["observed"] == ["127.0.0.1"])
        assert a.status()["direct"]["observed"] == []
        assert b.status()["direct"]["offered"] == [f"127.0.0.1:{b.listen_url.rsplit(':', 1)[1]}"]
        nursery.cancel_scope.cancel()
