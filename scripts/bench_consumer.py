"""Consumer-side benchmark rows, called by scripts/bench.py.

- cold verification of a full gemma3 stage (both cores) vs serial hashing of the same bytes;
- warm (cached) verification of the unchanged stage;
- fetch of a stage from the local test hub (huggingface_hub over HTTP on 127.0.0.1) vs
  reading the same bytes from disk.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from benchlib import BenchContext, Row, median_time  # type: ignore[import-not-found]

from mesh_node.lab.hub_server import running_hub
from skippy.config import read_environment
from skippy.consume.preflight import load_package
from skippy.consume.resolve import resolve_stage
from skippy.consume.verify import VerifyCache, verify_selection
from skippy.package.ranges import LayerRange
from skippy.package.select import select_stage


def consumer_rows(source: Path, work: Path, runs: int) -> list[Row]:
    pkg_dir = work / "pkg-gemma3"  # written by bench_write_validate
    pkg = load_package(pkg_dir)
    n = pkg.manifest.layer_count
    sel = select_stage(pkg.manifest, LayerRange(0, n, n))
    files = [pkg_dir / r.path for r in sel.all_refs]
    total = sum(f.stat().st_size for f in files)
    cache_dir = work / "verify-cache"

    def serial() -> None:
        for f in files:
            with open(f, "rb") as fh:
                hashlib.file_digest(fh, "sha256")

    def cold() -> None:
        shutil.rmtree(cache_dir, ignore_errors=True)
        verify_selection(
            pkg_dir, sel, manifest_sha256=pkg.manifest_sha256, cache=VerifyCache(cache_dir)
        )

    def warm() -> None:
        verify_selection(
            pkg_dir, sel, manifest_sha256=pkg.manifest_sha256, cache=VerifyCache(cache_dir)
        )

    t_serial = median_time(serial, runs)
    t_cold = median_time(cold, runs)
    cold()
    t_warm = median_time(warm, runs)

    stage_layers = f"0..{n // 3}"
    stage_sel = select_stage(pkg.manifest, LayerRange(0, n // 3, n))
    stage_bytes = sum(r.artifact.artifact_bytes for r in stage_sel.all_refs)

    def read_disk() -> None:
        for r in stage_sel.all_refs:
            with open(pkg_dir / r.path, "rb") as fh:
                while fh.read(1 << 20):
                    pass

    hub_cache = work / "hub-cache"
    with running_hub({"bench/gemma3-layers": pkg_dir}) as hub:
        env = read_environment(
            {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(hub_cache), "HOME": str(work)}
        )

        def fetch() -> None:
            shutil.rmtree(hub_cache, ignore_errors=True)
            resolve_stage("hf://bench/gemma3-layers", env, layers_text=stage_layers)

        t_fetch = median_time(fetch, runs)
    t_disk = median_time(read_disk, runs)
    os.sync()
    return [
        (
            "gemma3",
            "serial sha256 of a full stage (21 files)",
            f"{t_serial:.3f} s",
            f"{total / t_serial / 1e9:.2f} GB/s",
        ),
        (
            "gemma3",
            "cold verification, 2 threads, empty cache",
            f"{t_cold:.3f} s",
            f"ratio {t_cold / t_serial:.2f} (target <= 0.6)",
        ),
        ("gemma3", "warm verification (cache hit)", f"{t_warm * 1000:.1f} ms", "target <= 50 ms"),
        (
            "gemma3",
            f"read stage {stage_layers} from disk",
            f"{t_disk:.3f} s",
            f"{stage_bytes / t_disk / 1e6:.0f} MB/s",
        ),
        (
            "gemma3",
            f"fetch + verify stage {stage_layers} from the local hub",
            f"{t_fetch:.3f} s",
            f"{stage_bytes / t_fetch / 1e6:.0f} MB/s ({t_fetch / t_disk:.1f}x disk read)",
        ),
    ]


def rows(ctx: BenchContext) -> list[Row]:
    return consumer_rows(ctx.gemma, ctx.work, ctx.runs)
