"""Swarm fetch over real mesh links, nodes in this process on loopback
with the synthetic package: a worker fetches a file from two holders at once; a holder that
serves a corrupted chunk is detected at that chunk and dropped, the file still installs
verified; a node outside the topology is never asked and refuses; the swarm never hands a
worker a file its stage does not need."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshtools import wait_for
from meshxfer import (
    Member,
    import_into,
    propose,
    records,
    sha256_of,
    snapshot_files,
    start_member,
    wait_connected,
)
from test_transfer_mesh import TARGET, _pair, misbehaving, required_of

from mesh_node.node import MeshNode
from mesh_node.transfer.requests import read_request
from mesh_node.transfer.swarm import ask_sources, speaks_swarm
from protocol import constants as pc
from skippy.constants import MANIFEST_NAME
from skippy.transfer.chunks import MIN_CHUNK_BYTES
from skippy.transfer.fetch_plan import FetchItem, request_for
from skippy.transfer.serve import ArtifactServer
from skippy.transfer.wire import (
    ArtifactResponse,
    RequestReader,
    ResponseHeader,
    ResponseReader,
    encode_request,
    encode_response,
)

SHARED = "shared/embeddings.gguf"  # both stages need it: 9024 bytes, 3 chunks of 4 KiB


class NoChainNode(MeshNode):
    """A real node whose hello lacks ``chunk-chain``: a node from before SHA-256 chains."""

    @property
    def features(self) -> dict[str, tuple[str, ...]]:
        bits = super().features[pc.FEATURE_SKIPPY_STAGE]
        return {pc.FEATURE_SKIPPY_STAGE: tuple(b for b in bits if b != pc.BIT_CHUNK_CHAIN)}


async def _swarm(n, tmp_path, hp, *, holder_server=ArtifactServer, worker_class=MeshNode):  # type: ignore[no-untyped-def]
    """A coordinator (not a stage), a holder H that already has the package (ready at once)
    and a worker W whose fetch starts only after H reported ready (so W's first source list
    names H: no race). Every node serves (``open``); chunks are the smallest allowed."""
    owner = Ed25519PrivateKey.generate()
    coord = await start_member(n, tmp_path, "coord", owner, hub=hp.hub, artifact_transfer="open")
    coord.service.sources.chunk_bytes = MIN_CHUNK_BYTES
    pkg = import_into(coord, hp)
    holder = await start_member(
        n, tmp_path, "h", owner, hub=hp.hub, peers=(coord.node,), artifact_transfer="open",
        server_class=holder_server,
    )
    import_into(holder, hp)
    worker = await start_member(
        n, tmp_path, "w", owner, hub=None, offline=True, peers=(coord.node,),
        artifact_transfer="open", run_service=False, node_class=worker_class,
    )
    await wait_connected([coord, holder, worker])
    active = await propose(coord, pkg, include_self=False, stages=2)
    hid = holder.node.node_id
    await wait_for(lambda: (r := coord.topology.active.reports.get(hid)) is not None
                   and r.state == "ready", 20)
    # W learns H by gossip: start its fetch only once it is linked to H and has H's hello,
    # or H is not yet a usable source and the coordinator alone serves (seen in the suite).
    await wait_for(lambda: speaks_swarm(worker.node, hid), 20)
    await n.start(worker.service.run)
    await wait_for(lambda: coord.topology.active.all_ready, 20)
    return coord, holder, worker, pkg, active.topology


async def _ask(member: Member, node_id: str, request) -> ArtifactResponse:  # type: ignore[no-untyped-def]
    """One raw request to ``node_id``: its response header."""
    stream = await member.node.open_stream(node_id, pc.KIND_ARTIFACT_TRANSFER)
    async with stream:
        await stream.send_all(encode_request(request))
        await stream.send_eof()
        reader = ResponseReader(request.offset, request.length)
        while True:
            data = await stream.receive_some()
            for event in reader.feed(data):
                if isinstance(event, ResponseHeader):
                    return event.response
            if not data:
                raise AssertionError("no response header")


def _item(pkg, path: str) -> FetchItem:  # type: ignore[no-untyped-def]
    return FetchItem.of({r.path: r for r in pkg.manifest.artifacts()}[path])


@pytest.mark.parametrize("chain", [True, False], ids=["chain", "plain-digests"])
async def test_a_worker_fetches_a_file_from_two_holders_at_once_and_only_what_its_stage_needs(
    tmp_path, hub_package, chain
):
    """Either kind of digest list: a worker that speaks ``chunk-chain`` is sent SHA-256
    chains, one from before them (its hello lacks the bit) plain per-chunk digests; both
    install every file verified from both holders."""
    async with trio.open_nursery() as n:
        coord, holder, worker, pkg, topology = await _swarm(
            n, tmp_path, hub_package, worker_class=MeshNode if chain else NoChainNode
        )
        cid, hid, wid = coord.node.node_id, holder.node.node_id, worker.node.node_id
        rec = records(worker)[SHARED]
        assert rec["source"] == "peer" and rec["verified"]
        served = {s["node_id"]: s["bytes"] for s in rec["served_by"]}
        assert set(served) == {cid, hid} and all(b > 0 for b in served.values())
        size = _item(pkg, SHARED).size
        assert sum(served.values()) == size and rec["dropped_sources"] == []
        assert sha256_of(snapshot_files(worker, pkg.ref)[SHARED]) == _item(pkg, SHARED).sha256
        # what the holder served went to the worker and was counted there (beyond it, at
        # most the end-game copies that lost to another source's copy)
        credited = sum(
            s["bytes"] for r in records(worker).values() for s in r["served_by"]
            if s["node_id"] == hid
        )
        endgame = sum(r["endgame_chunks"] for r in records(worker).values())
        served_by_holder = holder.service.records.counters.served_bytes
        assert credited <= served_by_holder <= credited + endgame * MIN_CHUNK_BYTES
        # W's own files came only from the coordinator (H's stage does not hold them)
        required = required_of(worker, pkg, topology)
        h_required = required_of(holder, pkg, topology)
        for path in set(required) - set(h_required):
            assert {s["node_id"] for s in records(worker)[path]["served_by"]} == {cid}
        # the swarm never hands a worker a file its stage does not need
        assert set(snapshot_files(worker, pkg.ref)) == {*required, MANIFEST_NAME}
        stage = topology.stage_of(wid)
        sources = await ask_sources(worker.node, cid, topology, stage, pkg.manifest)
        assert {a.path for a in sources.artifacts} == set(required)
        assert all(set(a.holders) <= {cid, hid} for a in sources.artifacts)
        assert sources.chain is chain
        for a in sources.artifacts:  # a chain ends at the file's SHA-256; plain digests don't
            assert (a.digests[-1].hex() == a.sha256) is (chain or len(a.digests) == 1)
        me = bytes.fromhex(wid)
        foreign = next(p for p in h_required if p not in required)
        refused = await _ask(
            worker, hid,
            dataclasses.replace(request_for(_item(pkg, foreign), topology, stage, me), length=64),
        )
        assert not refused.accepted
        assert holder.service.records.counters.refusals["not_in_stage"] == 1

        # a node outside the topology, holding the same package: never asked, and it refuses
        outsider = await start_member(
            n, tmp_path, "o", Ed25519PrivateKey.generate(), hub=None, peers=(coord.node,),
            artifact_transfer="open",
        )
        import_into(outsider, hub_package)
        await wait_connected([coord, holder, worker, outsider])
        assert outsider.service.records.counters.served_requests == 0
        assert not any(outsider.service.records.counters.refusals.values())
        again = await ask_sources(worker.node, cid, topology, stage, pkg.manifest)
        assert all(outsider.node.node_id not in a.holders for a in again.artifacts)
        request = dataclasses.replace(
            request_for(_item(pkg, SHARED), topology, stage, me), length=MIN_CHUNK_BYTES
        )
        answer = await _ask(worker, outsider.node.node_id, request)
        assert not answer.accepted and answer.error == "artifact unavailable"
        assert outsider.service.records.counters.served_requests == 0
        n.cancel_scope.cancel()


async def test_a_holder_serving_a_corrupted_chunk_is_dropped_and_the_file_installs_verified(
    tmp_path, hub_package
):
    async with trio.open_nursery() as n:
        coord, holder, worker, pkg, _ = await _swarm(
            n, tmp_path, hub_package, holder_server=misbehaving(flip=True)
        )
        cid, hid = coord.node.node_id, holder.node.node_id
        rec = records(worker)[TARGET]
        assert rec["source"] == "peer" and rec["verified"] and rec["fallback"] is None
        assert rec["dropped_sources"] == [{"node_id": hid, "code": "chunk_digest_mismatch"}]
        # Every byte installed was served by someone, the coordinator served what the dropped
        # holder did not; the holder may have served a good chunk before its bad one (the
        # order in which the two sources take chunks is not fixed).
        served = {s["node_id"]: s["bytes"] for s in rec["served_by"]}
        assert sum(served.values()) == _item(pkg, TARGET).size
        assert served[cid] > 0 and served.get(hid, 0) < _item(pkg, TARGET).size
        counters = worker.service.records.counters
        assert counters.chunk_failures == 1 and counters.dropped_sources == 1
        status = worker.node.status()["transfers"]["counters"]
        assert status["chunk_failures"] == 1 and status["dropped_sources"] == 1
        assert sha256_of(snapshot_files(worker, pkg.ref)[TARGET]) == _item(pkg, TARGET).sha256
        n.cancel_scope.cancel()


async def _replicas(n, tmp_path, hp):  # type: ignore[no-untyped-def]
    """Two replicas of one coordinator (as ``mesh_node.serving.replicas`` builds them), both
    ready: replica 0's node H (ready from its cache), replica 1's worker W (served by H
    under W's topology T1, which H learns from the coordinator, kind 0x05) and a stranger X
    holding no stage. Returns (coord, H, W, X, pkg, T1)."""

    owner = Ed25519PrivateKey.generate()
    coord = await start_member(n, tmp_path, "coord", owner, hub=hp.hub, artifact_transfer="open")
    coord.service.sources.chunk_bytes = MIN_CHUNK_BYTES
    pkg = import_into(coord, hp)
    holder = await start_member(n, tmp_path, "h", owner, hub=hp.hub, peers=(coord.node,),
                                artifact_transfer="open")
    import_into(holder, hp)
    worker = await start_member(n, tmp_path, "w", owner, hub=None, offline=True,
                                peers=(coord.node,), artifact_transfer="open", run_service=False)
    stranger = await start_member(n, tmp_path, "x", owner, hub=None, offline=True,
                                  peers=(coord.node,), artifact_transfer="open",
                                  run_service=False)
    await wait_connected([coord, holder, worker, stranger])
    hid, wid = holder.node.node_id, worker.node.node_id
    main = coord.topology
    sibling = main.sibling()
    await propose(coord, pkg, include_self=False, stages=1, exclude={wid, stranger.node.node_id})
    await wait_for(lambda: main.active.all_ready, 20)  # H found its stage in its cache
    await wait_for(lambda: speaks_swarm(worker.node, hid), 20)
    await n.start(worker.service.run)
    t1 = (await sibling.propose(
        package_ref=pkg.ref, manifest_sha256=pkg.manifest_sha256,
        sizes=main.active.sizes, include_self=False, stages=1,  # type: ignore[union-attr]
        exclude={hid, stranger.node.node_id},
    )).topology
    assert t1.stage_of(wid) is not None and t1.stage_of(hid) is None
    await wait_for(lambda: sibling.active.all_ready, 30)  # type: ignore[union-attr]
    return coord, holder, worker, stranger, pkg, t1


async def test_a_sibling_replicas_ready_node_serves_a_worker_and_a_stranger_is_refused(
    tmp_path, hub_package
):
    """Replica 0's ready node H serves replica 1's worker W under W's topology, which H
    learns from the coordinator (kind 0x05); a node holding no stage in that topology is
    refused by H."""
    async with trio.open_nursery() as n:
        coord, holder, worker, stranger, pkg, t1 = await _replicas(n, tmp_path, hub_package)
        cid, hid, wid = coord.node.node_id, holder.node.node_id, worker.node.node_id
        recs = records(worker)
        from_holder = {p: s["bytes"] for p, r in recs.items() for s in r["served_by"]
                       if s["node_id"] == hid}
        assert from_holder and all(r["verified"] for r in recs.values()), recs
        assert holder.service.records.counters.served_bytes >= sum(from_holder.values())
        for path, rec in recs.items():
            assert {s["node_id"] for s in rec["served_by"]} <= {cid, hid}
            if path != MANIFEST_NAME:
                got = sha256_of(snapshot_files(worker, pkg.ref)[path])
                assert got == _item(pkg, path).sha256
        # a node with no stage in T1, naming T1, is refused by the sibling holder
        stage = t1.stage_of(wid)
        assert stage is not None
        forged = request_for(_item(pkg, SHARED), t1, stage, bytes.fromhex(stranger.node.node_id),
                             offset=0)
        assert not (await _ask(stranger, hid, forged)).accepted
        # and W itself is served by H under T1 (the holder's answer, not only the record)
        mine = request_for(_item(pkg, SHARED), t1, stage, bytes.fromhex(wid), offset=0)
        assert (await _ask(worker, hid, mine)).accepted
        n.cancel_scope.cancel()


async def test_a_sibling_question_that_got_no_answer_is_asked_again_soon(tmp_path, hub_package):
    """A holder whose question about a sibling topology went unanswered (the coordinator's
    stream was reset) asks again after ``RETRY_TTL_S`` and then serves; a refusal is
    remembered for ``MISS_TTL_S``. Before, one lost answer made the holder refuse that
    replica's chunk requests for the full ``MISS_TTL_S``."""
    from mesh_node.transfer.siblings import MISS_TTL_S, RETRY_TTL_S

    async with trio.open_nursery() as n:
        coord, holder, worker, _, pkg, t1 = await _replicas(n, tmp_path, hub_package)
        hid, wid = holder.node.node_id, worker.node.node_id
        key = (pc.SKIPPY_STAGE, pc.SKIPPY_STAGE_MAJOR, pc.KIND_SIBLING_TOPOLOGY)
        real = coord.node._handlers[key]
        lost = [0]

        async def loses_first(inbound):  # type: ignore[no-untyped-def]
            if not lost[0]:
                lost[0] += 1
                inbound.stream.reset("test", "this answer is lost")
                return
            await real(inbound)

        coord.node._handlers[key] = loses_first
        holder.service.handler.siblings._entries.clear()  # H asks again for T1
        stage = t1.stage_of(wid)
        assert stage is not None
        mine = request_for(_item(pkg, SHARED), t1, stage, bytes.fromhex(wid), offset=0)
        assert not (await _ask(worker, hid, mine)).accepted  # the answer was lost
        assert lost[0] == 1
        await trio.sleep(RETRY_TTL_S + 0.1)
        assert RETRY_TTL_S + 0.1 < MISS_TTL_S
        assert (await _ask(worker, hid, mine)).accepted  # asked again, answered, served
        # a refusal is an answer: remembered for MISS_TTL_S, not asked again soon
        async def refuses(inbound):  # type: ignore[no-untyped-def]
            await read_request(inbound.stream, RequestReader(), 5.0)
            await inbound.stream.send_all(encode_response(ArtifactResponse.refusal("unavailable")))
            await inbound.stream.send_eof()

        holder.service.handler.siblings._entries.clear()
        coord.node._handlers[key] = refuses
        assert not (await _ask(worker, hid, mine)).accepted
        coord.node._handlers[key] = real
        await trio.sleep(RETRY_TTL_S + 0.1)
        assert not (await _ask(worker, hid, mine)).accepted  # still the remembered refusal
        n.cancel_scope.cancel()


async def test_the_coordinator_digests_its_workers_files_when_the_topology_activates(
    tmp_path, hub_package, caplog
):
    """The chunk digests of every file the workers' stages need are
    computed as the topology becomes active, before any worker asks for its source list
    (this worker never asks: its service does not run), and none of the coordinator's own;
    the coordinator brings up its own stage only after them."""
    caplog.set_level(logging.INFO, logger="mesh_node.transfer")
    async with trio.open_nursery() as n:
        coord, worker, pkg = await _pair(
            n, tmp_path, hub_package, worker_hub=False, run_service=False
        )
        active = await propose(coord, pkg, stages=2)
        sources = coord.service.sources
        with trio.fail_after(20):
            await sources.prepared(active.topology.topology_id)
        store, chunk = sources.digests, sources.chunk_bytes
        refs = {r.path: r for r in pkg.manifest.artifacts()}
        theirs = set(required_of(worker, pkg, active.topology))
        ours = set(required_of(coord, pkg, active.topology)) - theirs
        assert theirs and ours
        for path in theirs:  # the worker speaks chunk-chain: chains, and no plain list
            art = refs[path].artifact
            assert store.get(art.sha256, art.artifact_bytes, chunk, chain=True) is not None
            assert store.get(art.sha256, art.artifact_bytes, chunk) is None, path
        for path in ours:
            art = refs[path].artifact
            for chain in (False, True):
                assert store.get(art.sha256, art.artifact_bytes, chunk, chain=chain) is None
        assert worker.service.records.stage is None  # it fetched nothing, asked nothing
        await wait_for(
            lambda: (st := coord.service.records.stage) is not None and st.state == "ready", 20
        )
        tid = active.topology.topology_id
        said = [r.getMessage() for r in caplog.records if tid in r.getMessage()]
        digested = next(i for i, m in enumerate(said) if "chunk digests of" in m)
        own = next(i for i, m in enumerate(said) if "fetching this node's stage" in m)
        assert digested < own, said
        n.cancel_scope.cancel()
