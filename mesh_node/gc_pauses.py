"""Garbage-collector pauses of a running node (honest-link RTT).

CPython's cyclic collector stops the whole process, and its full (generation 2) collection
walks every tracked object. A started `mesh-node run` holds ~70-110 thousand of them, nearly
all from start-up (~860 imported modules: functions, classes, their dicts): a full
collection took ~41 ms of CPU here (~130-150 ms wall on the loaded machine), and a burst of
new objects (a flood opening a thousand streams) triggers one. Measured in the victim during
the adversary bench, it was the longest single step of the event loop (docs/performance.md).

Start-up objects live as long as the process, so once the node has started they are moved
to the collector's permanent generation (``gc.freeze``): later collections walk only what
was allocated since (per-link and per-stream objects), and nothing that is garbage is kept,
since a collection runs first. The thresholds are left at CPython's defaults: young
collections stay well under a millisecond.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("mesh_node.gc_pauses")


def freeze_startup_heap() -> int:
    """Collect, then exclude every surviving object from future collections (once the node
    has started: imports done, settings read, listeners open). Returns how many objects
    were frozen."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug(
        "froze %d start-up objects out of garbage collection (%.0f ms)",
        frozen,
        (time.perf_counter() - t0) * 1000,
    )
    return frozen
