"""The receiving side under faults: corrupted and truncated streams, a crash mid-transfer
(a real SIGKILLed process), stale and hostile partials, a partial written to while it is
opened, the 16 MiB manifest cap on both sides, two concurrent fetches, and a restart after
completion. In every case: nothing corrupt or partial is installed, and a fetch ends
verified or with a coded error."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from transfer_tools import (
    WORKER_A,
    WORKER_B,
    ServedPackage,
    fetch_item,
    item_for,
    policy,
    pump,
    served_package,  # noqa: F401 - a fixture
)

from skippy.atomic import find_partials, resumable_partial_for
from skippy.constants import MANIFEST_MAX_BYTES, MANIFEST_NAME
from skippy.consume.verify import VerifyCache
from skippy.errors import IntegrityError, ManifestError
from skippy.package.manifest import ArtifactRef, LayerArtifact
from skippy.transfer.chunk_sink import open_chunk_sink
from skippy.transfer.errors import (
    ArtifactWireError,
    InstallBusy,
    PartialChanged,
    TransferRefused,
)
from skippy.transfer.fetch_plan import FetchItem, request_for
from skippy.transfer.hubcache import RepoCache
from skippy.transfer.policy import PeerFacts
from skippy.transfer.serve import ArtifactServer
from skippy.transfer.wire import ArtifactResponse, encode_request

LAYER = "layers/layer-00003.gguf"  # 44,000 bytes: several 16 KiB chunks


@pytest.fixture
def server(served_package: ServedPackage, tmp_path: Path) -> ArtifactServer:  # noqa: F811
    return ArtifactServer(served_package.hub_cache, verify_cache=VerifyCache(tmp_path / "vs"))


def _nothing_installed(sp: ServedPackage, hub: Path, item: FetchItem) -> None:
    cache = RepoCache.for_ref(hub, sp.ref)
    assert not cache.blob_path(item.sha256).exists()
    assert not os.path.lexists(cache.snapshot_path(item.path))


def _installed_ok(sp: ServedPackage, hub: Path, item: FetchItem) -> None:
    cache = RepoCache.for_ref(hub, sp.ref)
    link = cache.snapshot_path(item.path)
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    assert link.read_bytes() == (sp.package_dir / item.path).read_bytes()
    assert cache.blob_path(item.sha256).is_file()
    assert find_partials(cache.blob_path(item.sha256)) == []


def _flip_a_body_byte(pieces: list[bytes]) -> list[bytes]:
    body = bytearray(pieces[2])
    body[len(body) // 2] ^= 0xFF
    return [*pieces[:2], bytes(body), *pieces[3:]]


def test_corrupted_byte_deletes_the_partial_and_installs_nothing(
    served_package: ServedPackage, server: ArtifactServer, tmp_path: Path  # noqa: F811
) -> None:
    sp, hub, item = served_package, tmp_path / "worker-hub", item_for(served_package, LAYER)
    with pytest.raises(IntegrityError) as exc:
        fetch_item(sp, server, hub, item, mutate=_flip_a_body_byte)
    assert exc.value.code == "artifact_sha256_mismatch"
    _nothing_installed(sp, hub, item)
    cache = RepoCache.for_ref(hub, sp.ref)
    assert find_partials(cache.blob_path(item.sha256)) == []  # proven wrong: deleted
    sink, _ = fetch_item(sp, server, hub, item)  # the lock was released: a retry works
    assert sink.state == "installed"
    _installed_ok(sp, hub, item)


def test_truncated_stream_keeps_the_partial_and_the_next_fetch_resumes(
    served_package: ServedPackage, server: ArtifactServer, tmp_path: Path  # noqa: F811
) -> None:
    sp, hub, item = served_package, tmp_path / "worker-hub", item_for(served_package, LAYER)
    with pytest.raises(ArtifactWireError) as exc:  # the peer vanished after 2 of 3 chunks
        fetch_item(sp, server, hub, item, mutate=lambda pieces: pieces[:3])
    assert exc.value.code == "artifact_wire_truncated"
    _nothing_installed(sp, hub, item)
    cache = RepoCache.for_ref(hub, sp.ref)
    (partial,) = find_partials(cache.blob_path(item.sha256))
    assert partial.stat().st_size == 2 * 16 * 1024
    sink, ex = fetch_item(sp, server, hub, item)
    assert sink.state == "installed" and ex is not None
    assert sink.received_bytes == item.size - 2 * 16 * 1024  # only the rest crossed the wire
    _installed_ok(sp, hub, item)


_CRASHING_CHILD = r"""
import os, signal, sys
from pathlib import Path
from skippy.transfer.fetch_plan import FetchItem
from skippy.transfer.hubcache import RepoCache
from skippy.transfer.chunk_sink import open_chunk_sink
from skippy.transfer.wire import ArtifactResponse

hub, ref, path, sha, size, source, cut = sys.argv[1:8]
sink = open_chunk_sink(RepoCache.for_ref(Path(hub), ref), FetchItem(path, sha, int(size)),
                 manifest_sha256="0" * 64, verify_cache=None)
sink.accept(ArtifactResponse.accept(int(size), sha))
data = Path(source).read_bytes()
for i in range(0, int(cut), 4096):
    sink.write(data[i : min(i + 4096, int(cut))])
os.kill(os.getpid(), signal.SIGKILL)  # a crash: no abort, no cleanup, the lock dies with us
"""


def test_resume_after_a_crash_mid_transfer(
    served_package: ServedPackage, server: ArtifactServer, tmp_path: Path  # noqa: F811
) -> None:
    sp, hub, item = served_package, tmp_path / "worker-hub", item_for(served_package, LAYER)
    assert item.size is not None
    cut = 30_000
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHING_CHILD, str(hub), sp.ref, item.path, item.sha256,
         str(item.size), str(sp.package_dir / item.path), str(cut)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    _nothing_installed(sp, hub, item)
    cache = RepoCache.for_ref(hub, sp.ref)
    (partial,) = find_partials(cache.blob_path(item.sha256))
    assert partial.stat().st_size == cut
    sink, ex = fetch_item(sp, server, hub, item)
    assert ex is not None and ex.outcome.decision.allowed
    assert sink.state == "installed" and sink.received_bytes == item.size - cut
    _installed_ok(sp, hub, item)


def test_partials_larger_than_the_artifact_are_deleted_and_the_largest_valid_one_resumes(
    served_package: ServedPackage, server: ArtifactServer, tmp_path: Path  # noqa: F811
) -> None:
    sp, hub, item = served_package, tmp_path / "worker-hub", item_for(served_package, LAYER)
    assert item.size is not None
    data = (sp.package_dir / item.path).read_bytes()
    blob = RepoCache.for_ref(hub, sp.ref).blob_path(item.sha256)
    blob.parent.mkdir(parents=True)
    stale = blob.parent / f".{blob.name}.111.1.part"
    stale.write_bytes(data + b"stale tail")
    small = blob.parent / f".{blob.name}.222.2.part"
    small.write_bytes(data[:5000])
    best = blob.parent / f".{blob.name}.333.3.part"
    best.write_bytes(data[:20000])
    outside = tmp_path / "precious"
    outside.write_bytes(b"keep me")
    hostile = blob.parent / f".{blob.name}.444.4.part"
    hostile.symlink_to(outside)  # a symlink posing as a partial is never opened
    sink, _ = fetch_item(sp, server, hub, item)
    assert sink.received_bytes == item.size - 20000
    assert not stale.exists() and not small.exists() and not os.path.lexists(hostile)
    assert outside.read_bytes() == b"keep me"
    _installed_ok(sp, hub, item)


def test_a_whole_partial_left_by_a_crash_before_the_rename_installs_without_a_request(
    served_package: ServedPackage, tmp_path: Path  # noqa: F811
) -> None:
    sp, hub, item = served_package, tmp_path / "worker-hub", item_for(served_package, LAYER)
    blob = RepoCache.for_ref(hub, sp.ref).blob_path(item.sha256)
    blob.parent.mkdir(parents=True)
    resumable_partial_for(blob).write_bytes((sp.package_dir / item.path).read_bytes())
    sink = open_chunk_sink(RepoCache.for_ref(hub, sp.ref), item, manifest_sha256="0" * 64,
                     verify_cache=None)
    assert sink.state == "installed" and sink.received_bytes == 0
    _installed_ok(sp, hub, item)


def _big_item(size: int) -> FetchItem:
    """A declared artifact of ``size`` bytes (its content is never received here)."""
    sha = hashlib.sha256(b"big").hexdigest()
    artifact = LayerArtifact(
        layer_index=0, path="layers/big.gguf", tensor_count=1, tensor_bytes=size,
        artifact_bytes=size, sha256=sha,
    )
    return FetchItem.of(ArtifactRef("layer", artifact, 0))


def test_a_partial_that_changes_while_it_is_opened_is_an_error(
    served_package: ServedPackage, tmp_path: Path  # noqa: F811
) -> None:
    item = _big_item(1 << 30)  # larger than the partial can grow while the test runs
    cache = RepoCache.for_ref(tmp_path / "worker-hub", served_package.ref)
    blob = cache.blob_path(item.sha256)
    blob.parent.mkdir(parents=True)
    partial = resumable_partial_for(blob)
    partial.write_bytes(os.urandom(48 * 1024 * 1024))  # hashing it takes a while
    stop, started = threading.Event(), threading.Event()

    def another_writer() -> None:  # someone else keeps appending to "our" partial
        with open(partial, "ab") as f:
            while not stop.is_set():
                f.write(b"x" * 512)
                f.flush()
                started.set()

    writer = threading.Thread(target=another_writer)
    writer.start()
    try:
        assert started.wait(10)
        with pytest.raises(PartialChanged) as exc:
            open_chunk_sink(cache, item, manifest_sha256="0" * 64, verify_cache=None)
        assert exc.value.code == "partial_changed"
    finally:
        stop.set()
        writer.join()
    assert partial.exists()  # not ours to delete
    assert not blob.exists()
    # The lock was released: once the other writer is gone the partial is resumed (its
    # garbage tail would then fail the final SHA-256 and be deleted).
    size = partial.stat().st_size
    sink = open_chunk_sink(cache, item, manifest_sha256="0" * 64, verify_cache=None)
    assert sink.offset == size
    sink.abort()


def test_manifest_cap_on_the_receiving_side(
    served_package: ServedPackage, tmp_path: Path  # noqa: F811
) -> None:
    """A peer announcing a 16 MiB + 1 manifest is refused before a byte is written."""
    cache = RepoCache.for_ref(tmp_path / "worker-hub", served_package.ref)
    item = FetchItem(MANIFEST_NAME, served_package.manifest_sha256, None)
    sink = open_chunk_sink(cache, item, manifest_sha256=item.sha256, verify_cache=None)
    with sink, pytest.raises(ManifestError) as exc:
        sink.accept(ArtifactResponse.accept(MANIFEST_MAX_BYTES + 1, item.sha256))
    assert exc.value.code == "manifest_too_large"
    assert not os.path.lexists(cache.snapshot_path(MANIFEST_NAME))


@pytest.mark.parametrize("extra", [0, 1])
def test_manifest_cap_on_the_serving_side(
    served_package: ServedPackage, tmp_path: Path, extra: int  # noqa: F811
) -> None:
    """A 16 MiB manifest is served and received whole; 16 MiB + 1 is refused by the server
    (and would be by the worker)."""
    sp = served_package
    raw = (sp.package_dir / MANIFEST_NAME).read_bytes()
    padded = raw + b" " * (MANIFEST_MAX_BYTES + extra - len(raw))  # JSON allows the spaces
    sha = hashlib.sha256(padded).hexdigest()
    coordinator = RepoCache.for_ref(tmp_path / "coordinator-hub", sp.ref)
    coordinator.snapshot_dir.mkdir(parents=True)
    coordinator.snapshot_path(MANIFEST_NAME).write_bytes(padded)
    server = ArtifactServer(coordinator.cache_dir, verify_cache=None)
    topology = sp.topology(manifest_sha256=sha)
    stage = topology.stage_of(WORKER_B.hex())
    assert stage is not None
    item = FetchItem(MANIFEST_NAME, sha, None)
    worker = RepoCache.for_ref(tmp_path / "worker-hub", sp.ref)
    sink = open_chunk_sink(worker, item, manifest_sha256=sha, verify_cache=None)
    frame = encode_request(request_for(item, topology, stage, WORKER_B))
    peer = PeerFacts(WORKER_B, None, "unverified")
    if extra == 0:
        ex = pump(server, policy("open"), peer, topology, frame, sink=sink, chunk=1 << 20)
        assert ex.installed is not None and ex.installed.read_bytes() == padded
        return
    with pytest.raises(TransferRefused):
        pump(server, policy("open"), peer, topology, frame, sink=sink)
    outcome = server.serve(policy("open"), peer, topology, request_for(item, topology, stage,
                                                                      WORKER_B))
    assert outcome.decision.reason == "manifest_too_large"
    assert not os.path.lexists(worker.snapshot_path(MANIFEST_NAME))


def test_a_refusal_mid_transfer_keeps_the_partial(
    served_package: ServedPackage, server: ArtifactServer, tmp_path: Path  # noqa: F811
) -> None:
    sp, hub, item = served_package, tmp_path / "worker-hub", item_for(served_package, LAYER)
    with pytest.raises(ArtifactWireError):
        fetch_item(sp, server, hub, item, mutate=lambda pieces: pieces[:2])
    with pytest.raises(TransferRefused) as exc:  # reconnected, but now the policy refuses
        fetch_item(sp, server, hub, item, mode="disabled")
    assert exc.value.actual == "artifact transfer disabled"
    (partial,) = find_partials(RepoCache.for_ref(hub, sp.ref).blob_path(item.sha256))
    assert partial.stat().st_size == 16 * 1024
    _nothing_installed(sp, hub, item)


def test_a_peer_serving_other_bytes_is_caught_by_the_header(
    served_package: ServedPackage, tmp_path: Path  # noqa: F811
) -> None:
    sp, item = served_package, item_for(served_package, LAYER)
    assert item.size is not None
    sink = open_chunk_sink(RepoCache.for_ref(tmp_path / "hub", sp.ref), item,
                     manifest_sha256="0" * 64, verify_cache=None)
    with sink:
        with pytest.raises(IntegrityError) as wrong_sha:
            sink.accept(ArtifactResponse.accept(item.size, "e" * 64))
        assert wrong_sha.value.code == "peer_artifact_mismatch"
        with pytest.raises(IntegrityError) as wrong_size:
            sink.accept(ArtifactResponse.accept(item.size + 1, item.sha256))
        assert wrong_size.value.code == "peer_artifact_mismatch"


def test_two_concurrent_fetches_install_once(
    served_package: ServedPackage, server: ArtifactServer, tmp_path: Path  # noqa: F811
) -> None:
    sp, hub, item = served_package, tmp_path / "worker-hub", item_for(served_package, LAYER)
    cache = RepoCache.for_ref(hub, sp.ref)
    first = open_chunk_sink(cache, item, manifest_sha256=sp.manifest_sha256, verify_cache=None)
    with pytest.raises(InstallBusy):  # the lock is held: a second fetch cannot start
        open_chunk_sink(cache, item, manifest_sha256=sp.manifest_sha256, verify_cache=None)
    results: dict[str, object] = {}
    entering = threading.Event()

    def second_fetch() -> None:
        entering.set()
        results["second"] = fetch_item(sp, server, hub, item, lock_timeout_s=30)

    waiter = threading.Thread(target=second_fetch)
    waiter.start()
    assert entering.wait(10)
    time.sleep(0.2)  # sequencing only: let the second fetch reach the lock and wait on it
    frame = encode_request(
        request_for(item, sp.topology(), sp.topology().stages[2], WORKER_B)
    )
    pump(server, policy("open"), PeerFacts(WORKER_B, None, "unverified"), sp.topology(),
         frame, sink=first)
    inode = cache.blob_path(item.sha256).stat().st_ino
    waiter.join(30)
    second_sink, second_exchange = results["second"]  # type: ignore[misc]
    assert first.state == "installed"
    assert second_sink.present and second_exchange is None  # found it installed: no request
    assert cache.blob_path(item.sha256).stat().st_ino == inode  # not installed a second time
    _installed_ok(sp, hub, item)


def test_restart_after_completion_fetches_nothing(
    served_package: ServedPackage, server: ArtifactServer, tmp_path: Path  # noqa: F811
) -> None:
    sp, hub = served_package, tmp_path / "worker-hub"
    verify = VerifyCache(tmp_path / "verify-worker")
    items = [item_for(sp, p) for p in (MANIFEST_NAME, LAYER, "shared/output.gguf")]
    for item in items:
        sink, ex = fetch_item(sp, server, hub, item, verify_cache=verify)
        assert sink.state == "installed" and ex is not None
    for item in items:  # a restarted worker: every sink finds its file, nothing is asked
        sink, ex = fetch_item(sp, server, hub, item, verify_cache=verify)
        assert sink.present and ex is None and sink.received_bytes == 0


def test_two_workers_fetch_their_stages_from_one_server_at_once(
    served_package: ServedPackage, server: ArtifactServer, tmp_path: Path  # noqa: F811
) -> None:
    sp = served_package
    wanted = {
        WORKER_A: {"shared/metadata.gguf", "layers/layer-00001.gguf", "layers/layer-00002.gguf"},
        WORKER_B: {"shared/metadata.gguf", "shared/embeddings.gguf", LAYER, "shared/output.gguf"},
    }
    errors: list[BaseException] = []

    def worker(node: bytes) -> None:
        try:
            for path in sorted(wanted[node]):
                sink, _ = fetch_item(sp, server, tmp_path / node.hex()[:8], item_for(sp, path),
                                     requester=node, chunk=4096)
                assert sink.state == "installed"
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(node,)) for node in wanted]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    for node, paths in wanted.items():
        hub = tmp_path / node.hex()[:8]
        snapshot = RepoCache.for_ref(hub, sp.ref).snapshot_dir
        got = {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()}
        assert got == paths
        for path in paths:
            _installed_ok(sp, hub, item_for(sp, path))
