"""Benchmarks for the performance targets of issues #2 and #3 (run through scripts/bench).

Every figure is a ratio measured side by side in one run (these machines are noisy), the
median of N runs on a warm page cache. Peak RSS is measured in a child process. Tests never
time anything; this script is where speed is measured. ``--record`` appends the table to
docs/performance.md with the machine and the date.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from skippy.produce.validate import validate_package  # noqa: E402
from skippy.produce.write_package import WriteOptions, local_provenance, write_package  # noqa: E402

Row = tuple[str, str, str, str]


def times_of(
    fn: Callable[[], object], runs: int, setup: Callable[[], object] | None = None
) -> list[float]:
    times = []
    for _ in range(runs):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def median_time(
    fn: Callable[[], object], runs: int, setup: Callable[[], object] | None = None
) -> float:
    return statistics.median(times_of(fn, runs, setup))


def hash_file(path: Path) -> None:
    with open(path, "rb") as f:
        hashlib.file_digest(f, "sha256")


def _prov(source: Path) -> object:
    return local_provenance(
        model_id="bench/model-GGUF:Q",
        source_repo=None,
        source_revision="r",
        source_file=source.name,
    )


def child_peak_rss_mib(argv: list[str]) -> float:
    """Run a CLI command in a child and return its peak RSS (ru_maxrss of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{argv} failed: {proc.stderr}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(after, before) / 1024


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


def bench_extra(source: Path, work: Path, runs: int) -> list[Row]:
    """Consumer-side figures (issue #3) when those modules are present."""
    try:
        from bench_consumer import consumer_rows  # type: ignore[import-not-found]
    except ImportError:
        return []
    rows: list[Row] = consumer_rows(source, work, runs)
    return rows


def render(rows: list[Row]) -> str:
    lines = ["| model | measurement | value | ratio / note |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, Python {platform.python_version()}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gemma", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--big-bytes", type=int, default=2 * 1024**3)
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--record", action="store_true", help="append to docs/performance.md")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    rows += bench_write_validate("gemma3", args.gemma, args.work, args.runs)
    print(render(rows), flush=True)
    if not args.skip_big:
        import synth_gguf

        big = args.work / "big.gguf"
        if not big.exists() or abs(big.stat().st_size - args.big_bytes) > args.big_bytes // 10:
            synth_gguf.big(big, args.big_bytes)
        rows += bench_write_validate(
            f"synthetic {big.stat().st_size / 2**30:.1f} GiB", big, args.work, args.runs
        )
    rows += bench_inspect(args.gemma, args.runs)
    rows += bench_extra(args.gemma, args.work, args.runs)
    table = render(rows)
    header = (
        f"### {datetime.date.today().isoformat()} — {machine()}\n\n"
        f"Median of {args.runs} runs, warm page cache.\n"
    )
    print("\n" + header + "\n" + table)
    if args.record:
        doc = ROOT / "docs" / "performance.md"
        with open(doc, "a") as f:
            f.write("\n" + header + "\n" + table + "\n")
        print(f"\nrecorded in {doc}")
    print(json.dumps({"rows": rows}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
