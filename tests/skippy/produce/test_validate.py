"""validate-package: every corruption gets its own stable code and exit code 1."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pkgtools import edit_manifest, make_package

from skippy.cli import main
from skippy.constants import layer_path
from skippy.gguf.writer import write_fragment
from skippy.produce.fragments import plan_fragments
from skippy.produce.source import SourceModelFiles
from skippy.produce.validate import validate_package


@pytest.fixture
def pkg(synth_dir, tmp_path) -> Path:
    out = tmp_path / "pkg"
    make_package(synth_dir.llama, out)
    return out


def codes(source: Path, pkg: Path) -> set[str]:
    return {f.code for f in validate_package(source, pkg).findings}


def cli(*args: str) -> int:
    return main([*map(str, args)])


def test_fresh_package_is_valid(synth_dir, pkg, capsys):
    report = validate_package(synth_dir.llama, pkg)
    assert report.valid and report.findings == []
    assert report.artifacts_checked == 7
    assert cli("validate-package", synth_dir.llama, pkg) == 0
    assert "valid" in capsys.readouterr().out


def _flip(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_byte_in_a_layer(synth_dir, pkg, capsys):
    _flip(pkg / layer_path(1), 40)  # inside the last tensor's payload
    found = codes(synth_dir.llama, pkg)
    assert {"artifact_sha256_mismatch", "tensor_bytes_differ"} <= found
    assert cli("validate-package", synth_dir.llama, pkg, "--json") == 1
    out = json.loads(capsys.readouterr().out)
    assert out["valid"] is False
    assert any(f["path"] == layer_path(1) for f in out["findings"])


def test_truncated_artifact(synth_dir, pkg):
    p = pkg / layer_path(2)
    p.write_bytes(p.read_bytes()[:-100])
    assert "artifact_size_mismatch" in codes(synth_dir.llama, pkg)
    assert cli("validate-package", synth_dir.llama, pkg) == 1


def test_deleted_artifact(synth_dir, pkg):
    (pkg / layer_path(3)).unlink()
    found = codes(synth_dir.llama, pkg)
    assert "missing_artifact" in found
    assert "tensor_missing" in found  # its tensors are now in no artifact
    assert cli("validate-package", synth_dir.llama, pkg) == 1


def test_duplicated_layer_entry(synth_dir, pkg):
    edit_manifest(pkg, lambda d: d["layers"].append(dict(d["layers"][0])))
    found = codes(synth_dir.llama, pkg)
    assert {"duplicate_layer", "tensor_duplicated", "duplicate_artifact_path"} <= found
    assert cli("validate-package", synth_dir.llama, pkg) == 1


def test_escaping_path(synth_dir, pkg, tmp_path):
    shutil.copy(pkg / layer_path(0), tmp_path / "x")
    edit_manifest(pkg, lambda d: d["layers"][0].update(path="../x"))
    assert "unsafe_artifact_path" in codes(synth_dir.llama, pkg)
    assert cli("validate-package", synth_dir.llama, pkg) == 1


def test_symlink_escaping_the_root(synth_dir, pkg, tmp_path):
    target = pkg / layer_path(0)
    outside = tmp_path / "outside.gguf"
    shutil.move(target, outside)
    os.symlink(outside, target)
    assert "unsafe_artifact_path" in codes(synth_dir.llama, pkg)


def test_missing_layer(synth_dir, pkg):
    edit_manifest(pkg, lambda d: d["layers"].pop(2))
    assert "missing_layer" in codes(synth_dir.llama, pkg)


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (lambda d: d.update(schema_version=3), "unsupported_schema_version"),
        (lambda d: d.update(format="gguf-split"), "invalid_format"),
    ],
)
def test_unreadable_manifest_versions(synth_dir, pkg, edit, code):
    edit_manifest(pkg, edit)
    assert codes(synth_dir.llama, pkg) == {code}
    assert cli("validate-package", synth_dir.llama, pkg) == 1


def test_wrong_source(synth_dir, pkg):
    found = codes(synth_dir.gemma, pkg)
    assert "source_sha256_mismatch" in found
    assert "tensor_missing" in found or "tensor_unexpected" in found


def test_tensor_missing_and_metadata_consistent(synth_dir, pkg):
    """A layer fragment rewritten without one tensor, with a manifest updated to match: only
    the source comparison can notice, and it does."""
    with SourceModelFiles(synth_dir.llama) as src:
        plans = plan_fragments(
            kv_records=[(f.key, src.head.raw_field(f.key)) for f in src.kv_fields()],
            tensors=src.tensors,
            layer_count=4,
        )
        plan = next(p for p in plans if p.layer_index == 1)
        dropped = plan.tensors[0].info.name
        w = write_fragment(
            pkg / plan.path,
            plan.kv_records,
            [src.tensor_source(t) for t in plan.tensors[1:]],
            src.alignment,
        )

    def edit(d):
        d["layers"][1].update(
            artifact_bytes=w.artifact_bytes,
            sha256=w.sha256,
            tensor_count=w.tensor_count,
            tensor_bytes=w.tensor_bytes,
        )

    edit_manifest(pkg, edit)
    report = validate_package(synth_dir.llama, pkg)
    assert [(f.code, dropped in f.message) for f in report.findings] == [("tensor_missing", True)]


def test_bad_manifest_sha_field(synth_dir, pkg):
    edit_manifest(pkg, lambda d: d["shared"]["metadata"].update(sha256="zz"))
    found = codes(synth_dir.llama, pkg)
    assert {"invalid_artifact_sha256", "artifact_sha256_mismatch"} <= found


def test_cli_user_errors_have_no_traceback(synth_dir, pkg, tmp_path):
    """Run the real console entry point: bad input gets a code, an exit code, no traceback."""
    cases = [
        (["validate-package", str(tmp_path / "nope.gguf"), str(pkg)], 2, "unreadable_input"),
        (
            ["validate-package", str(synth_dir.llama), str(tmp_path / "nodir")],
            2,
            "unreadable_input",
        ),
        (
            ["write-package", str(synth_dir.llama), "--out-dir", str(tmp_path / "o")],
            2,
            "missing_provenance",
        ),
        (["plan", str(pkg), "--stages", "9"], 2, "stage_count_exceeds_layer_count"),
        (["plan", str(pkg), "--stages", "0"], 2, "invalid_stage_count"),
        (["inspect", str(tmp_path / "missing")], 2, "unreadable_input"),
    ]
    (tmp_path / "text.gguf").write_text("hello")
    cases.append((["inspect", str(tmp_path / "text.gguf")], 1, "gguf_"))
    for argv, exit_code, code in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "skippy.cli", *argv], capture_output=True, text=True
        )
        assert proc.returncode == exit_code, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert f"[{code}" in proc.stderr, proc.stderr


def test_json_error_document(synth_dir, tmp_path, capsys):
    rc = cli("write-package", synth_dir.llama, "--out-dir", tmp_path / "o", "--json")
    assert rc == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["error"]["code"] == "missing_provenance"


def test_write_package_cli_with_validate(synth_dir, tmp_path, capsys):
    out = tmp_path / "o"
    rc = cli(
        "write-package",
        synth_dir.llama,
        "--out-dir",
        out,
        "--model-id",
        "acme/t:Q",
        "--source-revision",
        "r1",
        "--source-file",
        "llama.gguf",
        "--validate",
        "--json",
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["validation"]["valid"] is True
    readme = (out / "README.md").read_text()
    assert "Result at write time: valid" in readme
    manifest_sha = hashlib.sha256((out / "model-package.json").read_bytes()).hexdigest()
    assert manifest_sha in readme


def test_generation_block_is_checked_against_artifacts(synth_dir, tmp_path):
    pkg = tmp_path / "nextn"
    m = make_package(synth_dir.nextn, pkg).manifest
    assert m.generation is not None
    assert validate_package(synth_dir.nextn, pkg).valid

    def point_mtp_at_layer_0(d):
        d["generation"]["speculative_decoding"]["proposers"]["mtp"]["layer_indices"] = [0]

    edit_manifest(pkg, point_mtp_at_layer_0)
    assert "mtp_layer_missing_nextn_tensors" in codes(synth_dir.nextn, pkg)


def test_metadata_kv_must_match_the_source(synth_dir, pkg):
    """A metadata fragment with one KV value changed and a manifest updated to match: only
    the comparison with the source can notice, and it does."""
    from skippy.gguf.constants import ValueType
    from skippy.gguf.writer import encode_kv

    with SourceModelFiles(synth_dir.llama) as src:
        plans = plan_fragments(
            kv_records=[(f.key, src.head.raw_field(f.key)) for f in src.kv_fields()],
            tensors=src.tensors,
            layer_count=4,
        )
        meta = plans[0]
        key = "llama.rope.freq_base"
        original = src.head.raw_field(key)
        records = [
            encode_kv(key, ValueType.FLOAT32, 1234.0) if r == original else r
            for r in meta.kv_records
        ]
        w = write_fragment(
            pkg / meta.path, records, [src.tensor_source(t) for t in meta.tensors], src.alignment
        )
    edit_manifest(
        pkg,
        lambda d: d["shared"]["metadata"].update(artifact_bytes=w.artifact_bytes, sha256=w.sha256),
    )
    report = validate_package(synth_dir.llama, pkg)
    assert [(f.code, key in f.message) for f in report.findings] == [("metadata_kv_differs", True)]


def test_tied_embeddings_flag_must_match_the_source(synth_dir, pkg):
    edit_manifest(pkg, lambda d: d.update(tied_embeddings=True))  # llama has output.weight
    assert codes(synth_dir.llama, pkg) == {"tied_embeddings_mismatch"}
