"""The one deadline a peer response is read under (a trickle falls back).

One cancel scope per response, its deadline pushed on as bytes arrive (a scope per receive
costs more than the bytes it guards: ~20k receives per GiB). It is pushed on only while the
peer keeps ``min_bytes_per_s`` since the last push, so a trickle under ``idle_s`` cannot
postpone the fallback forever. Used by the whole-file fetch and by each swarm chunk."""

from __future__ import annotations

from collections.abc import Sequence

import trio


class RateDeadline:
    def __init__(self, idle_s: float, min_bytes_per_s: int) -> None:
        self.idle_s, self.min_bytes_per_s = idle_s, min_bytes_per_s
        now = trio.current_time()
        self.scope = trio.CancelScope(deadline=now + idle_s)
        self._mark_time, self._mark_bytes, self._received = now, 0, 0

    def received(self, views: Sequence[memoryview]) -> None:
        """Count what just arrived; push the deadline on if it is near and the rate held."""
        self._received += sum(len(v) for v in views)
        now = trio.current_time()
        due = now + 0.75 * self.idle_s > self.scope.deadline
        if due and self._received - self._mark_bytes >= self.min_bytes_per_s * (
            now - self._mark_time
        ):
            self.scope.deadline = now + self.idle_s
            self._mark_time, self._mark_bytes = now, self._received

    @property
    def since_mark(self) -> int:
        """Bytes since the last push: more than 0 when the deadline passed means a trickle,
        0 a stall."""
        return self._received - self._mark_bytes
