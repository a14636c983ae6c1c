"""Package-tool rows: write-package and validate-package on gemma3-270m
and a synthetic ~2 GiB model, where write-package's time goes, command start-up, inspect vs
gguf.GGUFReader, and what a progress bar costs."""

from __future__ import annotations

import io
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
    spread,
    times_of,
)

from skippy import progress
from skippy.produce.validate import validate_package
from skippy.produce.write_package import (
    Provenance,
    WriteOptions,
    WriteResult,
    local_provenance,
    write_package,
)

CLI = [sys.executable, "-m", "skippy.cli"]


def _prov(source: Path) -> Provenance:
    return local_provenance(
        model_id="bench/model-GGUF:Q",
        source_repo=None,
        source_revision="r",
        source_file=source.name,
    )


def _write_argv(source: Path, out: Path) -> list[str]:
    return [
        *CLI,
        "write-package",
        str(source),
        "--out-dir",
        str(out),
        "--model-id",
        "bench/m-GGUF:Q",
        "--source-revision",
        "r",
        "--source-file",
        source.name,
        "--json",
    ]


def _median_phase(results: list[WriteResult], name: str) -> float:
    return statistics.median(r.phases.get(name, 0.0) for r in results)


def bench_write_validate(label: str, source: Path, work: Path, runs: int) -> list[Row]:
    pkg = work / f"pkg-{label}"
    opts = WriteOptions(out_dir=pkg, provenance=_prov(source), overwrite=True)

    def clean() -> None:
        shutil.rmtree(pkg, ignore_errors=True)
        os.sync()  # no earlier run's dirty pages are written back during this one

    hash_file(source)  # warm the page cache
    hash_times = times_of(lambda: hash_file(source), runs)
    t_hash = statistics.median(hash_times)
    results: list[WriteResult] = []
    write_times = times_of(lambda: results.append(write_package(source, opts)), runs, clean)
    t_write = statistics.median(write_times)
    cli_pkg = work / f"pkg-{label}-cli"
    cli_times = times_of(
        lambda: subprocess.run(_write_argv(source, cli_pkg), capture_output=True, check=True),
        runs,
        lambda: (shutil.rmtree(cli_pkg, ignore_errors=True), os.sync()),
    )
    package_files = list(pkg.rglob("*.gguf"))

    def serial_hash() -> None:
        hash_file(source)
        for p in package_files:
            hash_file(p)

    serial_times = times_of(serial_hash, runs)
    t_serial = statistics.median(serial_times)
    validate_times = times_of(lambda: validate_package(source, pkg), runs)
    report = validate_package(source, pkg)
    if not report.valid:
        raise SystemExit(f"validate-package failed on {label}: {report.findings}")
    shutil.rmtree(cli_pkg, ignore_errors=True)
    rss_write = child_peak_rss_mib(_write_argv(source, cli_pkg))
    rss_validate = child_peak_rss_mib([*CLI, "validate-package", str(source), str(pkg), "--json"])
    shutil.rmtree(cli_pkg, ignore_errors=True)
    size = source.stat().st_size
    ms = 1000.0
    plan, hashed = _median_phase(results, "plan"), _median_phase(results, "source_hash")
    fragments, finish = _median_phase(results, "fragments"), _median_phase(results, "finish")
    last = "fragments" if fragments > hashed else "source hash"
    return [
        (
            label,
            "source sha256 (hashlib.file_digest)",
            f"{spread(hash_times)} s",
            f"{size / t_hash / 1e9:.2f} GB/s",
        ),
        (
            label,
            "write-package, in process",
            f"{spread(write_times)} s",
            f"ratio {spread([t / t_hash for t in write_times], fmt='{:.2f}')} (target <= 1.3)",
        ),
        (
            label,
            "write-package phases (median, ms since start)",
            f"plan {plan * ms:.0f}; source hashed {hashed * ms:.0f}; "
            f"fragments {fragments * ms:.0f}; manifest {finish * ms:.0f}",
            # the gap between the source digest and the last fragment; both workers take
            # fragments until then, so it is not idle time
            f"start delay {plan * ms:.0f} ms; {last} end "
            f"{abs(fragments - hashed) * ms:.0f} ms after the other phase",
        ),
        (
            label,
            "write-package CLI (start-up + imports + run)",
            f"{spread(cli_times)} s",
            f"start-up and imports ~{(statistics.median(cli_times) - t_write) * ms:.0f} ms",
        ),
        (label, "write-package peak RSS", f"{rss_write:.0f} MiB", "target <= 200 MiB"),
        (label, "serial sha256 of source + package", f"{spread(serial_times)} s", ""),
        (
            label,
            "validate-package (each byte read once)",
            f"{spread(validate_times)} s",
            f"ratio {spread([t / t_serial for t in validate_times], fmt='{:.2f}')} "
            f"(target <= 0.6); {report.bytes_reread} B re-read",
        ),
        (label, "validate-package peak RSS", f"{rss_validate:.0f} MiB", "target <= 200 MiB"),
    ]


class _FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def bench_progress(source: Path, work: Path, runs: int) -> list[Row]:
    """What a bar costs: validate-package of gemma3 with bars drawn (into a fake terminal)
    against without, interleaved."""
    pkg = work / "pkg-gemma3"
    off: list[float] = []
    on: list[float] = []
    for _ in range(runs):
        progress.configure(enabled=False)
        off += times_of(lambda: validate_package(source, pkg), 1)
        progress.configure(enabled=True, stream=_FakeTerminal())
        on += times_of(lambda: validate_package(source, pkg), 1)
    progress.configure(enabled=False)
    ratio = statistics.median(on) / statistics.median(off)
    return [
        (
            "gemma3",
            "validate-package with tqdm bars / without",
            f"{spread(on)} s / {spread(off)} s",
            f"ratio {ratio:.2f} (a bar must not slow the work)",
        )
    ]


def bench_startup(source: Path, pkg: Path, runs: int) -> list[Row]:
    """Command start-up, each beside bare ``python -c pass``."""

    def cli(*argv: str) -> list[float]:
        return times_of(lambda: subprocess.run([*CLI, *argv], capture_output=True), runs)

    bare = times_of(lambda: subprocess.run([sys.executable, "-c", "pass"]), runs)
    t_bare = statistics.median(bare)
    helps, version = cli("--help"), cli("--version")
    inspect, inspect_pkg = cli("inspect", str(source), "--json"), cli("inspect", str(pkg), "--json")
    preflight = cli("preflight", str(pkg), "--json")
    ms = 1000.0
    return [
        ("-", "python -c pass", f"{spread(bare, ms, '{:.0f}')} ms", ""),
        (
            "-",
            "--help",
            f"{spread(helps, ms, '{:.0f}')} ms",
            f"+{(statistics.median(helps) - t_bare) * ms:.0f} ms over bare Python (target <= 60)",
        ),
        (
            "-",
            "--version",
            f"{spread(version, ms, '{:.0f}')} ms",
            f"+{(statistics.median(version) - t_bare) * ms:.0f} ms over bare Python",
        ),
        (
            "gemma3",
            "inspect GGUF, CLI wall",
            f"{spread(inspect, ms, '{:.0f}')} ms",
            "target <= 120",
        ),
        ("gemma3", "inspect package, CLI wall", f"{spread(inspect_pkg, ms, '{:.0f}')} ms", ""),
        ("gemma3", "preflight package, CLI wall", f"{spread(preflight, ms, '{:.0f}')} ms", ""),
    ]


def bench_inspect_vs_gguf(source: Path, runs: int) -> list[Row]:
    from skippy.produce.inspect import inspect_gguf

    lib = times_of(lambda: inspect_gguf(source), runs)
    t0 = time.perf_counter()
    import gguf

    gguf.GGUFReader(source)
    t_ref = time.perf_counter() - t0  # one run: it takes 10+ s
    return [
        ("gemma3", "gguf.GGUFReader open (import included, 1 run)", f"{t_ref:.2f} s", ""),
        (
            "gemma3",
            "inspect, in process",
            f"{spread(lib, 1000.0, '{:.0f}')} ms",
            f"{t_ref / statistics.median(lib):.0f}x faster (target >= 50x)",
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
    out += bench_progress(ctx.gemma, ctx.work, ctx.runs)
    out += bench_startup(ctx.gemma, ctx.work / "pkg-gemma3", ctx.runs)
    return out + bench_inspect_vs_gguf(ctx.gemma, ctx.runs)
