"""The node's hub-cache budget (issue #23 item 5): use vs budget, LRU eviction before a
stage's fetch, and the counters ``mesh-node status`` and ``/metrics`` show.

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
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from skippy.config import SecuritySettings
from skippy.transfer.disk import cache_usage
from skippy.transfer.evict import evict, plan_eviction, scan_blobs
from skippy.transfer.recency import RecencyIndex, blob_key

log = logging.getLogger("mesh_node.transfer.cache")
INDEX_NAME = "cache-recency.json"  # in the node's data_dir, beside (not in) the hub cache


class CacheBudget:
    def __init__(self, hub_cache_dir: Path, data_dir: Path, security: SecuritySettings) -> None:
        self.root = hub_cache_dir
        self.budget_bytes = security.cache_budget_bytes
        self.index = RecencyIndex(data_dir / INDEX_NAME)
        self.used_bytes: int | None = None  # None until first measured
        self.evicted_blobs = 0
        self.evicted_bytes = 0
        self.refusals = 0  # fetches refused because eviction could not make room (the caller)

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
        """The status document's ``cache`` section (``budget_bytes`` 0: no budget)."""
        return {
            "used_bytes": self.used_bytes,
            "budget_bytes": self.budget_bytes,
            "evicted_blobs": self.evicted_blobs,
            "evicted_bytes": self.evicted_bytes,
            "refusals": self.refusals,
        }
