"""The cache budget's eviction: least-recently-used blobs that nothing on
this node needs make room for a stage's fetch.

- ``plan_eviction`` (pure): given every blob with its size, last use and whether it is pinned,
  which to delete (oldest first) so the cache plus the incoming bytes fits the budget; nothing
  at all when even deleting every unpinned blob would not make room (the fetch is refused
  then, with ``cache_budget``, and nothing was lost for it).
- ``scan_blobs`` / ``evict`` (the shell): a blob is *pinned* when a file of a needed snapshot
  (the active topology's, the running stage's; the caller names them) resolves to it. Only
  blobs of repositories holding a layer package (a snapshot with ``model-package.json``) are
  candidates: the hub cache may be shared with other huggingface_hub users, whose models this
  node has no business deleting. Partials are never candidates (``evict_partials`` caps those,
  never one being written). A blob is deleted under its install lock (the sink's, the delta
  linker's): one being installed or linked right now is skipped; then the links left dangling
  by it in other snapshots are removed, so huggingface_hub sees the file as absent, not broken.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from skippy.atomic import LockBusy, exclusive_lock
from skippy.constants import MANIFEST_NAME
from skippy.transfer.hubcache import PEER_SNAPSHOTS
from skippy.transfer.recency import blob_key

log = logging.getLogger(__name__)
_BLOB_RE: Final = re.compile(r"\A[0-9a-f]{64}\Z")


@dataclass(frozen=True)
class BlobUse:
    key: str  # models--ns--name/<sha256>
    size: int
    last_used: float  # unix seconds (the recency index, else the blob's mtime)
    pinned: bool  # needed by an active topology or a running stage: never evicted


@dataclass(frozen=True)
class EvictionPlan:
    evict: tuple[BlobUse, ...]  # oldest first
    freed_bytes: int
    shortfall_bytes: int  # > 0: even evicting every unpinned blob would not make room

    @property
    def fits(self) -> bool:
        return self.shortfall_bytes == 0


def plan_eviction(
    blobs: Iterable[BlobUse], *, used_bytes: int, budget_bytes: int, incoming_bytes: int
) -> EvictionPlan:
    """Which blobs to delete so ``used_bytes - freed + incoming_bytes <= budget_bytes``.
    Ties in last use go by key, so the plan does not depend on listing order."""
    over = used_bytes + incoming_bytes - budget_bytes
    if over <= 0:
        return EvictionPlan((), 0, 0)
    chosen: list[BlobUse] = []
    freed = 0
    for blob in sorted((b for b in blobs if not b.pinned), key=lambda b: (b.last_used, b.key)):
        if freed >= over:
            break
        chosen.append(blob)
        freed += blob.size
    if freed < over:
        return EvictionPlan((), 0, over - freed)  # refuse, and lose nothing for it
    return EvictionPlan(tuple(chosen), freed, 0)


# --- the shell ------------------------------------------------------------------------------
def _snapshot_dirs(repo: Path) -> list[Path]:
    out: list[Path] = []
    for area in ("snapshots", PEER_SNAPSHOTS):
        with contextlib.suppress(OSError):
            out += [p for p in sorted((repo / area).iterdir()) if p.is_dir()]
    return out


def _holds_package(repo: Path) -> bool:
    return any((d / MANIFEST_NAME).exists() for d in _snapshot_dirs(repo))


def _linked_blobs(snapshot: Path) -> set[str]:
    """The real paths of every file under ``snapshot`` (what it links to)."""
    out: set[str] = set()
    for dirpath, _dirs, files in os.walk(snapshot):
        for name in files:
            out.add(os.path.realpath(os.path.join(dirpath, name)))
    return out


def scan_blobs(
    cache_dir: Path, needed_snapshots: Collection[Path], recency: Mapping[str, float]
) -> list[BlobUse]:
    """Every blob of the package repositories in the hub cache, pinned or not (I/O)."""
    pinned: set[str] = set()
    for snap in needed_snapshots:
        pinned |= _linked_blobs(snap)
    out: list[BlobUse] = []
    try:
        repos = sorted(p for p in cache_dir.iterdir() if p.name.startswith("models--"))
    except OSError:
        return []
    for repo in repos:
        if not _holds_package(repo):
            continue
        with contextlib.suppress(OSError), os.scandir(repo / "blobs") as entries:
            for entry in entries:
                if not _BLOB_RE.match(entry.name):
                    continue  # partials (".<sha>.<pid>.<ns>.part") and anything else
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                path = Path(entry.path)
                key = blob_key(path)
                out.append(
                    BlobUse(
                        key,
                        st.st_size,
                        recency.get(key, st.st_mtime),
                        os.path.realpath(path) in pinned,
                    )
                )
    return out


def _lock_for(blob: Path) -> Path:
    repo = blob.parent.parent
    return repo.parent / ".locks" / repo.name / f"{blob.name}.lock"


def evict(cache_dir: Path, plan: EvictionPlan) -> list[BlobUse]:
    """Delete the planned blobs (each under its install lock; a busy one is skipped) and the
    snapshot links they leave dangling. Returns the blobs deleted."""
    done: list[BlobUse] = []
    for blob in plan.evict:
        repo_name, _, sha = blob.key.partition("/")
        repo = cache_dir / repo_name
        path = repo / "blobs" / sha
        try:
            with exclusive_lock(_lock_for(path)):
                path.unlink()
        except (LockBusy, FileNotFoundError):
            continue
        except OSError as exc:
            log.warning("could not evict %s: %s", blob.key, exc)
            continue
        _drop_dangling(repo, path)
        log.info("evicted %s (%d bytes, last used %.0f)", blob.key, blob.size, blob.last_used)
        done.append(blob)
    return done


def _drop_dangling(repo: Path, blob: Path) -> None:
    target = os.path.realpath(blob)
    for snap in _snapshot_dirs(repo):
        for dirpath, _dirs, files in os.walk(snap):
            for name in files:
                link = Path(dirpath) / name
                if link.is_symlink() and os.path.realpath(link) == target and not link.exists():
                    with contextlib.suppress(FileNotFoundError):
                        link.unlink()
