"""Threads under contention (issue #25 item 1): the pure decision, the /proc/stat reading, and
the governor's sampling rule (clocks injected: no wall-clock assertions)."""

from __future__ import annotations

import pytest

from skippy.runtime.contention import (
    CpuSample,
    ThreadGovernor,
    others_busy,
    parse_proc_stat,
    sample_cpu,
    threads_for,
)


@pytest.mark.parametrize(
    ("cap", "cores", "others", "want"),
    [
        (2, 2, 0.0, 2),  # quiet: the cap
        (2, 2, 0.2, 2),  # a light neighbour (a shell) leaves both cores
        (2, 2, 1.0, 1),  # one busy process: one core left
        (2, 2, 1.6, 1),  # more than a core busy: still at least one thread
        (2, 2, 5.0, 1),
        (4, 8, 3.0, 4),  # enough cores free for the cap
        (8, 8, 3.0, 5),
        (1, 2, 0.0, 1),  # the cap holds
    ],
)
def test_threads_for(cap: int, cores: int, others: float, want: int) -> None:
    assert threads_for(cap, cores, others) == want


def test_others_busy_is_the_machine_minus_this_process() -> None:
    a = CpuSample(wall_s=10.0, busy_s=100.0, own_s=5.0)
    b = CpuSample(wall_s=10.5, busy_s=101.0, own_s=5.5)  # 1 s busy in 0.5 s, half of it ours
    assert others_busy(a, b) == pytest.approx(1.0)
    assert others_busy(a, a) == 0.0
    assert others_busy(a, CpuSample(11.0, 100.0, 6.0)) == 0.0  # never negative (tick rounding)


def test_proc_stat_busy_excludes_idle_and_iowait() -> None:
    line = "cpu  100 20 30 4000 50 6 7 8 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
    assert parse_proc_stat(line, 100.0) == pytest.approx((100 + 20 + 30 + 6 + 7 + 8) / 100)
    with pytest.raises(ValueError):
        parse_proc_stat("intr 1 2 3", 100.0)


def test_this_machine_can_be_sampled() -> None:
    s = sample_cpu()
    assert s is not None and s.busy_s > 0 and s.own_s > 0


def test_governor_decides_once_per_interval_from_the_last_window() -> None:
    now = [0.0]
    samples = iter(
        [
            CpuSample(0.0, 0.0, 0.0),  # at construction
            CpuSample(1.0, 1.9, 0.9),  # others used 1.0 core: one thread
            CpuSample(2.0, 2.9, 1.9),  # quiet again (only our own 1.0)
        ]
    )
    gov = ThreadGovernor(2, 2, interval_s=0.5, sample=lambda: next(samples), clock=lambda: now[0])
    assert gov.threads() == 2  # no window yet
    now[0] = 1.0
    assert gov.threads() == 1
    now[0] = 1.2
    assert gov.threads() == 1  # within the interval: no new sample taken
    now[0] = 2.0
    assert gov.threads() == 2


def test_governor_without_proc_stat_keeps_the_cap() -> None:
    gov = ThreadGovernor(2, 2, sample=lambda: None)
    assert gov.threads() == 2
