"""write-package against a hostile or busy --out-dir and against bad input: it deletes only
its own stale artifacts inside the package, refuses bad input before it touches the previous
package, and lets one run at a time write into a folder."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
from pkgtools import edit_manifest, make_package

from skippy.cli import main
from skippy.constants import MANIFEST_NAME, README_NAME, layer_path
from skippy.errors import InputUnreadable, ModelError, OutputExists, UnsafePath, UsageError
from skippy.gguf.reader import open_gguf
from skippy.package.manifest import parse_manifest
from skippy.produce.source import SourceModelFiles
from skippy.produce.validate import validate_package
from skippy.produce.write_package import (
    Provenance,
    WriteOptions,
    local_provenance,
    write_package,
)

MODEL_ID = "acme/tiny-GGUF:Q8_0"


def _fake_artifact(path: str) -> dict[str, object]:
    return {
        "kind": "mmproj",
        "path": path,
        "tensor_count": 0,
        "tensor_bytes": 0,
        "artifact_bytes": 1,
        "sha256": "0" * 64,
    }


def _previous_package(synth_dir, pkg: Path) -> bytes:
    make_package(synth_dir.llama, pkg)
    return (pkg / MANIFEST_NAME).read_bytes()


def _assert_previous_package_intact(synth_dir, pkg: Path, manifest_bytes: bytes) -> None:
    assert (pkg / MANIFEST_NAME).read_bytes() == manifest_bytes
    report = validate_package(synth_dir.llama, pkg)
    assert report.valid, report.findings


# --- finding 1: stale removal stays inside the package and spares the root files -------------
def test_overwrite_never_follows_a_symlinked_folder_out_of_the_package(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    make_package(synth_dir.llama, pkg)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "victim.txt"
    victim.write_text("not yours")
    (pkg / "layers" / "evil").symlink_to(elsewhere, target_is_directory=True)

    def point_layer_3_at_the_victim(data):
        data["layers"][3]["path"] = "layers/evil/victim.txt"

    edit_manifest(pkg, point_layer_3_at_the_victim)
    parse_manifest((pkg / MANIFEST_NAME).read_bytes())  # readable, so its paths are candidates
    result = make_package(synth_dir.llama, pkg, overwrite=True)
    assert victim.read_text() == "not yours"
    assert "layers/evil/victim.txt" not in result.removed_stale
    assert validate_package(synth_dir.llama, pkg).valid


@pytest.mark.parametrize("listed", [MANIFEST_NAME, README_NAME, "notes.txt"])
def test_overwrite_never_deletes_root_files_an_old_manifest_lists(synth_dir, tmp_path, listed):
    pkg = tmp_path / "pkg"
    make_package(synth_dir.llama, pkg)
    (pkg / "notes.txt").write_text("the publisher's notes")
    edit_manifest(pkg, lambda data: data["projectors"].append(_fake_artifact(listed)))
    parse_manifest((pkg / MANIFEST_NAME).read_bytes())
    result = make_package(synth_dir.llama, pkg, overwrite=True)
    assert result.removed_stale == ()
    for name in (MANIFEST_NAME, README_NAME, "notes.txt"):
        assert (pkg / name).is_file(), name
    assert validate_package(synth_dir.llama, pkg).valid


def test_overwrite_still_removes_its_own_stale_fragments(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    make_package(synth_dir.llama, pkg, projectors=(synth_dir.projector,))
    result = make_package(synth_dir.llama, pkg, overwrite=True)
    assert result.removed_stale == (f"projectors/{synth_dir.projector.name}",)
    assert not (pkg / "projectors" / synth_dir.projector.name).exists()


def test_an_artifact_folder_symlinked_out_of_the_package_is_refused(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    someone_elses = elsewhere / ".their-download.partial"
    someone_elses.write_text("in progress")
    pkg.mkdir()
    (pkg / "layers").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafePath):
        make_package(synth_dir.llama, pkg, overwrite=True)
    assert someone_elses.read_text() == "in progress"
    assert sorted(p.name for p in elsewhere.iterdir()) == [someone_elses.name]


# --- finding 2: bad input is refused before the previous package is withdrawn -----------------
def test_split_source_file_not_a_shard_name_keeps_the_previous_package(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    before = _previous_package(synth_dir, pkg)
    prov = local_provenance(
        model_id=MODEL_ID, source_repo=None, source_revision="r", source_file="model.gguf"
    )
    with pytest.raises(UsageError) as exc:
        write_package(
            synth_dir.split[0], WriteOptions(out_dir=pkg, provenance=prov, overwrite=True)
        )
    assert exc.value.code == "missing_provenance"
    _assert_previous_package_intact(synth_dir, pkg, before)


def test_missing_projector_keeps_the_previous_package(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    before = _previous_package(synth_dir, pkg)
    with pytest.raises(InputUnreadable):
        make_package(synth_dir.llama, pkg, projectors=(tmp_path / "nope.gguf",), overwrite=True)
    _assert_previous_package_intact(synth_dir, pkg, before)


def test_projector_name_not_utf8_keeps_the_previous_package(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    before = _previous_package(synth_dir, pkg)
    odd = tmp_path / os.fsdecode(b"mmproj-\xff.gguf")
    try:
        shutil.copyfile(synth_dir.projector, odd)
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system refuses non-UTF-8 file names")
    with pytest.raises(UnsafePath):
        make_package(synth_dir.llama, pkg, projectors=(odd,), overwrite=True)
    _assert_previous_package_intact(synth_dir, pkg, before)


@pytest.mark.parametrize(
    "field", ["model_id", "repo", "revision", "source_file"], ids=lambda f: f"bad-{f}"
)
def test_provenance_must_be_utf8(field):
    good = {"model_id": MODEL_ID, "repo": "acme/tiny-GGUF", "revision": "r", "source_file": "f"}
    bad = os.fsdecode(b"abc\xff")  # what argv holds for bytes that are not UTF-8
    with pytest.raises(UsageError) as exc:
        Provenance(**{**good, field: bad})
    assert exc.value.code == "invalid_provenance"


def test_cli_source_revision_not_utf8_is_a_usage_error_and_keeps_the_package(
    synth_dir, tmp_path, capsys
):
    pkg = tmp_path / "pkg"
    before = _previous_package(synth_dir, pkg)
    argv = [
        "write-package",
        str(synth_dir.llama),
        "--out-dir",
        str(pkg),
        "--model-id",
        MODEL_ID,
        "--source-revision",
        os.fsdecode(b"rev\xff"),
        "--source-file",
        synth_dir.llama.name,
        "--overwrite",
    ]
    assert main(argv) == 2
    assert "invalid_provenance" in capsys.readouterr().err
    _assert_previous_package_intact(synth_dir, pkg, before)


# --- finding 3: odd blk.* names are metadata, not a crash --------------------------------------
def _write_gguf(path: Path, tensor_names: list[str], *, block_count: int = 1) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(block_count)
    writer.add_embedding_length(8)
    for name in tensor_names:
        writer.add_tensor(name, np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_blk_names_without_a_number_go_to_shared_metadata(tmp_path):
    src = _write_gguf(
        tmp_path / "odd-names.gguf",
        ["token_embd.weight", "blk.0.attn_norm.weight", "blk.x.weight", "blk..weight"],
    )
    pkg = tmp_path / "pkg"
    m = make_package(src, pkg).manifest
    assert m.layer_count == 1
    with open_gguf(pkg / m.shared.metadata.path) as meta:
        assert {t.name for t in meta} == {"blk.x.weight", "blk..weight"}
    report = validate_package(src, pkg)
    assert report.valid, report.findings


# --- finding 8: one tied-embeddings rule -------------------------------------------------------
def test_no_token_embeddings_is_not_tied(tmp_path):
    src = _write_gguf(tmp_path / "headless.gguf", ["blk.0.attn_norm.weight"])
    m = make_package(src, tmp_path / "pkg").manifest
    assert m.tied_embeddings is False


# --- finding 4: durable writes -----------------------------------------------------------------
def test_durable_write_is_a_valid_package(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    make_package(synth_dir.llama, pkg, projectors=(synth_dir.projector,), durable=True)
    report = validate_package(synth_dir.llama, pkg)
    assert report.valid, report.findings


# --- finding 6: one writer per folder ----------------------------------------------------------
@contextlib.contextmanager
def _another_run_holds(folder: Path) -> Iterator[None]:
    """What a concurrent write-package holds: an exclusive flock on the folder itself."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def test_a_second_write_into_a_busy_folder_is_refused_and_touches_nothing(synth_dir, tmp_path):
    pkg = tmp_path / "pkg"
    before = _previous_package(synth_dir, pkg)
    theirs = pkg / "layers" / f".{Path(layer_path(0)).name}.0123456789ab.partial"
    theirs.write_bytes(b"the other run's half-written fragment")
    with _another_run_holds(pkg):
        with pytest.raises(OutputExists) as exc:
            make_package(synth_dir.llama, pkg, overwrite=True)
        assert exc.value.code == "package_busy" and exc.value.exit_code == 2
        assert theirs.exists()
        _assert_previous_package_intact(synth_dir, pkg, before)
    make_package(synth_dir.llama, pkg, overwrite=True)  # the lock is free again
    assert not theirs.exists()  # a later run clears leftovers of killed runs


def test_cli_busy_folder_exit_code(synth_dir, tmp_path, capsys):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    argv = [
        "write-package",
        str(synth_dir.llama),
        "--out-dir",
        str(pkg),
        "--model-id",
        MODEL_ID,
        "--source-revision",
        "r",
        "--source-file",
        synth_dir.llama.name,
    ]
    with _another_run_holds(pkg):
        assert main(argv) == 2
        assert "package_busy" in capsys.readouterr().err
    assert main(argv) == 0


# --- finding 7: a refused split set closes its shards ------------------------------------------
def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_split_set_repeating_a_tensor_closes_every_shard(tmp_path):
    for no in range(2):
        writer = gguf.GGUFWriter(tmp_path / f"dup-{no + 1:05d}-of-00002.gguf", "llama")
        writer.add_uint16("split.no", no)
        writer.add_uint16("split.count", 2)
        writer.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    before = _open_fds()
    with pytest.raises(ModelError) as exc:
        SourceModelFiles(tmp_path / "dup-00001-of-00002.gguf")
    assert exc.value.code == "duplicate_source_tensor"
    assert _open_fds() == before
