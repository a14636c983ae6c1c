"""Runs of chunks on one stream (``chunk-runs``), over real mesh links in
this process on loopback with the synthetic package: a holder that advertises the bit gets one
range request for several chunks in a row and a corrupted chunk in that run drops it at that
chunk (the run's chunks before it stay verified); a peer without the bit (an older node) still
gets one chunk a request; the file installs verified from what is left.

The coordinator and holder H both hold the whole package; the fetch is one of worker W's layer
files (11 chunks of 4 KiB), driven as ``SwarmFetch`` into a fresh cache with a source list
naming both (a coordinator's list names only holders whose stage needs a file, and no stage
but W's needs W's layers)."""

from __future__ import annotations

from typing import Any, ClassVar

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshtools import wait_for
from meshxfer import import_into, propose, sha256_of, start_member, wait_connected
from test_transfer_mesh import required_of

from mesh_node.node import MeshNode
from mesh_node.transfer.swarm import SourceBook, SwarmFetch, speaks_runs, speaks_swarm
from protocol import constants as pc
from skippy.package.topology import SplitTopology
from skippy.transfer.chunk_sink import open_chunk_sink
from skippy.transfer.chunks import MIN_CHUNK_BYTES, chunk_count, digest_chunks, run_length
from skippy.transfer.fetch_plan import FetchItem
from skippy.transfer.hubcache import RepoCache
from skippy.transfer.serve import ArtifactServer
from skippy.transfer.sources import ArtifactSources, SourceList

CHUNK = MIN_CHUNK_BYTES


class OldNode(MeshNode):
    """A real node whose hello lacks ``chunk-runs``: a node from before runs."""

    @property
    def features(self) -> dict[str, tuple[str, ...]]:
        bits = super().features[pc.FEATURE_SKIPPY_STAGE]
        return {pc.FEATURE_SKIPPY_STAGE: tuple(b for b in bits if b != pc.BIT_CHUNK_RUNS)}


def seen(*, flip_run: bool) -> type[ArtifactServer]:
    """A real ArtifactServer that records the ranges asked for ``target`` (set later); with
    ``flip_run`` its first run (a range over several chunks) has one byte flipped in its
    second chunk."""

    class Server(ArtifactServer):
        target = ""
        ranges: ClassVar[list[tuple[int, int | None]]] = []
        flipped: ClassVar[list[int]] = []  # the chunk corrupted

        def serve(self, policy, peer, topology, request):  # type: ignore[no-untyped-def]
            out = super().serve(policy, peer, topology, request)
            if out.body is None or request.relative_path != Server.target:
                return out
            Server.ranges.append((request.offset, request.length))
            if flip_run and not Server.flipped and (request.length or 0) > CHUNK:
                Server.flipped.append(request.offset // CHUNK + 1)
                out.body.read = _flipping(out.body.read, CHUNK + 10)  # type: ignore[method-assign]
            return out

    return Server


def _flipping(read: Any, at: int) -> Any:
    sent = 0

    def wrapped(max_bytes: int = 256 * 1024) -> bytes:
        nonlocal sent
        data = bytearray(read(max_bytes))
        if sent <= at < sent + len(data):
            data[at - sent] ^= 0xFF
        sent += len(data)
        return bytes(data)

    return wrapped


def _chunks(r: tuple[int, int | None], size: int) -> range:
    start, length = r
    return range(start // CHUNK, -(-(size if length is None else start + length) // CHUNK))


def test_run_length_spreads_the_waiting_chunks_and_one_means_one_chunk_a_request() -> None:
    assert run_length(22, 2, 8) == 8  # one holder, two streams: whole runs
    assert run_length(11, 6, 8) == 2  # shared with other streams: each its share
    assert run_length(3, 6, 8) == 1
    assert run_length(40, 2, 1) == 1  # a holder without chunk-runs


async def test_a_run_with_a_corrupted_chunk_drops_its_holder_there_and_an_old_peer_gets_chunks(
    tmp_path, hub_package
):
    async with trio.open_nursery() as n:
        owner = Ed25519PrivateKey.generate()
        coord = await start_member(
            n, tmp_path, "coord", owner, hub=hub_package.hub, artifact_transfer="open",
            node_class=OldNode,
        )
        pkg = import_into(coord, hub_package)
        holder_server = seen(flip_run=True)
        holder = await start_member(
            n, tmp_path, "h", owner, hub=None, peers=(coord.node,), artifact_transfer="open",
            server_class=holder_server,
        )
        import_into(holder, hub_package)  # H holds every file (it serves W's layers too)
        worker = await start_member(
            n, tmp_path, "w", owner, hub=None, offline=True, peers=(coord.node,),
            artifact_transfer="open", run_service=False,
        )
        await wait_connected([coord, holder, worker])
        active = await propose(coord, pkg, include_self=False, stages=2)
        topology: SplitTopology = active.topology
        wid, hid, cid = worker.node.node_id, holder.node.node_id, coord.node.node_id
        await wait_for(lambda: (a := holder.topology.active) is not None
                       and a.topology.topology_id == topology.topology_id, 20)
        await wait_for(lambda: speaks_swarm(worker.node, hid), 20)
        assert speaks_runs(worker.node, hid) and not speaks_runs(worker.node, cid)
        target = sorted(p for p in required_of(worker, pkg, topology) if p.startswith("layers/"))[0]
        holder_server.target = target
        # the coordinator's ranges, recorded by wrapping its real server's decision
        coord_ranges: list[tuple[int, int | None]] = []
        real_serve = coord.service.server.serve

        def coord_serve(policy, peer, topo, request):  # type: ignore[no-untyped-def]
            if request.relative_path == target:
                coord_ranges.append((request.offset, request.length))
            return real_serve(policy, peer, topo, request)

        coord.service.server.serve = coord_serve  # type: ignore[method-assign]

        ref = {r.path: r for r in pkg.manifest.artifacts()}[target]
        item = FetchItem.of(ref)
        assert item.size is not None and chunk_count(item.size, CHUNK) >= 8
        digests = digest_chunks(
            RepoCache.for_ref(coord.cache, topology.package_ref).snapshot_path(target),
            size=item.size, sha256=item.sha256, chunk_bytes=CHUNK,
        )
        stage = topology.stage_of(wid)
        assert stage is not None
        sources = SourceList(
            topology_id=topology.topology_id, run_id=topology.run_id,
            manifest_sha256=topology.manifest_sha256, stage_id=stage.stage_id,
            requester_id=wid, chunk_bytes=CHUNK,
            artifacts=(ArtifactSources(target, item.sha256, item.size, digests, (hid, cid)),),
        )
        cache = RepoCache.for_ref(tmp_path / "fresh-cache", topology.package_ref)
        sink = open_chunk_sink(
            cache, item, digests=digests, chunk_bytes=CHUNK,
            manifest_sha256=topology.manifest_sha256, verify_cache=None,
        )
        records = worker.service.records
        rec = records.start("fetch", target, total=item.size)
        fetch = SwarmFetch(
            worker.node, records, cache, topology, stage, item, rec, SourceBook(None, sources),
            verify_cache=None,
        )
        try:
            await fetch.run(sink, cid)
            path = await trio.to_thread.run_sync(sink.finish)
        finally:
            sink.abort()
        assert sha256_of(path) == item.sha256

        # H got runs and its bad chunk dropped it there; the run's earlier chunk was kept
        assert any((length or 0) > CHUNK for _, length in holder_server.ranges)
        assert rec.dropped == {hid: "chunk_digest_mismatch"}
        assert records.counters.chunk_failures == 1
        bad = holder_server.flipped[0]
        covering = [r for r in holder_server.ranges if bad in _chunks(r, item.size)]
        assert len(covering) == 1  # never asked of H again
        assert rec.served_by[hid] >= CHUNK  # at least the run's chunk before the bad one
        assert sum(rec.served_by.values()) == item.size
        # the old coordinator got one chunk a request, the bad chunk among them
        assert coord_ranges and all(length == CHUNK or o + (length or 0) == item.size
                                    for o, length in coord_ranges)
        assert all((length or 0) <= CHUNK for _, length in coord_ranges)
        assert any(bad in _chunks(r, item.size) for r in coord_ranges)
        n.cancel_scope.cancel()


async def test_the_source_list_is_asked_again_sooner_only_when_the_fetch_says_so(autojump_clock):
    """``SourceBook.refreshed``: at most every ``refresh_s``; every ``every_s`` when given
    (a counterpart's fetch with a task waiting for the other's chunks), never faster."""
    asked: list[float] = []

    async def ask() -> Any:
        asked.append(trio.current_time())
        return object()

    book = SourceBook(ask, object(), refresh_s=0.25)  # type: ignore[arg-type]
    await trio.sleep(1.0)  # the mock clock starts at 0, the time of the book's own list
    await book.refreshed()  # the first ask
    await trio.sleep(0.1)
    await book.refreshed()  # 0.1 s later: the last list
    await book.refreshed(0.05)  # a waiting fetch: asked again
    await book.refreshed(0.05)  # at once again: not yet
    await trio.sleep(0.05)
    await book.refreshed(0.05)
    await trio.sleep(0.1)
    await book.refreshed(1.0)  # a longer wish never stretches refresh_s
    assert [round(t - asked[0], 3) for t in asked] == [0.0, 0.1, 0.15]
    await trio.sleep(0.15)  # refresh_s after the last ask
    await book.refreshed(1.0)
    assert [round(t - asked[0], 3) for t in asked] == [0.0, 0.1, 0.15, 0.4]
