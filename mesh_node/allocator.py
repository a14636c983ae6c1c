"""glibc malloc settings for a process that streams bulk bytes (``mesh-node run``).

Every byte a link moves passes through short-lived buffers of 64 KiB to ~1 MiB: file chunks,
Noise records, WebSocket messages (a stock WebSocket library copies each outgoing one several
times).
With glibc's defaults a freed buffer of that size is handed back to the kernel (the dynamic
mmap threshold, heap trimming at twice it) and the next one is page-faulted in again: measured
here, 0.18-0.46 million minor faults per GB on the sending side, a fifth to a third of its CPU
(raw trio-websocket's server shows the same, docs/performance.md). A fixed mmap threshold
above the largest such buffer and a trim threshold above the working set keep freed memory in
the heap for the next buffer. Peak RSS does not grow: memory is reused, not accumulated (the
heap may keep up to ``TRIM_THRESHOLD_BYTES`` of free memory after a burst).

Other C libraries (musl, macOS) have no ``mallopt``: nothing is changed there.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Final

log = logging.getLogger("mesh_node.allocator")

# mallopt parameters (glibc <malloc.h>)
M_TRIM_THRESHOLD: Final = -1
M_MMAP_THRESHOLD: Final = -3
# Above a whole WebSocket message of 16 Noise records (~1 MiB) and a 4 MiB read.
MMAP_THRESHOLD_BYTES: Final = 8 * 1024 * 1024
# Above the streaming working set (stream windows, queued messages, write batches).
TRIM_THRESHOLD_BYTES: Final = 64 * 1024 * 1024


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``int mallopt(int param, int value)``, declared once; None elsewhere."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it; raises AttributeError)
        fn = libc.mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    mallopt: Callable[[int, int], int] = fn
    return mallopt


def tune_for_streaming() -> bool:
    """Apply the settings above to this process; True when the C library took them."""
    fn = _mallopt()
    if fn is None:
        return False
    ok = bool(fn(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        fn(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    if not ok:
        log.debug("mallopt refused the streaming settings")
    return ok


def release_free_memory() -> bool:
    """Hand free heap back to the kernel (glibc ``malloc_trim(0)``): after a link that held
    megabytes for a peer closes, RSS returns near where it was, despite
    the trim threshold above. True when something was released."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))

