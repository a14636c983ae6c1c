"""Shared pieces of the benchmark sections: timing, peak RSS of a child, table rendering and the
machine line. Every figure is a ratio measured side by side in one run (these machines are
noisy); a figure is the median of N runs with the spread (min..max) beside it."""

from __future__ import annotations

import hashlib
import json
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
from typing import Any, BinaryIO

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "scripts", ROOT / "tests" / "support"):
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
    """Run a CLI command in a child and return its own peak RSS (VmHWM), in MiB.

    Neither ``RUSAGE_CHILDREN`` (the largest child this process ever had: scripts/bench
    execs python from a shell whose setup may have run pip) nor the child's ``wait4`` rusage
    will do: a child forked from a large parent starts with the parent's resident pages, and
    Linux carries that high-water mark across ``exec``. The exec'd program's own mm reports
    its peak as ``VmHWM`` in /proc: it is polled once the child has exec'd, until it exits.
    """
    want = "\0".join(argv).encode()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err
        )
        peak_kib = 0
        status = Path(f"/proc/{proc.pid}/status")
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        while proc.poll() is None:
            try:
                if cmdline.read_bytes().rstrip(b"\0") == want:  # exec'd: its own mm
                    for line in status.read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            peak_kib = max(peak_kib, int(line.split()[1]))
            except (OSError, ValueError):
                pass  # exiting between the poll and the read
            time.sleep(0.005)
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{argv} failed: {err.read().decode(errors='replace')}")
    return peak_kib / 1024


def cpu_ticks() -> tuple[int, int, float]:
    """(the machine's busy CPU ticks, this process's own, the monotonic time)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]  # user .. steal (guest is in user)
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    with open("/proc/self/stat") as f:
        own = f.read().rsplit(")", 1)[1].split()
    return busy, int(own[11]) + int(own[12]), time.monotonic()  # utime + stime, all threads


def others_cores(a: tuple[int, int, float], b: tuple[int, int, float]) -> float:
    """Cores' worth of CPU the machine's other processes used between two ``cpu_ticks``
    readings: with 2 OpenMP threads on 2 cores, a neighbour that takes a core stalls every
    barrier of a graph, so a run is only comparable with runs as quiet as it."""
    hz = os.sysconf("SC_CLK_TCK")
    return max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / hz / max(b[2] - a[2], 1e-9))


def render(rows: list[Row]) -> str:
    lines = ["| model | measurement | value | ratio / note |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


# Vector extensions that change which kernels win (a VM's "model name" may say only the vendor).
_CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_vp2intersect")


def machine() -> str:
    cpu, flags = "?", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "?":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                have = set(line.split(":", 1)[1].split())
                flags = " ".join(f for f in _CPU_FLAGS if f in have)
    except OSError:
        pass
    if flags:
        cpu = f"{cpu}; {flags}"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, Python {platform.python_version()}"


def gemma_package(ctx: BenchContext) -> Path:
    """gemma3-270m as a package (written by the package section, or here once)."""
    from skippy.constants import MANIFEST_NAME
    from skippy.produce.write_package import WriteOptions, local_provenance, write_package

    pkg_dir = ctx.work / "pkg-gemma3"
    if not (pkg_dir / MANIFEST_NAME).exists():
        prov = local_provenance(
            model_id="bench/model-GGUF:Q",
            source_repo=None,
            source_revision="r",
            source_file=ctx.gemma.name,
        )
        write_package(ctx.gemma, WriteOptions(out_dir=pkg_dir, provenance=prov, overwrite=True))
    return pkg_dir


def random_file(
    ctx: BenchContext,
    nbytes: int,
    name: str = "transfer-synthetic.bin",
    *,
    layer: int | None = None,
) -> tuple[Path, str]:
    """``nbytes`` of random bytes (whole 64 MiB blocks; kept between runs) and their SHA-256.
    With ``layer``: a GGUF layer fragment instead, one I8 tensor of ``blk.<layer>`` holding the
    random bytes after its header, so a package may carry it as that layer (a coordinator reads
    its fragments' headers when it plans)."""
    path = ctx.work / name
    block = 64 << 20
    if not path.exists() or path.stat().st_size < nbytes:
        with open(path, "wb") as f:
            if layer is not None:
                _gguf_header(f, f"blk.{layer}.ffn_up.weight", nbytes)
            for _ in range(nbytes // block):
                f.write(os.urandom(block))
    with open(path, "rb") as f:
        return path, hashlib.file_digest(f, "sha256").hexdigest()


def _gguf_header(f: BinaryIO, tensor: str, nbytes: int) -> None:
    """A GGUF header declaring one I8 tensor of ``nbytes`` (its data follows, aligned)."""
    from skippy.gguf.reader import TensorInfo
    from skippy.gguf.writer import build_header

    i8 = 24  # GGML_TYPE_I8: one byte per element
    info = TensorInfo(tensor, (nbytes,), i8, 0, 0, nbytes)
    f.write(build_header([], [info], 32)[0])


def run_child(script: str, *args: str) -> dict[str, Any]:
    """Run ``script child ARGS`` (a bench module's own measuring child) with
    ``OPENBLAS_NUM_THREADS=1`` (numpy's BLAS threads and ggml's OpenMP threads fight in one
    process) and return the JSON object its last output line holds."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, script, "child", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        name = Path(script).stem
        raise SystemExit(f"{name} child {args} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result
