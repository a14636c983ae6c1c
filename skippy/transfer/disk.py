"""Disk budgets for what peers make a node store.

- ``stage_disk_problem`` (pure): the declared sizes of a stage's artifacts are checked before
  a byte of them is written: the stage must fit the node's announced memory budget (a stage is
  loaded whole; the coordinator planned it so), the cache budget (when configured) and the
  disk's free space.
- ``evict_partials``: partials of failed or abandoned fetches stay for a resume, but all
  partials of the hub cache together are capped; the oldest (by modification time) go first,
  never one whose artifact another fetch is installing right now (its lock is held).
- ``auto_cache_budget`` (pure): the hub-cache budget a node takes from its disk when
  ``cache_budget = "auto"`` (the default), so a cache that nobody sized still stops growing.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from skippy.atomic import LockBusy, exclusive_lock

PARTIAL_SUFFIX = ".part"
GIB: Final = 1024**3
AUTO_CACHE_SHARE: Final = 0.5  # at most half the filesystem holding the cache
AUTO_CACHE_RESERVE_SHARE: Final = 0.1  # left free for everything else on that filesystem,
AUTO_CACHE_RESERVE_MAX_BYTES: Final = 10 * GIB  # but never more than this
AUTO_CACHE_MIN_BYTES: Final = 1 * GIB  # a nearly full disk: the free-space check refuses


@dataclass(frozen=True)
class AutoCacheBudget:
    """The derived budget and the figures it came from (the node's start-up line)."""

    budget_bytes: int
    disk_total_bytes: int
    disk_free_bytes: int
    cache_used_bytes: int
    reserve_bytes: int

    def explain(self) -> str:
        return (
            f"the least of half the filesystem ({self.disk_total_bytes // 2} of "
            f"{self.disk_total_bytes} bytes) and the cache's {self.cache_used_bytes} bytes plus "
            f"the {self.disk_free_bytes} free, less a reserve of {self.reserve_bytes}; at least "
            f"{AUTO_CACHE_MIN_BYTES}"
        )


def auto_cache_budget(
    *, disk_total_bytes: int, disk_free_bytes: int, cache_used_bytes: int
) -> AutoCacheBudget:
    """``min(half the filesystem, cache + free space - reserve)``, at least 1 GiB; the reserve
    is a tenth of the filesystem, at most 10 GiB. The cache's own bytes count as room, so a
    node restarted with a full cache derives the same budget as before it filled."""
    reserve = min(int(disk_total_bytes * AUTO_CACHE_RESERVE_SHARE), AUTO_CACHE_RESERVE_MAX_BYTES)
    room = cache_used_bytes + disk_free_bytes - reserve
    budget = max(AUTO_CACHE_MIN_BYTES, min(int(disk_total_bytes * AUTO_CACHE_SHARE), room))
    return AutoCacheBudget(budget, disk_total_bytes, disk_free_bytes, cache_used_bytes, reserve)


def stage_disk_problem(
    *,
    required_bytes: int,
    fetch_bytes: int,
    memory_budget_bytes: int,
    cache_budget_bytes: int,
    cache_used_bytes: int,
    disk_free_bytes: int,
) -> tuple[str, str] | None:
    """Why the declared sizes cannot be accepted, as ``(code, message)``, or None."""
    if required_bytes > memory_budget_bytes:
        return (
            "stage_too_large",
            f"the stage declares {required_bytes} bytes, over this node's memory budget of "
            f"{memory_budget_bytes}",
        )
    if cache_budget_bytes and cache_used_bytes + fetch_bytes > cache_budget_bytes:
        return (
            "cache_budget",
            f"fetching {fetch_bytes} bytes would grow the hub cache to "
            f"{cache_used_bytes + fetch_bytes}, over its budget of {cache_budget_bytes}",
        )
    if fetch_bytes > disk_free_bytes:
        return (
            "disk_full",
            f"fetching {fetch_bytes} bytes needs more than the {disk_free_bytes} free on disk",
        )
    return None


def _blob_dirs(cache_dir: Path) -> list[Path]:
    try:
        return [p / "blobs" for p in cache_dir.iterdir() if p.name.startswith("models--")]
    except OSError:
        return []


def cache_usage(cache_dir: Path) -> int:
    """Bytes in the hub cache's blobs (partials included): what the cache budget counts."""
    total = 0
    for blobs in _blob_dirs(cache_dir):
        with contextlib.suppress(OSError), os.scandir(blobs) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        total += st.st_size
    return total


def _partials(cache_dir: Path) -> list[tuple[float, int, Path]]:
    out: list[tuple[float, int, Path]] = []
    for blobs in _blob_dirs(cache_dir):
        with contextlib.suppress(OSError), os.scandir(blobs) as entries:
            for entry in entries:
                if entry.name.startswith(".") and entry.name.endswith(PARTIAL_SUFFIX):
                    with contextlib.suppress(OSError):
                        st = entry.stat(follow_symlinks=False)
                        out.append((st.st_mtime, st.st_size, Path(entry.path)))
    return out


def _lock_for(partial: Path) -> Path:
    """The install lock of the blob a partial belongs to (``.<sha256>.<pid>.<ns>.part``)."""
    sha = partial.name.split(".")[1]
    repo = partial.parent.parent
    return repo.parent / ".locks" / repo.name / f"{sha}.lock"


def evict_partials(cache_dir: Path, budget_bytes: int, incoming_bytes: int = 0) -> list[Path]:
    """Delete the oldest partials until they and ``incoming_bytes`` fit ``budget_bytes``.
    Returns the deleted paths."""
    found = sorted(_partials(cache_dir))
    total = sum(size for _, size, _ in found)
    deleted: list[Path] = []
    for _mtime, size, path in found:
        if total + incoming_bytes <= budget_bytes:
            break
        try:
            with exclusive_lock(_lock_for(path)):
                path.unlink()
        except (LockBusy, FileNotFoundError, IndexError):
            continue
        except OSError:
            continue
        total -= size
        deleted.append(path)
    return deleted
