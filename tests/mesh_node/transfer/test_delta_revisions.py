"""Delta revisions: a second revision that changes one layer moves only
that layer's bytes; every other artifact is linked from the revision already in the cache,
verified by its records, and the report says ``cache (revision <short>)``. The rule
holds: an untrusted topology's links go to the peer area, never under the commit."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from conftest import HubPackage
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshtools import wait_for
from meshxfer import import_into, propose, records, start_member, wait_connected

from mesh_node.cli import main as mesh_main
from mesh_node.lab.package import revise_directory
from mesh_node.lab.report import render_revision_change, revision_change, source_text
from mesh_node.lab.run import LabOptions
from skippy.constants import MANIFEST_NAME, ROLE_LAYER
from skippy.consume import hub
from skippy.consume.verify import VerifyCache
from skippy.errors import UsageError
from skippy.package.artifact_ref import Artifact, ArtifactRef
from skippy.package.manifest import PackageManifest
from skippy.package.refs import parse_hf_package_ref
from skippy.transfer.delta import (
    HeldRevision,
    delta_candidates,
    delta_matches,
    link_from_revisions,
)
from skippy.transfer.hubcache import RepoCache, load_held_manifest, verified_present


# --- the decision (pure) ----------------------------------------------------------------------
def _ref(path: str, sha: str, size: int = 100, layer: int | None = None) -> ArtifactRef:
    art = Artifact(path=path, tensor_count=1, tensor_bytes=size, artifact_bytes=size, sha256=sha)
    return ArtifactRef(ROLE_LAYER if layer is not None else "metadata", art, layer)


A, B, C = "a" * 64, "b" * 64, "c" * 64


def test_delta_matches_by_digest_and_size_only_what_a_revision_verified() -> None:
    wanted = [_ref("x.gguf", A), _ref("y.gguf", B), _ref("z.gguf", C, size=7)]
    old = HeldRevision(
        "1" * 40, "m" * 64, (_ref("x-old.gguf", A), _ref("y.gguf", B), _ref("z.gguf", C))
    )
    # z has the digest but another size: not the same artifact; y was not verified
    assert {k: [r.path for r in v] for k, v in delta_candidates(wanted, [old]).items()} == {
        old.label: ["x-old.gguf", "y.gguf"]
    }
    found = delta_matches(wanted, [old], {old.label: ["x-old.gguf"]})
    assert set(found) == {"x.gguf"}  # renamed in the new revision: still the same blob
    assert found["x.gguf"].source.path == "x-old.gguf" and found["x.gguf"].revision is old
    assert delta_matches(wanted, [old], {}) == {}


def test_a_commit_is_preferred_over_a_peer_area_whatever_the_listing_order() -> None:
    wanted = [_ref("x.gguf", A)]
    peer = HeldRevision("peer:" + "0" * 64, "p" * 64, (_ref("x.gguf", A),))
    commit = HeldRevision("f" * 40, "q" * 64, (_ref("x.gguf", A),))
    verified = {peer.label: ["x.gguf"], commit.label: ["x.gguf"]}
    for order in ([peer, commit], [commit, peer]):
        assert delta_matches(wanted, order, verified)["x.gguf"].revision is commit
    assert delta_matches(wanted, [peer], verified)["x.gguf"].revision.short == "peer:" + "0" * 12
    assert commit.short == "f" * 12


def test_the_report_names_the_revision_a_cached_artifact_came_from() -> None:
    assert source_text({"source": "cache", "revision": "abcdef123456"}) == (
        "cache (revision abcdef123456)"
    )
    assert source_text({"source": "cache", "revision": None}) == "cache"
    assert source_text({"source": "peer"}) == "peer"


# --- the shell: two revisions in one hub cache --------------------------------------------------
@dataclass(frozen=True)
class TwoRevisions:
    first: str  # hf://lab/tiny-layers@<commit>
    second: str  # the same with layer 2 changed
    changed: str  # the changed layer's path


@pytest.fixture(scope="module")
def two_revisions(hub_package: HubPackage, tmp_path_factory) -> TwoRevisions:  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("rev2") / hub_package.directory.name
    return TwoRevisions(hub_package.ref, _revise(hub_package, out, 2), "layers/layer-00002.gguf")


def _revise(hp: HubPackage, out: Path, layer: int) -> str:
    """Publish a copy of the package with ``layer`` changed as a new commit (no branch moves:
    other tests share this hub)."""
    revise_directory(hp.directory, out, layer=layer)
    repo = hp.ref.removeprefix("hf://").split("@")[0]
    return f"hf://{repo}@{hp.hub.add_revision(repo, out, branches=())}"


def _download(ref_text: str, cache_dir: Path, url: str, paths: list[str]) -> None:
    ref = parse_hf_package_ref(ref_text)
    commit = ref.revision or ""
    hub.download_many(ref, commit, paths, endpoint=url, cache_dir=cache_dir)


def _manifest_of(cache: RepoCache, root: Path) -> tuple[PackageManifest, str]:
    raw = (cache.snapshot_dir / MANIFEST_NAME).read_bytes()
    sha = hashlib.sha256(raw).hexdigest()
    return load_held_manifest(cache, sha).held.manifest, sha


def test_a_revision_changing_one_layer_links_every_other_artifact_without_reading_it(
    tmp_path, hub_package, two_revisions
):
    url = hub_package.hub.url
    cache_dir = tmp_path / "hf"
    verify = VerifyCache(tmp_path / "verify")
    first = RepoCache.for_ref(cache_dir, two_revisions.first)
    _download(two_revisions.first, cache_dir, url, [MANIFEST_NAME])
    manifest1, sha1 = _manifest_of(first, tmp_path)
    refs1 = list(manifest1.artifacts())
    _download(two_revisions.first, cache_dir, url, [r.path for r in refs1])
    assert len(verified_present(first, refs1, manifest_sha256=sha1, verify_cache=verify)) == len(
        refs1
    )  # hashed once, recorded
    second = RepoCache.for_ref(cache_dir, two_revisions.second)
    _download(two_revisions.second, cache_dir, url, [MANIFEST_NAME])
    manifest2, sha2 = _manifest_of(second, tmp_path)
    refs2 = list(manifest2.artifacts())

    linked = link_from_revisions(second, refs2, manifest_sha256=sha2, verify_cache=verify)
    assert set(linked) == {r.path for r in refs2} - {two_revisions.changed}
    assert {m.revision.short for m in linked.values()} == {first.commit[:12]}
    for path in linked:  # the same blob, not a copy
        assert second.snapshot_path(path).resolve() == first.snapshot_path(path).resolve()
    assert not second.snapshot_path(two_revisions.changed).exists()
    # the records were carried over: the new revision's check reads nothing
    now = verified_present(second, refs2, manifest_sha256=sha2, verify_cache=verify)
    assert now == dict.fromkeys(linked, "cached")
    # a second call finds nothing new to link (the plan then fetches only the changed layer)
    missing = [r for r in refs2 if r.path not in now]
    assert [r.path for r in missing] == [two_revisions.changed]
    assert link_from_revisions(second, missing, manifest_sha256=sha2, verify_cache=verify) == {}


def test_a_corrupted_blob_is_never_linked(tmp_path, hub_package, two_revisions):
    url = hub_package.hub.url
    cache_dir = tmp_path / "hf"
    first = RepoCache.for_ref(cache_dir, two_revisions.first)
    _download(two_revisions.first, cache_dir, url, [MANIFEST_NAME])
    manifest1, _ = _manifest_of(first, tmp_path)
    refs1 = list(manifest1.artifacts())
    _download(two_revisions.first, cache_dir, url, [r.path for r in refs1])
    victim = next(r for r in refs1 if r.path != two_revisions.changed and r.role == ROLE_LAYER)
    blob = first.snapshot_path(victim.path).resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    second = RepoCache.for_ref(cache_dir, two_revisions.second)
    _download(two_revisions.second, cache_dir, url, [MANIFEST_NAME])
    manifest2, sha2 = _manifest_of(second, tmp_path)
    refs2 = list(manifest2.artifacts())
    linked = link_from_revisions(second, refs2, manifest_sha256=sha2, verify_cache=None)
    assert victim.path not in linked and two_revisions.changed not in linked
    assert len(linked) == len(refs2) - 2
    assert not second.snapshot_path(victim.path).exists()


def test_an_untrusted_topology_links_into_the_peer_area_never_under_the_commit(
    tmp_path, hub_package, two_revisions
):
    url = hub_package.hub.url
    cache_dir = tmp_path / "hf"
    first = RepoCache.for_ref(cache_dir, two_revisions.first)
    _download(two_revisions.first, cache_dir, url, [MANIFEST_NAME])
    manifest1, _ = _manifest_of(first, tmp_path)
    _download(two_revisions.first, cache_dir, url, [r.path for r in manifest1.artifacts()])
    # the second revision's manifest as a stranger named it: in the peer area only
    trusted2 = RepoCache.for_ref(cache_dir, two_revisions.second)
    _download(two_revisions.second, cache_dir, url, [MANIFEST_NAME])
    manifest2, sha2 = _manifest_of(trusted2, tmp_path)
    raw = (trusted2.snapshot_dir / MANIFEST_NAME).read_bytes()
    for p in sorted(trusted2.snapshot_dir.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() else p.rmdir()
    trusted2.snapshot_dir.rmdir()
    peer2 = RepoCache.for_ref(cache_dir, two_revisions.second, untrusted_manifest=sha2)
    peer2.snapshot_dir.mkdir(parents=True)
    (peer2.snapshot_dir / MANIFEST_NAME).write_bytes(raw)
    refs2 = list(manifest2.artifacts())
    linked = link_from_revisions(peer2, refs2, manifest_sha256=sha2, verify_cache=None)
    assert set(linked) == {r.path for r in refs2} - {two_revisions.changed}
    assert all(peer2.snapshot_path(p).is_file() for p in linked)
    assert not trusted2.snapshot_dir.exists()  # nothing under the commit a stranger named
    # the peer area is a revision too: a later trusted topology of the first commit's layout
    # finds it (the same bytes by SHA-256), and it never goes the other way by itself
    assert not (first.repo_root / "snapshots" / trusted2.commit).exists()


# --- the real thing: two topologies over real mesh links ---------------------------------------
async def test_a_second_revision_moves_only_the_changed_layers_bytes(tmp_path, hub_package):
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
        assert stage is not None
        # the second revision changes a layer of the worker's stage
        ref2 = _revise(hp, tmp_path / "rev" / hp.directory.name, stage.layers.start)
        pkg2 = import_into(coord, HubPackage(hp.directory, hp.hub, ref2))
        hp.hub.reset()  # count only what the worker asks of the hub
        peer_before = worker.service.records.counters.fetched_bytes["peer"]

        second = await propose(coord, pkg2, stages=2)
        assert second.topology.stage_of(worker.node.node_id).layers == stage.layers
        await wait_for(
            lambda: (
                worker.service.records.stage.topology_id == second.topology.topology_id
                and worker.service.records.stage.report == "accepted"
            ),
            20,
        )
        recs = records(worker)
        changed = next(
            r
            for r in pkg2.manifest.artifacts()
            if r.role == ROLE_LAYER and r.layer_index == stage.layers.start
        )
        moved = worker.service.records.counters.fetched_bytes["peer"] - peer_before
        manifest_bytes = recs[MANIFEST_NAME]["total"]
        assert moved == changed.artifact.artifact_bytes + manifest_bytes  # that layer, manifest
        assert recs[changed.path]["source"] == "peer" and recs[changed.path]["verified"]
        short = pkg1.ref.split("@")[1][:12]
        others = set(worker.service.records.stage.required) - {changed.path}
        assert others
        for path in others:
            assert recs[path]["source"] == "cache" and recs[path]["revision"] == short, path
            assert recs[path]["verified"]
        assert worker.service.result.load.sha256_verified
        assert hp.hub.downloaded_paths("lab/tiny-layers") == set()  # the worker asked no hub
        n.cancel_scope.cancel()


# --- the lab's report of it (pure; the lab itself is run by hand, see docs/mesh-node.md) -----
def test_the_lab_report_says_whether_only_the_changed_layer_moved() -> None:
    layer = _ref("layers/layer-00001.gguf", B, size=40, layer=1)
    manifest = [_ref("a.gguf", A), layer]

    def doc(source: str) -> dict[str, object]:
        arts = [
            {"path": MANIFEST_NAME, "bytes": 7, "source": "peer"},
            {"path": "a.gguf", "bytes": 100, "source": "cache", "revision": "1" * 12},
            {"path": layer.path, "bytes": 40, "source": source},
        ]
        return {"nodes": [{"role": "worker", "artifacts": arts},
                          {"role": "coordinator", "artifacts": arts}]}  # fmt: skip

    good = revision_change(doc("peer"), manifest, 1)
    assert good["only_the_change_moved"] and good["moved_bytes"] == 40
    assert good["cached_from_revisions"] == ["1" * 12] and good["workers_holding_it"] == 1
    assert "only that layer moved" in render_revision_change(good)[0]
    moved_more = doc("peer")
    moved_more["nodes"][0]["artifacts"][1]["source"] = "hub"  # type: ignore[index]
    bad = revision_change(moved_more, manifest, 1)
    assert not bad["only_the_change_moved"] and "MORE MOVED" in render_revision_change(bad)[0]


def test_the_lab_refuses_a_revision_change_with_serve_or_a_negative_layer() -> None:
    with pytest.raises(UsageError):
        LabOptions(nodes=2, package="x", revision_change=1, prompt="hi")
    with pytest.raises(UsageError):
        LabOptions(nodes=2, package="x", revision_change=-1)


def test_the_lab_cli_refuses_a_revision_change_of_a_hub_reference_with_a_code(capsys) -> None:
    argv = ["lab", "--nodes", "2", "--package", "hf://lab/x@main", "--revision-change", "1"]
    assert mesh_main([*argv, "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "usage" and "package directory" in error["message"]
