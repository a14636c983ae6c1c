"""Shared pieces of the benchmark sections: timing, peak RSS of a child, table rendering and the
machine line. Every figure is a ratio measured side by side in one run (these machines are
noisy); a figure is the median of N runs with the spread (min..max) beside it."""

from __future__ import annotations

import hashlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "scripts", ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

Row = tuple[str, str, str, str]


@dataclass(frozen=True)
class BenchContext:
    """What every section receives: the real model, a scratch folder, the run count."""

    gemma: Path
    work: Path
    runs: int
    big_bytes: int
    skip_big: bool


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


def spread(times: list[float], unit: float = 1.0, fmt: str = "{:.3f}") -> str:
    """``median (min..max)`` of ``times`` scaled by ``unit``: never the fastest run alone."""
    med = statistics.median(times) * unit
    return f"{fmt.format(med)} ({fmt.format(min(times) * unit)}..{fmt.format(max(times) * unit)})"


def child_peak_rss_mib(argv: list[str]) -> float:
    """Run a command in a child and return that child's own peak RSS (``wait4``'s rusage:
    RUSAGE_CHILDREN would report the largest of every child so far, e.g. a pip install run
    by scripts/_setup.sh before this process was exec'ed)."""
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{argv} failed: {err.read()}")
    return usage.ru_maxrss / 1024


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


def gemma_package(ctx: BenchContext) -> Path:
    """gemma3-270m as a package (written by the package section, or here once)."""
    from skippy.constants import MANIFEST_NAME
    from skippy.produce.write_package import WriteOptions, local_provenance, write_package

    pkg_dir = ctx.work / "pkg-gemma3"
    if not (pkg_dir / MANIFEST_NAME).exists():
        prov = local_provenance(
            model_id="bench/model-GGUF:Q", source_repo=None, source_revision="r",
            source_file=ctx.gemma.name,
        )
        write_package(ctx.gemma, WriteOptions(out_dir=pkg_dir, provenance=prov, overwrite=True))
    return pkg_dir


def random_file(ctx: BenchContext, nbytes: int, name: str = "transfer-synthetic.bin") -> tuple[
    Path, str
]:
    """``nbytes`` of random bytes (whole 64 MiB blocks; kept between runs) and their SHA-256."""
    path = ctx.work / name
    block = 64 << 20
    if not path.exists() or path.stat().st_size != nbytes:
        with open(path, "wb") as f:
            for _ in range(nbytes // block):
                f.write(os.urandom(block))
    with open(path, "rb") as f:
        return path, hashlib.file_digest(f, "sha256").hexdigest()
