"""The hub cache budget: least-recently-used blobs nothing on the node
needs are evicted to make room, oldest first; never a blob a needed snapshot (the active
topology's, a running stage's) links to, never a partial being written; where eviction
cannot make room the fetch is refused (``cache_budget``) and nothing is deleted for it;
``mesh-node status`` and ``/metrics`` show use vs budget. With no ``cache_budget`` set the
budget is derived from the disk at start and said in the log."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import trio
from conftest import HubPackage
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
from servetools import Cluster, node_toml
from test_delta_revisions import _revise

from mesh_node.lab.package import revise_directory
from mesh_node.metrics import cache_families
from mesh_node.peers import render_cache, render_status
from mesh_node.settings import SecuritySettings, security_settings
from mesh_node.transfer.cache_budget import CacheBudget
from skippy.atomic import exclusive_lock, resumable_partial_for
from skippy.constants import MANIFEST_NAME, ROLE_LAYER
from skippy.consume import hub
from skippy.errors import UsageError
from skippy.package.refs import parse_hf_package_ref
from skippy.transfer.disk import auto_cache_budget, cache_usage
from skippy.transfer.evict import BlobUse, plan_eviction
from skippy.transfer.hubcache import RepoCache, load_held_manifest
from skippy.transfer.recency import RecencyIndex, blob_key


# --- the decision (pure) ----------------------------------------------------------------------
def _b(key: str, size: int, used: float, pinned: bool = False) -> BlobUse:
    return BlobUse(f"models--a--b/{key * 64}", size, used, pinned)


def test_eviction_takes_the_least_recently_used_first_and_only_what_is_needed() -> None:
    blobs = [_b("1", 50, 300), _b("2", 40, 100), _b("3", 30, 200), _b("4", 999, 0, pinned=True)]
    plan = plan_eviction(blobs, used_bytes=1119, budget_bytes=1100, incoming_bytes=0)
    assert [b.key[-1] for b in plan.evict] == ["2"] and plan.fits  # 40 >= 19 over
    plan = plan_eviction(blobs, used_bytes=1119, budget_bytes=1100, incoming_bytes=50)
    assert [b.key[-1] for b in plan.evict] == ["2", "3"] and plan.freed_bytes == 70
    within = plan_eviction(blobs, used_bytes=1000, budget_bytes=1100, incoming_bytes=100)
    assert within.evict == () and within.fits


def test_a_pinned_blob_is_never_evicted_and_no_room_means_nothing_is_deleted() -> None:
    blobs = [_b("1", 50, 300), _b("4", 999, 0, pinned=True)]
    plan = plan_eviction(blobs, used_bytes=1049, budget_bytes=1000, incoming_bytes=100)
    assert plan.evict == () and not plan.fits and plan.shortfall_bytes == 99
    ties = [_b("b", 10, 5), _b("a", 10, 5)]
    assert (
        plan_eviction(ties, used_bytes=20, budget_bytes=10, incoming_bytes=0).evict[0].key[-1]
        == "a"
    )


def test_the_recency_index_round_trips_forgets_and_tolerates_garbage(tmp_path) -> None:
    index = RecencyIndex(tmp_path / "r.json")
    k1, k2 = f"models--a--b/{'1' * 64}", f"models--a--b/{'2' * 64}"
    index.touch([k1, k2, "../../etc/passwd"], 100.0)
    index.touch([k2], 200.0)
    assert index.load() == {k1: 100.0, k2: 200.0}
    index.forget([k1])
    assert index.load() == {k2: 200.0}
    (tmp_path / "r.json").write_text("{not json")
    assert index.load() == {}
    (tmp_path / "r.json").write_text(json.dumps({"version": 1, "blobs": {k1: "x", "z": 1}}))
    assert index.load() == {}


GIB = 1024**3


@pytest.mark.parametrize(
    ("total", "free", "used", "budget"),
    [
        (100 * GIB, 60 * GIB, 0, 50 * GIB),  # cache + free - a tenth: 50, half the disk: 50
        (100 * GIB, 57 * GIB, 3 * GIB, 50 * GIB),  # its own bytes count: the same on restart
        (100 * GIB, 30 * GIB, 0, 20 * GIB),  # a fuller disk: what is free, less the reserve
        (1024 * GIB, 900 * GIB, 0, 512 * GIB),  # at most half; the reserve stops at 10 GiB
        (1024 * GIB, 15 * GIB, 0, 5 * GIB),
        (20 * GIB, 1 * GIB, 0, 1 * GIB),  # nearly full: 1 GiB (the free-space check refuses)
    ],
)
def test_the_automatic_budget_follows_the_disk(total, free, used, budget) -> None:
    auto = auto_cache_budget(disk_total_bytes=total, disk_free_bytes=free, cache_used_bytes=used)
    assert auto.budget_bytes == budget
    assert str(auto.disk_total_bytes // 2) in auto.explain()


def test_cache_budget_is_auto_unless_set_and_says_what_it_takes() -> None:
    assert SecuritySettings().cache_budget_bytes == "auto"
    assert security_settings({"cache_budget": "auto"}).cache_budget_bytes == "auto"
    assert security_settings({"cache_budget": 0}).cache_budget_bytes == 0
    assert security_settings({"cache_budget": "20GiB"}).cache_budget_bytes == 20 * GIB
    with pytest.raises(UsageError) as err:
        security_settings({"cache_budget": "big"})
    assert err.value.code == "invalid_config" and '"auto"' in err.value.message


def test_start_resolves_the_budget_and_says_which_holds(tmp_path) -> None:
    data = tmp_path / "data"
    auto = CacheBudget(data / "hub", data, SecuritySettings())  # the hub folder not made yet
    assert auto.auto and auto.budget_bytes == 0  # nothing derived before start
    line = auto.start()
    assert 1 * GIB <= auto.budget_bytes <= shutil.disk_usage(tmp_path).total // 2
    assert f"({auto.budget_bytes} bytes, cache_budget = auto: " in line
    assert auto.status()["budget_auto"] is True
    fixed = CacheBudget(data / "hub", data, SecuritySettings(cache_budget_bytes=5000))
    assert "5000 bytes, [security] cache_budget" in fixed.start() and fixed.budget_bytes == 5000
    none = CacheBudget(data / "hub", data, SecuritySettings(cache_budget_bytes=0))
    assert "none ([security] cache_budget = 0)" in none.start() and none.budget_bytes == 0
    assert none.status()["budget_auto"] is False


def test_a_node_started_with_no_cache_budget_takes_one_from_the_disk_and_says_so(
    tmp_path,
) -> None:
    """A real `mesh-node run` with a config that never mentions the cache: its log says the
    automatic budget at start, and `status` shows it."""
    cluster = Cluster(tmp_path)
    toml = node_toml(tmp_path, "n")
    assert "cache_budget" not in toml
    proc = cluster.start("n", ["run"], toml)
    try:
        proc.wait_line("listening ")
        deadline = time.monotonic() + 30
        while not (said := [line for line in proc.log if "hub cache budget" in line]):
            assert time.monotonic() < deadline, proc.log[-10:]
            time.sleep(0.05)
        cache = cluster.status("n")["cache"]
    finally:
        cluster.stop()
    assert cache["budget_auto"] is True and cache["budget_bytes"] >= GIB
    assert f"({cache['budget_bytes']} bytes, cache_budget = auto: " in said[0]
    assert "half the filesystem" in said[0]


def test_status_text_and_metrics_show_use_vs_budget() -> None:
    doc = {"used_bytes": 750, "budget_bytes": 1000, "evicted_blobs": 2, "evicted_bytes": 300,
           "refusals": 1}  # fmt: skip
    assert render_cache(doc) == (
        "cache    750 bytes used of 1000 budget (75%); evicted 2 blobs (300 bytes), "
        "1 fetches refused"
    )
    assert "no budget" in render_cache({**doc, "budget_bytes": 0})
    assert "of 1000 budget (75%, auto);" in render_cache({**doc, "budget_auto": True})
    got = {m.name: m.samples[0].value for m in cache_families(doc)}
    assert got["mesh_node_cache_used_bytes"] == 750
    assert got["mesh_node_cache_budget_bytes"] == 1000
    assert got["mesh_node_cache_evicted_bytes"] == 300


# --- the shell over a real hub cache --------------------------------------------------------------
def test_make_room_evicts_lru_never_a_needed_blob_nor_a_partial_being_written(
    tmp_path, hub_package: HubPackage
) -> None:
    cache_dir = tmp_path / "hf"
    ref = parse_hf_package_ref(hub_package.ref)
    hub.download_many(ref, ref.revision or "", [MANIFEST_NAME], endpoint=hub_package.hub.url,
                      cache_dir=cache_dir)  # fmt: skip
    repo = RepoCache.for_ref(cache_dir, hub_package.ref)
    raw = (repo.snapshot_dir / MANIFEST_NAME).read_bytes()
    manifest = load_held_manifest(repo, hashlib.sha256(raw).hexdigest()).held.manifest
    refs = {r.path: r for r in manifest.artifacts()}
    hub.download_many(ref, ref.revision or "", list(refs), endpoint=hub_package.hub.url,
                      cache_dir=cache_dir)  # fmt: skip
    layers = sorted(r.path for r in refs.values() if r.role == ROLE_LAYER)
    # a running stage links metadata and layer 0 (a peer area: only those files)
    running = repo.repo_root / "peer-snapshots" / ("e" * 64)
    for path in (MANIFEST_NAME, "shared/metadata.gguf", layers[0]):
        (running / path).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.realpath(repo.snapshot_path(path)), running / path)
    # a partial being written right now (its install lock held)
    sha = "f" * 64
    partial = resumable_partial_for(repo.blob_path(sha))
    partial.write_bytes(b"x" * 1000)
    budget = CacheBudget(cache_dir, tmp_path / "data", SecuritySettings())
    key = {p: blob_key(Path(os.path.realpath(repo.snapshot_path(p)))) for p in refs}
    # recency: layer 1 the oldest, then layer 3; everything else used recently
    budget.index.touch(key.values(), 300.0)
    budget.index.touch([key[layers[1]]], 100.0)
    budget.index.touch([key[layers[3]], key[layers[0]]], 200.0)
    used = cache_usage(cache_dir)
    size = {p: r.artifact.artifact_bytes for p, r in refs.items()}
    budget.budget_bytes = used - size[layers[1]]
    with exclusive_lock(repo.lock_path(sha)):
        assert budget.make_room(0, [running]) == size[layers[1]]
        assert not repo.snapshot_path(layers[1]).exists()  # the blob and its link are gone
        assert not repo.snapshot_path(layers[1]).is_symlink()
        # more room: the next least recently used goes, never layer 0 (pinned, also old)
        assert budget.make_room(size[layers[3]], [running]) == size[layers[3]]
        assert not repo.snapshot_path(layers[3]).exists()
        assert all((running / p).is_file() for p in ("shared/metadata.gguf", layers[0]))
        # no room possible without what the running stage links to: nothing is deleted
        before = sorted(os.listdir(repo.repo_root / "blobs"))
        assert budget.make_room(10**9, [running]) == 0
        assert sorted(os.listdir(repo.repo_root / "blobs")) == before
        assert partial.is_file()  # never a partial
    assert budget.evicted_blobs == 2
    assert budget.evicted_bytes == size[layers[1]] + size[layers[3]]
    assert budget.status()["used_bytes"] == cache_usage(cache_dir)
    assert key[layers[1]] not in budget.index.load()  # forgotten with the blob


# --- over real mesh links: the running stage is never evicted -------------------------------------
async def test_a_small_budget_never_evicts_the_running_stage_then_evicts_what_nothing_needs(
    tmp_path, hub_package
):
    owner = Ed25519PrivateKey.generate()
    hp = hub_package
    async with trio.open_nursery() as n:
        coord = await start_member(
            n, tmp_path, "coord", owner, hub=hp.hub, artifact_transfer="trusted"
        )
        pkg1 = import_into(coord, hp)
        worker = await start_member(n, tmp_path, "w", owner, hub=hp.hub, peers=(coord.node,))
        await wait_connected([coord, worker])
        first = await propose(coord, pkg1, stages=2)
        await wait_for(lambda: worker.service.records.stage.report == "accepted", 20)
        stage = first.topology.stage_of(worker.node.node_id)
        running = {p: sha256_of(f) for p, f in snapshot_files(worker, pkg1.ref).items()}
        ref2 = _revise(hp, tmp_path / "rev" / hp.directory.name, stage.layers.start)
        pkg2 = import_into(coord, HubPackage(hp.directory, hp.hub, ref2))
        # room for everything but one byte of the changed layer: only the running stage's
        # blobs could make it, and they are never evicted
        budget = worker.service.fetcher.cache_budget
        changed = next(
            r for r in pkg2.manifest.artifacts()
            if r.role == ROLE_LAYER and r.layer_index == stage.layers.start
        )  # fmt: skip
        manifest_bytes = records(worker)[MANIFEST_NAME]["total"]
        budget.budget_bytes = (
            cache_usage(worker.cache) + manifest_bytes + changed.artifact.artifact_bytes - 1
        )
        second = await propose(coord, pkg2, stages=2)
        await wait_for(
            lambda: worker.service.records.stage.topology_id == second.topology.topology_id
            and worker.service.records.stage.state == "failed",
            20,
        )  # fmt: skip
        assert worker.service.records.stage.error == "cache_budget"
        assert {p: sha256_of(f) for p, f in snapshot_files(worker, pkg1.ref).items()} == running
        assert worker.service.result is not None and worker.service.result.load.sha256_verified
        cache = worker.node.status()["cache"]
        assert cache["refusals"] == 1 and cache["evicted_blobs"] == 0
        assert cache["budget_bytes"] == budget.budget_bytes and cache["used_bytes"] > 0

        # the second revision runs now (no budget); a third changes another of its layers:
        # the first revision's own blobs are no longer needed, and go to make room
        budget.budget_bytes = 0
        again = await propose(coord, pkg2, stages=2)
        await _ready(worker, again.topology.topology_id)
        running2 = {p: sha256_of(f) for p, f in snapshot_files(worker, ref2).items()}
        dir2 = tmp_path / "rev" / hp.directory.name
        dir3 = tmp_path / "rev3" / hp.directory.name
        revise_directory(dir2, dir3, layer=stage.layers.start + 1)
        repo = ref2.removeprefix("hf://").split("@")[0]
        ref3 = f"hf://{repo}@{hp.hub.add_revision(repo, dir3, branches=())}"
        pkg3 = import_into(coord, HubPackage(dir3, hp.hub, ref3))
        changed3 = next(
            r for r in pkg3.manifest.artifacts()
            if r.role == ROLE_LAYER and r.layer_index == stage.layers.start + 1
        )  # fmt: skip
        budget.budget_bytes = (
            cache_usage(worker.cache) + manifest_bytes + changed3.artifact.artifact_bytes - 1
        )
        old_only = {  # blobs only the first revision links to
            os.path.realpath(f) for f in snapshot_files(worker, pkg1.ref).values()
        } - {os.path.realpath(f) for f in snapshot_files(worker, ref2).values()}
        assert old_only
        third = await propose(coord, pkg3, stages=2)
        await _ready(worker, third.topology.topology_id)
        cache = worker.node.status()["cache"]
        assert cache["evicted_blobs"] >= 1 and cache["used_bytes"] <= budget.budget_bytes
        assert sum(not os.path.exists(b) for b in old_only) == cache["evicted_blobs"]
        assert {p: sha256_of(f) for p, f in snapshot_files(worker, ref2).items()} == running2
        assert "cache    " in render_status(worker.node.status())
        n.cancel_scope.cancel()


async def _ready(worker: Member, topology_id: str) -> None:
    await wait_for(
        lambda: worker.service.records.stage.topology_id == topology_id
        and worker.service.records.stage.report == "accepted",
        20,
    )  # fmt: skip
