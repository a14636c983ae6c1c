"""Delta revisions: a new revision's artifacts that another revision in
the hub cache already holds, verified, move no bytes; their blob is linked into the new
snapshot.

- ``delta_matches`` (pure): which of the wanted artifacts (new manifest) are held, verified,
  under which other revision, matched by SHA-256 and size (what the hub cache's blobs are
  named by: content addressing is what makes a blob shareable).
- ``link_from_revisions`` (the shell): lists the other revisions of the package in the cache,
  reads each one's manifest through the bounded reader, asks ``verified_present`` (records,
  else one hash) which of the candidates really are what that manifest declares, and links
  each match into the new snapshot under the blob's install lock. The verification record is
  carried over to the new manifest's key when the old one still covers the file's stamp; else
  the linked file is hashed once. Nothing that fails a check is ever linked.

The rule ("the cache tells the truth about commits", docs/security.md) decides
*where* the link goes, not this module: the caller's ``RepoCache`` is the commit's snapshot
for a trusted coordinator's topology and ``peer-snapshots/<manifest sha256>/`` otherwise, so
an untrusted topology never writes under a commit. A blob first received for a peer area may
appear under a commit only when that commit's trusted manifest declares exactly its SHA-256
and size: it is then byte for byte the commit's file (blobs are shared and named by what
they are proven to be), which is the rule's own reasoning for sharing blobs.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from skippy.atomic import LockBusy, atomic_symlink, exclusive_lock
from skippy.consume.verify import FileStamp, VerifyCache, cache_key
from skippy.errors import SkippyError
from skippy.findings import raise_for_findings
from skippy.package.manifest import ArtifactRef, check_manifest, parse_manifest, read_manifest_bytes
from skippy.paths import is_within
from skippy.transfer.fetch_plan import FetchItem
from skippy.transfer.hubcache import PEER_SNAPSHOTS, RepoCache, verified_file, verified_present

log = logging.getLogger(__name__)
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
SHORT = 12  # characters of a commit (or manifest SHA-256) in a label


@dataclass(frozen=True)
class HeldRevision:
    """Another revision of the package in the cache: its label (``<commit>`` or
    ``peer:<manifest sha256>``), its manifest's SHA-256 and its artifacts."""

    label: str
    manifest_sha256: str
    refs: tuple[ArtifactRef, ...]

    @property
    def short(self) -> str:
        """What a report shows: ``<12 hex of the commit>`` or ``peer:<12 hex>``."""
        kind, _, ident = self.label.rpartition(":")
        return f"{kind}:{ident[:SHORT]}" if kind else ident[:SHORT]


@dataclass(frozen=True)
class DeltaMatch:
    """``path`` of the new manifest is ``source`` of revision ``revision``, same bytes."""

    path: str
    revision: HeldRevision
    source: ArtifactRef


def _key(ref: ArtifactRef) -> tuple[str, int]:
    return ref.artifact.sha256.lower(), ref.artifact.artifact_bytes


def delta_candidates(
    wanted: Iterable[ArtifactRef], held: Sequence[HeldRevision]
) -> dict[str, list[ArtifactRef]]:
    """Per revision label, its artifacts with the SHA-256 and size of a wanted one: what is
    worth verifying (pure)."""
    keys = {_key(r) for r in wanted}
    out: dict[str, list[ArtifactRef]] = {}
    for rev in held:
        found = [r for r in rev.refs if _key(r) in keys]
        if found:
            out[rev.label] = found
    return out


def delta_matches(
    wanted: Iterable[ArtifactRef],
    held: Sequence[HeldRevision],
    verified: Mapping[str, Iterable[str]],
) -> dict[str, DeltaMatch]:
    """Which ``wanted`` artifacts (by path) are held, verified, under another revision (pure).

    ``verified`` maps a revision label to the paths proven present in it (size and SHA-256
    against its own manifest). Commits are preferred over peer areas, then the label order,
    so the answer does not depend on the order directories were listed in."""
    by_key: dict[tuple[str, int], tuple[HeldRevision, ArtifactRef]] = {}
    for rev in sorted(held, key=lambda r: (r.label.startswith("peer:"), r.label)):
        proven = set(verified.get(rev.label, ()))
        for ref in rev.refs:
            if ref.path in proven:
                by_key.setdefault(_key(ref), (rev, ref))
    out: dict[str, DeltaMatch] = {}
    for ref in wanted:
        hit = by_key.get(_key(ref))
        if hit is not None:
            out[ref.path] = DeltaMatch(ref.path, hit[0], hit[1])
    return out


# --- the shell ------------------------------------------------------------------------------
def _revision_caches(cache: RepoCache) -> list[tuple[str, RepoCache]]:
    """Every other revision folder of the package: commits, then peer areas."""
    out: list[tuple[str, RepoCache]] = []
    root = cache.repo_root
    own = cache.snapshot_dir
    with contextlib.suppress(OSError):
        for entry in sorted(os.listdir(root / "snapshots")):
            if _COMMIT_RE.match(entry):
                other = RepoCache(cache.cache_dir, cache.ref.at(entry))
                if other.snapshot_dir != own:
                    out.append((entry, other))
    with contextlib.suppress(OSError):
        for entry in sorted(os.listdir(root / PEER_SNAPSHOTS)):
            if _SHA256_RE.match(entry):
                other = RepoCache(cache.cache_dir, cache.ref, peer_area=entry)
                if other.snapshot_dir != own:
                    out.append((f"peer:{entry}", other))
    return out


def _held(label: str, other: RepoCache) -> HeldRevision | None:
    """The revision's manifest, through the bounded reader; None if it is not a valid one."""
    try:
        raw = read_manifest_bytes(other.snapshot_dir, containment_root=other.repo_root)
        manifest = parse_manifest(raw)
        raise_for_findings(check_manifest(manifest), f"{other.ref} manifest")
    except SkippyError as exc:
        log.debug("revision %s not usable for delta: %s", label, exc.code)
        return None
    sha = hashlib.sha256(raw).hexdigest()
    if other.peer_area is not None and other.peer_area != sha:
        return None  # a peer area is named by its manifest's digest, or it is not one
    return HeldRevision(label, sha, tuple(manifest.artifacts()))


def held_revisions(cache: RepoCache) -> list[tuple[HeldRevision, RepoCache]]:
    """The other revisions of ``cache``'s package with a valid manifest, with where each
    lives (I/O)."""
    out = []
    for label, other in _revision_caches(cache):
        held = _held(label, other)
        if held is not None:
            out.append((held, other))
    return out


def link_from_revisions(
    cache: RepoCache,
    wanted: Sequence[ArtifactRef],
    *,
    manifest_sha256: str,
    verify_cache: VerifyCache | None,
) -> dict[str, DeltaMatch]:
    """Link every ``wanted`` artifact (of the manifest ``manifest_sha256``) that another
    revision holds verified into ``cache``'s snapshot; return what was linked, by path.
    Synchronous (a trio shell runs it on a thread)."""
    if not wanted:
        return {}
    found = held_revisions(cache)
    held = [h for h, _ in found]
    candidates = delta_candidates(wanted, held)
    if not candidates:
        return {}
    caches = {h.label: c for h, c in found}
    revisions = {h.label: h for h in held}
    verified = {
        label: verified_present(
            caches[label],
            refs,
            manifest_sha256=revisions[label].manifest_sha256,
            verify_cache=verify_cache,
        )
        for label, refs in candidates.items()
    }
    matches = delta_matches(wanted, held, verified)
    by_path = {r.path: r for r in wanted}
    linked: dict[str, DeltaMatch] = {}
    for path, match in matches.items():
        source = caches[match.revision.label]
        if _link_one(cache, by_path[path], source, match, manifest_sha256, verify_cache):
            linked[path] = match
    return linked


def _link_one(
    cache: RepoCache,
    ref: ArtifactRef,
    source: RepoCache,
    match: DeltaMatch,
    manifest_sha256: str,
    verify_cache: VerifyCache | None,
) -> bool:
    item = FetchItem.of(ref)
    blobs = cache.repo_root / "blobs"
    try:
        with exclusive_lock(cache.lock_path(item.sha256)):  # the sink's and eviction's lock
            src = source.snapshot_path(match.source.path)
            target = Path(os.path.realpath(src))
            if not is_within(target, blobs):
                return False  # only a content-addressed blob is shared, never a local file
            link = cache.snapshot_path(ref.path)
            atomic_symlink(os.path.relpath(target, link.parent), link)
            st = link.stat()  # the blob, as the records know it
            if _carry_record(ref, match, st, manifest_sha256, verify_cache):
                return True
            if verified_file(
                link, item, manifest_sha256=manifest_sha256, verify_cache=verify_cache
            ):
                return True
            with contextlib.suppress(FileNotFoundError):
                link.unlink()  # changed since it was verified: the fetch brings it
            return False
    except (LockBusy, OSError, SkippyError) as exc:
        log.info("delta link of %s skipped: %s", ref.path, exc)
        return False


def _carry_record(
    ref: ArtifactRef,
    match: DeltaMatch,
    st: os.stat_result,
    manifest_sha256: str,
    verify_cache: VerifyCache | None,
) -> bool:
    """The old revision's record still covers this exact file: record it for the new
    manifest too (no read). False when there is no such record."""
    if verify_cache is None:
        return False
    stamp = FileStamp.of(st)
    old = cache_key(match.revision.manifest_sha256, match.source, stamp)
    if not verify_cache.hit(old, ref.artifact.sha256):
        return False
    verify_cache.record(cache_key(manifest_sha256, ref, stamp), ref.artifact.sha256, st.st_size)
    return True
