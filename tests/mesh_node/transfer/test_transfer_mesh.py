"""Peer artifact transfer over real mesh links, nodes in this
process on loopback: workers fetch their stage's artifacts from the coordinator, verify and
install them, and report ready; the feature bit and the handler follow one decision; hostile
bytes are never installed; concurrency is bounded."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshtools import identity, settings, wait_for, with_peers
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

from mesh_node.coordination import sign_topology
from mesh_node.errors import StreamRefused
from mesh_node.node import MeshNode
from mesh_node.topology import ActiveTopology
from mesh_node.transfer.serve import (
    CHUNK_BYTES,
    MIN_PACED_CHUNK_BYTES,
    PEER_BUSY,
    PER_LINK,
    RateLimit,
)
from protocol import constants as pc
from protocol.messages import TopologyOffer
from skippy.atomic import find_partials
from skippy.constants import MANIFEST_MAX_BYTES, MANIFEST_NAME
from skippy.package.ranges import LayerRange
from skippy.package.topology import SplitTopology, StageAssignment
from skippy.transfer.authorize import PEER_UNAVAILABLE
from skippy.transfer.chunks import MIN_CHUNK_BYTES
from skippy.transfer.fetch_plan import FetchItem, request_for
from skippy.transfer.hubcache import RepoCache
from skippy.transfer.required import stage_refs
from skippy.transfer.serve import ArtifactServer, Body, BytesBody
from skippy.transfer.wire import ArtifactResponse, encode_request


def required_of(member: Member, pkg, topology) -> dict[str, object]:  # type: ignore[no-untyped-def]
    stage = topology.stage_of(member.node.node_id)
    return {r.path: r for r in stage_refs(pkg.manifest, stage.layers)}


async def test_workers_fetch_their_stage_from_the_coordinator_and_report_ready(
    tmp_path, hub_package
):
    owner = Ed25519PrivateKey.generate()
    hp = hub_package
    async with trio.open_nursery() as n:
        coord = await start_member(
            n, tmp_path, "coord", owner, hub=hp.hub, artifact_transfer="trusted"
        )
        pkg = import_into(coord, hp)
        hp.hub.reset()  # count only what the workers ask of the hub
        workers = [
            await start_member(n, tmp_path, f"w{i}", owner, hub=hp.hub, peers=(coord.node,))
            for i in range(2)
        ]
        await wait_connected([coord, *workers])
        active = await propose(coord, pkg)
        assert active.state == "active"
        await wait_for(
            lambda: all(w.service.records.stage.report == "accepted" for w in workers), 20
        )
        assert coord.topology.active.all_ready

        served = 0
        for w in workers:
            required = required_of(w, pkg, active.topology)
            files = snapshot_files(w, pkg.ref)
            assert set(files) == {*required, MANIFEST_NAME}  # exactly its required set
            for path, ref in required.items():
                assert sha256_of(files[path]) == ref.artifact.sha256
            recs = records(w)
            assert {p for p, r in recs.items()} == {*required, MANIFEST_NAME}
            assert all(r["source"] == "peer" and r["verified"] for r in recs.values())
            assert all(r["peer_id"] == coord.node.node_id for r in recs.values())
            stage = w.node.status()["transfers"]["stage"]
            assert stage["state"] == "ready" and stage["report"] == "accepted"
            assert stage["required"] == list(required)
            load = w.service.result.load
            stage_layers = active.topology.stage_of(w.node.node_id).layers
            assert load.sha256_verified and load.layers == stage_layers
            assert all(p.is_file() for p in load.part_paths)
            served += w.service.records.counters.fetched_bytes["peer"]
            cache = RepoCache.for_ref(w.cache, pkg.ref)
            for r in required.values():
                assert find_partials(cache.blob_path(r.artifact.sha256)) == []
        # the coordinator: its own stage from its cache, every byte sent counted once
        c = coord.service.records
        assert c.counters.served_bytes == served
        assert {r["source"] for r in records(coord).values()} == {"cache"}
        ready = coord.node.status()["topology"]["ready"]
        assert set(ready) == {s.node_id for s in active.topology.stages}
        assert all(v["state"] == "ready" for v in ready.values())
        assert hp.hub.downloaded_paths(hp.ref.split("@")[0].removeprefix("hf://")) == set()
        # the status document names repo-relative paths only, never a local folder
        for m in (coord, *workers):
            assert str(tmp_path) not in json.dumps(m.node.status())
        n.cancel_scope.cancel()


# --- one decision: the feature bit and the handler --------------------------------------------
@pytest.mark.parametrize(
    ("mode", "certified", "serves"),
    [("open", False, True), ("trusted", True, True), ("trusted", False, False),
     ("disabled", True, False)],
)
async def test_the_feature_bit_and_the_handler_follow_would_serve(
    tmp_path, mode, certified, serves
):
    owner = Ed25519PrivateKey.generate()
    async with trio.open_nursery() as n:
        a = await start_member(
            n, tmp_path, "a", owner if certified else None, hub=None, artifact_transfer=mode
        )
        b = MeshNode(with_peers(settings(tmp_path, "b"), a.node), identity(owner))
        await n.start(b.run)
        await wait_for(lambda: b.peer(a.node.node_id) is not None)
        bits = b.peer(a.node.node_id).features[pc.FEATURE_SKIPPY_STAGE]
        assert (pc.BIT_ARTIFACT_TRANSFER in bits) is serves
        assert a.service.serving is serves
        if serves:
            stream = await b.open_stream(a.node.node_id, pc.KIND_ARTIFACT_TRANSFER)
            async with stream:
                await stream.send_eof()  # an empty request: refused, naming the broken rule
                answer = await stream.receive_some()
            assert b"malformed artifact request" in answer
        else:
            with pytest.raises(StreamRefused) as refused:
                await b.open_stream(a.node.node_id, pc.KIND_ARTIFACT_TRANSFER)
            assert refused.value.actual == "unknown_kind"
        n.cancel_scope.cancel()


# --- hostile or broken coordinators -----------------------------------------------------------
TARGET = "shared/metadata.gguf"  # every stage needs it


class _Body:
    """Wraps a real body: flips one byte, or ends it early (once per server class)."""

    def __init__(self, inner: Body, *, flip: bool, stop_at: int | None) -> None:
        self.inner, self.flip, self.stop_at, self.sent = inner, flip, stop_at, 0

    @property
    def remaining(self) -> int:
        return self.inner.remaining

    def read(self, max_bytes: int = 256 * 1024) -> bytes:
        if self.stop_at is not None:
            max_bytes = min(max_bytes, self.stop_at - self.sent)
            if max_bytes <= 0:
                return b""
        data = bytearray(self.inner.read(max_bytes))
        if self.flip and data:
            data[len(data) // 2] ^= 0xFF
            self.flip = False
        self.sent += len(data)
        return bytes(data)

    def close(self) -> None:
        self.inner.close()


def misbehaving(*, flip: bool = False, truncate: bool = False) -> type[ArtifactServer]:
    """A real ArtifactServer whose first body for TARGET is corrupted or cut in half."""

    class Server(ArtifactServer):
        done = False

        def serve(self, policy, peer, topology, request):  # type: ignore[no-untyped-def]
            out = super().serve(policy, peer, topology, request)
            if out.body is None or request.relative_path != TARGET or Server.done:
                return out
            Server.done = True
            half = out.body.remaining // 2 if truncate else None
            return dataclasses.replace(out, body=_Body(out.body, flip=flip, stop_at=half))

    return Server


async def _pair(  # type: ignore[no-untyped-def]
    n, tmp_path, hp, *, server_class=ArtifactServer, worker_hub=True, run_service=True, **kw
):
    owner = Ed25519PrivateKey.generate()
    coord = await start_member(
        n, tmp_path, "coord", owner, hub=hp.hub, server_class=server_class,
        artifact_transfer="open", **kw,
    )
    pkg = import_into(coord, hp)
    worker = await start_member(
        n, tmp_path, "w", owner, hub=hp.hub if worker_hub else None,
        offline=not worker_hub, peers=(coord.node,), run_service=run_service,
    )
    await wait_connected([coord, worker])
    return coord, worker, pkg


@pytest.mark.parametrize("swarm", [False, True])
async def test_a_corrupted_byte_is_never_installed_and_the_hub_supplies_the_artifact(
    tmp_path, hub_package, swarm
):
    """Never installed, the hub asked. Without the coordinator's signed list (its
    swarm-transfer off) the file is one chunk, caught by the manifest's SHA-256; with it, the
    coordinator is a swarm of one and the bad chunk is caught by its digest. A bad chunk from
    one of several holders is tests/mesh_node/transfer/test_swarm_transfer.py's."""
    detected_as = "chunk_digest_mismatch" if swarm else "artifact_sha256_mismatch"
    async with trio.open_nursery() as n:
        coord, worker, pkg = await _pair(
            n, tmp_path, hub_package, server_class=misbehaving(flip=True), swarm_transfer=swarm
        )
        await propose(coord, pkg)
        await wait_for(lambda: coord.topology.active.all_ready, timeout_s=20)
        rec = records(worker)[TARGET]
        assert rec["source"] == "hub" and rec["verified"]
        assert rec["fallback"] == detected_as
        counters = worker.service.records.counters
        assert counters.verification_failures == 1
        assert counters.chunk_failures == (1 if swarm else 0)
        ref = {r.path: r for r in pkg.manifest.artifacts()}[TARGET]
        assert sha256_of(snapshot_files(worker, pkg.ref)[TARGET]) == ref.artifact.sha256
        cache = RepoCache.for_ref(worker.cache, pkg.ref)
        assert find_partials(cache.blob_path(ref.artifact.sha256)) == []
        others = [r for p, r in records(worker).items() if p != TARGET]
        assert others and all(r["source"] == "peer" for r in others)
        n.cancel_scope.cancel()


async def test_a_truncated_stream_resumes_from_the_partial(tmp_path, hub_package):
    async with trio.open_nursery() as n:
        coord, worker, pkg = await _pair(  # no list: the file is one chunk, cut in half
            n, tmp_path, hub_package, server_class=misbehaving(truncate=True), worker_hub=False,
            swarm_transfer=False,
        )
        await propose(coord, pkg)
        await wait_for(lambda: coord.topology.active.all_ready, timeout_s=20)
        rec = records(worker)[TARGET]
        size = {r.path: r for r in pkg.manifest.artifacts()}[TARGET].artifact.artifact_bytes
        assert rec["source"] == "peer" and rec["verified"]
        assert rec["resumed_from"] == size // 2  # the second request asked from the partial
        assert sha256_of(snapshot_files(worker, pkg.ref)[TARGET]) == sha256_of(
            hub_package.directory / TARGET
        )
        n.cancel_scope.cancel()


async def test_one_holder_is_a_swarm_of_one_and_a_cut_resumes_inside_a_chunk(
    tmp_path, hub_package
):
    """The coordinator alone, with its signed list: the file comes as chunk ranges (one
    engine whatever the number of holders), written as the bytes arrive. A body cut inside a
    chunk keeps those bytes as the chunk's head: the next try asks from that exact byte, and
    the head is checked with the rest of its chunk."""
    asked: list[tuple[int, int | None]] = []

    class Server(misbehaving(truncate=True)):  # type: ignore[misc,valid-type]
        def serve(self, policy, peer, topology, request):  # type: ignore[no-untyped-def]
            if request.relative_path == TARGET:
                asked.append((request.offset, request.length))
            return super().serve(policy, peer, topology, request)

    async with trio.open_nursery() as n:
        coord, worker, pkg = await _pair(
            n, tmp_path, hub_package, server_class=Server, worker_hub=False
        )
        coord.service.sources.chunk_bytes = MIN_CHUNK_BYTES  # the target is 2 chunks
        await propose(coord, pkg)
        await wait_for(lambda: coord.topology.active.all_ready, timeout_s=20)
        rec = records(worker)[TARGET]
        size = {r.path: r for r in pkg.manifest.artifacts()}[TARGET].artifact.artifact_bytes
        assert size > MIN_CHUNK_BYTES
        assert rec["source"] == "peer" and rec["verified"] and rec["fallback"] is None
        assert all(length is not None for _, length in asked), asked  # ranges, not files
        cut = [o for o, _ in asked if o % MIN_CHUNK_BYTES]  # asked from inside a chunk
        assert len(cut) == 1 and rec["resumed_from"] >= cut[0] % MIN_CHUNK_BYTES > 0, asked
        assert worker.service.records.counters.chunk_failures == 0
        assert sha256_of(snapshot_files(worker, pkg.ref)[TARGET]) == sha256_of(
            hub_package.directory / TARGET
        )
        n.cancel_scope.cancel()


async def test_a_manifest_over_16_MiB_from_a_peer_is_refused_before_a_byte_is_written(
    tmp_path, hub_package
):
    class Oversized(ArtifactServer):
        def serve(self, policy, peer, topology, request):  # type: ignore[no-untyped-def]
            out = super().serve(policy, peer, topology, request)
            if out.body is None or request.relative_path != MANIFEST_NAME:
                return out
            size = MANIFEST_MAX_BYTES + 1
            return dataclasses.replace(
                out,
                response=ArtifactResponse.accept(size, topology.manifest_sha256),
                body=BytesBody(b"{" + b" " * (size - 1), request.offset),
            )

    async with trio.open_nursery() as n:
        coord, worker, pkg = await _pair(
            n, tmp_path, hub_package, server_class=Oversized, worker_hub=False
        )
        await propose(coord, pkg)
        await wait_for(lambda: _stage_state(worker) == "failed", 20)
        rec = records(worker)[MANIFEST_NAME]
        assert rec["fallback"] == "manifest_too_large" and not rec["verified"]
        assert worker.service.records.counters.fetched_bytes["peer"] == 0
        assert snapshot_files(worker, pkg.ref) == {}
        cache = RepoCache.for_ref(worker.cache, pkg.ref)
        assert find_partials(cache.blob_path(pkg.manifest_sha256)) == []
        await wait_for(lambda: worker.service.records.stage.report == "accepted")
        assert coord.topology.active.reports[worker.node.node_id].state == "failed"
        n.cancel_scope.cancel()


async def test_a_coordinator_holding_a_manifest_over_16_MiB_refuses_it(tmp_path, hub_package):
    big = b"{" + b" " * MANIFEST_MAX_BYTES
    sha = hashlib.sha256(big).hexdigest()
    ref = "hf://lab/oversized@" + "1" * 40
    async with trio.open_nursery() as n:
        coord, worker, _ = await _pair(n, tmp_path, hub_package, worker_hub=False)
        cache = RepoCache.for_ref(coord.cache, ref)
        blob, link = cache.blob_path(sha), cache.snapshot_path(MANIFEST_NAME)
        blob.parent.mkdir(parents=True)
        blob.write_bytes(big)
        link.parent.mkdir(parents=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
        stages = (
            StageAssignment(coord.node.node_id, "stage-0", 0, LayerRange(0, 2, 4)),
            StageAssignment(worker.node.node_id, "stage-1", 1, LayerRange(2, 4, 4)),
        )
        topology = SplitTopology("topo-big", "run-big", ref, sha, 4, stages)
        topology, sig = sign_topology(
            coord.node.identity.key, topology, coord.topology.epochs, time.time()
        )
        coord.topology.active = ActiveTopology(
            topology, sig, coord.node.node_id, "coordinator", "active"
        )
        offer = TopologyOffer(topology.to_dict(), sig)
        assert worker.topology.accept_offer(offer, coord.node.node_id).accepted
        await wait_for(lambda: _stage_state(worker) == "failed", 20)
        assert coord.service.records.counters.refusals["manifest_too_large"] == 1
        rec = records(worker)[MANIFEST_NAME]
        assert rec["fallback"] == "refused: artifact unavailable"  # generic to the peer
        assert snapshot_files(worker, ref) == {}
        n.cancel_scope.cancel()


def _stage_state(member: Member) -> str | None:
    stage = member.service.records.stage
    return None if stage is None else stage.state


class _SlowEnd:
    """Wraps a real body: the read that finds its end takes ``delay_s`` (a busy disk or
    thread pool), so the requester holds the whole body before the server's end of stream."""

    def __init__(self, inner: Body, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def read(self, max_bytes: int = 256 * 1024) -> bytes:
        data = self.inner.read(max_bytes)
        if not data:
            time.sleep(self.delay_s)  # on the serving node's worker thread
        return data

    def close(self) -> None:
        self.inner.close()


async def test_a_requester_closing_after_the_whole_body_leaves_every_serve_record_done(
    tmp_path, hub_package
):
    """Found in the suite: the status page listed the manifest it served as failed. The
    requester's reader ends at the body's last byte and its close resets the stream when
    that overtakes the server's end of stream; the server served every byte."""

    class Server(ArtifactServer):
        def serve(self, policy, peer, topology, request):  # type: ignore[no-untyped-def]
            out = super().serve(policy, peer, topology, request)
            if out.body is None:
                return out
            return dataclasses.replace(out, body=_SlowEnd(out.body, 0.3))

    async with trio.open_nursery() as n:
        coord, worker, pkg = await _pair(
            n, tmp_path, hub_package, server_class=Server, swarm_transfer=False
        )
        await propose(coord, pkg)
        await wait_for(lambda: coord.topology.active.all_ready, timeout_s=20)
        fetched = records(worker)
        assert MANIFEST_NAME in fetched
        assert all(r["source"] == "peer" and r["verified"] for r in fetched.values())
        await wait_for(lambda: not coord.service.records.active, timeout_s=10)  # the slow ends
        recent = coord.node.status()["transfers"]["recent"]
        served = [r for r in recent if r["direction"] == "serve"]
        assert sorted(r["path"] for r in served) == sorted(fetched)
        assert all(r["verified"] and r["error"] is None for r in served), served
        n.cancel_scope.cancel()


# --- concurrency ---------------------------------------------------------------------------------
async def test_two_fetches_of_one_stage_on_one_node_move_each_artifact_once(
    tmp_path, hub_package
):
    async with trio.open_nursery() as n:
        coord, worker, pkg = await _pair(n, tmp_path, hub_package, run_service=False)
        active = await propose(coord, pkg)
        assert active.acks[worker.node.node_id] == "accepted"
        held = worker.topology.active
        results = []

        async def fetch() -> None:
            results.append(await worker.service.fetcher.fetch_stage(held))

        async with trio.open_nursery() as both:
            both.start_soon(fetch)
            both.start_soon(fetch)
        assert len(results) == 2 and results[0].load.part_paths == results[1].load.part_paths
        required = required_of(worker, pkg, active.topology)
        manifest_bytes = (hub_package.directory / MANIFEST_NAME).stat().st_size
        expected = sum(r.artifact.artifact_bytes for r in required.values()) + manifest_bytes
        assert coord.service.records.counters.served_bytes == expected  # each artifact once
        sources: dict[str, list[str]] = {}
        for rec in worker.node.status()["transfers"]["recent"]:
            sources.setdefault(rec["path"], []).append(rec["source"])
        assert {p: sorted(s) for p, s in sources.items()} == {
            p: ["cache", "peer"] for p in [*required, MANIFEST_NAME]
        }
        n.cancel_scope.cancel()


async def test_requests_beyond_the_per_link_bound_wait_for_a_slot(tmp_path, hub_package):
    async with trio.open_nursery() as n:
        coord, worker, pkg = await _pair(
            n, tmp_path, hub_package, run_service=False, artifact_serve_bytes_per_s=200_000
        )
        active = await propose(coord, pkg)
        stage = active.topology.stage_of(worker.node.node_id)
        ref = max(
            required_of(worker, pkg, active.topology).values(),
            key=lambda r: r.artifact.artifact_bytes,
        )
        me = bytes.fromhex(worker.node.node_id)
        request = encode_request(request_for(FetchItem.of(ref), active.topology, stage, me))
        answers: list[bytes] = []

        async def ask() -> None:
            stream = await worker.node.open_stream(coord.node.node_id, pc.KIND_ARTIFACT_TRANSFER)
            async with stream:
                await stream.send_all(request)
                await stream.send_eof()
                data = b""
                while chunk := await stream.receive_some():
                    data += chunk
            answers.append(data)

        async with trio.open_nursery() as many:
            for _ in range(2 * PER_LINK - 2):
                many.start_soon(ask)
        counters = coord.service.records.counters
        assert counters.serving_peak == PER_LINK and counters.serving_now == 0
        full = [a for a in answers if len(a) > ref.artifact.artifact_bytes]
        busy = [a for a in answers if PEER_BUSY.encode() in a]
        assert len(full) + len(busy) == len(answers) == 2 * PER_LINK - 2
        assert counters.served_requests == len(full)
        assert counters.refusals["server_busy"] == len(busy)
        n.cancel_scope.cancel()


async def test_a_refusal_reaches_a_requester_whose_end_of_stream_comes_late(tmp_path, hub_package):
    """The server answers once the requester's end of stream is in (``read_request``). A
    refusal sent before it, by a handler that then returned, had its stream reset on close,
    which cleared what the requester had buffered of it: the requester heard "closed early",
    not why. Here the requester sends its end 0.3 s after its request, then reads."""
    async with trio.open_nursery() as n:
        coord, worker, pkg = await _pair(n, tmp_path, hub_package, run_service=False)
        active = await propose(coord, pkg)
        stage = active.topology.stage_of(worker.node.node_id)
        ref = next(iter(required_of(worker, pkg, active.topology).values()))
        me = bytes.fromhex(worker.node.node_id)
        wanted = request_for(FetchItem.of(ref), active.topology, stage, me)
        request = encode_request(dataclasses.replace(wanted, relative_path="layers/none.gguf"))
        stream = await worker.node.open_stream(coord.node.node_id, pc.KIND_ARTIFACT_TRANSFER)
        async with stream:
            await stream.send_all(request)
            await trio.sleep(0.3)
            await stream.send_eof()
            data = b""
            with trio.fail_after(30):
                while chunk := await stream.receive_some():
                    data += chunk
        assert PEER_UNAVAILABLE.encode() in data
        assert coord.service.records.counters.refusals["undeclared_path"] == 1
        n.cancel_scope.cancel()


def test_serving_reads_are_a_slice_of_the_upload_rate_when_one_is_set():
    """Unlimited: whole 4 MiB reads; under a limit at most 1/8 s of it (paced smoothly, and a
    transfer is several reads long), never below 64 KiB."""
    assert RateLimit(0).chunk_bytes(CHUNK_BYTES) == CHUNK_BYTES
    assert RateLimit(8_000_000).chunk_bytes(CHUNK_BYTES) == 1_000_000
    assert RateLimit(1000).chunk_bytes(CHUNK_BYTES) == MIN_PACED_CHUNK_BYTES
    assert RateLimit(10**12).chunk_bytes(CHUNK_BYTES) == CHUNK_BYTES



class GatedDial(MeshNode):
    """A real node whose dials wait for ``gate`` while it is set (a redial held back)."""

    gate: trio.Event | None = None

    async def _dial(self, address):  # type: ignore[no-untyped-def]
        if GatedDial.gate is not None:
            await GatedDial.gate.wait()
        return await super()._dial(address)


async def test_a_fetch_begun_while_the_link_is_down_waits_for_the_redial(tmp_path, hub_package):
    """The coordinator's link is down when the stage's fetch begins (its redial held back
    0.5 s): no holder can be asked, which is a cut link (wait for the redial, ask again),
    not a reason for the hub, which this worker cannot reach (offline)."""
    async with trio.open_nursery() as n:
        coord, worker, pkg = await _pair(
            n, tmp_path, hub_package, run_service=False, worker_hub=False,
            node_class=GatedDial,
        )
        active = await propose(coord, pkg)
        held = worker.topology.active
        link = worker.node._members[coord.node.node_id].link
        assert link is not None
        GatedDial.gate = gate = trio.Event()
        try:
            link.close("test", "dropped by the test")
            await wait_for(
                lambda: not worker.node.peer(coord.node.node_id).connected  # type: ignore[union-attr]
                and not coord.node.peer(worker.node.node_id).connected,  # type: ignore[union-attr]
                timeout_s=10,
            )
            n.start_soon(_open_after, gate, 0.5)
            with trio.fail_after(30):
                await worker.service.fetcher.fetch_stage(held)
        finally:
            GatedDial.gate = None
        required = required_of(worker, pkg, active.topology)
        got = records(worker)
        for path in [*required, MANIFEST_NAME]:
            assert got[path]["source"] == "peer" and got[path]["fallback"] is None, got[path]
        n.cancel_scope.cancel()


async def _open_after(gate: trio.Event, delay_s: float) -> None:
    await trio.sleep(delay_s)
    gate.set()
