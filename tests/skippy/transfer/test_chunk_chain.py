"""SHA-256 chains over chunks (``chunk-chain``): every chunk is checked on
its own, in any order, and once all have passed the file's SHA-256 has been computed over
every byte exactly once. libcrypto through ctypes, checked against hashlib."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_swarm_chunks import _topology

from skippy.atomic import find_partials
from skippy.errors import IntegrityError
from skippy.transfer import chunk_sink as chunk_sink_module
from skippy.transfer import chunks as chunks_module
from skippy.transfer import sha256_chain
from skippy.transfer.chunk_sink import open_chunk_sink
from skippy.transfer.chunks import (
    MIN_CHUNK_BYTES,
    ChunkDigestStore,
    check_chain,
    chunk_digest,
    chunk_spans,
    digest_chunks,
)
from skippy.transfer.fetch_plan import FetchItem
from skippy.transfer.hubcache import RepoCache
from skippy.transfer.sources import (
    ArtifactSources,
    SourceList,
    check_source_list,
    decode_source_list,
    encode_source_list,
)

CB = MIN_CHUNK_BYTES


def _chain(data: bytes, chunk: int) -> tuple[bytes, ...]:
    return sha256_chain.chain_states(data[i : i + chunk] for i in range(0, len(data), chunk))


def test_libcrypto_is_found_and_agrees_with_hashlib():
    """Not optional here: a node without it falls back to plain digests, but every machine
    this project runs on has the libcrypto Python's own hashlib links."""
    assert sha256_chain.available()


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=3000),
    blocks=st.integers(min_value=1, max_value=12),
)
def test_each_link_is_the_state_after_its_chunk_and_the_last_is_the_files_sha256(data, blocks):
    chunk = 64 * blocks
    chain = _chain(data, chunk)
    digest = hashlib.sha256(data).digest()
    assert chain[-1] == digest and len(chain) == -(-len(data) // chunk)
    for i in range(len(chain)):
        start = i * chunk
        piece = data[start : start + chunk]
        assert sha256_chain.check_chunk(chain, i, start, [piece], digest)
        # from link i-1, the rest of the file reaches the file's digest (it is SHA-256's
        # own state there, not a digest of its own)
        rest = sha256_chain.ChainHasher(sha256_chain.start_of(chain, i), start)
        rest.update(data[start:])
        assert rest.digest() == digest


@settings(max_examples=40, deadline=None)
@given(
    data=st.binary(min_size=65, max_size=2000),
    blocks=st.integers(min_value=1, max_value=4),
    where=st.integers(min_value=0),
)
def test_a_changed_byte_fails_its_own_chunk_and_no_other(data, blocks, where):
    chunk = 64 * blocks
    chain = _chain(data, chunk)
    digest = hashlib.sha256(data).digest()
    pos = where % len(data)
    bad = bytearray(data)
    bad[pos] ^= 0x5A
    hit = pos // chunk
    for i in range(len(chain)):
        piece = bytes(bad[i * chunk : (i + 1) * chunk])
        assert sha256_chain.check_chunk(chain, i, i * chunk, [piece], digest) is (i != hit)


def test_a_chain_resumes_only_at_a_whole_block():
    with pytest.raises(ValueError) as e:
        sha256_chain.ChainHasher(sha256_chain.INITIAL_STATE, 100)
    assert getattr(e.value, "code", "") == "sha256_chain_misaligned"
    h = sha256_chain.ChainHasher()
    h.update(b"x" * 65)
    with pytest.raises(ValueError):
        h.state()


def test_chain_digests_come_only_from_a_file_that_hashes_whole(tmp_path):
    data = os.urandom(3 * CB + 100)
    path = tmp_path / "a.bin"
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    chain = digest_chunks(path, size=len(data), sha256=sha, chunk_bytes=CB, chain=True)
    assert chain == _chain(data, CB) and chain[-1].hex() == sha
    # the chain proves the file in its one pass, even when the caller calls it proven
    with pytest.raises(IntegrityError) as e:
        digest_chunks(path, size=len(data), sha256="0" * 64, chunk_bytes=CB, proven=True,
                      chain=True)
    assert e.value.code == "artifact_sha256_mismatch"
    store = ChunkDigestStore.beside(tmp_path / "cache" / "verify")
    assert store.digests_for(path, size=len(data), sha256=sha, chunk_bytes=CB, chain=True) == chain
    assert store.get(sha, len(data), CB) is None  # plain digests are another list
    plain = store.digests_for(path, size=len(data), sha256=sha, chunk_bytes=CB)
    assert plain != chain and store.get(sha, len(data), CB, chain=True) == chain


def _setup(tmp_path: Path, data: bytes):  # type: ignore[no-untyped-def]
    cache = RepoCache.for_ref(tmp_path / "hub", "hf://acme/tiny@" + "a" * 40)
    item = FetchItem("a.gguf", hashlib.sha256(data).hexdigest(), len(data), None)
    return cache, item


def _open(cache, item, digests, *, chain=True):  # type: ignore[no-untyped-def]
    return open_chunk_sink(
        cache, item, digests=digests, chunk_bytes=CB, manifest_sha256="b" * 64,
        verify_cache=None, chain=chain,
    )


class _Counting:
    """Counts the bytes every SHA-256 in the chunk path hashes: hashlib's objects in the
    sink and the chunk module, and the chain's libcrypto updates."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        counter = self
        real_update = sha256_chain.ChainHasher.update

        class Hashlib:
            @staticmethod
            def sha256(data: bytes = b""):  # type: ignore[no-untyped-def]
                h = hashlib.sha256()

                class Counted:
                    def update(self, more):  # type: ignore[no-untyped-def]
                        counter.bytes += memoryview(more).nbytes
                        h.update(more)

                    def digest(self) -> bytes:
                        return h.digest()

                    def hexdigest(self) -> str:
                        return h.hexdigest()

                c = Counted()
                if data:
                    c.update(data)
                return c

        def update(self, data):  # type: ignore[no-untyped-def]
            counter.bytes += memoryview(data).nbytes
            real_update(self, data)

        monkeypatch.setattr(chunk_sink_module, "hashlib", Hashlib)
        monkeypatch.setattr(chunks_module, "hashlib", Hashlib)
        monkeypatch.setattr(sha256_chain.ChainHasher, "update", update)


@pytest.mark.parametrize(("chain", "passes"), [(True, 1), (False, 2)])
def test_chunks_in_any_order_install_verified_hashing_each_byte_once_with_a_chain(
    tmp_path, monkeypatch, chain, passes
):
    """The point of the chain: chunks arriving out of order, each checked on arrival, then
    the install, with every byte hashed once; plain per-chunk digests need the second,
    whole-file pass (and read the out-of-order chunks back from the partial for it)."""
    data = os.urandom(4 * CB + 33)
    cache, item = _setup(tmp_path, data)
    spans = chunk_spans(len(data), CB)
    digests = (
        _chain(data, CB) if chain else tuple(chunk_digest(data[s.start : s.stop]) for s in spans)
    )
    counted = _Counting(monkeypatch)
    sink = _open(cache, item, digests, chain=chain)
    for i in (4, 2, 0, 3, 1):
        assert sink.write_chunk(i, data[spans[i].start : spans[i].stop])
    assert sink.finish().read_bytes() == data and sink.state == "installed"
    assert counted.bytes == passes * len(data)
    assert find_partials(cache.blob_path(item.sha256)) == []


def test_a_bad_chunk_is_refused_at_that_chunk_and_the_file_still_installs(tmp_path):
    data = os.urandom(3 * CB)
    cache, item = _setup(tmp_path, data)
    sink = _open(cache, item, _chain(data, CB))
    bad = bytearray(data[CB : 2 * CB])
    bad[-1] ^= 1
    with pytest.raises(IntegrityError) as e:
        sink.write_chunk(1, bad)
    assert e.value.code == "chunk_digest_mismatch" and sink.verified == set()
    for i in (2, 1, 0):
        sink.write_chunk(i, data[i * CB : (i + 1) * CB])
    assert sink.finish().read_bytes() == data


def test_a_chain_that_does_not_end_at_the_artifacts_sha256_is_refused_before_any_chunk(tmp_path):
    data = os.urandom(2 * CB)
    cache, item = _setup(tmp_path, data)
    wrong_end = (*_chain(data, CB)[:-1], b"\x00" * 32)
    with pytest.raises(IntegrityError) as e:
        _open(cache, item, wrong_end)
    assert e.value.code == "chunk_digests_invalid"
    assert find_partials(cache.blob_path(item.sha256)) == []
    with pytest.raises(IntegrityError):
        check_chain(_chain(data, CB), item.sha256, CB + 1)  # not whole blocks


def test_a_lying_chain_cannot_install_other_bytes(tmp_path):
    """A chain of other bytes, ending at the true SHA-256 (the only end a list may have):
    the other bytes pass every link but the last, whose check is the manifest's digest; the
    true bytes fail at chunk 0. Nothing is installed either way."""
    data, other = os.urandom(3 * CB), os.urandom(3 * CB)
    cache, item = _setup(tmp_path, data)
    lying = (*_chain(other, CB)[:-1], bytes.fromhex(item.sha256))
    sink = _open(cache, item, lying)
    for i in (0, 1):
        assert sink.write_chunk(i, other[i * CB : (i + 1) * CB])
    with pytest.raises(IntegrityError):
        sink.write_chunk(2, other[2 * CB :])
    with pytest.raises(IntegrityError):
        sink.write_chunk(0, data[:CB])
    sink.abort()
    assert not cache.blob_path(item.sha256).exists()


def test_a_resume_keeps_the_chunks_that_pass_their_links(tmp_path):
    data = os.urandom(4 * CB)
    cache, item = _setup(tmp_path, data)
    chain = _chain(data, CB)
    sink = _open(cache, item, chain)
    for i in (1, 3):
        sink.write_chunk(i, data[i * CB : (i + 1) * CB])
    sink.abort()
    again = _open(cache, item, chain)
    assert again.verified == {1, 3}
    for i in (0, 2):
        again.write_chunk(i, data[i * CB : (i + 1) * CB])
    assert again.finish().read_bytes() == data


def _chain_list(digests: tuple[bytes, ...], sha: str, size: int, **kw) -> SourceList:  # type: ignore[no-untyped-def]
    t = _topology()
    fields = dict(
        topology_id=t.topology_id,
        run_id=t.run_id,
        manifest_sha256=t.manifest_sha256,
        stage_id="s1",
        requester_id=t.stages[1].node_id,
        chunk_bytes=CB,
        artifacts=(ArtifactSources("a.gguf", sha, size, digests, ((b"\x09" * 32).hex(),)),),
        chain=True,
    )
    fields.update(kw)
    return SourceList(**fields)  # type: ignore[arg-type]


def test_a_chain_list_round_trips_and_is_checked_against_the_manifest():
    data = os.urandom(2 * CB + 5)
    sha = hashlib.sha256(data).hexdigest()
    chain = _chain(data, CB)
    sl = _chain_list(chain, sha, len(data))
    back, signed, _ = decode_source_list(encode_source_list(sl, b"s" * 64))
    assert back == sl and back.chain and signed == sl.signed_bytes()
    t = _topology()
    me, coord = t.stages[1].node_id, (b"\x09" * 32).hex()
    required = {"a.gguf": (sha, len(data))}
    assert check_source_list(back, t, required, me, coord) is back
    bad = _chain_list((*chain[:-1], b"\x01" * 32), sha, len(data))
    with pytest.raises(IntegrityError) as e:
        check_source_list(bad, t, required, me, coord)
    assert e.value.code == "source_list_mismatch"
    # a plain list of the same digests is another list (the kind is signed too)
    assert _chain_list(chain, sha, len(data), chain=False).signed_bytes() != sl.signed_bytes()
