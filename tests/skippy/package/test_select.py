"""Stage selection (spec "Layer Selection"): parts per stage, tied embeddings, projectors; and
the consumer-side checks and CLI around it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import synth_gguf
from pkgtools import edit_manifest, make_package

from skippy.cli import main
from skippy.consume.preflight import load_package, prepare_stage
from skippy.errors import PackageInvalid, UsageError
from skippy.package.manifest import Manifest
from skippy.package.ranges import LayerRange
from skippy.package.select import select_stage

L = 4  # synth models have 4 layers
META, EMB, OUT = "shared/metadata.gguf", "shared/embeddings.gguf", "shared/output.gguf"


def layer(i: int) -> str:
    return f"layers/layer-{i:05d}.gguf"


@pytest.fixture(scope="module")
def projectors(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("proj")
    return (
        synth_gguf.projector(d / "mmproj-a.gguf", seed=1),
        synth_gguf.projector(d / "mmproj-b.gguf", seed=2),
    )


@pytest.fixture(scope="module")
def packages(synth_dir, projectors, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("sel")
    make_package(synth_dir.llama, d / "untied", projectors=projectors)
    make_package(synth_dir.gemma, d / "tied")
    make_package(synth_dir.llama, d / "text")
    return {"untied": d / "untied", "tied": d / "tied", "text": d / "text"}


def manifest(packages: dict[str, Path], name: str) -> Manifest:
    return load_package(packages[name]).manifest


# (package, start, stop, expected parts in load order, expected projector)
SELECTION_TABLE = [
    ("untied", 0, 2, [META, EMB, layer(0), layer(1)], "projectors/mmproj-a.gguf"),
    ("untied", 1, 3, [META, layer(1), layer(2)], None),
    ("untied", 2, 4, [META, layer(2), layer(3), OUT], None),
    ("untied", 0, 4, [META, EMB, *map(layer, range(4)), OUT], "projectors/mmproj-a.gguf"),
    ("untied", 3, 4, [META, layer(3), OUT], None),
    # tied embeddings: the final stage projects logits through token_embd
    ("tied", 0, 2, [META, EMB, layer(0), layer(1)], None),
    ("tied", 1, 3, [META, layer(1), layer(2)], None),
    ("tied", 2, 4, [META, EMB, layer(2), layer(3), OUT], None),
    ("tied", 0, 4, [META, EMB, *map(layer, range(4)), OUT], None),
    ("text", 0, 4, [META, EMB, *map(layer, range(4)), OUT], None),
]


@pytest.mark.parametrize(("name", "start", "stop", "parts", "projector"), SELECTION_TABLE)
def test_selection_table(packages, name, start, stop, parts, projector) -> None:
    m = manifest(packages, name)
    sel = select_stage(m, LayerRange(start, stop, L))
    assert [r.path for r in sel.parts] == parts
    assert (sel.projector.path if sel.projector else None) == projector
    assert [r.layer_index for r in sel.parts if r.role == "layer"] == list(range(start, stop))
    assert sel.total_bytes == sum(r.artifact.artifact_bytes for r in sel.all_refs)


def test_tied_flag_comes_from_the_manifest(packages) -> None:
    assert manifest(packages, "tied").tied_embeddings is True
    assert manifest(packages, "untied").tied_embeddings is False


@pytest.mark.parametrize(("start", "stop"), [(0, 1), (1, 3), (3, 4)])
def test_explicit_projector_wins_on_any_stage(packages, start, stop) -> None:
    sel = select_stage(
        manifest(packages, "untied"),
        LayerRange(start, stop, L),
        projector_path="projectors/mmproj-b.gguf",
    )
    assert sel.projector is not None and sel.projector.path == "projectors/mmproj-b.gguf"
    assert sel.projector not in sel.parts  # never part of the split set


def test_stage0_gets_the_first_declared_mmproj(packages, tmp_path) -> None:
    m = manifest(packages, "untied")
    assert [p.path for p in m.projectors] == [
        "projectors/mmproj-a.gguf",
        "projectors/mmproj-b.gguf",
    ]
    sel = select_stage(m, LayerRange(0, 1, L))
    assert sel.projector is not None and sel.projector.path == "projectors/mmproj-a.gguf"
    # "first declared entry with kind mmproj": a leading projector of another kind is skipped
    other = select_stage(_with_first_projector_kind(m, "not-mmproj"), LayerRange(0, 1, L))
    assert other.projector is not None and other.projector.path == "projectors/mmproj-b.gguf"


def _with_first_projector_kind(m: Manifest, kind: str) -> Manifest:
    first = dataclasses.replace(m.projectors[0], kind=kind)
    return dataclasses.replace(m, projectors=(first, *m.projectors[1:]))


def test_downstream_stages_get_no_projector(packages) -> None:
    m = manifest(packages, "untied")
    for start in range(1, L):
        assert select_stage(m, LayerRange(start, L, L)).projector is None


def test_projector_is_never_inferred_from_sibling_files(synth_dir, projectors, tmp_path) -> None:
    root = tmp_path / "text"
    make_package(synth_dir.llama, root)
    (root / "projectors").mkdir()
    shutil.copyfile(projectors[0], root / "projectors" / "mmproj-model-f16.gguf")
    loaded = load_package(root)
    assert select_stage(loaded.manifest, LayerRange(0, 4, L)).projector is None
    stage = prepare_stage(loaded, LayerRange(0, 4, L), verify=False, cache=None)
    assert stage.projector_path is None


def test_undeclared_explicit_projector_is_an_error(packages) -> None:
    with pytest.raises(UsageError) as exc_info:
        select_stage(
            manifest(packages, "untied"), LayerRange(0, 1, L), projector_path="mmproj.gguf"
        )
    assert exc_info.value.code == "undeclared_projector"


def test_range_for_another_layer_count_is_refused(packages) -> None:
    with pytest.raises(UsageError) as exc_info:
        select_stage(manifest(packages, "untied"), LayerRange(0, 2, 8))
    assert exc_info.value.code == "invalid_layer_range"


# --- consumer validation around selection ---------------------------------------------------
@pytest.fixture
def pkg(synth_dir, projectors, tmp_path) -> Path:
    make_package(synth_dir.llama, tmp_path / "pkg", projectors=projectors)
    return tmp_path / "pkg"


def test_prepare_stage_checks_its_parts_but_not_other_stages(pkg: Path) -> None:
    (pkg / layer(0)).unlink()
    loaded = load_package(pkg)
    stage = prepare_stage(loaded, LayerRange(2, 4, L), verify=False, cache=None)
    assert [p.name for p in stage.part_paths] == [
        "metadata.gguf",
        "layer-00002.gguf",
        "layer-00003.gguf",
        "output.gguf",
    ]
    with pytest.raises(PackageInvalid) as exc_info:
        prepare_stage(loaded, LayerRange(0, 2, L), verify=False, cache=None)
    assert exc_info.value.code == "missing_artifact"


def test_prepare_stage_checks_every_declared_projector(pkg: Path) -> None:
    """Spec: "declared projector paths are relative, safe, and files" and sizes match."""
    with (pkg / "projectors" / "mmproj-b.gguf").open("ab") as f:
        f.write(b"\0")
    with pytest.raises(PackageInvalid) as exc_info:
        prepare_stage(load_package(pkg), LayerRange(2, 4, L), verify=False, cache=None)
    assert exc_info.value.code == "artifact_size_mismatch"
    assert exc_info.value.path == "projectors/mmproj-b.gguf"


def test_prepare_stage_refuses_an_invalid_manifest(pkg: Path) -> None:
    edit_manifest(pkg, lambda d: d["layers"].pop())
    with pytest.raises(PackageInvalid) as exc_info:
        load_package(pkg)
    assert exc_info.value.code == "missing_layer"


# --- CLI ----------------------------------------------------------------------------------------
@pytest.fixture
def cli():
    return main


def test_cli_select_lists_validated_parts(cli, pkg: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("SKIPPY_VERIFY_PACKAGE_SHA", "0")
    assert cli(["select", str(pkg), "--layers", "0..2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(p["role"], p["layer_index"], p["path"]) for p in data["parts"]] == [
        ("metadata", None, META),
        ("embeddings", None, EMB),
        ("layer", 0, layer(0)),
        ("layer", 1, layer(1)),
    ]
    m = load_package(pkg).manifest
    assert data["parts"][2]["sha256"] == m.layer(0).sha256
    assert data["parts"][2]["artifact_bytes"] == m.layer(0).artifact_bytes
    assert data["projector"]["path"] == "projectors/mmproj-a.gguf"
    assert data["sha256_verified"] is False


@pytest.mark.parametrize("env", [None, "1"])
def test_cli_select_verifies_unless_opted_out(cli, pkg: Path, capsys, monkeypatch, env) -> None:
    if env is None:
        monkeypatch.delenv("SKIPPY_VERIFY_PACKAGE_SHA", raising=False)
    else:
        monkeypatch.setenv("SKIPPY_VERIFY_PACKAGE_SHA", env)
    assert cli(["select", str(pkg), "--layers", "1..3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verification"]["hashed"] == 3
    assert cli(["select", str(pkg), "--layers", "1..3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verification"]["cached"] == 3
    data = bytearray((pkg / layer(1)).read_bytes())
    data[-1] ^= 1
    (pkg / layer(1)).write_bytes(bytes(data))
    assert cli(["select", str(pkg), "--layers", "1..3", "--json"]) == 1
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["code"] == "artifact_sha256_mismatch" and err["path"] == layer(1)


@pytest.mark.parametrize(
    ("argv_tail", "code", "exit_code"),
    [
        (["--layers", "2..2"], "invalid_layer_range", 2),
        (["--layers", "0..9"], "invalid_layer_range", 2),
        (["--layers", "0-2"], "invalid_layer_range", 2),
        (["--layers", "0..1", "--projector", "nope.gguf"], "undeclared_projector", 2),
    ],
)
def test_cli_select_usage_errors(cli, pkg: Path, capsys, argv_tail, code, exit_code) -> None:
    assert cli(["select", str(pkg), *argv_tail, "--json"]) == exit_code
    assert json.loads(capsys.readouterr().out)["error"]["code"] == code


def test_cli_refs(cli, tmp_path: Path, capsys) -> None:
    assert cli(["select", "hf://ns", "--layers", "0..1", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "invalid_package_ref"
    assert cli(["select", str(tmp_path / "nope"), "--layers", "0..1", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "unreadable_input"
