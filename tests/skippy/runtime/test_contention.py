"""Threads under contention: the pure decisions, the /proc readings, and
the governor's sampling rules (clocks injected: no wall-clock assertions)."""

from __future__ import annotations

import threading

import pytest

from skippy.runtime.contention import (
    CpuSample,
    ThreadGovernor,
    next_threads,
    others_busy,
    own_threads_waited_s,
    parse_proc_stat,
    sample_cpu,
    threads_for,
    waited,
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


@pytest.mark.parametrize(
    ("current", "waited_cores", "others", "want"),
    [
        (2, 0.0, None, 2),  # quiet: our threads never queue
        (2, 0.1, None, 2),  # a little queueing (a shell, our own idle helpers) is not a stall
        (2, 0.5, None, 1),  # a busy neighbour: our threads queue half the time
        (2, 0.5, 0.0, 1),  # the long window may not veto a stall our threads felt
        (2, None, 1.5, 2),  # the machine busy but our threads do not queue: never down from it
        (1, 0.0, None, 1),  # at one thread nothing queues: only the long window may raise it
        (1, None, 1.0, 1),  # the neighbour still holds a core
        (1, None, 0.1, 2),  # gone: back to the cap
        (1, 0.9, 0.1, 2),
        (1, None, None, 1),
    ],
)
def test_next_threads_down_from_our_wait_up_from_the_others(
    current: int, waited_cores: float | None, others: float | None, want: int
) -> None:
    assert next_threads(current, 2, 2, waited_cores=waited_cores, others=others) == want


def test_next_threads_on_more_cores_gives_up_what_the_others_take() -> None:
    assert next_threads(8, 8, 8, waited_cores=0.5, others=3.0) == 5
    assert next_threads(8, 8, 8, waited_cores=0.5, others=None) == 7
    assert next_threads(5, 8, 8, waited_cores=0.0, others=1.0) == 7


def test_waited_counts_threads_alive_at_both_readings() -> None:
    a = {1: 1.0, 2: 5.0, 3: 9.0}  # thread 3 ends, thread 4 starts: neither counts
    b = {1: 1.25, 2: 5.25, 4: 100.0}
    assert waited(a, b, 0.5) == pytest.approx(1.0)
    assert waited(a, a, 0.0) == 0.0


def test_own_threads_waited_reads_this_process() -> None:
    w = own_threads_waited_s()
    assert w is not None and threading.get_native_id() in w
    assert all(v >= 0 for v in w.values())

    def broken(path: str) -> str:
        raise FileNotFoundError(path)  # every thread ended between the listing and the read

    assert own_threads_waited_s(broken) == {}


class _Clocks:
    """Injected clocks: the machine's samples and our threads' waits at given times."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0  # machine busy s
        self.own = 0.0
        self.wait = 0.0  # our one thread's run-queue wait s

    def run(self, dt: float, *, ours: float, others: float, wait: float) -> None:
        self.now += dt
        self.own += ours * dt
        self.busy += (ours + others) * dt
        self.wait += wait * dt

    def governor(self) -> ThreadGovernor:
        return ThreadGovernor(
            2,
            2,
            interval_s=0.5,
            short_s=0.05,
            stale_s=0.25,
            sample=lambda: CpuSample(self.now, self.busy, self.own),
            waits=lambda: {1: self.wait},
            clock=lambda: self.now,
        )


def _steps(c: _Clocks, gov: ThreadGovernor, n: int, **load: float) -> list[int]:
    out = []
    for _ in range(n):
        out.append(gov.threads())
        c.run(0.02, **load)
    return out


def test_governor_keeps_the_cap_on_a_quiet_machine_whatever_its_own_use() -> None:
    c = _Clocks()
    gov = c.governor()
    # our 2 threads (and their barrier spin) use both cores; nothing else runs; no queueing
    assert set(_steps(c, gov, 100, ours=2.0, others=0.0, wait=0.0)) == {2}


def test_governor_drops_within_a_few_steps_beside_a_neighbour_and_returns_after() -> None:
    c = _Clocks()
    gov = c.governor()
    got = _steps(c, gov, 10, ours=1.0, others=1.0, wait=0.5)
    assert got[0] == 2 and got[-1] == 1 and got.index(1) <= 4
    assert set(_steps(c, gov, 40, ours=1.0, others=1.0, wait=0.0)) == {1}  # it is still there
    got = _steps(c, gov, 40, ours=1.0, others=0.0, wait=0.0)  # it has gone
    assert got[0] == 1 and got[-1] == 2


def test_governor_after_a_pause_restarts_at_the_cap() -> None:
    c = _Clocks()
    gov = c.governor()
    _steps(c, gov, 10, ours=1.0, others=1.0, wait=0.5)
    assert gov.current == 1
    c.run(3.0, ours=0.0, others=1.0, wait=0.0)  # idle while the neighbour was busy, then quiet
    c.run(1.0, ours=0.0, others=0.0, wait=0.0)
    assert _steps(c, gov, 30, ours=2.0, others=0.0, wait=0.0)[0] == 2
    assert gov.current == 2  # the stale window (mostly busy) is never read


def test_governor_without_proc_keeps_the_cap() -> None:
    gov = ThreadGovernor(2, 2, sample=lambda: None, waits=lambda: None)
    assert gov.threads() == 2
