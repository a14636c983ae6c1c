"""One heap trim for a burst of closing links, off the event loop (honest-link RTT).

``mesh_node.allocator.release_free_memory`` (glibc ``malloc_trim``) walks the whole heap:
~20-30 ms of CPU after a flood, measured in the adversary bench, and 32 links closing at once
asked for it 32 times on the event loop, stalling every other link for the sum. (Its own
module: the allocator settings are applied before trio is imported, and stay free of it.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import trio

from mesh_node.allocator import release_free_memory

# Links that close together (a flood leaving) share one trim, this long after the first.
RELEASE_DELAY_S: Final = 0.25


class MemoryReleaser:
    """``release_free_memory`` once for a burst of requests: requests made while a trim is
    pending are served by it; the trim runs in a worker thread (ctypes releases the GIL)."""

    def __init__(self, release: Callable[[], bool] = release_free_memory) -> None:
        self._release = release
        self._wanted = trio.Event()
        self.released = 0  # trims run

    def request(self) -> None:
        self._wanted.set()

    async def run(self) -> None:
        while True:
            await self._wanted.wait()
            await trio.sleep(RELEASE_DELAY_S)
            self._wanted = trio.Event()  # later requests: the next trim
            await trio.to_thread.run_sync(self._release)
            self.released += 1
