"""preflight: the source-less package check. One hostile package per finding code."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pkgtools import edit_manifest, make_package

from skippy.cli import main
from skippy.consume.preflight import REMEDIATIONS, preflight_package
from skippy.errors import UsageError

MANIFEST = "model-package.json"
LAYER0, LAYER1 = "layers/layer-00000.gguf", "layers/layer-00001.gguf"
MTP_LAYER3 = {
    "speculative_decoding": {
        "default": "mtp",
        "strategies": {
            "mtp": {
                "type": "native-mtp",
                "prediction_depth": 1,
                "layer_indices": [3],
                "window_policy": {
                    "default": "fixed",
                    "initial_window": 1,
                    "min_window": 1,
                    "max_window": 1,
                },
            }
        },
    }
}


@pytest.fixture
def pkg(synth_dir, tmp_path: Path) -> Path:
    make_package(synth_dir.llama, tmp_path / "pkg", projectors=(synth_dir.projector,))
    return tmp_path / "pkg"


# --- hostile edits ----------------------------------------------------------------------------
def manifest_edit(fn: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    return lambda pkg: edit_manifest(pkg, fn)


def setitem(path: str, value: Any) -> Callable[[Path], None]:
    """Set ``a.b[0].c`` in the manifest."""

    def edit(d: dict[str, Any]) -> None:
        *parents, last = path.replace("[", ".").replace("]", "").split(".")
        for key in parents:
            d = d[int(key)] if key.isdigit() else d[key]
        d[last] = value

    return manifest_edit(edit)


def write_raw(text: str) -> Callable[[Path], None]:
    return lambda pkg: (pkg / MANIFEST).write_text(text)


def remove_file(rel: str) -> Callable[[Path], None]:
    return lambda pkg: (pkg / rel).unlink()


def replace_with_dir(rel: str) -> Callable[[Path], None]:
    def edit(pkg: Path) -> None:
        (pkg / rel).unlink()
        (pkg / rel).mkdir()

    return edit


def append_byte(rel: str) -> Callable[[Path], None]:
    def edit(pkg: Path) -> None:
        with (pkg / rel).open("ab") as f:
            f.write(b"\0")

    return edit


def flip_last_byte(rel: str) -> Callable[[Path], None]:
    def edit(pkg: Path) -> None:
        data = bytearray((pkg / rel).read_bytes())
        data[-1] ^= 0xFF
        (pkg / rel).write_bytes(bytes(data))

    return edit


def symlink_outside(rel: str) -> Callable[[Path], None]:
    def edit(pkg: Path) -> None:
        outside = pkg.parent / "outside.gguf"
        shutil.copyfile(pkg / rel, outside)
        (pkg / rel).unlink()
        (pkg / rel).symlink_to(outside)

    return edit


def drop_layer(d: dict[str, Any]) -> None:
    d["layers"].pop()


def no_edit(pkg: Path) -> None:
    pass


# (id, edit, preflight kwargs, expected code)
HOSTILE: list[tuple[str, Callable[[Path], None], dict[str, Any], str]] = [
    ("no manifest", remove_file(MANIFEST), {}, "missing_manifest"),
    ("not json", write_raw("{not json"), {}, "invalid_manifest_json"),
    ("not utf-8", lambda p: (p / MANIFEST).write_bytes(b"\xff\xfe{}"), {}, "invalid_manifest_json"),
    ("schema 3", setitem("schema_version", 3), {}, "unsupported_schema_version"),
    ("schema 2 with v1 fields", setitem("schema_version", 2), {}, "unknown_field"),
    ("schema missing", manifest_edit(lambda d: d.pop("schema_version")), {},
     "unsupported_schema_version"),
    ("format", setitem("format", "gguf"), {}, "invalid_format"),
    ("empty model id", setitem("model_id", " "), {}, "empty_model_id"),
    ("source sha", setitem("source_model.sha256", "abc"), {}, "invalid_source_model_sha256"),
    ("no abi", manifest_edit(lambda d: d.pop("skippy_abi_version")), {},
     "missing_skippy_abi_version"),
    ("future abi", setitem("skippy_abi_version", "2.0.0"), {}, "incompatible_skippy_abi_version"),
    ("newer minor abi", setitem("skippy_abi_version", "1.99.0"), {},
     "incompatible_skippy_abi_version"),
    ("projector kind", setitem("projectors[0].kind", "clip-ng"), {}, "unsupported_projector_kind"),
    ("layer index", setitem("layers[0].layer_index", 4), {}, "layer_index_out_of_range"),
    ("missing layer", manifest_edit(drop_layer), {}, "missing_layer"),
    ("duplicate layer", setitem("layers[1].layer_index", 0), {}, "duplicate_layer"),
    ("dotdot path", setitem("layers[0].path", "../x.gguf"), {}, "unsafe_artifact_path"),
    ("absolute path", setitem("shared.output.path", "/etc/passwd"), {}, "unsafe_artifact_path"),
    ("projector path", setitem("projectors[0].path", "projectors/../../p.gguf"), {},
     "unsafe_artifact_path"),
    ("symlink escape", symlink_outside(LAYER1), {}, "unsafe_artifact_path"),
    ("not a file", replace_with_dir(LAYER0), {}, "artifact_not_file"),
    ("missing file", remove_file(LAYER1), {}, "missing_artifact"),
    ("missing projector", remove_file("projectors/mmproj.gguf"), {}, "missing_artifact"),
    ("size", append_byte("shared/output.gguf"), {}, "artifact_size_mismatch"),
    ("empty artifact", setitem("layers[2].artifact_bytes", 0), {}, "empty_artifact"),
    ("tensor bytes", setitem("layers[2].tensor_bytes", 0), {}, "invalid_tensor_bytes"),
    ("artifact sha", setitem("shared.embeddings.sha256", "zz" * 32), {}, "invalid_artifact_sha256"),
    ("sha mismatch", flip_last_byte(LAYER1), {"verify_sha256": True}, "artifact_sha256_mismatch"),
    ("projector sha", flip_last_byte("projectors/mmproj.gguf"), {"verify_sha256": True},
     "artifact_sha256_mismatch"),
    ("tensor count", setitem("layers[3].tensor_count", 1), {}, "tensor_count_mismatch"),
    ("not gguf", lambda p: (p / LAYER1).write_bytes(b"\0" * (p / LAYER1).stat().st_size), {},
     "invalid_artifact_gguf"),
    ("generation", setitem("generation", {"policy": {"profile": "no-such-profile"}}), {},
     "unsupported_policy_profile"),
    ("mtp without nextn", setitem("generation", MTP_LAYER3), {},
     "mtp_layer_missing_nextn_tensors"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "kwargs", "code"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE]
)
def test_hostile_package_reports_its_code(pkg: Path, edit, kwargs, code) -> None:
    assert preflight_package(pkg, verify_sha256=True).valid  # the untouched package is fine
    edit(pkg)
    report = preflight_package(pkg, **kwargs)
    assert not report.valid
    hits = [f for f in report.findings if f.code == code]
    assert hits, f"{code} not in {report.codes()}"
    assert all(f.severity == "error" and f.remediation for f in hits)
    json.dumps(report.to_dict())  # the report always serialises


def test_sha_mismatch_is_only_found_when_asked(pkg: Path) -> None:
    flip_last_byte(LAYER1)(pkg)
    assert preflight_package(pkg).valid  # same size: only hashing can tell
    report = preflight_package(pkg, verify_sha256=True)
    [bad] = [f for f in report.findings if f.code == "artifact_sha256_mismatch"]
    assert bad.path == LAYER1
    assert report.verification is not None
    assert len(report.verification.artifacts) == report.artifacts_checked
    assert report.verification.hashed == report.artifacts_checked - 1


def test_every_table_code_has_a_remediation() -> None:
    codes = {h[3] for h in HOSTILE} - {"unsupported_policy_profile",
                                       "mtp_layer_missing_nextn_tensors"}  # fmt: skip
    assert codes <= set(REMEDIATIONS)


def test_clean_package_with_stages(pkg: Path) -> None:
    report = preflight_package(pkg, stages=3)
    assert report.valid and not report.findings
    assert report.artifacts_checked == 3 + 4 + 1  # shared, layers, projector
    assert [(s.layers.start, s.layers.stop) for s in report.stages] == [(0, 2), (2, 3), (3, 4)]
    first, middle, last = (s.to_dict() for s in report.stages)
    assert [p["path"] for p in first["parts"]] == [
        "shared/metadata.gguf",
        "shared/embeddings.gguf",
        LAYER0,
        LAYER1,
    ]
    assert first["projector"]["path"] == "projectors/mmproj.gguf"
    assert [p["role"] for p in middle["parts"]] == ["metadata", "layer"]
    assert middle["projector"] is None
    assert [p["role"] for p in last["parts"]] == ["metadata", "layer", "output"]
    for s in report.stages:
        sel = s.selection
        assert sel is not None
        assert s.to_dict()["total_bytes"] == sum(r.artifact.artifact_bytes for r in sel.all_refs)


def test_metadata_only_ignores_layers_and_needs_no_range(pkg: Path) -> None:
    remove_file(LAYER1)(pkg)
    flip_last_byte("shared/output.gguf")(pkg)
    assert not preflight_package(pkg).valid
    report = preflight_package(pkg, metadata_only=True, verify_sha256=True)
    assert report.valid, report.findings
    assert report.artifacts_checked == 1
    assert report.verification is not None and report.verification.hashed == 1
    assert report.stages == []

    flip_last_byte("shared/metadata.gguf")(pkg)
    report = preflight_package(pkg, metadata_only=True, verify_sha256=True)
    assert report.codes() == {"artifact_sha256_mismatch"}


def test_metadata_only_still_checks_the_manifest(pkg: Path) -> None:
    setitem("skippy_abi_version", "7.0.0")(pkg)
    assert "incompatible_skippy_abi_version" in preflight_package(pkg, metadata_only=True).codes()


def test_metadata_only_skips_layer_evidence(pkg: Path) -> None:
    setitem("generation", MTP_LAYER3)(pkg)
    report = preflight_package(pkg, metadata_only=True)
    assert "mtp_layer_missing_nextn_tensors" not in report.codes()
    assert report.valid


def test_metadata_only_and_stages_exclude_each_other(pkg: Path) -> None:
    with pytest.raises(UsageError):
        preflight_package(pkg, metadata_only=True, stages=2)


def test_valid_mtp_package_passes(synth_dir, tmp_path: Path) -> None:
    make_package(synth_dir.nextn, tmp_path / "nextn")
    report = preflight_package(tmp_path / "nextn")
    assert report.valid, report.findings


def test_unreadable_root_raises(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        preflight_package(tmp_path / "nope")


# --- CLI ---------------------------------------------------------------------------------------
@pytest.fixture
def cli():
    return main


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The real console entry point in a child: only there can a traceback be seen."""
    return subprocess.run(
        [sys.executable, "-m", "skippy.cli", *args], capture_output=True, text=True
    )


@pytest.mark.parametrize("as_json", [True, False])
def test_cli_exit_codes_without_tracebacks(pkg: Path, tmp_path: Path, as_json):
    flag = ["--json"] if as_json else []
    assert _run_cli("preflight", str(pkg), *flag).returncode == 0

    setitem("layers[1].layer_index", 0)(pkg)
    proc = _run_cli("preflight", str(pkg), "--stages", "2", *flag)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr
    if as_json:
        data = json.loads(proc.stdout)
        assert data["valid"] is False
        assert "duplicate_layer" in {f["code"] for f in data["findings"]}
    else:
        assert "duplicate_layer" in proc.stdout and "hint:" in proc.stdout

    proc = _run_cli("preflight", str(tmp_path / "missing"), *flag)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "unreadable_input" in (proc.stdout if as_json else proc.stderr)


def test_cli_unreadable_manifest_is_exit_2(cli, pkg: Path, capsys) -> None:
    (pkg / MANIFEST).unlink()
    (pkg / MANIFEST).mkdir()  # exists but cannot be read as a file (works as root too)
    assert cli(["preflight", str(pkg), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "manifest_not_file"


def test_cli_hostile_json_manifest(cli, pkg: Path, capsys) -> None:
    write_raw("[1, 2")(pkg)
    assert cli(["preflight", str(pkg), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [f["code"] for f in data["findings"]] == ["invalid_manifest_json"]


@pytest.mark.parametrize(
    ("stages", "code"), [(0, "invalid_stage_count"), (5, "stage_count_exceeds_layer_count")]
)
def test_a_bad_stage_count_is_a_usage_error_not_a_finding(pkg: Path, stages, code) -> None:
    with pytest.raises(UsageError) as exc:
        preflight_package(pkg, stages=stages)
    assert exc.value.code == code


def test_cli_stage_count_is_a_usage_error(cli, pkg: Path, capsys) -> None:
    assert cli(["preflight", str(pkg), "--stages", "9", "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["error"]["code"] == "stage_count_exceeds_layer_count"
    assert [f["code"] for f in data["findings"]] == ["stage_count_exceeds_layer_count"]
    assert cli(["preflight", str(pkg), "--stages", "2", "--metadata-only", "--json"]) == 2
