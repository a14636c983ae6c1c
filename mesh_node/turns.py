"""Strangers take turns on the event loop during a flood (honest-link RTT).

trio runs every runnable task in one batch, then polls the sockets (and timers) once before
the next. An honest link's ping waits for the batch under way and runs in the next one, so
its delay is the length of a batch. Under a flood from many untrusted links a batch held a
step for each of them (32 WebSocket readers each parsing 64 KiB, 32 link readers, hundreds of
stream handlers): tens of milliseconds of CPU, hundreds under load (measured in a loop
instrument, docs/performance.md "Where the honest-link RTT tail came from").

A ``Turnstile`` admits its waiters one per batch, taking the accounts (one per peer link) in
turn and each account's tasks first come first served: the task admitted in one batch wakes
the next waiter, which runs in the following batch (trio reschedules an
unparked task into the next batch, never the current one). So however many strangers wait,
each batch runs at most about one stranger's work item (a read of 64 KiB, a record, a
stream handler's step) beside every trusted task, and the loop looks at the sockets between
two of them: a trusted link's frames are served within one stranger item of arriving. Turns
go round the accounts, not the tasks: an attacker's 1024 queued stream handlers are one
account's queue, so an honest untrusted peer waits for one item of each other account, not
for all of them (first come first served kept it behind ~1 s of the attacker's work).

With ``rest=True`` (a flood: ``PeerMemory.under_pressure``) strangers also leave the node
idle part of the time: once their turns have followed each other for ``SLICE_S`` without a
break, the next one waits ``REST_S`` first. On a loaded host a process that never sleeps is
scheduled in the host's time slices, and every ping waits for one; a node that rests half of
the time is woken at once when a trusted peer's bytes arrive. The slice is wall time, so the
strangers' share shrinks by itself when the host is busy.

The caller decides who waits (``PeerMemory.take_turn``: untrusted peers); nothing is held
while admitted, so a turn can neither deadlock nor leak when its task is cancelled.
"""

from __future__ import annotations

from collections import deque
from typing import Final

import trio

SLICE_S: Final = 0.010  # strangers' turns in a row before a rest (under pressure)
REST_S: Final = 0.010  # the rest: strangers use at most half of the node's time


class Turnstile:
    def __init__(self) -> None:
        self._lots: dict[int, trio.lowlevel.ParkingLot] = {}  # account -> its waiting tasks
        self._rotation: deque[int] = deque()  # accounts with waiters, the next one first
        self._rotating: set[int] = set()  # the accounts in _rotation
        self._busy = False  # a waiter was admitted and others may be queued behind it
        self._run_since: float | None = None  # trio clock: turns in a row since then
        self._waiting_keys: dict[int, int] = {}  # account -> its tasks waiting
        self.admitted = 0
        self.queued = 0  # admissions that had to wait behind another
        self.rests = 0

    async def turn(self, *, rest: bool = False, key: int = 0) -> bool:
        """Wait for this task's turn (always a checkpoint): at most one admission per batch
        of the scheduler while others wait; with ``rest``, after ``SLICE_S`` of turns in a
        row, a pause of ``REST_S`` first. True if it queued behind another."""
        queued = holding = self._busy
        try:
            if queued:
                self.queued += 1
                holding = False
                self._waiting_keys[key] = self._waiting_keys.get(key, 0) + 1
                lot = self._lots.setdefault(key, trio.lowlevel.ParkingLot())
                if key not in self._rotating:
                    self._rotating.add(key)
                    self._rotation.append(key)
                try:
                    await lot.park()  # woken by the one admitted a batch earlier
                    holding = True  # the turn is ours: passed on even if cancelled now
                finally:
                    left = self._waiting_keys[key] - 1
                    if left:
                        self._waiting_keys[key] = left
                    else:
                        del self._waiting_keys[key]
                    if not lot.statistics().tasks_waiting and self._lots.get(key) is lot:
                        del self._lots[key]  # (still in _rotation: skipped there)
            else:
                self._busy = holding = True
                self._run_since = trio.current_time()
                await trio.lowlevel.checkpoint()  # the next batch, like a woken waiter
            now = trio.current_time()
            if rest and self._run_since is not None and now - self._run_since >= SLICE_S:
                self.rests += 1
                await trio.sleep(REST_S)  # nobody else is admitted meanwhile
                self._run_since = trio.current_time()
        except BaseException:
            if holding:
                self._pass_on()
            raise
        self.admitted += 1
        self._pass_on()
        return queued

    def _pass_on(self) -> None:
        """Wake the next account's oldest waiter (it runs in the next batch; the account goes
        to the back of the rotation if it has more) or free the turnstile (a run of turns in
        a row ends)."""
        while self._rotation:
            key = self._rotation.popleft()
            self._rotating.discard(key)
            lot = self._lots.get(key)
            if lot is None or not lot.statistics().tasks_waiting:
                continue  # its waiters were cancelled
            lot.unpark(count=1)
            if lot.statistics().tasks_waiting:
                self._rotating.add(key)
                self._rotation.append(key)
            return
        self._busy = False
        self._run_since = None

    @property
    def waiting(self) -> int:
        return sum(int(lot.statistics().tasks_waiting) for lot in self._lots.values())

    def others_waiting(self, key: int) -> bool:
        """Another account than ``key`` has a task waiting (one peer's own pipeline, its
        transport read, link reader and stream reader, does not count)."""
        return len(self._waiting_keys) > 1 or (
            len(self._waiting_keys) == 1 and key not in self._waiting_keys
        )
