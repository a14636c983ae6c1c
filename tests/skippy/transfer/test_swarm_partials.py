"""Serving verified chunks of a partial (``partial-serve``): the fetch orders, the
have-report, the coordinator's avoidance, the source list's new fields, and a partial
holder's serving decision on a real hub cache (the same authorization as for an installed
file, only chunks it verified)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil

import msgpack
import pytest
from transfer_tools import (
    OWNER,
    STRANGER,
    WORKER_B,
    item_for,
    policy,
    served_package,  # noqa: F401 - a fixture
)

from mesh_node.transfer.partials import PartialRegistry
from mesh_node.transfer.swarm import allowed_from_coordinator, counterpart_next, honoured_busy
from skippy.errors import IntegrityError
from skippy.serving.replicas import waits_for_first
from skippy.transfer.chunk_sink import open_chunk_sink
from skippy.transfer.chunks import (
    MIN_CHUNK_BYTES,
    ChunkScheduler,
    chunk_digest,
    chunk_spans,
    digest_chunks,
)
from skippy.transfer.errors import ArtifactWireError
from skippy.transfer.fetch_plan import request_for
from skippy.transfer.hubcache import RepoCache, load_held_manifest
from skippy.transfer.partials import (
    check_have,
    covered,
    decode_have,
    encode_have,
    fetch_order,
    pack_bitmap,
    stage_file_order,
    unpack_bitmap,
)
from skippy.transfer.policy import PeerFacts
from skippy.transfer.serve import ArtifactServer
from skippy.transfer.sources import (
    ArtifactSources,
    SourceList,
    decode_source_list,
    encode_source_list,
    required_set,
)
from skippy.transfer.wire import LENGTH_PREFIX, RequestReader, encode_request

CB = MIN_CHUNK_BYTES


# --- orders -------------------------------------------------------------------------------
def test_two_counterparts_fetch_in_opposite_orders_and_more_start_at_their_share():
    assert fetch_order(5, 0, 2) == [0, 1, 2, 3, 4]
    assert fetch_order(5, 1, 2) == [4, 3, 2, 1, 0]
    assert fetch_order(6, 1, 3) == [2, 3, 4, 5, 0, 1]
    assert fetch_order(4, 0, 1) == [0, 1, 2, 3]  # no counterpart: the plain order


def test_a_stage_files_split_into_disjoint_shares_the_others_deferred():
    paths = ["l/4", "l/5", "l/6", "l/7", "s/emb", "s/meta"]
    kw = {"big": ["s/emb"], "shared": {"s/meta": True}}
    order0, deferred0 = stage_file_order(paths, rank=0, ranks=2, **kw)  # type: ignore[arg-type]
    order1, deferred1 = stage_file_order(
        paths, big=["s/emb"], shared={"s/meta": False}, rank=1, ranks=2
    )
    assert order0[:2] == ["s/emb", "s/meta"]  # the multi-chunk file, then what it owns
    assert order0[2:4] == ["l/4", "l/5"] and deferred0 == {"l/6", "l/7"}
    assert order1[:3] == ["s/emb", "l/7", "l/6"] and order1[-1] == "s/meta"
    assert deferred1 == {"l/5", "l/4", "s/meta"}
    assert set(order0) == set(order1) == set(paths)
    # each one-chunk file is first fetched (not deferred) by exactly one of the two
    for p in ["l/4", "l/5", "l/6", "l/7", "s/meta"]:
        assert (p in deferred0) != (p in deferred1)
    assert stage_file_order(paths, big=[], shared={}, rank=0, ranks=1)[1] == set()


def test_the_scheduler_follows_its_order_and_takes_only_allowed_chunks():
    sched = ChunkScheduler(5, done=[2], order=fetch_order(5, 1, 2))
    assert sched.take() == 4
    assert sched.take(allow={0, 1}.__contains__) == 1  # a partial holder's chunks only
    assert sched.take(allow=lambda _i: False) is None  # nothing it has: nothing taken
    assert sched.take() == 3 and sched.take() == 0 and sched.take() is None


def test_the_coordinator_is_asked_only_for_chunks_no_counterpart_has_or_fetches():
    allow = allowed_from_coordinator([frozenset({3, 4})], [frozenset({2})])
    assert [i for i in range(6) if allow(i)] == [0, 1, 5]
    assert not allowed_from_coordinator([None])(0)  # a whole copy in use: stragglers only
    assert all(allowed_from_coordinator([])(i) for i in range(3))


def test_a_holder_claiming_chunks_it_never_verifies_holds_nobody_back_for_long():
    busy = frozenset({1, 2})
    assert honoured_busy(busy, {1: 10.0, 2: 14.0}, now=14.9, wait_s=5.0) == {1, 2}
    assert honoured_busy(busy, {1: 10.0, 2: 14.0}, now=15.5, wait_s=5.0) == {2}
    assert honoured_busy(busy, {}, now=15.0, wait_s=5.0) == {1, 2}  # first seen now


def test_replicas_come_up_at_once_when_every_peer_serves_partials():
    assert waits_for_first(first_ready=False, waited_s=0.0, siblings_serve=True)
    assert not waits_for_first(
        first_ready=False, waited_s=0.0, siblings_serve=True, partials_serve=True
    )


# --- bitmaps, ranges, the have-report ------------------------------------------------------
def test_bitmaps_round_trip_and_a_wrong_one_is_refused():
    assert unpack_bitmap(pack_bitmap({0, 3, 9}, 10), 10) == {0, 3, 9}
    with pytest.raises(ArtifactWireError):
        unpack_bitmap(b"\x00", 10)  # 10 chunks need 2 bytes
    with pytest.raises(ArtifactWireError):
        unpack_bitmap(b"\x00\x04", 10)  # bit 10: past the last chunk


def test_only_runs_of_whole_verified_chunks_are_covered():
    spans = chunk_spans(3 * CB + 5, CB)
    assert covered({1}, spans, CB, 2 * CB)
    assert covered({2, 3}, spans, 2 * CB, 3 * CB + 5)  # up to the short last chunk
    assert not covered({1}, spans, CB, 3 * CB)  # chunk 2 not verified
    assert not covered({0, 1}, spans, 10, CB)  # not at a chunk start
    assert not covered({0, 1}, spans, 0, CB + 10)  # ends inside a chunk
    assert not covered({0}, spans, 0, 0)


def test_a_have_report_is_kept_only_for_the_reporters_own_stage_files():
    required = {"a": ("0" * 64, 3 * CB), "b": ("1" * 64, CB)}
    frame = encode_have({"a": pack_bitmap({0, 2}, 3), "b": pack_bitmap((), 1)}, {"b": b"\x01"})
    have, busy = decode_have(frame[LENGTH_PREFIX.size :])
    assert check_have(have, required, CB) == {"a": frozenset({0, 2})}  # "b": nothing held
    assert check_have(busy, required, CB) == {"b": frozenset({0})}
    with pytest.raises(ArtifactWireError):
        check_have({"elsewhere": b"\x01"}, required, CB)
    with pytest.raises(ArtifactWireError):
        check_have({"a": b"\x01\x00"}, required, CB)  # 3 chunks: one byte
    with pytest.raises(ArtifactWireError):
        decode_have(b"\x81\xa3gen\x01")  # no have, no busy
    twice = msgpack.packb({"gen": 1, "have": {}, "busy": {}})[1:]  # the map's entries
    with pytest.raises(ArtifactWireError):  # a map of 4 entries naming "gen" twice
        decode_have(b"\x84" + twice + b"\xa3gen\x01")


def test_a_have_report_follows_a_request_only_where_a_trailer_is_allowed():
    request = encode_request(_any_request())
    report = encode_have({"a": b"\x01"})
    reader = RequestReader(1024)
    assert reader.feed(request + report[:3]) is not None
    reader.feed(report[3:])
    reader.eof()
    assert reader.trailer == report[LENGTH_PREFIX.size :]
    with pytest.raises(ArtifactWireError):
        RequestReader().feed(request + report)  # an old server: bytes after the request
    cut = RequestReader(1024)
    cut.feed(request + report[:-1])
    with pytest.raises(ArtifactWireError):
        cut.eof()


def _any_request():  # type: ignore[no-untyped-def]
    from skippy.transfer.wire import ArtifactRequest

    return ArtifactRequest(
        requester_id=WORKER_B,
        topology_id="topo-1",
        run_id="run-1",
        stage_id="stage-2",
        package_ref="hf://lab/tiny-layers@" + "a" * 40,
        manifest_sha256="b" * 64,
        relative_path="model-package.json",
        offset=0,
    )


# --- the source list's partial-serve fields ------------------------------------------------
def _list(*, partial: bool) -> SourceList:
    holders = ("aa" * 32, "bb" * 32)
    entry = ArtifactSources(
        "shared/x.gguf",
        "c" * 64,
        3 * CB,
        (b"\x01" * 32,) * 3,
        holders,
        (None, frozenset({2})) if partial else (),
        (frozenset(), frozenset({1})) if partial else (),
    )
    return SourceList(
        "topo-1",
        "run-1",
        "d" * 64,
        "stage-2",
        "ee" * 32,
        CB,
        (entry,),
        rank=1 if partial else 0,
        ranks=2 if partial else 1,
        partial=partial,
    )


def test_a_partial_source_list_carries_ranks_and_holders_chunks_and_an_old_one_does_not():
    got, signed, _sig = decode_source_list(encode_source_list(_list(partial=True), b"s" * 64))
    assert signed == _list(partial=True).signed_bytes()
    assert (got.rank, got.ranks, got.partial) == (1, 2, True)
    entry = got.artifacts[0]
    assert entry.chunks_of("aa" * 32) is None and entry.chunks_of("bb" * 32) == {2}
    assert entry.busy_of("bb" * 32) == {1} and entry.busy_of("aa" * 32) == frozenset()
    old, _signed, _sig = decode_source_list(encode_source_list(_list(partial=False), b"s" * 64))
    assert (old.partial, old.ranks) == (False, 1) and old.artifacts[0].chunks_of("bb" * 32) is None
    assert b"rank" not in _list(partial=False).signed_bytes()  # what older nodes decode


# --- a partial holder's serving decision (real hub cache, real sink) ------------------------
def test_a_partial_holder_serves_only_chunks_it_verified_under_the_usual_authorization(
    served_package,  # noqa: F811 - the fixture
    tmp_path,
):
    sp = served_package
    topology = sp.topology()
    stage = topology.stage_of(WORKER_B.hex())
    assert stage is not None
    manifest = load_held_manifest(RepoCache.for_ref(sp.hub_cache, sp.ref), sp.manifest_sha256)
    needed = required_set(manifest.held.manifest, topology, WORKER_B.hex())
    path = max(needed, key=lambda p: needed[p][1])  # the stage's largest file
    # the holder: the package's manifest, this file not installed, a partial of it
    hub = tmp_path / "holder-hub"
    shutil.copytree(sp.hub_cache, hub, symlinks=True)
    cache = RepoCache.for_ref(hub, sp.ref)
    item = item_for(sp, path)
    link = cache.snapshot_path(path)
    os.unlink(link.resolve())
    os.unlink(link)
    data = (sp.package_dir / path).read_bytes()
    spans = chunk_spans(len(data), CB)
    assert len(spans) >= 3
    digests = tuple(chunk_digest(data[s.start : s.stop]) for s in spans)
    sink = open_chunk_sink(
        cache,
        item,
        digests=digests,
        chunk_bytes=CB,
        manifest_sha256=sp.manifest_sha256,
        verify_cache=None,
    )
    try:
        sink.write_chunk(1, data[spans[1].start : spans[1].stop])
        partials = PartialRegistry()
        partials.add(sink)
        server = ArtifactServer(hub, verify_cache=None)
        server.partials = partials.open_range

        def ask(index: int, *, requester: bytes = WORKER_B, owner: str = OWNER, mode="open"):  # type: ignore[no-untyped-def]
            req = request_for(item, topology, stage, requester, offset=spans[index].start)
            req = dataclasses.replace(req, length=spans[index].length)
            peer = PeerFacts(requester, owner, "verified")
            return server.serve(policy(mode), peer, topology, req)

        served = ask(1)
        assert served.body is not None and served.decision.allowed
        assert served.body.read(len(data)) == data[spans[1].start : spans[1].stop]
        served.body.close()
        unverified = ask(0)
        assert unverified.body is None and unverified.decision.reason == "artifact_missing"
        outsider = ask(1, requester=bytes(range(7, 39)))  # no stage in the topology
        assert outsider.body is None and not outsider.decision.allowed
        untrusted = ask(1, owner=STRANGER, mode="trusted")
        assert untrusted.body is None and not untrusted.decision.allowed
        whole = request_for(item, topology, stage, WORKER_B, offset=0)  # not a range
        assert (
            server.serve(
                policy("open"), PeerFacts(WORKER_B, OWNER, "verified"), topology, whole
            ).body
            is None
        )
        partials.remove(sink)  # before the sink finishes or aborts: nothing served after
        assert ask(1).body is None
    finally:
        sink.abort()


def test_a_proven_files_digests_equal_the_full_passes_and_a_wrong_size_is_refused(tmp_path):
    data = os.urandom(5 * CB + 11)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    full = digest_chunks(path, size=len(data), sha256=sha, chunk_bytes=CB)
    assert digest_chunks(path, size=len(data), sha256=sha, chunk_bytes=CB, proven=True) == full
    with pytest.raises(IntegrityError) as e:
        digest_chunks(path, size=len(data) + 1, sha256=sha, chunk_bytes=CB, proven=True)
    assert e.value.code == "artifact_size_mismatch"


def test_a_counterpart_leaves_the_other_its_next_chunks_of_its_own_half():
    """Two counterparts meet in the middle of a 22-chunk file (rank 0 from the front, rank 1
    from the back): each leaves the other the next chunks the other will ask the coordinator
    for, in the other's half only, skipping what either holds or fetches; no chunk is left
    by both (the halves settle it) and a claimed one is never left."""
    count = 22
    # Rank 1 (mine: 21..11 done or in flight); rank 0 verified 0..7 and fetches 8 and 9.
    claimed = frozenset(range(0, 10)) | frozenset(range(11, 22))
    assert counterpart_next(count, 1, claimed) == {10}
    # Rank 0 (mine: 0..10); rank 1 has 21..14.
    assert counterpart_next(count, 0, frozenset(range(0, 11)) | frozenset(range(14, 22))) == {
        13,
        12,
    }
    for claimed in (frozenset(), frozenset(range(5, 17)), frozenset({10, 11})):
        left_by_0 = counterpart_next(count, 0, claimed)
        left_by_1 = counterpart_next(count, 1, claimed)
        assert not left_by_0 & left_by_1
        assert all(2 * i >= count for i in left_by_0) and all(2 * i < count for i in left_by_1)
        assert not (left_by_0 | left_by_1) & claimed
        assert len(left_by_0) <= 2 and len(left_by_1) <= 2
