"""Package schema version 2: the canonical package_id, the closed root, hostile
carriers, write-package --schema 2 with verify-package-v2, selection, the publisher's hook and
resume (both schemas), and fetch from a hub. Real files throughout: synthetic GGUFs from
tests/support/synth_gguf.py, our writer, the real huggingface_hub client against the lab hub."""

from __future__ import annotations

import json
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
from pkgtools import make_package

from mesh_node.lab.hub_server import running_hub
from skippy.cli import main
from skippy.config import read_environment
from skippy.constants import (
    ENV_ARTIFACT_PATH,
    ENV_ARTIFACT_RELATIVE_PATH,
    KEY_V2_TENSOR_OFFSET,
    KEY_V2_TENSOR_SIZE,
    MANIFEST_NAME,
    METADATA_PATH,
    V2_CARRIER_KEYS,
)
from skippy.consume.preflight import load_package, read_package
from skippy.consume.resolve import resolve_stage
from skippy.errors import ManifestError, PackageInvalid
from skippy.gguf.constants import ValueType
from skippy.gguf.reader import open_gguf
from skippy.gguf.writer import build_header, encode_kv
from skippy.package.manifest import parse_manifest
from skippy.package.ranges import LayerRange
from skippy.package.select import select_stage
from skippy.package.v2_root import compact_json, parse_root
from skippy.package.v2_view import ManifestV2, dump_root
from skippy.produce.artifact_hook import ArtifactHook
from skippy.produce.verify_v2 import verify_package_v2
from skippy.produce.write_package import local_provenance
from skippy.produce.write_package_v2 import WriteOptionsV2, write_package_v2

MODEL_ID = "acme/tiny-GGUF:Q8_0"


def write_v2(source: Path, out: Path, **kw: Any) -> Any:
    prov = local_provenance(
        model_id=MODEL_ID, source_repo=None, source_revision="0123abc", source_file=source.name
    )
    return write_package_v2(source, WriteOptionsV2(out_dir=out, provenance=prov, **kw))


@pytest.fixture(scope="module")
def v2pkg(synth_dir, tmp_path_factory) -> Path:
    """A v2 package of the gemma-like synthetic model (alignment 64), layers split in parts."""
    out = tmp_path_factory.mktemp("v2") / "pkg"
    write_v2(synth_dir.gemma, out, max_artifact_bytes=20_000)
    return out


@pytest.fixture
def pkg(v2pkg, tmp_path) -> Path:
    copy = tmp_path / "pkg"
    shutil.copytree(v2pkg, copy)
    return copy


def root_dict(pkg: Path) -> dict[str, Any]:
    return json.loads((pkg / MANIFEST_NAME).read_text())


def save_root(pkg: Path, data: dict[str, Any], *, reidentify: bool = True) -> None:
    """Write ``data`` back; with ``reidentify`` the package_id is recomputed so the edit is
    judged by the rule under test, not caught as an identity mismatch first."""
    if reidentify:
        data["package_id"] = parse_root(data).computed_package_id()
    (pkg / MANIFEST_NAME).write_text(json.dumps(data))


def codes_of(pkg: Path) -> set[str]:
    _, findings = read_package(pkg)
    return {f.code for f in findings if f.severity == "error"}


# --- package_id -----------------------------------------------------------------------------
def test_package_id_ignores_catalog_order_and_creation_time(v2pkg):
    data = root_dict(v2pkg)
    root = parse_root(data)
    assert root.package_id == root.computed_package_id()
    shuffled = json.loads(json.dumps(data))
    shuffled["artifact_catalog"]["entries"].reverse()
    shuffled["created_at_unix_secs"] = 12345
    assert parse_root(shuffled).computed_package_id() == root.package_id


@pytest.mark.parametrize("index", [0, 1, -1])
def test_package_id_changes_with_any_artifact_digest(v2pkg, index):
    data = root_dict(v2pkg)
    before = parse_root(data).computed_package_id()
    entry = data["artifact_catalog"]["entries"][index]
    entry["sha256"] = ("0" if entry["sha256"][0] != "0" else "1") + entry["sha256"][1:]
    assert parse_root(data).computed_package_id() != before


def test_canonical_form_field_order_omissions_and_sorts(v2pkg):
    data = root_dict(v2pkg)
    data["source_model"].pop("repo")  # an absent optional is omitted, never null
    data["sidecars"] = []  # an empty list is omitted
    data["publisher_metadata"] = [
        {
            "role": r,
            "artifact_id": "layer-00000-part00",
            "source_repo": "a/b",
            "source_revision": "0" * 40,
            "source_path": p,
        }
        for r, p in (("chat_template", "t.jinja"), ("model_config", "config.json"))
    ]
    canon = json.loads(compact_json(parse_root(data).canonical(for_identity=True)))
    assert list(canon) == [
        "schema_version",
        "package_id",
        "model_id",
        "source_model",
        "format",
        "layer_count",
        "artifact_catalog",
        "publisher_metadata",
        "native_abi_version",
        "generator_version",
        "created_at_unix_secs",
    ]
    assert canon["package_id"] == "" and canon["created_at_unix_secs"] == 0
    assert "repo" not in canon["source_model"]
    assert list(canon["source_model"])[:2] == ["sha256", "metadata_artifact_id"]
    ids = [e["id"] for e in canon["artifact_catalog"]["entries"]]
    assert ids == sorted(ids)
    # enum declaration order, not alphabetical: model_config sorts before chat_template
    assert [p["role"] for p in canon["publisher_metadata"]] == ["model_config", "chat_template"]
    assert b" " not in compact_json({"a": [1, 2], "b": "x"})


def test_float_spelling_follows_serde_json():
    assert compact_json({"x": 1e-5, "y": 0.95, "z": 1.0, "w": 1e16}) == (
        b'{"x":1e-5,"y":0.95,"z":1.0,"w":1e16}'
    )


# --- the closed root ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("edit", "path"),
    [
        (lambda d: d.update(tensor_catalog=[]), "tensor_catalog"),
        (lambda d: d["source_model"].update(path="/x"), "source_model.path"),
        (
            lambda d: d["artifact_catalog"]["entries"][0].update(role="x"),
            "artifact_catalog.entries[0].role",
        ),
        (lambda d: d.update(generation={"policy": {}}), "generation.policy"),
    ],
)
def test_a_root_with_an_unknown_field_is_refused(v2pkg, edit, path):
    data = root_dict(v2pkg)
    edit(data)
    with pytest.raises(ManifestError) as exc:
        parse_manifest(json.dumps(data).encode())
    assert (exc.value.code, exc.value.path) == ("unknown_field", path)


def test_an_edited_root_is_a_package_identity_mismatch(pkg):
    data = root_dict(pkg)
    data["model_id"] = "acme/other-GGUF:Q8_0"
    save_root(pkg, data, reidentify=False)
    assert "package_identity_mismatch" in codes_of(pkg)
    with pytest.raises(PackageInvalid):
        load_package(pkg)


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (
            lambda d: d["artifact_catalog"]["entries"].append(
                dict(d["artifact_catalog"]["entries"][1])
            ),
            "duplicate_artifact",
        ),
        (lambda d: d["artifact_catalog"]["entries"][1].update(id="bad id"), "invalid_identifier"),
        (lambda d: d["artifact_catalog"]["entries"][1].update(path="../x.gguf"), "invalid_path"),
        (lambda d: d["artifact_catalog"]["entries"][1].update(sha256="A" * 64), "invalid_digest"),
        (lambda d: d["source_model"].update(sha256="1" * 64), "source_identity_mismatch"),
        (
            lambda d: d["source_model"].update(metadata_artifact_id="nope"),
            "invalid_metadata_artifact",
        ),
        (lambda d: d.update(format="layer-package"), "invalid_format"),
    ],
)
def test_root_rules_fail_closed_with_upstream_codes(pkg, edit, code):
    data = root_dict(pkg)
    edit(data)
    save_root(pkg, data)
    assert code in codes_of(pkg)


# --- hostile carriers -----------------------------------------------------------------------
def rewrite_carrier(pkg: Path, edit_kv: Any = None, *, tail: bytes = b"") -> None:
    """Rebuild shared/metadata.gguf with ``edit_kv(records: dict key -> bytes)`` applied (and
    ``tail`` appended), then re-declare its size and digest and re-identify the root, so only
    the carrier's own rules can object."""
    import hashlib

    path = pkg / METADATA_PATH
    with open_gguf(path, header_only=True) as g:
        records = {k: g.raw_field(k) for k in g.fields}
        infos, align = list(g.tensors), g.alignment
    if edit_kv is not None:
        edit_kv(records)
    header, _ = build_header(list(records.values()), infos, align)
    path.write_bytes(header + tail)
    data = root_dict(pkg)
    for e in data["artifact_catalog"]["entries"]:
        if e["path"] == METADATA_PATH:
            e["byte_size"] = path.stat().st_size
            e["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    save_root(pkg, data)


def _array(key: str, values: list[int], item: int) -> bytes:
    return encode_kv(key, ValueType.ARRAY, values, item)


def _locators(pkg: Path, key: str) -> list[int]:
    with open_gguf(pkg / METADATA_PATH, header_only=True) as g:
        return [int(v) for v in g.value(key)]


def test_locator_arrays_of_the_wrong_length(pkg):
    sizes = _locators(pkg, KEY_V2_TENSOR_SIZE)
    rewrite_carrier(
        pkg, lambda r: r.update({KEY_V2_TENSOR_SIZE: _array(KEY_V2_TENSOR_SIZE, sizes[:-1], 10)})
    )
    assert codes_of(pkg) == {"carrier_locator_length_mismatch"}


def test_offsets_past_the_file(pkg):
    offsets = _locators(pkg, KEY_V2_TENSOR_OFFSET)
    offsets[0] += 1 << 30
    rewrite_carrier(
        pkg, lambda r: r.update({KEY_V2_TENSOR_OFFSET: _array(KEY_V2_TENSOR_OFFSET, offsets, 10)})
    )
    assert codes_of(pkg) == {"storage_out_of_bounds"}


def test_overlapping_extents(pkg):
    m = load_package(pkg).manifest
    assert isinstance(m, ManifestV2) and m.catalog is not None
    # two tensors of one part, the second moved onto the first
    first, second = m.catalog.in_artifact("common")[:2]
    with open_gguf(pkg / METADATA_PATH, header_only=True) as g:
        order = [t.name for t in g.tensors]
    offsets = _locators(pkg, KEY_V2_TENSOR_OFFSET)
    later = max((first, second), key=lambda t: t.offset)
    offsets[order.index(later.name)] = min(first.offset, second.offset)
    rewrite_carrier(
        pkg, lambda r: r.update({KEY_V2_TENSOR_OFFSET: _array(KEY_V2_TENSOR_OFFSET, offsets, 10)})
    )
    assert codes_of(pkg) == {"overlapping_storage"}


def test_a_carrier_with_payload_bytes(pkg):
    rewrite_carrier(pkg, tail=b"\x01" * 64)
    assert codes_of(pkg) == {"carrier_has_payload"}


@pytest.mark.parametrize(
    ("key", "code"),
    [
        ("skippy.package.metadata_only", "carrier_missing_marker"),
        ("skippy.package.locator_schema", "unsupported_locator_schema"),
        ("skippy.package.tensor_part", "carrier_missing_array"),
    ],
)
def test_a_carrier_missing_a_locator_key(pkg, key, code):
    rewrite_carrier(pkg, lambda r: r.pop(key))
    assert codes_of(pkg) == {code}


def test_a_hostile_carrier_stops_a_stage_before_it_loads(pkg):
    rewrite_carrier(pkg, tail=b"\0" * 32)
    with pytest.raises(PackageInvalid) as exc:
        load_package(pkg)
    assert "carrier_has_payload" in {f.code for f in exc.value.findings}


# --- write, verify, select -------------------------------------------------------------------
def test_verify_package_v2_reports_source_completeness(synth_dir, v2pkg, capsys):
    assert main(["verify-package-v2", str(v2pkg), "--source", str(synth_dir.gemma)]) == 0
    report = json.loads(capsys.readouterr().out)
    with open_gguf(synth_dir.gemma) as g:
        n_tensors = len(g.tensors)
    assert report == {
        "package_id": root_dict(v2pkg)["package_id"],
        "source_completeness_verified": True,
        "checked_source_files": 1,
        "checked_artifacts": len(root_dict(v2pkg)["artifact_catalog"]["entries"]),
        "checked_tensors": n_tensors,
        "checked_projectors": 0,
    }


def test_verify_refuses_another_source_and_v1(synth_dir, v2pkg, tmp_path, capsys):
    assert main(["verify-package-v2", str(v2pkg), "--source", str(synth_dir.llama)]) == 1
    v1 = tmp_path / "v1"
    make_package(synth_dir.gemma, v1)
    capsys.readouterr()
    assert main(["verify-package-v2", str(v1), "--source", str(synth_dir.gemma), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "unsupported_schema_version"
    with pytest.raises(ManifestError) as exc:
        verify_package_v2(v1, synth_dir.gemma)
    assert exc.value.code == "unsupported_schema_version"


def test_parts_are_payload_only_and_the_carrier_is_metadata_only(v2pkg):
    data = root_dict(v2pkg)
    paths = [e["path"] for e in data["artifact_catalog"]["entries"]]
    assert paths[0] == METADATA_PATH
    assert any(p.endswith("-part01.gguf") for p in paths)  # --max-artifact-bytes split them
    with open_gguf(v2pkg / METADATA_PATH, header_only=True) as g:
        assert g.file_size == g.data_offset
        assert all(k in g.fields for k in V2_CARRIER_KEYS)
    with open_gguf(v2pkg / paths[1]) as g:
        names = [t.name for t in g.tensors]
        assert names == sorted(names)
        assert not any(k.startswith("split.") for k in g.fields)


def test_selection_takes_exactly_the_artifacts_holding_a_stages_tensors(v2pkg):
    m = load_package(v2pkg).manifest
    assert isinstance(m, ManifestV2) and m.catalog is not None
    n = m.layer_count
    first = select_stage(m, LayerRange(0, 1, n))
    middle = select_stage(m, LayerRange(1, n - 1, n))
    last = select_stage(m, LayerRange(n - 1, n, n))
    for sel in (first, middle, last):
        assert sel.parts[0].path == METADATA_PATH
        held = {t.name for t in m.catalog if t.path in {p.path for p in sel.parts}}
        for t in m.catalog:
            if t.layer is not None and t.layer in sel.layers:
                assert t.name in held
    assert "shared/common.gguf" in {p.path for p in first.parts}
    assert "shared/common.gguf" in {p.path for p in last.parts}
    assert "shared/common.gguf" not in {p.path for p in middle.parts}  # no boundary tensor


def test_write_refuses_an_existing_package(synth_dir, v2pkg, capsys):
    code = main(
        [
            "write-package",
            str(synth_dir.gemma),
            "--schema",
            "2",
            "--out-dir",
            str(v2pkg),
            "--model-id",
            MODEL_ID,
            "--source-revision",
            "r",
            "--source-file",
            "gemma.gguf",
            "--json",
        ]
    )
    assert code == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "output_exists"


# --- the publisher's hook and resume ------------------------------------------------------
def make_hook(tmp_path: Path, remote: Path, *, fail_on: str | None = None) -> str:
    """A hook that 'uploads' (copies into ``remote``) and deletes the local file; it exits 3
    for the artifact ``fail_on``."""
    script = tmp_path / "hook.py"
    script.write_text(
        "import os, shutil, sys\n"
        f"path = os.environ[{ENV_ARTIFACT_PATH!r}]\n"
        f"rel = os.environ[{ENV_ARTIFACT_RELATIVE_PATH!r}]\n"
        f"if rel == {fail_on!r}:\n    sys.exit(3)\n"
        f"dest = os.path.join({str(remote)!r}, rel)\n"
        "os.makedirs(os.path.dirname(dest), exist_ok=True)\n"
        "assert os.path.isabs(path)\n"
        "shutil.copyfile(path, dest)\n"
        "os.remove(path)\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return f"{sys.executable} {script}"


@pytest.mark.parametrize("schema", ["1", "2"])
def test_upload_and_delete_hook_end_to_end_on_the_lab_hub(
    synth_dir, tmp_path, schema, capsys, monkeypatch
):
    remote = tmp_path / "remote"
    out = tmp_path / "out"
    args = [
        "write-package",
        str(synth_dir.gemma),
        "--schema",
        schema,
        "--out-dir",
        str(out),
        "--model-id",
        MODEL_ID,
        "--source-revision",
        "0123abc",
        "--source-file",
        "gemma.gguf",
        "--after-artifact-command",
        make_hook(tmp_path, remote),
    ]
    assert main(args) == 0
    capsys.readouterr()
    # every artifact went to the remote and left the local disk; the manifest stays local
    local = [p for p in out.rglob("*.gguf")]
    assert local == []
    shutil.copyfile(out / MANIFEST_NAME, remote / MANIFEST_NAME)
    with running_hub({"acme/hooked": remote}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        resolved = resolve_stage("hf://acme/hooked", read_environment(), layers_text="0..1")
    assert resolved.stage.verification is not None
    if schema == "2":
        assert main(["verify-package-v2", str(remote), "--source", str(synth_dir.gemma)]) == 0


def test_a_failing_hook_aborts_and_resume_reuses_what_was_verified(synth_dir, tmp_path, capsys):
    out = tmp_path / "out"
    base = [
        "write-package",
        str(synth_dir.gemma),
        "--schema",
        "2",
        "--out-dir",
        str(out),
        "--model-id",
        MODEL_ID,
        "--source-revision",
        "0123abc",
        "--source-file",
        "gemma.gguf",
        "--json",
    ]
    hook = make_hook(tmp_path, tmp_path / "remote", fail_on="layers/layer-00002.gguf")
    assert main([*base, "--after-artifact-command", hook]) == 1
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["code"] == "artifact_hook_failed" and "status 3" in err["message"]
    assert not (out / MANIFEST_NAME).exists()
    assert (out / "layers/layer-00002.gguf").exists()  # kept: the hook refused it
    # without --resume the leftovers are refused; with it they are verified and reused
    assert main(base) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "output_exists"
    tampered = out / "layers/layer-00002.gguf"
    data = bytearray(tampered.read_bytes())
    data[-1] ^= 0xFF
    tampered.write_bytes(bytes(data))
    assert main([*base, "--resume-existing-artifacts"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "layers/layer-00002.gguf" in doc["written"]  # different bytes: rewritten
    assert "layers/layer-00001.gguf" in doc["written"]  # uploaded and deleted: rewritten
    assert main(["verify-package-v2", str(out), "--source", str(synth_dir.gemma)]) == 0


def test_v1_resume_reuses_only_verified_fragments(synth_dir, tmp_path, capsys):
    out = tmp_path / "out"
    base = [
        "write-package",
        str(synth_dir.llama),
        "--out-dir",
        str(out),
        "--model-id",
        MODEL_ID,
        "--source-revision",
        "0123abc",
        "--source-file",
        "llama.gguf",
        "--json",
    ]
    hook = make_hook(tmp_path, tmp_path / "remote", fail_on="layers/layer-00001.gguf")
    assert main([*base, "--after-artifact-command", hook]) == 1
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "artifact_hook_failed"
    kept = out / "layers/layer-00001.gguf"
    before = kept.stat().st_mtime_ns
    assert main([*base, "--resume-existing-artifacts"]) == 0
    capsys.readouterr()
    assert kept.stat().st_mtime_ns == before  # verified against the source, reused
    assert main(["validate-package", str(synth_dir.llama), str(out)]) == 0


def test_hook_that_modifies_its_artifact_is_refused(synth_dir, tmp_path):
    script = tmp_path / "touch.sh"
    script.write_text(f'#!/bin/sh\necho x >> "${ENV_ARTIFACT_PATH}"\n')
    script.chmod(0o755)
    with pytest.raises(Exception) as exc:
        write_v2(synth_dir.gemma, tmp_path / "o", hook=ArtifactHook.parse(str(script)))
    assert getattr(exc.value, "code", None) == "artifact_changed_by_hook"


# --- fetch from a hub -----------------------------------------------------------------------
def test_fetch_downloads_exactly_a_v2_stages_artifacts(v2pkg, monkeypatch, capsys):
    with running_hub({"acme/v2-layers": v2pkg}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        assert main(["fetch", "hf://acme/v2-layers", "--layers", "1..2", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        got = hub.downloaded_paths("acme/v2-layers")
    parts = [p["path"] for p in doc["parts"]]
    assert parts[0] == METADATA_PATH and all(p.startswith("layers/layer-00001") for p in parts[1:])
    assert got == {MANIFEST_NAME, *parts}
    assert doc["sha256_verified"] is True
    assert doc["fetch"]["bytes_downloaded"] < doc["fetch"]["package_bytes"]


def _inspect(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, dict[str, Any]]:
    code = main(["inspect", str(path), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_inspect_reads_width_tied_embeddings_and_parts_from_the_carrier(
    synth_dir, v2pkg, pkg, capsys
):
    """What a v2 root leaves to its carrier (the width, whether embeddings are tied, each
    part's tensors) is read from it, and agrees with the source GGUF's own inspect."""
    _, source = _inspect(capsys, synth_dir.gemma)
    assert source["tied_embeddings"] is True and source["activation_width"]  # gemma-like
    assert _inspect(capsys, v2pkg)[0] == 0
    _, doc = _inspect(capsys, v2pkg)
    assert doc["activation_width"] == source["activation_width"]
    assert doc["tied_embeddings"] is True and doc["carrier_read"] is True
    assert set(doc["shared"]) >= {"metadata", "common"}
    assert {e["layer_index"] for e in doc["layers"]} == set(range(doc["layer_count"]))
    parts = [*doc["shared"].values(), *doc["layers"]]
    assert sum(a["tensor_count"] for a in parts) == source["tensor_count"]
    assert sum(a["tensor_bytes"] for a in parts) == source["tensor_bytes"]
    assert main(["inspect", str(v2pkg)]) == 0
    text = capsys.readouterr().out
    assert f"width: {source['activation_width']}  tied embeddings: yes" in text
    # a folder without the carrier (a hub snapshot holding only the root): unknown, said so
    (pkg / METADATA_PATH).unlink()
    _, bare = _inspect(capsys, pkg)
    assert bare["activation_width"] is None and bare["tied_embeddings"] is None
    assert bare["carrier_read"] is False and len(bare["layers"]) == len(doc["layers"])
    assert main(["inspect", str(pkg)]) == 0
    text = capsys.readouterr().out
    assert "width: unknown  tied embeddings: unknown" in text and "metadata carrier" in text


def test_inspect_of_a_truncated_carrier_is_the_packages_error(pkg, capsys):
    carrier = pkg / METADATA_PATH
    carrier.write_bytes(carrier.read_bytes()[:-1])
    code, doc = _inspect(capsys, pkg)
    assert code == 1 and doc["ok"] is False
    assert doc["error"]["code"] == "artifact_size_mismatch"


def test_dump_root_round_trips(v2pkg):
    raw = (v2pkg / MANIFEST_NAME).read_bytes()
    m = parse_manifest(raw)
    assert isinstance(m, ManifestV2)
    assert dump_root(m.root) == raw


# --- one catalog for both versions ----------------------------------------------------------
def test_v1_and_v2_packages_of_one_source_yield_the_same_catalog(synth_dir, v2pkg, tmp_path):
    from skippy.package.catalog import catalog_from_fragments

    v1 = tmp_path / "v1"
    make_package(synth_dir.gemma, v1)
    m1 = load_package(v1).manifest
    c1 = catalog_from_fragments((r.path, v1 / r.path) for r in m1.artifacts())
    m2 = load_package(v2pkg).manifest
    assert isinstance(m2, ManifestV2) and m2.catalog is not None

    def facts(c: Any) -> list[tuple[Any, ...]]:
        return [(t.name, t.ggml_type, t.shape, t.nbytes, t.layer) for t in c]

    assert facts(c1) == facts(m2.catalog)
    for t in m2.catalog:  # the locator is where the part's own header puts the tensor
        with open_gguf(v2pkg / t.path) as g:
            info = g.tensor(t.name)
            assert (info.data_start, info.nbytes) == (t.offset, t.nbytes)


def test_materialize_of_v2_holds_the_same_tensors_as_v1(synth_dir, v2pkg, tmp_path, capsys):
    v1 = tmp_path / "v1"
    make_package(synth_dir.gemma, v1)
    outs = {}
    for name, pkg in (("v1", v1), ("v2", v2pkg)):
        out = tmp_path / f"{name}.gguf"
        assert main(["materialize", str(pkg), "--layers", "0..4", "--out", str(out)]) == 0
        with open_gguf(out) as g:
            outs[name] = {t.name: (t.shape, t.ggml_type) for t in g.tensors}
            assert not any(k.startswith("skippy.package.") for k in g.fields)
    capsys.readouterr()
    assert outs["v1"] == outs["v2"]
    # a middle stage of v2 holds only its layers' tensors
    out = tmp_path / "mid.gguf"
    assert main(["materialize", str(v2pkg), "--layers", "1..2", "--out", str(out)]) == 0
    with open_gguf(out) as g:
        assert {t.name.split(".")[1] for t in g.tensors} == {"1"}


def test_peer_transfer_authorizes_the_superset_from_a_bare_root(v2pkg):
    from skippy.transfer.required import servable_refs, stage_refs

    bare = parse_manifest((v2pkg / MANIFEST_NAME).read_bytes())  # what a held manifest is
    full = load_package(v2pkg).manifest
    assert isinstance(bare, ManifestV2) and bare.catalog is None
    n = bare.layer_count
    for layers in (LayerRange(0, 1, n), LayerRange(1, 3, n), LayerRange(3, n, n)):
        allowed = set(servable_refs(bare, layers))
        wanted = {r.path for r in stage_refs(full, layers)}
        assert wanted <= allowed  # the precise selection is always authorized
        assert METADATA_PATH in allowed
        assert all(
            p.startswith("shared/") or any(p.startswith(f"layers/layer-{i:05d}") for i in layers)
            for p in allowed
        )


@pytest.mark.parametrize(
    ("key", "change", "code"),
    [
        ("skippy.package.tensor_part", lambda v: [999, *v[1:]], "unknown_artifact"),
        ("skippy.package.tensor_offset", lambda v: [v[0] + 1, *v[1:]], "misaligned_offset"),
        ("skippy.package.tensor_alignment", lambda v: [48, *v[1:]], "invalid_alignment"),
        ("skippy.package.tensor_size", lambda v: [v[0] + 64, *v[1:]], "invalid_stored_length"),
    ],
)
def test_a_carrier_with_a_bad_locator(pkg, key, change, code):
    item = ValueType.UINT32 if key.endswith(("part", "alignment")) else ValueType.UINT64
    values = change(_locators(pkg, key))
    rewrite_carrier(pkg, lambda r: r.update({key: _array(key, values, item)}))
    assert codes_of(pkg) == {code}


def test_a_carrier_with_another_part_count(pkg):
    rewrite_carrier(
        pkg,
        lambda r: r.update(
            {
                "skippy.package.part_count": encode_kv(
                    "skippy.package.part_count", ValueType.UINT32, 1
                )
            }
        ),
    )
    assert codes_of(pkg) == {"carrier_part_count_mismatch"}


def test_preflight_finds_a_part_whose_directory_disagrees_with_the_carrier(pkg, synth_dir):
    """Swap two equal-sized layer parts' contents: sizes and digests re-declared, the root
    re-identified; only the carrier-against-part check can tell."""
    import hashlib

    data = root_dict(pkg)
    entries = {e["path"]: e for e in data["artifact_catalog"]["entries"]}
    a, b = "layers/layer-00000-part01.gguf", "layers/layer-00001-part01.gguf"
    ra, rb = (pkg / a).read_bytes(), (pkg / b).read_bytes()
    (pkg / a).write_bytes(rb)
    (pkg / b).write_bytes(ra)
    for path, raw in ((a, rb), (b, ra)):
        entries[path].update(byte_size=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    save_root(pkg, data)
    from skippy.consume.preflight import preflight_package

    report = preflight_package(pkg)
    assert {"unexpected_tensor", "missing_tensor"} <= report.codes()
    with pytest.raises(PackageInvalid):
        verify_package_v2(pkg, synth_dir.gemma)
