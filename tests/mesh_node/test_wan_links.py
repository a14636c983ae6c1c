"""Links that ride out a WAN, at reduced scale: real nodes in one process,
every link through the emulated-link relay (``mesh_node.lab.netem``) via ``dial_via``.

Short timeouts stand in for the defaults (heartbeat 0.2 s, peer loss 2 s); the behaviours are
the same: a dropped connection that comes back within ``peer_loss_timeout_s`` is not a peer
loss, a blackhole partition shorter than it keeps the link, one that outlasts it is a loss
that heals when the partition does. Assertions are on events and link identity, never on
elapsed time."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from meshtools import identity, settings, topology_node, topology_of, wait_for

from mesh_node.lab.netem import LinkSpec, LinkTable, Netem, open_netem
from mesh_node.link import Link
from mesh_node.node import MeshNode
from mesh_node.peers import NodeEvent, PeerDown
from mesh_node.settings import PeerAddress
from protocol.messages import ComputeCost
from skippy.package.plan import ModelSizes

TIMEOUTS = {"heartbeat_interval_s": 0.2, "peer_loss_timeout_s": 2.0, "idle_timeout_s": 3.0}
SIZES = ModelSizes(layer_bytes=(100,) * 6, metadata_bytes=10, embeddings_bytes=50, output_bytes=50)
SHA = "ab" * 32
REF = "hf://lab/pkg@" + "0" * 40


@dataclass
class Mesh:
    netem: Netem
    nodes: list[MeshNode]
    events: list[list[NodeEvent]]  # what each node emitted since it started

    def link(self, i: int, j: int) -> Link | None:
        member = self.nodes[i]._members.get(self.nodes[j].node_id)
        return None if member is None else member.link

    def downs(self) -> list[PeerDown]:
        return [e for evs in self.events for e in evs if isinstance(e, PeerDown)]

    def meshed(self) -> bool:
        """Every node linked to every other, hellos exchanged (a peer counts from its hello)."""
        want = {n.node_id for n in self.nodes}
        return all(
            {p.node_id for p in n.peers(connected_only=True)} == want - {n.node_id}
            for n in self.nodes
        )


@asynccontextmanager
async def relayed_mesh(
    tmp: Path,
    count: int,
    links: LinkTable,
    compute: Sequence[ComputeCost | None] = (),
    **node_kw: Any,
) -> AsyncIterator[Mesh]:
    """``count`` nodes, node k > 0 configured to dial node 0; every dial crosses a relay.
    ``compute[k]``: node k's calibration, advertised in its hello (default: none)."""
    idents = [identity() for _ in range(count)]
    async with open_netem(links, seed=7) as netem, trio.open_nursery() as nursery:
        nodes: list[MeshNode] = []
        for k, ident in enumerate(idents):
            via = {}
            for j, other in enumerate(idents):
                if j != k:
                    url = await netem.route(f"n{k}", f"n{j}")
                    host, port = url.removeprefix("ws://").rsplit(":", 1)
                    via[other.node_id] = PeerAddress(host, int(port), other.node_id)
            peers = ()
            if k > 0:
                host, port = nodes[0].listen_url.removeprefix("ws://").rsplit(":", 1)  # type: ignore[union-attr]
                peers = (PeerAddress(host, int(port), idents[0].node_id),)
            s = settings(tmp, f"n{k}", peers=peers, dial_via=via, **TIMEOUTS, **node_kw)
            node = topology_node(s, ident)
            node.compute = compute[k] if k < len(compute) else None
            await nursery.start(node.run)
            assert node.listen_url is not None
            h, p = node.listen_url.removeprefix("ws://").rsplit(":", 1)
            netem.set_target(f"n{k}", lambda h=h, p=int(p): (h, p))
            nodes.append(node)
        mesh = Mesh(netem, nodes, [[] for _ in nodes])
        for k, node in enumerate(nodes):

            async def collect(node: MeshNode = node, out: list[NodeEvent] = mesh.events[k]) -> None:
                async with node.subscribe() as events:
                    async for event in events:
                        out.append(event)

            nursery.start_soon(collect)
        await wait_for(mesh.meshed, timeout_s=30)
        try:
            yield mesh
        finally:
            nursery.cancel_scope.cancel()


async def test_every_link_crosses_its_relay_and_heartbeats_measure_the_emulated_rtt(tmp_path):
    links = LinkTable(LinkSpec(rtt_s=0.05, jitter_s=0.005))
    async with relayed_mesh(tmp_path, 3, links) as mesh:
        # Several heartbeats at 50 ms RTT with jitter: no peer flaps.
        await trio.sleep(1.5)
        assert mesh.downs() == []
        for i in range(3):
            for j in range(3):
                if i != j:
                    link = mesh.link(i, j)
                    assert link is not None and link.rtt_s is not None
                    assert link.rtt_s >= 0.05 - 2 * 0.005  # the relay's delay is in it
        pairs = {frozenset((e.src, e.dst)) for e in mesh.netem.events if e.kind == "connect"}
        assert pairs == {frozenset(p) for p in (("n0", "n1"), ("n0", "n2"), ("n1", "n2"))}


async def test_a_dropped_connection_that_comes_back_is_not_a_peer_loss(tmp_path):
    async with relayed_mesh(tmp_path, 2, LinkTable(LinkSpec(rtt_s=0.02))) as mesh:
        before = mesh.link(0, 1)
        assert mesh.netem.drop_connections("n1") == 1
        await wait_for(lambda: mesh.link(0, 1) not in (None, before), timeout_s=10)
        await wait_for(lambda: mesh.link(1, 0) is not None, timeout_s=10)
        # Past the deadline the broken link had (peer_loss_timeout_s after its last byte).
        await trio.sleep(TIMEOUTS["peer_loss_timeout_s"] + 0.5)
        assert mesh.downs() == []
        assert mesh.netem.counts["accept"] >= 2  # it really was a second connection


async def test_a_connection_that_stays_down_is_a_peer_loss_and_heals_after(tmp_path):
    async with relayed_mesh(tmp_path, 2, LinkTable()) as mesh:
        mesh.netem.partition("n1", mode="reset")
        await wait_for(lambda: len(mesh.downs()) == 2, timeout_s=15)  # both ends report it
        assert {d.node_id for d in mesh.downs()} == {n.node_id for n in mesh.nodes}
        mesh.netem.heal("n1")
        await wait_for(mesh.meshed, timeout_s=15)


async def test_a_blackhole_partition_shorter_than_peer_loss_keeps_the_link(tmp_path):
    async with relayed_mesh(tmp_path, 2, LinkTable(LinkSpec(rtt_s=0.02))) as mesh:
        link = mesh.link(0, 1)
        mesh.netem.partition("n1")  # silent, not closed
        await trio.sleep(TIMEOUTS["peer_loss_timeout_s"] / 2)
        mesh.netem.heal("n1")
        await trio.sleep(TIMEOUTS["peer_loss_timeout_s"])
        assert mesh.link(0, 1) is link and mesh.downs() == []
        assert mesh.netem.counts["accept"] == 1


async def test_the_topology_stays_active_through_a_dropped_connection(tmp_path):
    async with relayed_mesh(tmp_path, 3, LinkTable(LinkSpec(rtt_s=0.02))) as mesh:
        coord = mesh.nodes[0]
        active = await topology_of(coord).propose(package_ref=REF, manifest_sha256=SHA, sizes=SIZES)
        assert active.state == "active" and len(active.topology.stages) == 3
        mesh.netem.drop_connections("n2")
        await wait_for(mesh.meshed, timeout_s=10)
        await trio.sleep(TIMEOUTS["peer_loss_timeout_s"] + 0.5)
        assert topology_of(coord).active is active and active.state == "active"
        assert not active.lost and mesh.downs() == []


def test_dial_via_is_checked_when_the_config_is_read(tmp_path):
    import pytest

    from mesh_node.settings import node_settings
    from skippy.config import NodeConfig
    from skippy.errors import UsageError

    nid = "ab" * 32

    def read(table: object) -> object:
        raw = {"identity": "k", "dial_via": table}
        return node_settings(NodeConfig(tmp_path / "n.toml", None, raw)).dial_via  # type: ignore[arg-type]

    assert read({nid: "ws://127.0.0.1:7000"}) == {nid: PeerAddress("127.0.0.1", 7000, nid)}
    for bad in ({"xyz": "ws://127.0.0.1:1"}, {nid: "http://x:1"}, {nid: f"ws://h:1#{'cd' * 32}"}):
        with pytest.raises(UsageError, match="dial_via"):
            read(bad)
