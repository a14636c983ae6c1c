"""Chunk planning, digest lists, the chunk scheduler, the source list and the chunk sink
: the pure parts, and the sink on a real hub cache folder."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from skippy.atomic import find_partials
from skippy.errors import IntegrityError, UsageError
from skippy.package.ranges import LayerRange
from skippy.package.topology import SplitTopology, StageAssignment
from skippy.transfer.chunk_sink import open_chunk_sink
from skippy.transfer.chunks import (
    MIN_CHUNK_BYTES,
    ChunkDigestStore,
    ChunkScheduler,
    chunk_digest,
    chunk_spans,
    digest_chunks,
)
from skippy.transfer.errors import ArtifactWireError, PartialChanged
from skippy.transfer.fetch_plan import FetchItem
from skippy.transfer.hubcache import RepoCache
from skippy.transfer.sources import (
    ArtifactSources,
    SourceList,
    check_source_list,
    decode_source_list,
    encode_source_list,
)
from skippy.transfer.wire import (
    ArtifactRequest,
    ArtifactResponse,
    BodyData,
    BodyEnd,
    ResponseReader,
    encode_response,
)

CB = MIN_CHUNK_BYTES


@pytest.mark.parametrize(
    ("size", "spans"),
    [
        (1, [(0, 1)]),
        (CB, [(0, CB)]),
        (CB + 1, [(0, CB), (CB, CB + 1)]),
        (3 * CB, [(0, CB), (CB, 2 * CB), (2 * CB, 3 * CB)]),
    ],
)
def test_chunks_are_fixed_size_half_open_ranges_covering_the_file(size, spans):
    got = chunk_spans(size, CB)
    assert [(s.start, s.stop) for s in got] == spans
    assert [s.index for s in got] == list(range(len(spans)))


def test_chunk_sizes_and_counts_out_of_bounds_are_refused():
    with pytest.raises(UsageError) as e:
        chunk_spans(10, CB - 1)
    assert e.value.code == "invalid_chunk_bytes"
    with pytest.raises(UsageError) as e:
        chunk_spans(CB * (1 << 16) + 1, CB)
    assert e.value.code == "too_many_chunks"


def test_digests_come_only_from_a_file_that_hashes_whole(tmp_path):
    data = os.urandom(2 * CB + 100)
    path = tmp_path / "a.bin"
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    digests = digest_chunks(path, size=len(data), sha256=sha, chunk_bytes=CB)
    assert digests == tuple(
        hashlib.sha256(data[i : i + CB]).digest() for i in range(0, len(data), CB)
    )
    with pytest.raises(IntegrityError) as e:
        digest_chunks(path, size=len(data), sha256="0" * 64, chunk_bytes=CB)
    assert e.value.code == "artifact_sha256_mismatch"
    store = ChunkDigestStore.beside(tmp_path / "cache" / "verify")
    assert store.digests_for(path, size=len(data), sha256=sha, chunk_bytes=CB) == digests
    path.unlink()  # the stored list answers without the file (content-addressed)
    assert store.get(sha, len(data), CB) == digests
    assert store.root == tmp_path / "cache" / "chunk-digests"


def test_the_scheduler_hands_each_chunk_once_and_a_failed_one_first_again():
    s = ChunkScheduler(4, done=[1])
    a, b = s.take(), s.take()
    assert (a, b) == (0, 2)
    s.failed(a)  # back first in line
    assert s.take() == 0
    assert s.take() == 3 and s.take() is None
    for i in (0, 2, 3):
        s.finished(i)
    assert s.complete and s.waiting == 0


def test_the_end_game_duplicates_a_chunk_in_flight_and_the_first_verified_copy_wins():
    s = ChunkScheduler(3)
    assert [s.take(), s.take()] == [0, 1]
    assert s.take_duplicate() is None  # chunk 2 still waits for a first copy
    assert s.take() == 2 and s.take() is None
    assert s.take_duplicate(busy=[0]) == 1  # not the caller's own chunk
    assert s.take_duplicate(busy=[0]) == 2
    assert s.take_duplicate() == 0
    assert s.take_duplicate() is None  # one duplicate per chunk at a time
    assert s.finished(1) is True and s.finished(1) is False  # the slower copy does not count
    s.failed(2)  # one copy of 2 failed, the other is still in flight: not queued again
    assert s.take() is None and s.in_flight[2] == 1
    s.failed(2)  # now both did: first in line
    assert s.take() == 2
    for i in (0, 2):
        assert s.finished(i)
    s.failed(0)  # a late failure of a verified chunk's other copy changes nothing
    assert s.complete and s.take() is None and not s.in_flight


def test_the_end_game_copies_only_a_straggler_the_oldest_first():
    s = ChunkScheduler(2)
    assert s.take(now=10.0) == 0 and s.take(now=11.0) == 1
    assert s.take_duplicate(now=11.5, min_age_s=1.0) == 0  # in flight 1.5 s
    assert s.take_duplicate(now=11.5, min_age_s=1.0) is None  # chunk 1: only 0.5 s
    assert s.take_duplicate(now=12.0, min_age_s=1.0) == 1


# --- the source list -------------------------------------------------------------------
def _topology() -> SplitTopology:
    ids = [bytes([i]) * 32 for i in (1, 2, 3)]
    return SplitTopology(
        topology_id="t1",
        run_id="r1",
        package_ref="hf://acme/tiny@" + "a" * 40,
        manifest_sha256="b" * 64,
        layer_count=4,
        stages=(
            StageAssignment(ids[0].hex(), "s0", 0, LayerRange(0, 2, 4)),
            StageAssignment(ids[1].hex(), "s1", 1, LayerRange(2, 4, 4)),
        ),
    )


def _list(holders: tuple[str, ...], **kw) -> SourceList:  # type: ignore[no-untyped-def]
    t = _topology()
    entry = ArtifactSources("a.gguf", "c" * 64, CB + 1, (b"\x01" * 32, b"\x02" * 32), holders)
    fields = dict(
        topology_id=t.topology_id,
        run_id=t.run_id,
        manifest_sha256=t.manifest_sha256,
        stage_id="s1",
        requester_id=t.stages[1].node_id,
        chunk_bytes=CB,
        artifacts=(entry,),
    )
    fields.update(kw)
    return SourceList(**fields)  # type: ignore[arg-type]


def test_a_source_list_round_trips_with_its_signature_bytes():
    sl = _list(((bytes([1]) * 32).hex(),))
    payload = encode_source_list(sl, b"s" * 64)
    back, signed, sig = decode_source_list(payload)
    assert back == sl and signed == sl.signed_bytes() and sig == b"s" * 64


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", b"\x80", b"\x93\x01\x02\x03", os.urandom(64)],
)
def test_malformed_source_lists_are_wire_errors(payload):
    with pytest.raises(ArtifactWireError):
        decode_source_list(payload)


def test_the_receiver_refuses_a_list_naming_a_stranger_or_another_topology():
    t = _topology()
    coord = (bytes([9]) * 32).hex()
    me = t.stages[1].node_id
    required = {"a.gguf": ("c" * 64, CB + 1)}
    ok = _list((coord, t.stages[0].node_id))
    assert check_source_list(ok, t, required, me, coord) is ok
    for bad in (
        _list(((bytes([7]) * 32).hex(),)),  # not a member
        _list((me,)),  # the requester itself
        _list((coord,), topology_id="t2"),
        _list((coord,), stage_id="s0"),
    ):
        with pytest.raises(IntegrityError) as e:
            check_source_list(bad, t, required, me, coord)
        assert e.value.code == "source_list_mismatch"
    for other in ({"b.gguf": ("c" * 64, CB + 1)}, {"a.gguf": ("e" * 64, CB + 1)}):
        with pytest.raises(IntegrityError):  # a file it does not need, or unlike the manifest
            check_source_list(ok, t, other, me, coord)


# --- the wire's chunk range -------------------------------------------------------------
def test_a_range_response_ends_after_length_bytes():
    reader = ResponseReader(CB, length=10)
    head = encode_response(ArtifactResponse.accept(3 * CB, "d" * 64))
    events = reader.feed(head + b"x" * 10)
    assert isinstance(events[1], BodyData) and len(events[1].data) == 10
    assert isinstance(events[2], BodyEnd)
    with pytest.raises(ArtifactWireError):
        ResponseReader(3 * CB - 5, length=10).feed(head)
    with pytest.raises(ArtifactWireError):
        ArtifactRequest(
            b"\x01" * 32, "t", "r", "s", "hf://a/b@" + "a" * 40, "b" * 64, "x.gguf",
            offset=5, expected_size=10, length=6,
        )


# --- the chunk sink ---------------------------------------------------------------------
def _sink_setup(tmp_path: Path, data: bytes):  # type: ignore[no-untyped-def]
    cache = RepoCache.for_ref(tmp_path / "hub", "hf://acme/tiny@" + "a" * 40)
    sha = hashlib.sha256(data).hexdigest()
    item = FetchItem("a.gguf", sha, len(data), None)
    digests = tuple(chunk_digest(data[i : i + CB]) for i in range(0, len(data), CB))
    return cache, item, digests


def _open(cache, item, digests):  # type: ignore[no-untyped-def]
    return open_chunk_sink(
        cache, item, digests=digests, chunk_bytes=CB, manifest_sha256="b" * 64, verify_cache=None
    )


def test_chunks_in_any_order_install_verified_and_a_bad_chunk_is_refused(tmp_path):
    data = os.urandom(3 * CB + 7)
    cache, item, digests = _sink_setup(tmp_path, data)
    sink = _open(cache, item, digests)
    spans = sink.spans
    bad = bytearray(data[spans[1].start : spans[1].stop])
    bad[3] ^= 1
    with pytest.raises(IntegrityError) as e:
        sink.write_chunk(1, bad)
    assert e.value.code == "chunk_digest_mismatch" and 1 not in sink.verified
    for i in (3, 1, 0, 2):
        sink.write_chunk(i, data[spans[i].start : spans[i].stop])
    path = sink.finish()
    assert path.read_bytes() == data and sink.state == "installed"
    assert find_partials(cache.blob_path(item.sha256)) == []


def test_a_resume_keeps_the_verified_chunks(tmp_path):
    data = os.urandom(4 * CB)
    cache, item, digests = _sink_setup(tmp_path, data)
    sink = _open(cache, item, digests)
    for i in (0, 2):
        sink.write_chunk(i, data[i * CB : (i + 1) * CB])
    sink.abort()
    again = _open(cache, item, digests)
    assert again.verified == {0, 2} and again.offset == 2 * CB
    for i in (1, 3):
        again.write_chunk(i, data[i * CB : (i + 1) * CB])
    assert again.finish().read_bytes() == data


def test_a_stream_cut_inside_a_chunk_resumes_from_its_exact_byte(tmp_path):
    """Bytes are written as they arrive: a cut keeps the unchecked head of the chunk it
    ended in, and the next fetch asks from that byte; the head is checked with the rest of
    its chunk (a wrong head is this node's fault: the chunk is asked for again whole)."""
    data = os.urandom(3 * CB + 5)
    cache, item, digests = _sink_setup(tmp_path, data)
    sink = _open(cache, item, digests)
    cut = CB + CB // 3
    stream = sink.stream(0)
    stream.write([memoryview(data[:cut])])
    assert stream.verified == [0]  # chunk 0 checked, 1 in progress
    stream.close()
    sink.abort()
    again = _open(cache, item, digests)
    assert again.verified == {0} and again.offset == cut and again.start_of(1) == cut
    rest = again.stream(cut)
    rest.write([memoryview(data[cut:])])
    assert rest.verified == [1, 2, 3]
    assert again.finish().read_bytes() == data
    # the same cut, but the head's bytes changed on disk: chunk 1 fails its check
    cache, item, digests = _sink_setup(tmp_path / "bad", data)
    sink = _open(cache, item, digests)
    sink.stream(0).write([memoryview(data[:cut])])
    sink.abort()
    (partial,) = find_partials(cache.blob_path(item.sha256))
    with open(partial, "r+b") as f:
        f.seek(CB + 1)
        f.write(b"\x00" if data[CB + 1] else b"\x01")
    again = _open(cache, item, digests)
    with pytest.raises(PartialChanged):  # not the source's fault: asked again from the start
        again.stream(again.start_of(1)).write([memoryview(data[cut : 2 * CB])])
    assert again.verified == {0} and again.start_of(1) == CB
    again.stream(CB).write([memoryview(data[CB:])])
    assert again.finish().read_bytes() == data


def test_a_source_list_is_taken_only_with_the_coordinators_signature():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from mesh_node.transfer.swarm import checked_source_list
    from protocol import constants as pc
    from protocol.certificates import public_bytes, sign_domain

    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    coord = public_bytes(key.public_key()).hex()
    t = _topology()
    me = t.stages[1].node_id
    required = {"a.gguf": ("c" * 64, CB + 1)}
    sl = _list((coord,))
    good = encode_source_list(sl, sign_domain(key, pc.SIG_DOMAIN_SWARM_SOURCES, sl.signed_bytes()))
    assert checked_source_list(good, t, required, me, coord) == sl
    forged = encode_source_list(
        sl, sign_domain(other, pc.SIG_DOMAIN_SWARM_SOURCES, sl.signed_bytes())
    )
    wrong_domain = encode_source_list(
        sl, sign_domain(key, pc.SIG_DOMAIN_TOPOLOGY, sl.signed_bytes())
    )
    for body in (forged, wrong_domain):
        with pytest.raises(IntegrityError) as e:
            checked_source_list(body, t, required, me, coord)
        assert e.value.code == "source_list_signature"


def test_chunks_matching_lying_digests_still_fail_the_whole_file_check(tmp_path):
    """Digests that describe other bytes (a lying coordinator): every chunk passes, the
    whole-file SHA-256 does not, and nothing is installed."""
    data, other = os.urandom(2 * CB), os.urandom(2 * CB)
    cache, item, _ = _sink_setup(tmp_path, data)
    lying = tuple(chunk_digest(other[i : i + CB]) for i in range(0, len(other), CB))
    sink = _open(cache, item, lying)
    for i in (0, 1):
        sink.write_chunk(i, other[i * CB : (i + 1) * CB])
    with pytest.raises(IntegrityError) as e:
        sink.finish()
    assert e.value.code == "artifact_sha256_mismatch"
    assert not cache.blob_path(item.sha256).exists()
    assert find_partials(cache.blob_path(item.sha256)) == []


def test_plan_sources_lists_ready_servers_needing_the_file_and_only_the_stage(hub_package):
    """The coordinator's decision: for each file of the requester's stage, itself first, then
    the ready, serving stage nodes whose stage needs that file; never the requester, never a
    file of another stage; a file it holds no digests for is left out."""
    from skippy.consume.preflight import load_package
    from skippy.transfer.required import stage_refs
    from skippy.transfer.sources import plan_sources

    manifest = load_package(hub_package.directory).manifest
    n = manifest.layer_count
    ids = [bytes([i]) * 32 for i in (1, 2, 3)]
    t = SplitTopology(
        topology_id="t1", run_id="r1", package_ref="hf://acme/tiny@" + "a" * 40,
        manifest_sha256="b" * 64, layer_count=n,
        stages=(
            StageAssignment(ids[0].hex(), "s0", 0, LayerRange(0, n // 2, n)),
            StageAssignment(ids[1].hex(), "s1", 1, LayerRange(n // 2, n, n)),
        ),
    )
    coord, holder, me = (bytes([9]) * 32).hex(), ids[0].hex(), ids[1].hex()
    mine = stage_refs(manifest, t.stages[1].layers)
    theirs = {r.path for r in stage_refs(manifest, t.stages[0].layers)}
    digests = {r.artifact.sha256.lower(): (b"\0" * 32,) for r in mine[1:]}  # not the first
    sl = plan_sources(
        t, manifest, me, coordinator_id=coord, ready=[holder, me], servers=[coord, holder, me],
        digests=digests, chunk_bytes=1 << 26,
    )
    assert [a.path for a in sl.artifacts] == [r.path for r in mine[1:]]
    for a in sl.artifacts:
        assert a.holders == ((coord, holder) if a.path in theirs else (coord,))
    not_ready = plan_sources(
        t, manifest, me, coordinator_id=coord, ready=[], servers=[coord, holder],
        digests=digests, chunk_bytes=1 << 26,
    )
    assert all(a.holders == (coord,) for a in not_ready.artifacts)
