"""SHA-256 verification of selected artifacts and its cache (spec "Consumer Validation")."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from pkgtools import make_package

from skippy.consume.preflight import LoadedPackage, load_package
from skippy.consume.verify import (
    VerifyCache,
    check_refs,
    verify_selection,
)
from skippy.errors import ArtifactMissing, IntegrityError, UnsafePath
from skippy.package.ranges import LayerRange
from skippy.package.select import StageSelection, select_stage


@pytest.fixture
def pkg(synth_dir, tmp_path: Path) -> LoadedPackage:
    make_package(synth_dir.llama, tmp_path / "pkg", projectors=(synth_dir.projector,))
    return load_package(tmp_path / "pkg")


def full(p: LoadedPackage) -> StageSelection:
    m = p.manifest
    return select_stage(m, LayerRange(0, m.layer_count, m.layer_count))


def verify(p: LoadedPackage, cache: VerifyCache | None, sel: StageSelection | None = None):
    return verify_selection(p.root, sel or full(p), manifest_sha256=p.manifest_sha256, cache=cache)


def flip_byte_keep_mtime(path: Path, offset: int = -1) -> None:
    """Corrupt one byte in place, keeping size and mtime (only ctime can tell)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_second_verification_is_served_from_the_cache(pkg: LoadedPackage, tmp_path: Path) -> None:
    cache = VerifyCache(tmp_path / "vcache")
    sel = full(pkg)
    n = len(sel.all_refs)
    assert sel.projector is not None  # the full stage owns the input: it gets the mmproj

    first = verify(pkg, cache)
    assert (first.hashed, first.cached) == (n, 0)
    assert first.bytes_hashed == sel.total_bytes
    assert {a.path for a in first.artifacts} == {r.path for r in sel.all_refs}

    second = verify(pkg, cache)
    assert (second.hashed, second.cached, second.bytes_hashed) == (0, n, 0)

    # Without a cache everything is hashed every time.
    assert verify(pkg, None).hashed == n


def test_cache_records_store_no_local_path(pkg: LoadedPackage, tmp_path: Path) -> None:
    cache = VerifyCache(tmp_path / "vcache")
    verify(pkg, cache)
    records = list(cache.root.iterdir())
    assert len(records) == len(full(pkg).all_refs)
    for rec in records:
        text = rec.read_text()
        assert str(pkg.root) not in text
        assert str(tmp_path) not in text
        assert "layers/" not in text  # not even manifest-relative paths
        assert rec.name.removesuffix(".json") in text  # named by its hashed key


def test_changed_file_misses_the_cache_even_with_restored_mtime(
    pkg: LoadedPackage, tmp_path: Path
) -> None:
    cache = VerifyCache(tmp_path / "vcache")
    verify(pkg, cache)
    layer = pkg.manifest.layer(1)
    flip_byte_keep_mtime(pkg.root / layer.path)
    with pytest.raises(IntegrityError) as exc_info:
        verify(pkg, cache)
    err = exc_info.value
    assert err.code == "artifact_sha256_mismatch"
    assert err.path == layer.path
    assert err.expected == layer.sha256
    assert err.actual != layer.sha256 and len(err.actual) == 64
    assert layer.path in err.message and layer.sha256 in err.message


def test_touched_or_replaced_file_is_hashed_again(pkg: LoadedPackage, tmp_path: Path) -> None:
    cache = VerifyCache(tmp_path / "vcache")
    verify(pkg, cache)
    touched = pkg.root / pkg.manifest.layer(0).path
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    replaced = pkg.root / pkg.manifest.layer(2).path  # same bytes, new inode
    shutil.copyfile(replaced, replaced.with_suffix(".tmp"))
    os.replace(replaced.with_suffix(".tmp"), replaced)

    report = verify(pkg, cache)
    statuses = {a.path: a.status for a in report.artifacts}
    assert statuses.pop(pkg.manifest.layer(0).path) == "hashed"
    assert statuses.pop(pkg.manifest.layer(2).path) == "hashed"
    assert set(statuses.values()) == {"cached"}


def test_mismatch_writes_no_record_for_that_file_only(pkg: LoadedPackage, tmp_path: Path) -> None:
    cache = VerifyCache(tmp_path / "vcache")
    bad = pkg.manifest.shared.metadata.path
    flip_byte_keep_mtime(pkg.root / bad, offset=100)
    for _ in range(2):  # the second attempt must hash again, not trust a record
        with pytest.raises(IntegrityError, match=r"metadata\.gguf"):
            verify(pkg, cache)
    refs = full(pkg).all_refs
    report = check_refs(pkg.root, refs, manifest_sha256=pkg.manifest_sha256, cache=cache)
    statuses = {a.path: a.status for a in report.artifacts}
    assert statuses.pop(bad) == "mismatch"
    assert set(statuses.values()) == {"cached"}  # the good files kept their records


def test_record_is_tied_to_the_manifest_digest(pkg: LoadedPackage, tmp_path: Path) -> None:
    cache = VerifyCache(tmp_path / "vcache")
    verify(pkg, cache)
    other = verify_selection(pkg.root, full(pkg), manifest_sha256="0" * 64, cache=cache)
    assert other.cached == 0


def test_forged_record_with_another_digest_is_a_miss(pkg: LoadedPackage, tmp_path: Path) -> None:
    cache = VerifyCache(tmp_path / "vcache")
    verify(pkg, cache)
    for rec in cache.root.iterdir():
        rec.write_text(rec.read_text().replace('"sha256": "', '"sha256": "0'))
    assert verify(pkg, cache).cached == 0


def test_only_the_selected_artifacts_are_verified(pkg: LoadedPackage, tmp_path: Path) -> None:
    m = pkg.manifest
    flip_byte_keep_mtime(pkg.root / m.layer(0).path)  # not part of the middle stage
    middle = select_stage(m, LayerRange(1, 3, m.layer_count))
    report = verify(pkg, VerifyCache(tmp_path / "vcache"), middle)
    assert sorted(a.path for a in report.artifacts) == sorted(r.path for r in middle.all_refs)
    assert m.layer(0).path not in {a.path for a in report.artifacts}


def test_size_mismatch_missing_and_escaping_files(pkg: LoadedPackage, tmp_path: Path) -> None:
    m = pkg.manifest
    with (pkg.root / m.layer(0).path).open("ab") as f:
        f.write(b"\0")
    with pytest.raises(IntegrityError) as exc_info:
        verify(pkg, None)
    assert exc_info.value.code == "artifact_size_mismatch"

    (pkg.root / m.layer(0).path).unlink()
    with pytest.raises(ArtifactMissing) as missing:
        verify(pkg, None)
    assert missing.value.code == "missing_artifact"

    outside = tmp_path / "outside.gguf"
    outside.write_bytes(b"x" * m.layer(0).artifact_bytes)
    (pkg.root / m.layer(0).path).symlink_to(outside)
    with pytest.raises(UnsafePath):
        verify(pkg, None)


def test_containment_root_for_hub_style_symlinks(pkg: LoadedPackage, tmp_path: Path) -> None:
    """A hub snapshot is a tree of symlinks into the repo's blobs/ (runtime-facts.md): the package
    root alone would call every file an escape; the repo cache folder contains them."""
    repo = tmp_path / "models--ns--name"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    for ref in full(pkg).all_refs:
        blob = blobs / ref.artifact.sha256
        shutil.copyfile(pkg.root / ref.path, blob)
        link = snap / ref.path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    with pytest.raises(UnsafePath):
        verify_selection(snap, full(pkg), manifest_sha256=pkg.manifest_sha256, cache=None)
    report = verify_selection(
        snap,
        full(pkg),
        manifest_sha256=pkg.manifest_sha256,
        cache=VerifyCache(tmp_path / "vcache"),
        containment_root=repo,
    )
    assert report.ok and report.hashed == len(full(pkg).all_refs)


@pytest.mark.slow
def test_gemma_full_stage_cold_then_warm(gemma_package: Path, tmp_path: Path) -> None:
    p = load_package(gemma_package)
    cache = VerifyCache(tmp_path / "vcache")
    sel = full(p)
    cold = verify(p, cache)
    assert cold.hashed == len(sel.parts) == p.manifest.layer_count + 3
    assert cold.bytes_hashed == sel.total_bytes
    warm = verify(p, cache)
    assert (warm.hashed, warm.cached, warm.bytes_hashed) == (0, len(sel.parts), 0)
