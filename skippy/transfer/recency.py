"""When each hub-cache blob was last used: what the cache budget evicts by.

atime is unreliable (``noatime``/``relatime`` mounts, and a verification-record hit reads
nothing), so a node records use itself: a small JSON index, ``{"version": 1, "blobs":
{"<models--ns--name>/<sha256>": <unix seconds>}}``, updated when a stage's artifacts are
installed or found in place (every stage load goes through that) and rewritten whole with the
one atomic-install helper, under a lock so two writers of one node never lose each other's
entries. A missing or malformed index is empty (the blob's mtime stands in); an index that
cannot be written costs only eviction order, never correctness.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final

from skippy.atomic import LockBusy, atomic_write_bytes, exclusive_lock

log = logging.getLogger(__name__)
VERSION: Final = 1
MAX_ENTRIES: Final = 65536  # the oldest are forgotten beyond this (bounded file)
_KEY_RE: Final = re.compile(r"\Amodels--[A-Za-z0-9._-]+(--[A-Za-z0-9._-]+)*/[0-9a-f]{64}\Z")
_LOCK_S: Final = 2.0


def blob_key(blob: Path) -> str:
    """``models--ns--name/<sha256>`` for ``.../models--ns--name/blobs/<sha256>``."""
    return f"{blob.parent.parent.name}/{blob.name}"


class RecencyIndex:
    """The index file at ``path`` (beside the node's data, not inside the hub cache, which
    huggingface_hub scans)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, float]:
        try:
            doc = json.loads(self.path.read_bytes())
        except (OSError, ValueError):
            return {}
        blobs = doc.get("blobs") if isinstance(doc, dict) else None
        if not isinstance(blobs, dict) or doc.get("version") != VERSION:
            return {}
        return {
            k: float(v)
            for k, v in blobs.items()
            if isinstance(k, str) and _KEY_RE.match(k) and isinstance(v, int | float)
        }

    def touch(self, keys: Iterable[str], now: float) -> None:
        """Mark ``keys`` used at ``now`` (unix seconds)."""
        self._update({k: now for k in keys if _KEY_RE.match(k)}, ())

    def forget(self, keys: Iterable[str]) -> None:
        self._update({}, keys)

    def _update(self, used: Mapping[str, float], gone: Iterable[str]) -> None:
        gone = set(gone)
        if not used and not gone:
            return
        try:
            with exclusive_lock(self.path.with_name(self.path.name + ".lock"), timeout_s=_LOCK_S):
                entries = self.load()
                entries.update(used)
                for key in gone:
                    entries.pop(key, None)
                if len(entries) > MAX_ENTRIES:
                    newest = sorted(entries.items(), key=lambda kv: -kv[1])[:MAX_ENTRIES]
                    entries = dict(newest)
                data = json.dumps({"version": VERSION, "blobs": entries}, sort_keys=True)
                atomic_write_bytes(self.path, data.encode("utf-8"), durable=False)
        except (LockBusy, OSError) as exc:
            log.warning("cache recency index %s not updated: %s", self.path, exc)
