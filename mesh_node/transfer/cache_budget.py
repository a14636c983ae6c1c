"""The node's hub-cache budget: use vs budget, LRU eviction before a stage's fetch, and the
counters ``mesh-node status`` and ``/metrics`` show. ``cache_budget = "auto"`` (the default)
is resolved by ``start`` from the disk (``skippy.transfer.disk.auto_cache_budget``) and said
in the node's log, like a configured budget or none.

The decisions are ``skippy.transfer.evict.plan_eviction`` (what to delete) and
``skippy.transfer.disk.stage_disk_problem`` (whether the fetch may go ahead: the existing
``cache_budget`` refusal, unchanged, when eviction cannot make room). This shell only reads
the disk, calls them and keeps the numbers. Every method but ``status`` does disk I/O: a trio
caller runs it with ``trio.to_thread.run_sync``. The numbers are plain ints written by those
calls and read by ``status`` (a torn read is impossible for an int in CPython).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from mesh_node.settings import SecuritySettings
from skippy.progress import human_bytes
from skippy.transfer.disk import auto_cache_budget, cache_usage
from skippy.transfer.evict import evict, plan_eviction, scan_blobs
from skippy.transfer.recency import RecencyIndex, blob_key

log = logging.getLogger("mesh_node.transfer.cache")
INDEX_NAME = "cache-recency.json"  # in the node's data_dir, beside (not in) the hub cache


class CacheBudget:
    def __init__(self, hub_cache_dir: Path, data_dir: Path, security: SecuritySettings) -> None:
        self.root = hub_cache_dir
        setting = security.cache_budget_bytes
        self.auto = not isinstance(setting, int)
        # an automatic budget is 0 (none) until ``start`` derives it
        self.budget_bytes: int = setting if isinstance(setting, int) else 0
        self.index = RecencyIndex(data_dir / INDEX_NAME)
        self.used_bytes: int | None = None  # None until first measured
        self.evicted_blobs = 0
        self.evicted_bytes = 0
        self.refusals = 0  # fetches refused because eviction could not make room (the caller)

    def start(self) -> str:
        """Measure the cache, derive the budget from the disk when it is automatic, and log
        which budget holds and why (thread). Returns the line logged."""
        used = self.refresh()
        if self.auto:
            disk = shutil.disk_usage(_existing(self.root))
            auto = auto_cache_budget(
                disk_total_bytes=disk.total, disk_free_bytes=disk.free, cache_used_bytes=used
            )
            self.budget_bytes = auto.budget_bytes
            line = (
                f"hub cache budget {human_bytes(self.budget_bytes)} ({self.budget_bytes} bytes, "
                f"cache_budget = auto: {auto.explain()}); {used} bytes in use; least recently "
                "used blobs no stage needs are evicted beyond it ([security] cache_budget sets "
                "it, 0 for none)"
            )
            log.info("%s", line)
        elif self.budget_bytes:
            line = (
                f"hub cache budget {human_bytes(self.budget_bytes)} ({self.budget_bytes} bytes, "
                f"[security] cache_budget); {used} bytes in use"
            )
            log.info("%s", line)
        else:
            line = (
                f"hub cache budget: none ([security] cache_budget = 0): the cache ({used} bytes "
                "now) grows until the disk is full"
            )
            log.warning("%s", line)
        return line

    def refresh(self) -> int:
        self.used_bytes = cache_usage(self.root)
        return self.used_bytes

    def make_room(self, incoming_bytes: int, needed: Collection[Path]) -> int:
        """Evict least-recently-used blobs no needed snapshot links to, so ``incoming_bytes``
        fit the budget; nothing when they cannot (the caller's check refuses then). Returns
        the bytes freed."""
        used = self.refresh()
        if not self.budget_bytes or used + incoming_bytes <= self.budget_bytes:
            return 0
        blobs = scan_blobs(self.root, needed, self.index.load())
        plan = plan_eviction(
            blobs, used_bytes=used, budget_bytes=self.budget_bytes, incoming_bytes=incoming_bytes
        )
        if not plan.fits:
            log.warning(
                "cache budget %d: %d bytes in use, %d incoming; only %d could be evicted "
                "(the rest is needed by this node's topology or a running stage)",
                self.budget_bytes,
                used,
                incoming_bytes,
                sum(b.size for b in blobs if not b.pinned),
            )
            return 0
        done = evict(self.root, plan)
        freed = sum(b.size for b in done)
        self.evicted_blobs += len(done)
        self.evicted_bytes += freed
        self.index.forget(b.key for b in done)
        self.refresh()
        log.info(
            "cache budget %d: evicted %d blobs (%d bytes, least recently used first) for %d "
            "incoming bytes",
            self.budget_bytes,
            len(done),
            freed,
            incoming_bytes,
        )
        return freed

    def touch(self, snapshot: Path) -> None:
        """Record that every blob ``snapshot`` links to was used now (a stage was installed
        or loaded from it)."""
        keys = []
        blobs = os.path.realpath(self.root)
        for dirpath, _dirs, files in os.walk(snapshot):
            for name in files:
                real = os.path.realpath(os.path.join(dirpath, name))
                if real.startswith(blobs + os.sep) and Path(real).parent.name == "blobs":
                    keys.append(blob_key(Path(real)))
        self.index.touch(keys, time.time())
        self.refresh()

    def status(self) -> dict[str, Any]:
        """The status document's ``cache`` section (``budget_bytes`` 0: no budget;
        ``budget_auto``: derived from the disk)."""
        return {
            "used_bytes": self.used_bytes,
            "budget_bytes": self.budget_bytes,
            "budget_auto": self.auto,
            "evicted_blobs": self.evicted_blobs,
            "evicted_bytes": self.evicted_bytes,
            "refusals": self.refusals,
        }


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent: the filesystem the cache will be on."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return path
