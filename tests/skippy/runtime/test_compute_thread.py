"""The process's compute thread (``skippy.runtime.compute_thread``) and the trio hand-off to it
(``mesh_node.compute``): every call runs on the one thread, results and errors come back, and a
cancelled caller still waits for its call to end."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import trio
from meshtools import identity, settings

from mesh_node.compute import run_compute
from mesh_node.node import MeshNode
from mesh_node.serving.host import StageHost
from mesh_node.settings import ServingSettings
from skippy.runtime.compute_thread import ComputeThread, compute_thread


async def test_every_call_runs_on_the_one_compute_thread_and_returns_its_result() -> None:
    seen = [await run_compute(lambda i=i: (i, threading.get_ident())) for i in range(5)]
    assert [i for i, _ in seen] == list(range(5))
    idents = {ident for _, ident in seen}
    assert len(idents) == 1 and threading.get_ident() not in idents
    assert compute_thread().call(threading.get_ident) in idents  # the blocking form too


async def test_an_exception_raised_by_the_call_reaches_the_caller_and_the_thread_goes_on() -> None:
    def boom() -> None:
        raise ValueError("from the stage")

    with pytest.raises(ValueError, match="from the stage"):
        await run_compute(boom)
    assert await run_compute(lambda: 7) == 7


async def test_a_cancelled_caller_waits_for_its_call_and_is_cancelled_after_it() -> None:
    ended: list[bool] = []
    got: list[str] = []

    def slow() -> str:
        time.sleep(0.2)  # a graph cannot be interrupted
        ended.append(True)
        return "done"

    with trio.move_on_after(0.05) as scope:
        got.append(await run_compute(slow))  # the deadline passes during the call
        assert ended == [True]  # returned only once the call had ended
        await trio.lowlevel.checkpoint()  # the cancellation arrives here
        got.append("not reached")
    assert scope.cancelled_caught and got == ["done"]


def test_call_from_the_compute_thread_itself_runs_directly() -> None:
    ct = ComputeThread("test-compute")
    assert ct.call(lambda: ct.call(lambda: threading.current_thread().name)) == "test-compute"


async def test_a_stage_hosts_calls_run_where_one_openmp_pool_can_form(tmp_path: Path) -> None:
    """A multi-threaded stage's calls all run on the compute thread (a short decode step
    blocks the loop for it); a single-threaded stage's short decode steps run on the loop
    itself; long calls (prefill) always on the compute thread."""
    host = StageHost(MeshNode(settings(tmp_path, "n0"), identity()), ServingSettings())
    here, compute = threading.current_thread().name, compute_thread().name

    def where() -> str:
        return threading.current_thread().name

    for threads, decode_thread in ((2, compute), (1, here)):
        host.stage_threads = threads
        assert await host.compute(where, step=True) == decode_thread
        assert await host.compute(where) == compute  # a prefill chunk
    host.step_s = 1.0  # a slow stage's steps no longer block the loop
    assert await host.compute(where, step=True) == compute
    assert host.blocking_steps == 2 and host.steps == 3
