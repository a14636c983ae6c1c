"""materialize: a stage's parts composed into one GGUF (derived cache, spec "Layer Selection")."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
from pkgtools import make_package

from skippy.cli import main
from skippy.constants import KEY_FRAGMENT_ROLE, SPLIT_KEYS
from skippy.consume.materialize import (
    KEY_MATERIALIZED_CACHE_KEY,
    KEY_MATERIALIZED_LAYER_START,
    KEY_MATERIALIZED_LAYER_STOP,
    MATERIALIZED_KEY_PREFIX,
    lock_path_for,
    materialization_key,
    materialize_stage,
)
from skippy.consume.preflight import LoadedPackage, load_package
from skippy.errors import OutputExists, UsageError
from skippy.gguf.reader import open_gguf
from skippy.package.ranges import LayerRange
from skippy.package.select import StageSelection, select_stage


def stage(p: LoadedPackage, start: int, stop: int) -> StageSelection:
    return select_stage(p.manifest, LayerRange(start, stop, p.manifest.layer_count))


def tensors_of(path: Path) -> dict[str, tuple[tuple[int, ...], int, bytes]]:
    """name -> (shape, ggml type, payload bytes), read with our bounded reader."""
    with open_gguf(path) as g:
        return {t.name: (t.shape, t.ggml_type, g.read_range(t.data_start, t.nbytes)) for t in g}


def reader_view(path: Path) -> tuple[dict[str, object], dict[str, tuple]]:
    """KV values and tensors as gguf-py's reference reader sees them."""
    r = gguf.GGUFReader(path)
    kv = {name: f.contents() for name, f in r.fields.items() if not name.startswith("GGUF.")}
    tensors = {
        t.name: (tuple(int(d) for d in t.shape), int(t.tensor_type), np.asarray(t.data).tobytes())
        for t in r.tensors
    }
    return kv, tensors


@pytest.fixture(params=["llama", "gemma"])
def source_and_pkg(request, synth_dir, tmp_path: Path) -> tuple[Path, LoadedPackage]:
    source = getattr(synth_dir, request.param)
    make_package(source, tmp_path / "pkg", projectors=(synth_dir.projector,))
    return source, load_package(tmp_path / "pkg")


def test_full_range_is_tensor_identical_to_the_source(source_and_pkg, tmp_path: Path) -> None:
    source, p = source_and_pkg
    out = tmp_path / "cache" / "full.gguf"
    out.parent.mkdir(exist_ok=True)
    result = materialize_stage(
        p.root, stage(p, 0, p.manifest.layer_count), out, manifest_sha256=p.manifest_sha256
    )
    assert result.built and out.is_file()
    assert tensors_of(out) == tensors_of(source)  # names, types, shapes, bytes
    assert result.tensor_count == len(tensors_of(source))

    # gguf-py's reference reader loads it and sees the source's KV and tensors.
    src_kv, src_tensors = reader_view(source)
    out_kv, out_tensors = reader_view(out)
    assert out_tensors == src_tensors
    ours = {k for k in out_kv if k.startswith(MATERIALIZED_KEY_PREFIX)}
    assert {k: v for k, v in out_kv.items() if k not in ours} == src_kv
    assert out_kv[KEY_MATERIALIZED_CACHE_KEY] == result.cache_key
    assert not SPLIT_KEYS & out_kv.keys()
    assert KEY_FRAGMENT_ROLE not in out_kv
    with open_gguf(source) as s, open_gguf(out) as o:
        assert o.alignment == s.alignment


def test_partial_range_holds_only_its_parts(source_and_pkg, tmp_path: Path) -> None:
    _, p = source_and_pkg
    sel = stage(p, 1, 3)
    out = tmp_path / "cache" / "mid.gguf"
    out.parent.mkdir(exist_ok=True)
    materialize_stage(p.root, sel, out, manifest_sha256=p.manifest_sha256)
    got = tensors_of(out)
    want = {}
    for ref in sel.parts:
        want.update(tensors_of(p.root / ref.path))
    assert got == want
    assert {n.split(".")[1] for n in got if n.startswith("blk.")} == {"1", "2"}
    assert not any(n.startswith(("token_embd.", "output")) for n in got)
    with open_gguf(out) as g:
        assert (g.get(KEY_MATERIALIZED_LAYER_START), g.get(KEY_MATERIALIZED_LAYER_STOP)) == (1, 3)


def test_projectors_are_never_merged(synth_dir, tmp_path: Path) -> None:
    make_package(synth_dir.llama, tmp_path / "pkg", projectors=(synth_dir.projector,))
    p = load_package(tmp_path / "pkg")
    sel = stage(p, 0, 2)
    assert sel.projector is not None
    out = tmp_path / "s0.gguf"
    materialize_stage(p.root, sel, out, manifest_sha256=p.manifest_sha256)
    assert not set(tensors_of(out)) & set(tensors_of(synth_dir.projector))


@pytest.fixture
def pkg(synth_dir, tmp_path: Path) -> LoadedPackage:
    make_package(synth_dir.llama, tmp_path / "pkg")
    return load_package(tmp_path / "pkg")


def test_same_key_is_kept_other_key_is_rebuilt(pkg: LoadedPackage, tmp_path: Path) -> None:
    out = tmp_path / "cache" / "stage.gguf"
    out.parent.mkdir(exist_ok=True)
    first = materialize_stage(pkg.root, stage(pkg, 0, 2), out, manifest_sha256=pkg.manifest_sha256)
    st = out.stat()
    again = materialize_stage(pkg.root, stage(pkg, 0, 2), out, manifest_sha256=pkg.manifest_sha256)
    assert (again.built, again.cache_key) == (False, first.cache_key)
    assert (out.stat().st_ino, out.stat().st_mtime_ns) == (st.st_ino, st.st_mtime_ns)

    other = materialize_stage(pkg.root, stage(pkg, 0, 3), out, manifest_sha256=pkg.manifest_sha256)
    assert other.built and other.cache_key != first.cache_key
    with open_gguf(out) as g:
        assert g.get(KEY_MATERIALIZED_CACHE_KEY) == other.cache_key
    assert lock_path_for(out).exists()
    leftovers = [f.name for f in out.parent.iterdir() if f.name.endswith(".partial")]
    assert leftovers == []


def test_cache_key_is_deterministic_and_covers_identity(pkg: LoadedPackage) -> None:
    sha = pkg.manifest_sha256
    key = materialization_key(sha, stage(pkg, 0, 2))
    assert key == materialization_key(sha, stage(pkg, 0, 2))
    assert key != materialization_key("0" * 64, stage(pkg, 0, 2))
    assert key != materialization_key(sha, stage(pkg, 0, 3))
    assert key != materialization_key(sha, stage(pkg, 1, 2))


def test_concurrent_callers_build_once(pkg: LoadedPackage, tmp_path: Path) -> None:
    out = tmp_path / "cache" / "stage.gguf"
    out.parent.mkdir()
    results = []

    def run() -> None:
        sel = stage(pkg, 0, pkg.manifest.layer_count)
        results.append(materialize_stage(pkg.root, sel, out, manifest_sha256=pkg.manifest_sha256))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    assert sum(r.built for r in results) == 1
    assert len({r.cache_key for r in results}) == 1


def test_refuses_output_inside_the_package(pkg: LoadedPackage, tmp_path: Path) -> None:
    sel = stage(pkg, 0, 2)
    link = tmp_path / "sneaky"
    link.symlink_to(pkg.root / "layers")
    for out in (pkg.root / "stage.gguf", pkg.root / "shared" / "x.gguf", link / "x.gguf"):
        with pytest.raises(UsageError) as exc_info:
            materialize_stage(pkg.root, sel, out, manifest_sha256=pkg.manifest_sha256)
        assert exc_info.value.code == "materialize_inside_package"
        assert not out.exists()


def test_refuses_to_replace_a_file_it_did_not_make(
    pkg: LoadedPackage, synth_dir, tmp_path: Path
) -> None:
    precious = tmp_path / "model.gguf"
    precious.write_bytes(synth_dir.llama.read_bytes())
    with pytest.raises(OutputExists):
        materialize_stage(pkg.root, stage(pkg, 0, 2), precious, manifest_sha256="a" * 64)
    assert precious.read_bytes() == synth_dir.llama.read_bytes()


def test_a_damaged_materialization_is_rebuilt_not_kept(pkg: LoadedPackage, tmp_path: Path) -> None:
    """The cache key in the header proves nothing about the bytes: a corrupted output with
    the right key must be rebuilt, and so must one without our build record."""
    out = tmp_path / "cache" / "s.gguf"
    out.parent.mkdir(exist_ok=True)
    sel = stage(pkg, 0, 4)
    first = materialize_stage(pkg.root, sel, out, manifest_sha256=pkg.manifest_sha256)
    data = bytearray(out.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor; header (and its cache key) untouched
    out.write_bytes(bytes(data))
    again = materialize_stage(pkg.root, sel, out, manifest_sha256=pkg.manifest_sha256)
    assert again.built is True
    assert hashlib.sha256(out.read_bytes()).hexdigest() == first.sha256
    kept = materialize_stage(pkg.root, sel, out, manifest_sha256=pkg.manifest_sha256)
    assert kept.built is False
    (out.parent / f".{out.name}.skippy.json").unlink()
    assert materialize_stage(pkg.root, sel, out, manifest_sha256=pkg.manifest_sha256).built


@pytest.fixture
def cli():
    return main


def test_cli_materialize(cli, pkg: LoadedPackage, tmp_path: Path, capsys) -> None:
    out = tmp_path / "cache" / "s.gguf"
    out.parent.mkdir(exist_ok=True)
    argv = ["materialize", str(pkg.root), "--layers", "2..4", "--out", str(out), "--json"]
    assert cli(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["built"] is True and data["out"] == str(out)
    assert [p["path"] for p in data["stage"]["parts"]][-1] == "shared/output.gguf"
    assert cli(argv) == 0
    assert json.loads(capsys.readouterr().out)["built"] is False
    inside = ["materialize", str(pkg.root), "--layers", "0..1", "--out", str(pkg.root / "x.gguf")]
    assert cli(inside) == 2
    assert "materialize_inside_package" in capsys.readouterr().err


@pytest.fixture(scope="module")
def gemma_pkg(gemma_package: Path) -> LoadedPackage:
    return load_package(gemma_package)  # tests/conftest.py: written once per session


@pytest.mark.slow
def test_gemma_full_range_is_tensor_identical(gemma_gguf, gemma_pkg, tmp_path: Path) -> None:
    out = tmp_path / "gemma-full.gguf"
    materialize_stage(
        gemma_pkg.root, stage(gemma_pkg, 0, 18), out, manifest_sha256=gemma_pkg.manifest_sha256
    )
    with open_gguf(gemma_gguf) as src, open_gguf(out) as got:
        assert len(got.tensors) == len(src.tensors)
        for t in src.tensors:
            u = got.tensor(t.name)
            assert (u.shape, u.ggml_type, u.nbytes) == (t.shape, t.ggml_type, t.nbytes)
            assert got.read_range(u.data_start, u.nbytes) == src.read_range(t.data_start, t.nbytes)
        for key in src.fields:
            assert got.raw_field(key) == src.raw_field(key)


@pytest.mark.slow
@pytest.mark.llama
def test_llama_cpp_runs_the_gemma_materialization(gemma_pkg, tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    out = tmp_path / "gemma-full.gguf"
    materialize_stage(
        gemma_pkg.root, stage(gemma_pkg, 0, 18), out, manifest_sha256=gemma_pkg.manifest_sha256
    )
    model = llama_cpp.Llama(str(out), n_ctx=128, n_threads=2, verbose=False)
    prompt = "The capital of France is"
    assert model.tokenize(prompt.encode(), add_bos=True) == [2, 818, 5279, 529, 7001, 563]
    text = model.create_completion(prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
    assert text.startswith(" the capital of the country of France")  # golden: runtime-facts.md
