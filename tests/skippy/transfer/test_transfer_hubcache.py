"""A worker's stage arrives from the coordinator and lands where everything else looks: the
fetch plan (manifest first, then what is missing), then the proof that the standard hub
cache layout was written: the real ``skippy.consume.resolve`` and ``skippy-model-package``
find and verify the stage offline (from the verification records the sink wrote, no
re-hash), and huggingface_hub itself, offline in a fresh process, finds every file; online
it downloads only what the peer did not bring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hubfaults import Fault
from transfer_tools import (
    REPO,
    WORKER_B,
    ServedPackage,
    fetch_item,
    item_for,
    served_package,  # noqa: F401 - a fixture
)

from skippy.cli import main
from skippy.config import Environment, read_environment
from skippy.constants import MANIFEST_NAME
from skippy.consume.hub import OfflineCacheMiss
from skippy.consume.resolve import resolve_stage
from skippy.consume.verify import VerifyCache
from skippy.errors import IntegrityError, TopologyError
from skippy.transfer.fallback import fetch_from_hub
from skippy.transfer.fetch_plan import FetchPlan, manifest_item, plan_fetch
from skippy.transfer.hubcache import (
    RepoCache,
    load_held_manifest,
    manifest_present,
    verified_present,
)
from skippy.transfer.serve import ArtifactServer

STAGE_PATHS = {
    "shared/metadata.gguf",
    "shared/embeddings.gguf",  # tied embeddings: the final stage projects through them
    "layers/layer-00003.gguf",
    "shared/output.gguf",
}


def _env(home: Path, **extra: str) -> dict[str, str]:
    return {
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / "xdg"),
        "HF_HUB_CACHE": str(home / "hub"),
        **extra,
    }


@dataclass(frozen=True)
class Worker:
    home: Path
    env: Environment
    cache: RepoCache
    verify: VerifyCache
    first_plan: FetchPlan


@pytest.fixture(scope="module")
def worker(served_package: ServedPackage, tmp_path_factory) -> Worker:  # noqa: F811
    """Worker B (final stage, layers 3..4) fetches its stage from the coordinator, driven by
    the plan exactly as the mesh shell will drive it."""
    sp = served_package
    home = tmp_path_factory.mktemp("worker")
    env = read_environment(_env(home))
    verify = VerifyCache.under(env.skippy_cache_dir)  # where resolve_stage looks
    cache = RepoCache.for_ref(env.hf_cache_dir, sp.ref)
    server = ArtifactServer(sp.hub_cache, verify_cache=VerifyCache(home / "coordinator-verify"))
    topology = sp.topology()
    assert not manifest_present(cache, topology.manifest_sha256)
    sink, _ = fetch_item(sp, server, env.hf_cache_dir, manifest_item(topology), verify_cache=verify)
    assert sink.state == "installed"
    held = load_held_manifest(cache, topology.manifest_sha256).held
    present = verified_present(
        cache, held.manifest.artifacts(), manifest_sha256=held.sha256, verify_cache=verify
    )
    plan = plan_fetch(held.manifest, held.sha256, topology, WORKER_B.hex(), present)
    for item in plan.fetch:
        sink, _ = fetch_item(sp, server, env.hf_cache_dir, item, verify_cache=verify)
        assert sink.state == "installed"
    return Worker(home, env, cache, verify, plan)


def test_the_plan_fetches_exactly_the_stage_largest_first(worker: Worker) -> None:
    plan = worker.first_plan
    assert plan.present == ()
    assert {i.path for i in plan.fetch} == STAGE_PATHS
    sizes = [i.size or 0 for i in plan.fetch]
    assert sizes == sorted(sizes, reverse=True)
    assert plan.bytes_to_fetch == plan.bytes_required
    assert plan.to_dict()["stage_id"] == "stage-2"


def test_after_the_fetch_the_plan_is_empty_and_nothing_is_rehashed(
    worker: Worker, served_package: ServedPackage  # noqa: F811
) -> None:
    topology = served_package.topology()
    assert manifest_present(worker.cache, topology.manifest_sha256)
    held = load_held_manifest(worker.cache, topology.manifest_sha256).held
    present = verified_present(
        worker.cache, held.manifest.artifacts(), manifest_sha256=held.sha256,
        verify_cache=worker.verify,
    )
    assert present == dict.fromkeys(STAGE_PATHS, "cached")  # the sink's records, no read
    plan = plan_fetch(held.manifest, held.sha256, topology, WORKER_B.hex(), present)
    assert plan.fetch == () and set(plan.present) == STAGE_PATHS


def test_the_plan_refuses_a_manifest_or_node_the_topology_does_not_name(
    worker: Worker, served_package: ServedPackage  # noqa: F811
) -> None:
    topology = served_package.topology()
    held = load_held_manifest(worker.cache, topology.manifest_sha256).held
    with pytest.raises(TopologyError) as wrong_manifest:
        plan_fetch(held.manifest, "0" * 64, topology, WORKER_B.hex(), ())
    assert wrong_manifest.value.code == "topology_manifest_mismatch"
    with pytest.raises(TopologyError) as stranger:
        plan_fetch(held.manifest, held.sha256, topology, "ab" * 32, ())
    assert stranger.value.code == "not_in_topology"


def test_resolve_finds_and_verifies_the_stage_offline_from_the_records(
    worker: Worker, served_package: ServedPackage  # noqa: F811
) -> None:
    env = read_environment(_env(worker.home, HF_HUB_OFFLINE="1"))
    resolved = resolve_stage(served_package.ref, env, layers_text="3..4")
    files = resolved.files()
    assert set(files) == STAGE_PATHS
    for rel, local in files.items():
        assert local.read_bytes() == (served_package.package_dir / rel).read_bytes()
    report = resolved.stage.verification
    assert report is not None and report.hashed == 0 and report.cached == len(STAGE_PATHS)
    with pytest.raises(OfflineCacheMiss) as miss:  # what the peer did not bring is not there
        resolve_stage(served_package.ref, env, layers_text="2..4")
    assert miss.value.missing == ("layers/layer-00002.gguf",)


def test_the_cli_selects_and_fetches_the_stage_offline(
    worker: Worker,
    served_package: ServedPackage,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in _env(worker.home, HF_HUB_OFFLINE="1").items():
        monkeypatch.setenv(name, value)
    assert main(["fetch", served_package.ref, "--layers", "3..4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fetch"]["bytes_downloaded"] == 0 and doc["sha256_verified"] is True
    assert {p["path"] for p in doc["parts"]} == STAGE_PATHS
    assert main(["select", served_package.ref, "--layers", "3..4", "--json"]) == 0
    selected = json.loads(capsys.readouterr().out)
    assert {p["path"] for p in selected["parts"]} == STAGE_PATHS


_HF_OFFLINE_CHILD = r"""
import json, sys
from huggingface_hub import hf_hub_download, scan_cache_dir
from huggingface_hub.errors import LocalEntryNotFoundError
repo, commit, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
found = {p: hf_hub_download(repo, p, revision=commit) for p in paths}
try:
    hf_hub_download(repo, "layers/layer-00000.gguf", revision=commit)
    missing = False
except LocalEntryNotFoundError:
    missing = True
info = scan_cache_dir()
(repo_info,) = info.repos
print(json.dumps({
    "found": found,
    "unfetched_is_missing": missing,
    "warnings": [str(w) for w in info.warnings],
    "revisions": [r.commit_hash for r in repo_info.revisions],
    "files": sorted(f.file_name for r in repo_info.revisions for f in r.files),
}))
"""


def test_huggingface_hub_itself_finds_every_file_offline(
    worker: Worker, served_package: ServedPackage  # noqa: F811
) -> None:
    env = {**os.environ, **_env(worker.home, HF_HUB_OFFLINE="1")}
    env.pop("HF_ENDPOINT", None)
    paths = sorted(STAGE_PATHS | {MANIFEST_NAME})
    proc = subprocess.run(
        [sys.executable, "-c", _HF_OFFLINE_CHILD, REPO, served_package.commit, *paths],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    for rel, local in doc["found"].items():
        assert Path(local) == worker.cache.snapshot_path(rel)
        assert Path(local).read_bytes() == (served_package.package_dir / rel).read_bytes()
    assert doc["unfetched_is_missing"]
    assert doc["warnings"] == []  # scan_cache_dir sees a well-formed cache
    assert doc["revisions"] == [served_package.commit]
    assert doc["files"] == sorted(p.rsplit("/", 1)[-1] for p in paths)


def test_online_the_hub_is_asked_only_for_what_the_peer_did_not_bring(
    worker: Worker, served_package: ServedPackage  # noqa: F811
) -> None:
    hub = served_package.hub
    before = {p: hub.get_count(REPO, p) for p in [*STAGE_PATHS, "layers/layer-00002.gguf"]}
    env = read_environment(_env(worker.home, HF_ENDPOINT=hub.url))
    resolved = resolve_stage(served_package.ref, env, layers_text="2..4")
    assert resolved.fetch.bytes_downloaded == resolved.files()[
        "layers/layer-00002.gguf"
    ].stat().st_size
    for path in STAGE_PATHS:
        assert hub.get_count(REPO, path) == before[path]
    assert hub.get_count(REPO, "layers/layer-00002.gguf") == before["layers/layer-00002.gguf"] + 1


def test_hub_fallback_installs_a_verified_copy_or_evicts_a_corrupt_one(
    served_package: ServedPackage, tmp_path: Path  # noqa: F811
) -> None:
    sp = served_package
    cache = RepoCache.for_ref(tmp_path / "hub", sp.ref)
    verify = VerifyCache(tmp_path / "verify")
    item = item_for(sp, "layers/layer-00002.gguf")
    sp.hub.inject(REPO, item.path, Fault.FLIP_BYTE, times=1)
    with pytest.raises(IntegrityError) as exc:
        fetch_from_hub(cache, item, manifest_sha256=sp.manifest_sha256, verify_cache=verify,
                       endpoint=sp.hub.url)
    assert exc.value.code == "artifact_sha256_mismatch"
    assert not os.path.lexists(cache.snapshot_path(item.path))
    assert not cache.blob_path(item.sha256).exists()
    path = fetch_from_hub(cache, item, manifest_sha256=sp.manifest_sha256, verify_cache=verify,
                          endpoint=sp.hub.url)
    assert path == cache.snapshot_path(item.path)
    assert path.read_bytes() == (sp.package_dir / item.path).read_bytes()
    assert verified_present(cache, [item.ref], manifest_sha256=sp.manifest_sha256,
                            verify_cache=verify) == {item.path: "cached"}
