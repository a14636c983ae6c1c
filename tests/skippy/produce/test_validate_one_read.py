"""validate-package reads each byte once: the source pass and the package
pass meet at every tensor chunk (``skippy.produce.byte_compare``). These tests check the
pairing itself: differences are found in any chunk, with any memory budget, serial or on two
cores, and a source that fails stops the other pass instead of hanging it."""

from __future__ import annotations

from pathlib import Path

import pytest
import synth_gguf
from pkgtools import make_package

from skippy.errors import GGUFFormatError
from skippy.gguf.reader import open_gguf
from skippy.hashing import CHUNK_BYTES
from skippy.produce.validate import validate_package


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, Path]:
    """A model whose token embeddings span three 4 MiB chunks, and its package."""
    root = tmp_path_factory.mktemp("wide")
    source = synth_gguf.llama_like(root / "wide.gguf", width=256, vocab=40_000)
    pkg = root / "pkg"
    make_package(source, pkg)
    return source, pkg


def _flip_in_tensor(path: Path, name: str, offset: int) -> None:
    with open_gguf(path) as g:
        t = next(t for t in g.tensors if t.name == name)
        assert t.nbytes > offset
        at = t.data_start + offset
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_the_embeddings_really_span_several_chunks(wide):
    source, _ = wide
    with open_gguf(source) as g:
        embd = next(t for t in g.tensors if t.name == "token_embd.weight")
    assert embd.nbytes > 2 * CHUNK_BYTES


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("budget", [0, CHUNK_BYTES, 64 * CHUNK_BYTES])
def test_a_fresh_package_is_valid_whatever_the_budget(wide, workers, budget):
    source, pkg = wide
    report = validate_package(source, pkg, workers=workers, park_budget_bytes=budget)
    assert report.valid, report.findings


@pytest.mark.parametrize("workers", [1, 2])
def test_with_room_to_park_nothing_is_read_twice(wide, workers):
    """The default budget holds every chunk of this model parked at once (tiny tensors count
    at their size), so however far one pass runs ahead, here fully with one worker, nothing
    is read twice (with each norm costing 1 MiB it overflowed, a load-dependent re-read)."""
    source, pkg = wide
    report = validate_package(source, pkg, workers=workers)
    assert report.valid and report.bytes_reread == 0


def test_without_room_the_source_bytes_are_read_again(wide):
    source, pkg = wide
    report = validate_package(source, pkg, workers=1, park_budget_bytes=0)
    with open_gguf(source) as g:
        tensor_bytes = sum(t.nbytes for t in g.tensors)
    assert report.valid and report.bytes_reread == tensor_bytes


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("budget", [0, 64 * CHUNK_BYTES])
@pytest.mark.parametrize("offset", [0, CHUNK_BYTES + 7, -1], ids=["first", "second", "last"])
def test_a_flipped_byte_is_found_in_any_chunk(wide, tmp_path, workers, budget, offset):
    import shutil

    source, pkg = wide
    copy = tmp_path / "pkg"
    shutil.copytree(pkg, copy)
    embeddings = copy / "shared" / "embeddings.gguf"
    with open_gguf(embeddings) as g:
        nbytes = next(t for t in g.tensors if t.name == "token_embd.weight").nbytes
    _flip_in_tensor(embeddings, "token_embd.weight", offset % nbytes)
    report = validate_package(source, copy, workers=workers, park_budget_bytes=budget)
    differ = [f for f in report.findings if f.code == "tensor_bytes_differ"]
    assert [f.path for f in differ] == ["shared/embeddings.gguf"]
    assert "token_embd.weight" in differ[0].message


def test_a_source_that_fails_to_parse_stops_both_passes(wide, tmp_path):
    _, pkg = wide
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(GGUFFormatError):
        validate_package(bad, pkg)
