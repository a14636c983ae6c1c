"""How many CPU threads a stage should use right now: its cap, lowered while other processes
keep this machine's cores busy.

ggml's CPU backend meets its threads at an OpenMP barrier after every op. When another process
holds one of the cores, the kernel preempts one of a 2-thread graph's threads and the other
spins at every barrier until it runs again: decode fell to 0.29x of its quiet speed beside one
busy-loop process, in llama.cpp too, while one thread keeps one core's full speed (runtime-facts.md
"OpenMP, threads and contention"; figures in docs/performance.md). So an adaptive stage
gives up a thread when its own threads queue for a CPU (their run-queue wait,
``/proc/self/task/*/schedstat``: nanosecond-precise, so a few decode steps decide, and blind
to other processes that leave it a core), and takes it back when the machine's busy time
(``/proc/stat``) minus its own over a longer window leaves a core free. A pause between steps
restarts at the cap: the first version decided from one window since its last step, which in
the bench spanned the busy phase before a quiet one and kept a quiet stage at one thread.

The decisions (``threads_for``, ``next_threads``) and the measurements (``others_busy``,
``waited``) are pure; ``ThreadGovernor`` is the thin shell that reads the clocks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

# Cores' worth of other work below which a core still counts as free: a neighbour using a
# quarter of a core (a shell, a logger) does not stall barriers often enough to halve a graph.
FREE_CORE_SLACK: Final = 0.25
SAMPLE_INTERVAL_S: Final = 0.5
PROC_STAT: Final = "/proc/stat"
TASK_DIR: Final = "/proc/self/task"
# Our threads' run-queue wait, in cores' worth over a short window, from which a thread is
# given up: quiet, a stage's threads wait ~0; beside one busy process a 2-thread graph's
# threads wait about half the time (measured: docs/performance.md).
WAIT_DOWN_CORES: Final = 0.2
SHORT_WINDOW_S: Final = 0.05
# A pause between step graphs after which the windows restart (at the cap).
STALE_GAP_S: Final = 0.25


@dataclass(frozen=True)
class CpuSample:
    """Wall clock, the machine's busy CPU time (all cores) and this process's CPU time, in s."""

    wall_s: float
    busy_s: float
    own_s: float


def others_busy(a: CpuSample, b: CpuSample) -> float:
    """Cores' worth of CPU other processes (and the hypervisor: steal) used between ``a`` and
    ``b``; 0 when the window is empty."""
    span = b.wall_s - a.wall_s
    if span <= 0:
        return 0.0
    return max(0.0, (b.busy_s - a.busy_s) - (b.own_s - a.own_s)) / span


def threads_for(cap: int, cores: int, others: float) -> int:
    """``cap`` threads, fewer when other work leaves fewer than ``cap`` cores free; >= 1."""
    free = cores - others + FREE_CORE_SLACK
    return max(1, min(cap, int(free)))


def parse_proc_stat(text: str, ticks_per_s: float) -> float:
    """Busy CPU seconds of all cores from ``/proc/stat``'s first line (user nice system idle
    iowait irq softirq steal ...): everything but idle and iowait."""
    fields = text.split("\n", 1)[0].split()
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        raise ValueError("not a /proc/stat aggregate cpu line")
    values = [int(v) for v in fields[1:9]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values) - idle) / ticks_per_s


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read(256)


def sample_cpu() -> CpuSample | None:
    """The clocks now, or None where ``/proc/stat`` cannot be read (not Linux)."""
    try:
        with open(PROC_STAT) as f:
            busy = parse_proc_stat(f.read(256), float(os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError):
        return None
    t = os.times()
    return CpuSample(time.monotonic(), busy, t.user + t.system)


def own_threads_waited_s(read: Callable[[str], str] = _read_text) -> dict[int, float] | None:
    """Seconds each thread of this process has spent runnable but waiting for a CPU
    (``/proc/self/task/<tid>/schedstat``, second field, ns), by thread id; None where it
    cannot be read. Precise to the nanosecond, so a window of a few decode steps is enough."""
    try:
        tids = os.listdir(TASK_DIR)
    except OSError:
        return None
    out: dict[int, float] = {}
    for tid in tids:
        try:
            out[int(tid)] = int(read(f"{TASK_DIR}/{tid}/schedstat").split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended between the listing and the read
    return out


def waited(a: dict[int, float], b: dict[int, float], span_s: float) -> float:
    """Cores' worth of run-queue wait of the threads alive at both readings over ``span_s``."""
    if span_s <= 0:
        return 0.0
    return sum(max(0.0, b[t] - a[t]) for t in b.keys() & a.keys()) / span_s


def next_threads(
    current: int, cap: int, cores: int, *, waited_cores: float | None, others: float | None
) -> int:
    """The thread count after a window, with hysteresis between two signals:

    - down, from ``waited_cores`` (a short window): our own threads queued for a CPU, i.e. the
      kernel preempts them and every barrier stalls. This reads only our threads' harm, so the
      bench's other processes, our idle helpers or our own barrier spin never count;
    - up, from ``others`` (a long window, ``others_busy``): at fewer threads our threads no
      longer queue, so only the cores other processes leave free can say a thread may return.
    ``None`` means that window is not complete yet: no change from it."""
    if waited_cores is not None and current > 1 and waited_cores >= WAIT_DOWN_CORES:
        free = threads_for(cap, cores, others) if others is not None else current - 1
        return max(1, min(current - 1, free))
    if others is not None and current < cap:
        return max(current, threads_for(cap, cores, others))
    return current


class ThreadGovernor:
    """The thread count for the next step graph. Samples at most every ``short_s``: our threads'
    run-queue wait over the last short window may lower the count; the machine's busy time minus
    ours over a window of ``interval_s`` may raise it. A pause longer than ``stale_s`` between
    steps (the stage idle, or other work in this process) restarts both windows at the cap: what
    the machine did while the stage was idle says little about now, and the short window lowers
    the count again within a few steps if a neighbour is still there. Without ``/proc`` it keeps
    ``cap``."""

    def __init__(
        self,
        cap: int,
        cores: int,
        *,
        interval_s: float = SAMPLE_INTERVAL_S,
        short_s: float = SHORT_WINDOW_S,
        stale_s: float = STALE_GAP_S,
        sample: Callable[[], CpuSample | None] = sample_cpu,
        waits: Callable[[], dict[int, float] | None] = own_threads_waited_s,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cap, self.cores = cap, cores
        self.interval_s, self.short_s, self.stale_s = interval_s, short_s, stale_s
        self._sample, self._waits, self._clock = sample, waits, clock
        self.current = cap
        self._last_call = clock()
        self._restart(self._last_call)

    def _restart(self, now: float) -> None:
        self._long = self._sample()
        self._short: tuple[float, dict[int, float]] | None = None
        w = self._waits()
        if w is not None:
            self._short = (now, w)

    def threads(self) -> int:
        now = self._clock()
        gap, self._last_call = now - self._last_call, now
        if gap > self.stale_s:
            self.current = self.cap
            self._restart(now)
            return self.current
        waited_cores: float | None = None
        if self._short is not None and now - self._short[0] >= self.short_s:
            w = self._waits()
            if w is not None:
                waited_cores = waited(self._short[1], w, now - self._short[0])
                self._short = (now, w)
        others: float | None = None
        long = self._long
        if long is not None and now - long.wall_s >= self.interval_s:
            s = self._sample()
            if s is not None:
                others = others_busy(long, s)
                self._long = s
        if waited_cores is None and others is None:
            return self.current
        n = next_threads(
            self.current, self.cap, self.cores, waited_cores=waited_cores, others=others
        )
        if n < self.current:
            self._long = self._sample()  # going up needs a whole window seen at the new count
        self.current = n
        return self.current


def machine_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def stage_threads(configured: int | None, cores: int, co_located: int) -> int:
    """A stage's CPU threads: ``configured`` when set, else ("auto") this machine's cores
    divided among the ``co_located`` stages running on it, at least 1. ggml's OpenMP threads
    spin at barriers, so stages that add up to more threads than cores stall each other
    (docs/runtime-facts.md, "OpenMP, threads and contention")."""
    if configured is not None:
        return configured
    return max(1, cores // max(1, co_located))
