"""The trio node in one process over loopback: membership, trust, streams, registration,
gossip over five nodes, topology distribution and peer loss."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshtools import (
    address_of,
    identity,
    settings,
    topology_node,
    topology_of,
    wait_for,
    with_peers,
)

from mesh_node.composition import compose
from mesh_node.errors import PeerUnavailable, StreamRefused, StreamReset
from mesh_node.node import MeshNode
from mesh_node.peers import InboundStream, PeerDown, PeerUp, TopologyChanged
from mesh_node.topology import topology_signature_valid
from protocol import constants as pc
from protocol.messages import TopologyOffer
from skippy.config import read_environment
from skippy.package.plan import ModelSizes
from skippy.package.topology import NodeCapacity, SplitTopology, plan_topology

SIZES = ModelSizes(layer_bytes=(100,) * 6, metadata_bytes=10, embeddings_bytes=50, output_bytes=50)
SHA = "ab" * 32
REF = "hf://lab/pkg@" + "0" * 40


async def start(nursery: trio.Nursery, node: MeshNode) -> MeshNode:
    await nursery.start(node.run)
    return node


async def test_two_nodes_of_one_owner_authenticate_and_trust_each_other(tmp_path):
    owner = Ed25519PrivateKey.generate()
    async with trio.open_nursery() as n:
        a = await start(n, topology_node(settings(tmp_path, "a"), identity(owner)))
        b = await start(n, topology_node(with_peers(settings(tmp_path, "b"), a), identity(owner)))
        await wait_for(lambda: len(a.peers()) == 1 and len(b.peers()) == 1)
        (pa,) = a.peers()
        assert pa.node_id == b.node_id and pa.peer.owner_status == "verified"
        assert pa.peer.trusted and pa.connected and pa.address == b.listen_url
        doc = b.status()
        assert doc["owner_status"] == "verified" and doc["peers"][0]["trusted"] is True
        assert doc["peers"][0]["node_id"] == a.node_id
        assert set(doc) == {
            "node_id",
            "uptime_s",
            "listen",
            "owner_id",
            "owner_status",
            "features",
            "memory_budget",
            "artifact_transfer",
            "peers",
            "topology",  # the sections of these nodes' services
            "stage",
            "security",
            "compute",  # this node's calibration (None: not calibrated)
            "devices",  # this node's devices as its hello advertises them (None: none read)
        }
        n.cancel_scope.cancel()


@pytest.mark.parametrize("case", ["no_certificate", "other_owner", "expired", "listed_owner"])
async def test_trust_needs_a_verified_owner_that_is_ours_or_listed(tmp_path, case):
    mine, theirs = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    peer_identity = {
        "no_certificate": identity(None),
        "other_owner": identity(theirs),
        "expired": identity(mine, days=1),
        "listed_owner": identity(theirs),
    }[case]
    wall = (lambda: 1e12) if case == "expired" else __import__("time").time
    listed = (theirs.public_key().public_bytes_raw().hex(),) if case == "listed_owner" else ()
    async with trio.open_nursery() as n:
        a = await start(
            n,
            topology_node(
                settings(tmp_path, "a", trusted_owners=listed), identity(mine), wall_clock=wall
            ),
        )
        b = await start(n, topology_node(with_peers(settings(tmp_path, "b"), a), peer_identity))
        await wait_for(lambda: len(a.peers()) == 1)
        (p,) = a.peers()
        expected_status = {"no_certificate": "unverified", "expired": "invalid"}.get(
            case, "verified"
        )
        assert p.peer.owner_status == expected_status
        assert p.peer.trusted is (case == "listed_owner")
        assert p.peer.trust_reason == {
            "no_certificate": "no owner certificate",
            "other_owner": "owner is not this node's and not in trusted_owners",
            "expired": "owner certificate invalid (bad signature, expired, or not this key)",
            "listed_owner": "owner listed in trusted_owners",
        }[case]
        assert a.status()["peers"][0]["trust_reason"] == p.peer.trust_reason
        del b
        n.cancel_scope.cancel()


def test_trust_reason_never_disagrees_with_the_trust_rule():
    import itertools

    from mesh_node.identity import trust_decision

    mine, theirs, other = "a" * 64, "b" * 64, "c" * 64
    for owner, status, own_status, listed in itertools.product(
        (None, mine, theirs, other),
        ("verified", "unverified", "invalid"),
        ("verified", "unverified", "invalid"),
        ((), (theirs,), (mine,)),
    ):
        trusted, reason = trust_decision(
            owner, status, own_owner_id=mine, own_owner_status=own_status, trusted_owners=listed
        )
        # spelled out independently of the implementation
        rule = status == "verified" and owner is not None and (
            (owner == mine and own_status == "verified") or owner in listed
        )
        assert trusted is rule and reason, (owner, status, own_status, listed)


async def test_artifact_transfer_bit_is_advertised_only_when_this_node_would_serve(tmp_path):
    owner = Ed25519PrivateKey.generate()
    cases = [
        ("disabled", owner, False),
        ("open", None, True),
        ("trusted", None, False),
        ("trusted", owner, True),
    ]
    for mode, node_owner, advertised in cases:
        s = settings(tmp_path, "x", artifact_transfer=mode)
        node = compose(s, identity(node_owner), read_environment()).node
        bits = node.features[pc.FEATURE_SKIPPY_STAGE]
        assert (pc.BIT_ARTIFACT_TRANSFER in bits) is advertised, mode
        assert set(bits) >= pc.STAGE_BUNDLE


async def test_registered_handler_gets_the_authenticated_peer_and_a_flow_controlled_stream(
    tmp_path,
):
    owner = Ed25519PrivateKey.generate()
    seen: list[InboundStream] = []

    async def echo_sum(inbound: InboundStream) -> None:
        seen.append(inbound)
        total = 0
        while data := await inbound.stream.receive_some():
            total += len(data)
        await inbound.stream.send_all(str(total).encode())
        await inbound.stream.send_eof()

    async with trio.open_nursery() as n:
        a = await start(n, topology_node(settings(tmp_path, "a"), identity(owner)))
        b = await start(n, topology_node(with_peers(settings(tmp_path, "b"), a), identity(owner)))
        a.register_subprotocol(pc.KIND_ARTIFACT_TRANSFER, echo_sum)
        await wait_for(lambda: len(b.peers()) == 1)
        stream = await b.open_stream(a.node_id, pc.KIND_ARTIFACT_TRANSFER)
        payload = b"z" * (3 * pc.DEFAULT_LIMITS.stream_window_bytes + 17)  # credit must flow back
        await stream.send_all(payload)
        await stream.send_eof()
        reply = b""
        while data := await stream.receive_some():
            reply += data
        await stream.aclose()
        assert int(reply) == len(payload)
        # Link byte counters (the status page's throughput) saw the payload cross, encrypted.
        await wait_for(lambda: a.peers()[0].bytes_received > len(payload))
        assert b.peers()[0].bytes_sent > len(payload)
        assert a.status()["peers"][0]["bytes_received"] == a.peers()[0].bytes_received
        (inbound,) = seen
        assert inbound.peer.node_id == b.node_id and inbound.peer.trusted
        assert (inbound.name, inbound.major, inbound.kind) == ("skippy-stage", 2, 0x03)
        n.cancel_scope.cancel()


async def test_an_answer_reaches_a_requester_whose_end_of_stream_comes_after_the_handler_returned(
    tmp_path,
):
    """A handler that answers (data and its end of stream) and returns before the requester
    ended its side: the answer is sent before the reset that closing such a stream sends,
    and the requester reads all of it and a clean end (its own later end of stream is a
    no-op; more data raises). Before, the reset went ahead of the queued answer and the
    requester's buffered part was dropped: it heard "closed early"."""
    answer = b"a" * 100_000 + b"end"
    returned = trio.Event()

    async def answer_at_once(inbound: InboundStream) -> None:
        await inbound.stream.receive_some()  # the request, not the requester's end
        await inbound.stream.send_all(answer)
        await inbound.stream.send_eof()
        returned.set()

    async with trio.open_nursery() as n:
        a = await start(n, topology_node(settings(tmp_path, "a"), identity()))
        b = await start(n, topology_node(with_peers(settings(tmp_path, "b"), a), identity()))
        a.register_subprotocol(pc.KIND_ARTIFACT_TRANSFER, answer_at_once)
        await wait_for(lambda: len(b.peers()) == 1)
        stream = await b.open_stream(a.node_id, pc.KIND_ARTIFACT_TRANSFER)
        await stream.send_all(b"request")
        with trio.fail_after(5):
            await returned.wait()
        await trio.sleep(0.2)  # the handler's stream is closed: its reset is on the wire
        await stream.send_eof()  # the peer reads no more: a no-op, not an error
        got = b""
        with trio.fail_after(5):
            while data := await stream.receive_some():
                got += data
        assert got == answer
        with pytest.raises(StreamReset):
            await stream.send_all(b"more")
        await stream.aclose()
        assert b.peers()[0].connected
        n.cancel_scope.cancel()


async def test_unknown_subprotocol_major_or_kind_is_refused_with_a_reason_and_link_stays(tmp_path):
    async with trio.open_nursery() as n:
        a = await start(n, topology_node(settings(tmp_path, "a"), identity()))
        b = await start(n, topology_node(with_peers(settings(tmp_path, "b"), a), identity()))
        await wait_for(lambda: len(b.peers()) == 1)
        for kwargs, code in [
            ({"name": "nope"}, "unknown_subprotocol"),
            ({"major": 3}, "unsupported_major"),
            ({}, "unknown_kind"),
        ]:
            with pytest.raises(StreamRefused) as exc:
                await b.open_stream(a.node_id, 0x7E, **kwargs)
            assert exc.value.actual == code
        # The link survived: the control kind is served.
        stream = await b.open_stream(a.node_id, pc.KIND_CONTROL)
        await stream.aclose()
        assert b.peers()[0].connected
        with pytest.raises(PeerUnavailable):
            await b.open_stream("f" * 64, pc.KIND_CONTROL)
        n.cancel_scope.cancel()


async def test_five_nodes_learn_each_other_through_gossip_and_dial_before_counting(tmp_path):
    async with trio.open_nursery() as n:
        hub = await start(n, topology_node(settings(tmp_path, "n0"), identity()))
        nodes = [hub]
        ups: list[str] = []
        async with hub.subscribe() as events:
            for i in range(1, 5):
                nodes.append(
                    await start(
                        n, topology_node(with_peers(settings(tmp_path, f"n{i}"), hub), identity())
                    )
                )
            await wait_for(lambda: all(len(x.peers(connected_only=True)) == 4 for x in nodes))
            while True:
                try:
                    event = events.receive_nowait()
                except trio.WouldBlock:
                    break
                if isinstance(event, PeerUp):
                    ups.append(event.peer.node_id)
        assert sorted(set(ups)) == sorted(x.node_id for x in nodes[1:])
        # Every membership entry is a peer this node authenticated itself, on its own link.
        for x in nodes:
            for p in x.peers():
                assert x._members[p.node_id].link is not None
                assert x._members[p.node_id].link.node_id == p.node_id
        n.cancel_scope.cancel()


async def test_coordinator_signs_and_workers_verify_store_and_acknowledge(tmp_path):
    owner = Ed25519PrivateKey.generate()
    async with trio.open_nursery() as n:
        coord = await start(n, topology_node(settings(tmp_path, "c"), identity(owner)))
        workers = [
            await start(
                n, topology_node(with_peers(settings(tmp_path, f"w{i}"), coord), identity(owner))
            )
            for i in range(2)
        ]
        await wait_for(lambda: len(coord.peers(connected_only=True)) == 2)
        async with workers[0].subscribe() as events:
            active = await topology_of(coord).propose(
                package_ref=REF, manifest_sha256=SHA, sizes=SIZES
            )
            assert active.state == "active"
            assert active.acks == {w.node_id: "accepted" for w in workers}
            assert {s.node_id for s in active.topology.stages} == {
                coord.node_id,
                *(w.node_id for w in workers),
            }
            event = await events.receive()
            while not isinstance(event, TopologyChanged):  # gossip PeerUps may come first
                event = await events.receive()
            assert event.state == "active"
        for w in workers:
            got = topology_of(w).active
            assert got is not None and got.role == "worker" and got.coordinator_id == coord.node_id
            assert got.topology == active.topology
            assert topology_signature_valid(got.topology, coord.node_id, got.signature)
        assert workers[0].status()["topology"]["topology_id"] == active.topology.topology_id
        # Per-stage bytes (the planner's rule) and state: accepted, not ready before any
        # report (no artifact service runs here); a worker knows only its own acceptance.
        stage_status = coord.status()["topology"]["stage_status"]
        assert [s["bytes"] for s in stage_status] == [
            SIZES.stage_bytes(s.layers) for s in active.topology.stages
        ]
        assert all(s["ready"] is False and s["state"] == "accepted" for s in stage_status)
        seen_by_w0 = {
            active.topology.stages[s["stage_index"]].node_id: s
            for s in workers[0].status()["topology"]["stage_status"]
        }
        assert seen_by_w0[workers[0].node_id]["state"] == "accepted"
        assert seen_by_w0[coord.node_id]["state"] == "unknown"
        assert all(s["ready"] is None and s["bytes"] is None for s in seen_by_w0.values())
        n.cancel_scope.cancel()


def test_stage_status_follows_reports_acks_and_losses():
    from mesh_node.topology import ActiveTopology, StageReport

    ids = ["1" * 64, "2" * 64, "3" * 64, "4" * 64, "5" * 64]
    topology = plan_topology(
        SIZES,
        [NodeCapacity(i, 1 << 30) for i in ids],
        topology_id="t",
        run_id="r",
        package_ref=REF,
        manifest_sha256=SHA,
    )
    by_node = {s.node_id: s.stage_index for s in topology.stages}
    active = ActiveTopology(
        topology,
        b"",
        ids[0],
        "coordinator",
        "degraded",
        acks={ids[1]: "accepted", ids[2]: "refused: not_in_topology: no", ids[4]: "accepted"},
        lost={ids[4]},
        reports={ids[0]: StageReport("ready"), ids[1]: StageReport("failed", "hub_failed")},
        sizes=SIZES,
        own_id=ids[0],
    )
    got = {nid: active.stage_status()[i] for nid, i in by_node.items()}
    assert (got[ids[0]]["state"], got[ids[0]]["ready"]) == ("ready", True)
    assert (got[ids[1]]["state"], got[ids[1]]["code"], got[ids[1]]["ready"]) == (
        "failed",
        "hub_failed",
        False,
    )
    assert got[ids[2]]["state"].startswith("refused") and got[ids[2]]["ready"] is False
    assert (got[ids[3]]["state"], got[ids[3]]["ready"]) == ("pending", False)
    assert (got[ids[4]]["state"], got[ids[4]]["ready"]) == ("lost", False)


async def test_topology_that_does_not_fit_names_the_node_and_the_missing_bytes(tmp_path):
    from mesh_node.errors import TopologyRefused

    async with trio.open_nursery() as n:
        coord = await start(
            n, topology_node(settings(tmp_path, "c", memory_budget_bytes=200), identity())
        )
        with pytest.raises(TopologyRefused) as exc:
            await topology_of(coord).propose(package_ref=REF, manifest_sha256=SHA, sizes=SIZES)
        assert exc.value.code == "topology_does_not_fit"
        assert coord.node_id[:12] in exc.value.message and "lacks 510 bytes" in exc.value.message
        n.cancel_scope.cancel()


_EPOCHS = iter(range(1, 1 << 30))


def _offer(signer: Ed25519PrivateKey, topology: SplitTopology) -> TopologyOffer:
    """Signed as a coordinator signs: each offer with a newer epoch."""
    import dataclasses

    from protocol.certificates import sign_domain

    topology = dataclasses.replace(topology, epoch=next(_EPOCHS))
    return TopologyOffer(
        topology.to_dict(), sign_domain(signer, pc.SIG_DOMAIN_TOPOLOGY, topology.canonical_bytes())
    )


def test_worker_checks_signature_against_the_sender_and_the_coverage(tmp_path):
    from skippy.package.topology import NodeCapacity, plan_topology

    coord_key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    coord_id = coord_key.public_key().public_bytes_raw().hex()
    worker = topology_node(settings(tmp_path, "w"), identity())
    topo = plan_topology(
        SIZES,
        [NodeCapacity(coord_id, 10**6), NodeCapacity(worker.node_id, 10**6)],
        topology_id="t1",
        run_id="r1",
        package_ref=REF,
        manifest_sha256=SHA,
    )
    ok = topology_of(worker).accept_offer(_offer(coord_key, topo), coord_id)
    assert ok.accepted and topology_of(worker).active is not None
    topology_of(worker).active = None
    # Signed by someone else than the authenticated sender.
    bad = topology_of(worker).accept_offer(_offer(other, topo), coord_id)
    assert (bad.accepted, bad.code) == (False, "topology_signature")
    # A byte of the topology changed after signing.
    offer = _offer(coord_key, topo)
    tampered = dict(offer.topology, run_id="r2")
    bad = topology_of(worker).accept_offer(TopologyOffer(tampered, offer.signature), coord_id)
    assert (bad.accepted, bad.code) == (False, "topology_signature")
    # Coverage: a gap between the stages is refused before any signature check.
    gap = dict(offer.topology)
    gap["stages"] = [dict(s) for s in offer.topology["stages"]]
    gap["stages"][1]["layer_start"] += 1
    bad = topology_of(worker).accept_offer(TopologyOffer(gap, offer.signature), coord_id)
    assert (bad.accepted, bad.code) == (False, "topology_coverage")
    # A topology that gives this node no stage.
    third = Ed25519PrivateKey.generate().public_key().public_bytes_raw().hex()
    elsewhere = plan_topology(
        SIZES,
        [NodeCapacity(coord_id, 10**6), NodeCapacity(third, 10**6)],
        topology_id="t2",
        run_id="r1",
        package_ref=REF,
        manifest_sha256=SHA,
    )
    bad = topology_of(worker).accept_offer(_offer(coord_key, elsewhere), coord_id)
    assert (bad.accepted, bad.code) == (False, "not_in_topology")
    assert topology_of(worker).active is None


async def test_peer_loss_degrades_the_topology_and_replan_uses_the_remaining_peers(tmp_path):
    async with trio.open_nursery() as n:
        coord = await start(n, topology_node(settings(tmp_path, "c"), identity()))
        w1 = await start(n, topology_node(with_peers(settings(tmp_path, "w1"), coord), identity()))
        w2_scope = trio.CancelScope()
        w2 = topology_node(with_peers(settings(tmp_path, "w2"), coord), identity())

        async def run_w2(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with w2_scope:
                await w2.run(task_status=task_status)

        await n.start(run_w2)
        await wait_for(lambda: len(coord.peers(connected_only=True)) == 2)
        first = await topology_of(coord).propose(package_ref=REF, manifest_sha256=SHA, sizes=SIZES)
        assert first.state == "active" and len(first.topology.stages) == 3
        async with coord.subscribe() as events:
            w2_scope.cancel()  # the worker process "dies"
            seen = [await events.receive(), await events.receive()]
        assert any(isinstance(e, PeerDown) and e.node_id == w2.node_id for e in seen)
        assert TopologyChanged("degraded", first.topology.topology_id) in seen
        held = topology_of(coord).active
        assert held is not None and held.lost == {w2.node_id}
        second = await topology_of(coord).replan()
        assert second.state == "active" and second.topology.run_id == first.topology.run_id
        assert {s.node_id for s in second.topology.stages} == {coord.node_id, w1.node_id}
        n.cancel_scope.cancel()


async def test_a_duplicate_pair_of_links_converges_to_one(tmp_path):
    a = topology_node(settings(tmp_path, "a"), identity())
    b = topology_node(settings(tmp_path, "b"), identity())
    async with trio.open_nursery() as n:
        await n.start(a.run)
        await n.start(b.run)
        a.settings = replace(a.settings, peers=(address_of(b),))
        a._start_dialing(address_of(b), persistent=True)
        b._start_dialing(address_of(a), persistent=True)  # both dial at once
        await wait_for(
            lambda: (
                len(a.peers(connected_only=True)) == 1 and len(b.peers(connected_only=True)) == 1
            )
        )
        await trio.sleep(0.3)
        link_a = a._members[b.node_id].link
        link_b = b._members[a.node_id].link
        assert link_a is not None and link_b is not None
        assert link_a.initiator != link_b.initiator  # the two ends of one and the same link
        n.cancel_scope.cancel()


async def _linked_pair(n: trio.Nursery, tmp_path: Path) -> tuple[MeshNode, MeshNode]:
    """Nodes a and b (b dials a), once both sides have each other's hello."""
    a = await start(n, topology_node(settings(tmp_path, "a"), identity()))
    b = await start(n, topology_node(with_peers(settings(tmp_path, "b"), a), identity()))
    await wait_for(lambda: len(a.peers(connected_only=True)) == len(b.peers()) == 1)
    return a, b


async def test_close_links_says_goodbye_completes_each_close_and_takes_no_new_link(tmp_path):
    """Shutdown (``close_links``, before the node's tasks are cancelled): the peer hears the
    goodbye (a peer loss with its reason, at once), gets a normal WebSocket close (code 1000,
    not an aborted connection: both readers still ran), and its redial is refused."""
    async with trio.open_nursery() as n:
        a, b = await _linked_pair(n, tmp_path)
        b_side = b._members[a.node_id].link
        assert b_side is not None
        async with b.subscribe() as events:
            await a.close_links()
            assert a.peers(connected_only=True) == []  # returned once its links were down
            with trio.fail_after(10):
                event = await events.receive()
            assert isinstance(event, PeerDown) and event.node_id == a.node_id
            assert "shutting down" in event.reason
        closed = b_side.ws.closed
        assert closed is not None and closed.code == 1000
        await wait_for(lambda: a.admission["rejected_closing"] >= 1)  # b dialed again
        assert a.peers(connected_only=True) == [] and b.peers(connected_only=True) == []
        n.cancel_scope.cancel()


async def test_a_configured_peer_is_redialed_after_its_link_drops(tmp_path):
    async with trio.open_nursery() as n:
        # Both sides' hellos: b must not see a's first PeerUp after subscribing below.
        a, b = await _linked_pair(n, tmp_path)
        first = a._members[b.node_id].link
        assert first is not None
        async with b.subscribe() as events:
            first.close("test", "dropped by the test")
            # b hears of the drop at once when a's close reaches it first, and not at all when
            # its socket just breaks (a broken connection that relinks within
            # peer_loss_timeout_s is no peer loss): either way the next PeerUp is the redial.
            with trio.fail_after(10):
                event = await events.receive()
                if isinstance(event, PeerDown):
                    assert event.node_id == a.node_id
                    event = await events.receive()
            assert isinstance(event, PeerUp) and event.peer.node_id == a.node_id
        second = a._members[b.node_id].link
        assert second is not None and second is not first
        n.cancel_scope.cancel()
