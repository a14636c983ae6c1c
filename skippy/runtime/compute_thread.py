"""One long-lived thread for every stage-runtime call of a process that runs them off its main
thread (a node: open, calibrate, prefill, decode, close).

Why one thread, and the same one every time: libgomp (ggml's CPU backend is built with OpenMP)
keeps one OpenMP thread pool per thread that starts a parallel region, and once a process's
pools hold more threads than it has CPUs, every barrier of every graph spins only 100 rounds
before it sleeps (libgomp's "throttled" spin count, whatever ``GOMP_SPINCOUNT`` says). On this
2-core machine a gemma3 stage at 2 threads decoded 55-63 tok/s while all its graphs ran on one
thread, and 34-38 tok/s from the moment a second thread had run one of them (the node ran decode
steps on its event loop and prefills on trio's worker threads: two pools;
docs/performance.md, "One compute thread per process"). A thread per call would also be a pool
per call.

The thread is a daemon started on first use; jobs run in submission order, one at a time (a
stage is not thread-safe anyway). ``submit`` takes a plain callable and never blocks, so an
event loop can hand a job over and be told by the job itself when it is done (see
``mesh_node.compute``); ``call`` is the blocking form for ordinary threads.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
Job = Callable[[], None]


class ComputeThread:
    """A FIFO of jobs run by one daemon thread, started on first use."""

    def __init__(self, name: str = "stage-compute") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, job: Job) -> None:
        """Queue ``job`` (it reports its own outcome; one that raises is logged by nothing and
        loses only itself: the thread goes on with the next)."""
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                    thread.start()
                    self._thread = thread
        self._jobs.put(job)

    def on_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the compute thread, blocking the caller until it returns or raises
        (run directly when the caller is the compute thread: no deadlock on itself)."""
        if self.on_thread():
            return fn()
        # A held lock the job releases: one futex wait, where ``threading.Event`` adds a
        # condition and its own lock (20-35 us less per call after an idle gap, measured).
        done = threading.Lock()
        done.acquire()
        box: list[T] = []
        err: list[BaseException] = []

        def job() -> None:
            try:
                box.append(fn())
            except BaseException as exc:  # handed to the caller, whatever it is
                err.append(exc)
            finally:
                done.release()

        self.submit(job)
        done.acquire()
        if err:
            raise err[0]
        return box[0]

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            with contextlib.suppress(BaseException):  # a job reports its own outcome (submit)
                job()


_SHARED = ComputeThread()


def compute_thread() -> ComputeThread:
    """The process's compute thread (one per process: libgomp's pools are per process)."""
    return _SHARED
