"""Progress lines for long work: one line per finished item with bytes and bytes/s.

Shown on a terminal only (stderr is a TTY) and never with ``--json``; thread-safe because
fragments are written on several threads.
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """``512 B``, ``1.5 MiB``, ``3.0 TiB``: binary units up to PiB (manifest sizes are bounded
    below 2^53 bytes, 8 PiB, so no figure grows past four digits)."""
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    def __init__(self, total_items: int, *, enabled: bool, stream: TextIO | None = None) -> None:
        self.total = total_items
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self._lock = threading.Lock()

    @classmethod
    def for_terminal(cls, total_items: int, *, quiet: bool) -> Progress:
        return cls(total_items, enabled=not quiet and sys.stderr.isatty())

    def item(self, label: str, nbytes: int, seconds: float) -> None:
        if not self.enabled:
            return
        rate = nbytes / seconds if seconds > 0 else 0.0
        with self._lock:
            self.done += 1
            self.stream.write(
                f"[{self.done:>{len(str(self.total))}}/{self.total}] {label}  "
                f"{human_bytes(nbytes)}  {human_bytes(rate)}/s\n"
            )
            self.stream.flush()
