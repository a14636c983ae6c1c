"""Package-tool rows (issues #2, #11, #14): write-package and validate-package on gemma3-270m
and a synthetic ~2 GiB model, inspect vs gguf.GGUFReader."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import (  # type: ignore[import-not-found]
    BenchContext,
    Row,
    child_peak_rss_mib,
    hash_file,
    median_time,
    times_of,
)

from skippy.produce.validate import validate_package
from skippy.produce.write_package import WriteOptions, local_provenance, write_package


def _prov(source: Path) -> object:
    return local_provenance(
        model_id="bench/model-GGUF:Q",
        source_repo=None,
        source_revision="r",
        source_file=source.name,
    )


def bench_write_validate(label: str, source: Path, work: Path, runs: int) -> list[Row]:
    pkg = work / f"pkg-{label}"
    opts = WriteOptions(out_dir=pkg, provenance=_prov(source), overwrite=True)  # type: ignore[arg-type]

    def clean() -> None:
        shutil.rmtree(pkg, ignore_errors=True)
        os.sync()

    hash_file(source)  # warm the page cache
    t_hash = median_time(lambda: hash_file(source), runs)
    # Fresh page-cache writes of GiBs sometimes meet the kernel's dirty-page writeback: runs
    # are then bimodal, so the fastest run is shown beside the median.
    write_times = times_of(lambda: write_package(source, opts), runs, setup=clean)
    t_write, t_write_min = statistics.median(write_times), min(write_times)
    package_files = [p for p in pkg.rglob("*.gguf")]

    def serial_hash() -> None:
        hash_file(source)
        for p in package_files:
            hash_file(p)

    t_serial = median_time(serial_hash, runs)
    t_validate = median_time(lambda: validate_package(source, pkg), runs)
    report = validate_package(source, pkg)
    if not report.valid:
        raise SystemExit(f"validate-package failed on {label}: {report.findings}")
    size = source.stat().st_size
    rss_pkg = work / f"pkg-{label}-rss"
    shutil.rmtree(rss_pkg, ignore_errors=True)
    rss = child_peak_rss_mib(
        [
            sys.executable,
            "-m",
            "skippy.cli",
            "write-package",
            str(source),
            "--out-dir",
            str(rss_pkg),
            "--model-id",
            "bench/m:Q",
            "--source-revision",
            "r",
            "--source-file",
            source.name,
            "--json",
        ]
    )
    shutil.rmtree(rss_pkg, ignore_errors=True)
    return [
        (
            label,
            "source sha256 (hashlib.file_digest)",
            f"{t_hash:.3f} s",
            f"{size / t_hash / 1e9:.2f} GB/s",
        ),
        (
            label,
            "write-package (median; fastest run)",
            f"{t_write:.3f} s; {t_write_min:.3f} s",
            f"ratio {t_write / t_hash:.2f}; {t_write_min / t_hash:.2f} (target <= 1.0)",
        ),
        (label, "write-package peak RSS", f"{rss:.0f} MiB", "target <= 200 MiB"),
        (label, "serial sha256 of source + package", f"{t_serial:.3f} s", ""),
        (
            label,
            "validate-package",
            f"{t_validate:.3f} s",
            f"ratio {t_validate / t_serial:.2f} (target <= 0.7)",
        ),
    ]


def bench_inspect(source: Path, runs: int) -> list[Row]:
    argv = [sys.executable, "-m", "skippy.cli", "inspect", str(source), "--json"]
    t_cli = median_time(lambda: subprocess.run(argv, capture_output=True, check=True), runs)
    from skippy.produce.inspect import inspect_gguf

    t_lib = median_time(lambda: inspect_gguf(source), runs)
    t0 = time.perf_counter()
    import gguf

    gguf.GGUFReader(source)
    t_ref = time.perf_counter() - t0  # one run: it takes 10+ s
    return [
        ("gemma3", "gguf.GGUFReader open (import included, 1 run)", f"{t_ref:.2f} s", ""),
        ("gemma3", "inspect, in process", f"{t_lib * 1000:.0f} ms", f"{t_ref / t_lib:.0f}x faster"),
        (
            "gemma3",
            "inspect CLI incl. interpreter start",
            f"{t_cli:.3f} s",
            f"{t_ref / t_cli:.0f}x faster (target >= 50x, <= 0.25 s)",
        ),
    ]


def rows(ctx: BenchContext) -> list[Row]:
    out = bench_write_validate("gemma3", ctx.gemma, ctx.work, ctx.runs)
    if not ctx.skip_big:
        import synth_gguf

        big = ctx.work / "big.gguf"
        if not big.exists() or abs(big.stat().st_size - ctx.big_bytes) > ctx.big_bytes // 10:
            synth_gguf.big(big, ctx.big_bytes)
        out += bench_write_validate(
            f"synthetic {big.stat().st_size / 2**30:.1f} GiB", big, ctx.work, ctx.runs
        )
    return out + bench_inspect(ctx.gemma, ctx.runs)
