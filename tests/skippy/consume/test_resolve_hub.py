"""Consumers against a hub: the real huggingface_hub client, our fake hub on 127.0.0.1.

Shows that a stage downloads exactly its parts (bytes counted on the server), that a corrupt
artifact is rejected on download and on a later cache hit, that offline mode serves from the
cache or lists what is missing, and that a revision pin is honoured.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from hubfaults import Fault, FaultyHub, running_hub
from pkgtools import edit_manifest, make_package

from skippy.cli import main
from skippy.config import read_environment
from skippy.constants import MANIFEST_NAME, layer_path
from skippy.consume.hub import HubError
from skippy.consume.resolve import resolve_stage
from skippy.errors import ArtifactMissing, IntegrityError, PackageInvalid

REPO = "acme/tiny-layers"


@pytest.fixture(scope="module")
def packages(synth_dir, tmp_path_factory) -> tuple[Path, Path]:
    """Two revisions of one package: v1 from llama_like, v2 from a re-seeded model."""
    import synth_gguf

    root = tmp_path_factory.mktemp("hubpkgs")
    v1 = root / "v1"
    make_package(synth_dir.llama, v1)
    other = synth_gguf.llama_like(root / "other.gguf", seed=7)
    v2 = root / "v2"
    make_package(other, v2)
    return v1, v2


@pytest.fixture
def hub(packages, monkeypatch) -> FaultyHub:
    v1, v2 = packages
    with running_hub({REPO: [v1, v2]}) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        yield h


def _manifest(pkg: Path) -> dict:
    return json.loads((pkg / MANIFEST_NAME).read_text())


def test_stage_downloads_exactly_its_parts(hub, packages):
    v2 = packages[1]
    m = _manifest(v2)
    resolved = resolve_stage(f"hf://{REPO}", read_environment(), layers_text="1..3")
    wanted = {MANIFEST_NAME, "shared/metadata.gguf", layer_path(1), layer_path(2)}
    assert hub.downloaded_paths(REPO) == wanted
    for path in wanted - {MANIFEST_NAME}:
        assert hub.stats(REPO, path).bytes_served == (v2 / path).stat().st_size
    assert resolved.stage.verification is not None  # hf:// always verifies
    assert resolved.fetch.bytes_downloaded == resolved.fetch.bytes_selected
    assert resolved.fetch.package_bytes == sum(
        a["artifact_bytes"] for a in [*m["shared"].values(), *m["layers"]]
    )
    for rel, local in resolved.files().items():
        assert local.read_bytes() == (v2 / rel).read_bytes()


def test_second_fetch_downloads_nothing(hub):
    env = read_environment()
    resolve_stage(f"hf://{REPO}", env, layers_text="0..2")
    before = {p: hub.get_count(REPO, p) for p in hub.downloaded_paths(REPO)}
    again = resolve_stage(f"hf://{REPO}", env, layers_text="0..2")
    assert again.fetch.bytes_downloaded == 0
    assert {p: hub.get_count(REPO, p) for p in before} == before


def test_revision_pin_is_honoured(packages, monkeypatch):
    v1, v2 = packages
    with FaultyHub() as h:
        old = h.add_revision(REPO, v1)
        new = h.add_revision(REPO, v2)  # main moves to v2
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        env = read_environment()
        pinned = resolve_stage(f"hf://{REPO}@{old}", env, layers_text="0..1")
        latest = resolve_stage(f"hf://{REPO}", env, layers_text="0..1")
    assert old != new
    assert pinned.stage.package.origin == f"hf://{REPO}@{old}"
    assert latest.stage.package.origin == f"hf://{REPO}@{new}"
    for resolved, pkg in ((pinned, v1), (latest, v2)):
        m = resolved.stage.package.manifest
        assert m.source_model.sha256 == _manifest(pkg)["source_model"]["sha256"]
        meta = resolved.files()["shared/metadata.gguf"]
        assert meta.read_bytes() == (pkg / "shared/metadata.gguf").read_bytes()


def test_moving_ref_warns(hub, caplog):
    with caplog.at_level(logging.WARNING, logger="skippy.consume.hub"):
        resolve_stage(f"hf://{REPO}@main", read_environment(), layers_text="0..1")
    assert any("pin" in r.getMessage() for r in caplog.records)


def test_corrupt_download_is_rejected_and_evicted(hub):
    hub.inject(REPO, layer_path(2), Fault.FLIP_BYTE)
    env = read_environment()
    with pytest.raises(IntegrityError) as exc:
        resolve_stage(f"hf://{REPO}", env, layers_text="2..3")
    assert exc.value.code == "artifact_sha256_mismatch"
    assert exc.value.path == layer_path(2)
    hub.clear_faults()
    resolved = resolve_stage(f"hf://{REPO}", env, layers_text="2..3")  # downloads it again
    assert resolved.fetch.bytes_downloaded > 0


def test_corruption_in_the_cache_is_caught_on_a_later_hit(hub):
    env = read_environment()
    first = resolve_stage(f"hf://{REPO}", env, layers_text="0..1")
    blob = first.files()["shared/metadata.gguf"].resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0x01
    blob.write_bytes(bytes(data))  # same size: only SHA-256 can tell
    with pytest.raises(IntegrityError) as exc:
        resolve_stage(f"hf://{REPO}", env, layers_text="0..1")
    assert exc.value.path == "shared/metadata.gguf"


def test_offline_serves_from_cache_and_lists_what_is_missing(hub, monkeypatch):
    commit = hub.commit_of(REPO, "main")
    resolve_stage(f"hf://{REPO}@{commit}", read_environment(), layers_text="0..2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.reset()
    offline = read_environment()
    again = resolve_stage(f"hf://{REPO}@{commit}", offline, layers_text="0..2")
    assert again.stage.verification is not None
    assert hub.request_log() == []  # nothing reached the server
    with pytest.raises(ArtifactMissing) as exc:
        resolve_stage(f"hf://{REPO}@{commit}", offline, layers_text="1..4")
    assert exc.value.code == "not_in_offline_cache"
    for rel in (layer_path(2), layer_path(3), "shared/output.gguf"):
        assert rel in exc.value.message


def test_missing_file_on_the_hub(hub):
    hub.inject(REPO, layer_path(3), Fault.NOT_FOUND)
    with pytest.raises(ArtifactMissing) as exc:
        resolve_stage(f"hf://{REPO}", read_environment(), layers_text="3..4")
    assert exc.value.code == "missing_artifact"


def test_fetch_cli_reports_bytes(hub, capsys):
    assert main(["fetch", f"hf://{REPO}", "--layers", "1..2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    fetch = doc["fetch"]
    assert fetch["bytes_downloaded"] == fetch["bytes_selected"] < fetch["package_bytes"]
    assert [p["path"] for p in doc["parts"]] == ["shared/metadata.gguf", layer_path(1)]
    assert doc["sha256_verified"] is True


def test_hub_package_is_never_materialized_into_the_cache(hub, tmp_path, capsys):
    resolved = resolve_stage(f"hf://{REPO}", read_environment(), layers_text="0..4")
    inside = resolved.stage.package.root / "stage.gguf"
    rc = main(["materialize", f"hf://{REPO}", "--layers", "0..4", "--out", str(inside), "--json"])
    assert rc == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "materialize_inside_package"
    out = tmp_path / "stage.gguf"
    assert main(["materialize", f"hf://{REPO}", "--layers", "0..4", "--out", str(out)]) == 0
    assert out.is_file()


def test_truncated_cache_blob_is_evicted_and_refetched(hub):
    env = read_environment()
    first = resolve_stage(f"hf://{REPO}", env, layers_text="1..2")
    blob = first.files()[layer_path(1)].resolve()
    blob.write_bytes(blob.read_bytes()[:-7])  # huggingface_hub never re-checks a cache hit
    with pytest.raises(PackageInvalid) as exc:
        resolve_stage(f"hf://{REPO}", env, layers_text="1..2")
    assert exc.value.code == "artifact_size_mismatch"
    again = resolve_stage(f"hf://{REPO}", env, layers_text="1..2")
    assert again.fetch.bytes_downloaded == (again.files()[layer_path(1)]).stat().st_size


def test_downstream_stage_checks_declared_projectors_without_downloading(
    synth_dir, tmp_path, monkeypatch
):
    pkg = tmp_path / "mm"
    make_package(synth_dir.llama, pkg, projectors=(synth_dir.projector,))
    proj = f"projectors/{synth_dir.projector.name}"
    with running_hub({"acme/mm-layers": pkg}) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        env = read_environment()
        resolve_stage("hf://acme/mm-layers", env, layers_text="2..4")  # no projector selected
        assert h.stats("acme/mm-layers", proj).get_requests == 0
        assert h.stats("acme/mm-layers", proj).head_requests >= 1
        stage0 = resolve_stage("hf://acme/mm-layers", env, layers_text="0..1")
        assert stage0.stage.projector_path is not None  # stage 0 gets the first mmproj
    bad = tmp_path / "mm-bad"
    shutil.copytree(pkg, bad)
    edit_manifest(
        bad,
        lambda d: d["projectors"][0].update(
            artifact_bytes=d["projectors"][0]["artifact_bytes"] + 64
        ),
    )
    with running_hub({"acme/mm-bad": bad}) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        with pytest.raises(PackageInvalid) as exc:
            resolve_stage("hf://acme/mm-bad", read_environment(), layers_text="2..4")
        assert exc.value.code == "artifact_size_mismatch"
        assert h.stats("acme/mm-bad", proj).get_requests == 0


@pytest.mark.parametrize(
    ("ref", "code"),
    [
        ("hf://acme/absent-layers", "hub_repo_not_found"),
        (f"hf://{REPO}@nope", "hub_revision_not_found"),
    ],
)
def test_bad_references_are_usage_errors(hub, capsys, ref, code):
    """A reference the hub does not know is bad input (exit 2), not an invalid package."""
    assert main(["select", ref, "--layers", "0..1", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == code


def test_offline_cache_miss_is_exit_2(hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commit = hub.commit_of(REPO, "main")
    assert main(["select", f"hf://{REPO}@{commit}", "--layers", "0..1", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "not_in_offline_cache"


def test_every_corrupt_blob_is_evicted_at_once(hub):
    env = read_environment()
    first = resolve_stage(f"hf://{REPO}", env, layers_text="0..3")
    victims = [layer_path(0), layer_path(2)]
    for rel in victims:
        blob = first.files()[rel].resolve()
        data = bytearray(blob.read_bytes())
        data[-1] ^= 0x01
        blob.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as exc:
        resolve_stage(f"hf://{REPO}", env, layers_text="0..3")
    assert sorted(exc.value.paths) == victims
    again = resolve_stage(f"hf://{REPO}", env, layers_text="0..3")  # one retry repairs both
    assert {f.path for f in again.fetch.files if f.downloaded} == set(victims)


def test_a_failing_head_follows_our_policy_not_huggingface_hubs_loop(hub):
    """huggingface_hub retries a failing metadata HEAD for ~23 s; with our policy installed the
    HEAD is tried exactly ``attempts`` times. The server's request count shows which path ran
    (no wall-clock assertion)."""
    hub.inject(REPO, layer_path(1), Fault.SERVER_ERROR, methods=["HEAD"])
    env = read_environment()
    with pytest.raises(HubError) as exc:
        resolve_stage(f"hf://{REPO}", env, layers_text="1..2")
    assert exc.value.code == "hub_http_error"
    assert hub.stats(REPO, layer_path(1)).head_requests == env.hub_policy.attempts


def test_unused_projector_check_tolerates_a_failing_hub(synth_dir, tmp_path, monkeypatch, caplog):
    pkg = tmp_path / "mm"
    make_package(synth_dir.llama, pkg, projectors=(synth_dir.projector,))
    proj = f"projectors/{synth_dir.projector.name}"
    with running_hub({"acme/mm-layers": pkg}) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        commit = h.commit_of("acme/mm-layers")
        env = read_environment()
        resolve_stage(f"hf://acme/mm-layers@{commit}", env, layers_text="2..4")
        h.inject("acme/mm-layers", proj, Fault.SERVER_ERROR, methods=["HEAD"])
        with caplog.at_level(logging.WARNING, logger="skippy.consume.resolve"):
            again = resolve_stage(f"hf://acme/mm-layers@{commit}", env, layers_text="2..4")
    assert again.stage.verification is not None
    assert any("not checked" in r.getMessage() for r in caplog.records)
