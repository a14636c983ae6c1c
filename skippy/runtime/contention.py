"""How many CPU threads a stage should use right now: its cap, lowered while other processes
keep this machine's cores busy (issue #25 item 1).

ggml's CPU backend meets its threads at an OpenMP barrier after every op. When another process
holds one of the cores, the kernel preempts one of a 2-thread graph's threads and the other
spins at every barrier until it runs again: decode fell to 0.29x of its quiet speed beside one
busy-loop process, in llama.cpp too, while one thread keeps one core's full speed (GOTCHAS
"OpenMP, threads and contention"; figures in docs/performance.md). So an adaptive stage
samples the machine's busy time (``/proc/stat``) minus its own process's CPU time over the
last window and uses only the cores the others leave free (at least one).

The decision (``threads_for``) and the measurement (``others_busy``) are pure; ``ThreadGovernor``
is the thin shell that reads the clocks, at most once per ``interval_s``.
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


def sample_cpu() -> CpuSample | None:
    """The clocks now, or None where ``/proc/stat`` cannot be read (not Linux)."""
    try:
        with open(PROC_STAT) as f:
            busy = parse_proc_stat(f.read(256), float(os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError):
        return None
    t = os.times()
    return CpuSample(time.monotonic(), busy, t.user + t.system)


class ThreadGovernor:
    """The thread count for the next graph: re-decided at most every ``interval_s`` from the
    window since the last decision. Without ``/proc/stat`` it keeps ``cap``."""

    def __init__(
        self,
        cap: int,
        cores: int,
        *,
        interval_s: float = SAMPLE_INTERVAL_S,
        sample: Callable[[], CpuSample | None] = sample_cpu,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cap, self.cores, self.interval_s = cap, cores, interval_s
        self._sample, self._clock = sample, clock
        self._last = sample()
        self.current = cap

    def threads(self) -> int:
        last = self._last
        if last is None:
            return self.current
        if self._clock() - last.wall_s < self.interval_s:
            return self.current
        now = self._sample()
        if now is None:
            return self.current
        self._last = now
        self.current = threads_for(self.cap, self.cores, others_busy(last, now))
        return self.current


def machine_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
