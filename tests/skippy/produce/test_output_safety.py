"""Never lose a user's file.

write-package writes only into an empty folder unless ``--overwrite``; with it, it replaces only
files a package holds (and the old manifest's own), and never a file that is one of its inputs
(the source, a split sibling, a projector; same inode, so hard links and symlinks count).
materialize never creates missing folders. An interrupted write-package removes its partial
files, prints one error line (or one JSON document) and exits 130/143.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pkgtools import edit_manifest, make_package

from skippy.atomic import PARTIAL_SUFFIX
from skippy.cli import main
from skippy.constants import MANIFEST_NAME, README_NAME, layer_path
from skippy.errors import OutputExists
from skippy.produce.validate import validate_package

REPO_ROOT = Path(__file__).resolve().parents[3]
MODEL_ID = "acme/tiny-GGUF:Q8_0"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_argv(source: Path, out: Path, *extra: str) -> list[str]:
    return [
        "write-package",
        str(source),
        "--out-dir",
        str(out),
        "--model-id",
        MODEL_ID,
        "--source-revision",
        "r",
        "--source-file",
        source.name,
        *extra,
    ]


# --- an occupied folder ------------------------------------------------------------------------
def test_a_folder_with_the_users_files_is_refused_without_overwrite(synth_dir, tmp_path, capsys):
    out = tmp_path / "mine"
    (out / "shared").mkdir(parents=True)
    (out / README_NAME).write_text("my own notes")
    (out / "shared" / "embeddings.gguf").write_bytes(b"my own embeddings")
    assert main(_write_argv(synth_dir.llama, out)) == 2
    assert "error [output_exists]" in capsys.readouterr().err
    assert (out / README_NAME).read_text() == "my own notes"
    assert (out / "shared" / "embeddings.gguf").read_bytes() == b"my own embeddings"
    assert sorted(p.name for p in out.rglob("*")) == sorted(
        [README_NAME, "shared", "embeddings.gguf"]
    )


def test_a_hidden_file_alone_makes_a_folder_occupied(synth_dir, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / ".keep").write_text("")
    with pytest.raises(OutputExists) as exc:
        make_package(synth_dir.llama, out)
    assert exc.value.code == "output_exists"


def test_an_empty_folder_and_a_new_one_are_fine(synth_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    make_package(synth_dir.llama, empty)
    make_package(synth_dir.llama, tmp_path / "new" / "pkg")
    assert validate_package(synth_dir.llama, empty).valid


def test_an_out_dir_that_is_a_file_is_refused(synth_dir, tmp_path):
    out = tmp_path / "file"
    out.write_text("not a folder")
    with pytest.raises(OutputExists) as exc:
        make_package(synth_dir.llama, out, overwrite=True)
    assert exc.value.code == "output_exists" and out.read_text() == "not a folder"


def test_overwrite_of_a_foreign_folder_keeps_files_a_package_never_holds(synth_dir, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "layers").mkdir()
    (out / "layers" / "my-lora.gguf").write_bytes(b"keep me too")
    make_package(synth_dir.llama, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "keep me"
    assert (out / "layers" / "my-lora.gguf").read_bytes() == b"keep me too"


# --- inputs are never outputs ------------------------------------------------------------------
def test_a_source_at_a_path_the_package_writes_is_refused(synth_dir, tmp_path):
    out = tmp_path / "c"
    source = out / layer_path(0)
    source.parent.mkdir(parents=True)
    shutil.copyfile(synth_dir.llama, source)
    before = _digest(source)
    with pytest.raises(OutputExists) as exc:
        make_package(source, out, overwrite=True)
    assert exc.value.code == "output_is_input"
    assert _digest(source) == before
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        "layers",
        layer_path(0),
    ]


@pytest.mark.parametrize("kind", ["hardlink", "symlink"])
def test_a_link_to_the_source_at_an_output_path_is_refused(synth_dir, tmp_path, kind):
    source = tmp_path / "model.gguf"
    shutil.copyfile(synth_dir.llama, source)
    out = tmp_path / "pkg"
    (out / "shared").mkdir(parents=True)
    link = out / "shared" / "metadata.gguf"
    if kind == "hardlink":
        os.link(source, link)
    else:
        link.symlink_to(source)
    before = _digest(source)
    with pytest.raises(OutputExists) as exc:
        make_package(source, out, overwrite=True)
    assert exc.value.code == "output_is_input"
    assert _digest(source) == before and link.exists()


def test_a_split_sibling_at_an_output_path_is_refused(synth_dir, tmp_path):
    out = tmp_path / "pkg"
    (out / "layers").mkdir(parents=True)
    second = synth_dir.split[1]
    os.link(second, out / layer_path(1))
    before = _digest(second)
    with pytest.raises(OutputExists) as exc:
        make_package(synth_dir.split[0], out, overwrite=True)
    assert exc.value.code == "output_is_input"
    assert _digest(second) == before


def test_a_projector_input_at_its_own_output_path_is_refused(synth_dir, tmp_path):
    out = tmp_path / "pkg"
    make_package(synth_dir.llama, out, projectors=(synth_dir.projector,))
    inside = out / "projectors" / synth_dir.projector.name
    before = _digest(inside)
    with pytest.raises(OutputExists) as exc:
        make_package(synth_dir.llama, out, projectors=(inside,), overwrite=True)
    assert exc.value.code == "output_is_input"
    assert _digest(inside) == before
    assert (out / MANIFEST_NAME).is_file()  # refused before the old package was touched


def test_stale_removal_never_deletes_an_input(synth_dir, tmp_path):
    out = tmp_path / "pkg"
    make_package(synth_dir.llama, out)
    (out / "projectors").mkdir()
    source = out / "projectors" / "model.gguf"
    shutil.copyfile(synth_dir.llama, source)

    def list_the_source(data: dict) -> None:
        data["projectors"] = [
            {
                "kind": "mmproj",
                "path": "projectors/model.gguf",
                "tensor_count": 1,
                "tensor_bytes": 1,
                "artifact_bytes": source.stat().st_size,
                "sha256": _digest(source),
            }
        ]

    edit_manifest(out, list_the_source)
    result = make_package(source, out, overwrite=True)
    assert source.is_file() and "projectors/model.gguf" not in result.removed_stale


# --- materialize -------------------------------------------------------------------------------
def test_materialize_never_creates_missing_folders(synth_dir, tmp_path, capsys):
    pkg = tmp_path / "pkg"
    make_package(synth_dir.llama, pkg)
    out = tmp_path / "nonexistent" / "dir" / "stage.gguf"
    argv = ["materialize", str(pkg), "--layers", "0..2", "--out", str(out)]
    assert main(argv) == 2
    assert "error [output_parent_missing]" in capsys.readouterr().err
    assert not (tmp_path / "nonexistent").exists()


def test_empty_out_dir_is_a_usage_error(synth_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = _write_argv(synth_dir.llama, Path("x"))
    argv[argv.index("--out-dir") + 1] = ""
    assert main(argv) == 2
    assert "error [usage]" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# --- interrupted -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_source(tmp_path_factory) -> Path:
    """A synthetic model big enough that write-package is still running when we stop it."""
    import synth_gguf

    return synth_gguf.big(tmp_path_factory.mktemp("big") / "big.gguf", 160 * 1024 * 1024)


def _hidden_partials(root: Path) -> list[Path]:
    return [p for p in root.rglob(f".*{PARTIAL_SUFFIX}")] if root.exists() else []


def _interrupt_mid_write(
    source: Path, out: Path, sig: int, *extra: str
) -> subprocess.CompletedProcess[str]:
    """Start write-package, stop it (SIGSTOP) once its folder exists and before its manifest,
    queue ``sig``, let it run. Retries when the run outpaced us (the manifest was already in)."""
    for _ in range(5):
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.Popen(
            [sys.executable, "-m", "skippy.cli", *_write_argv(source, out, *extra)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        while not out.exists() and proc.poll() is None:
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGSTOP)
        if (out / MANIFEST_NAME).exists() or proc.poll() is not None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.communicate()
            continue  # too late: the run finished; try again
        os.kill(proc.pid, sig)
        os.kill(proc.pid, signal.SIGCONT)
        stdout, stderr = proc.communicate(timeout=60)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    pytest.fail("write-package finished before it could be stopped, five times")


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_write_removes_its_files_and_says_so_once(big_source, tmp_path, sig, code):
    out = tmp_path / "pkg"
    done = _interrupt_mid_write(big_source, out, sig)
    assert done.returncode == code, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error [interrupted]: "), done.stderr
    assert "Traceback" not in done.stderr
    assert _hidden_partials(out) == []
    assert not (out / MANIFEST_NAME).exists()
    # The folder was new: it is gone again, so the next run needs no --overwrite.
    assert not out.exists()


def test_an_interrupted_json_write_prints_one_document(big_source, tmp_path):
    out = tmp_path / "pkg"
    done = _interrupt_mid_write(big_source, out, signal.SIGTERM, "--json")
    assert done.returncode == 143
    doc = json.loads(done.stdout)
    assert doc["ok"] is False and doc["error"]["code"] == "interrupted"
    assert done.stderr == ""
    assert _hidden_partials(out) == []


def test_an_interrupted_overwrite_leaves_no_partials_and_no_manifest(big_source, tmp_path):
    out = tmp_path / "pkg"
    make_package(big_source, out)
    done = _interrupt_mid_write_keeping(big_source, out)
    assert done.returncode == 130
    assert _hidden_partials(out) == []
    assert not (out / MANIFEST_NAME).exists()  # withdrawn before the first artifact changed


def _interrupt_mid_write_keeping(source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """Like ``_interrupt_mid_write`` over an existing package: wait for its manifest to be
    withdrawn (the run is past its input checks), then stop and interrupt it."""
    for _ in range(5):
        if not (out / MANIFEST_NAME).exists():
            make_package(source, out, overwrite=True)
        proc = subprocess.Popen(
            [sys.executable, "-m", "skippy.cli", *_write_argv(source, out, "--overwrite")],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        while (out / MANIFEST_NAME).exists() and proc.poll() is None:
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGSTOP)
        if (out / MANIFEST_NAME).exists() or proc.poll() is not None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.communicate()
            continue
        os.kill(proc.pid, signal.SIGINT)
        os.kill(proc.pid, signal.SIGCONT)
        stdout, stderr = proc.communicate(timeout=60)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    pytest.fail("write-package finished before it could be stopped, five times")
