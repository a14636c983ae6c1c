"""SHA-256 verification of a stage's selected artifacts, with a verification cache.

Spec "Consumer Validation": consumers MUST verify SHA-256 checksums for selected artifacts
before using an ``hf://`` package, cache hits included; local package directories MAY keep
it behind ``SKIPPY_VERIFY_PACKAGE_SHA``. Implementations MAY cache successful results, with
keys and records "derived from manifest and artifact identity plus file metadata", never
storing raw local package paths.

The cache is a directory of small JSON records, one per verified artifact, each installed
atomically through ``skippy.atomic`` (no shared file, so concurrent verifiers never lose each
other's updates). A record's name is the SHA-256 of its key: the manifest digest, the
artifact identity (role, layer index, manifest-relative path, SHA-256, bytes) and the file's
metadata (device, inode, size, mtime_ns, ctime_ns). Any change to the file, even one that
restores its mtime, changes ctime and therefore misses the cache. A record holds no path.

Only a fully successful verification writes records; a mismatch raises ``IntegrityError``
(``artifact_sha256_mismatch``) and records nothing. Known limit, as for any metadata-keyed
cache (git's "racy" files): a rewrite of the same size, inode and timestamps within one tick
of the filesystem clock after the verified write is not seen; ext4 here has ns timestamps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from skippy.atomic import atomic_write_bytes
from skippy.errors import IntegrityError
from skippy.hashing import DEFAULT_WORKERS, sha256_files
from skippy.package.artifacts import stat_artifact
from skippy.package.manifest import ArtifactRef
from skippy.package.select import StageSelection
from skippy.progress import byte_bar

log = logging.getLogger(__name__)

CACHE_RECORD_FORMAT: Final = "skippy-verify-cache"
CACHE_RECORD_VERSION: Final = 1
_RECORD_SUFFIX: Final = ".json"

Status = Literal["hashed", "cached", "mismatch"]


@dataclass(frozen=True)
class FileStamp:
    """The file metadata a cache record is tied to."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def cache_key(manifest_sha256: str, ref: ArtifactRef, stamp: FileStamp) -> str:
    """The hex SHA-256 naming one artifact's verification record (spec: keys "derived from
    manifest and artifact identity plus file metadata"; no local path goes in)."""
    identity = {
        "v": CACHE_RECORD_VERSION,
        "manifest_sha256": manifest_sha256.lower(),
        "role": ref.role,
        "layer_index": ref.layer_index,
        "path": ref.path,  # manifest-relative, never a local path
        "sha256": ref.artifact.sha256.lower(),
        "artifact_bytes": ref.artifact.artifact_bytes,
        "file": [stamp.device, stamp.inode, stamp.size, stamp.mtime_ns, stamp.ctime_ns],
    }
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class VerifyCache:
    """A directory of verification records; pass its location explicitly (or ``default()``)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def under(cls, skippy_cache_dir: Path) -> VerifyCache:
        """The cache inside the project's cache folder (``skippy.config``)."""
        return cls(skippy_cache_dir / "verify")

    def _record_path(self, key: str) -> Path:
        return self.root / f"{key}{_RECORD_SUFFIX}"

    def hit(self, key: str, expected_sha256: str) -> bool:
        """True iff a well-formed record for ``key`` vouches for ``expected_sha256``. An
        unreadable or malformed record is a miss: the artifact is simply hashed again."""
        try:
            raw = self._record_path(key).read_bytes()
            rec = json.loads(raw)
        except (OSError, ValueError):
            return False
        return (
            isinstance(rec, dict)
            and rec.get("format") == CACHE_RECORD_FORMAT
            and rec.get("version") == CACHE_RECORD_VERSION
            and rec.get("key") == key
            and isinstance(rec.get("sha256"), str)
            and rec["sha256"].lower() == expected_sha256.lower()
        )

    def record(self, key: str, sha256: str, artifact_bytes: int) -> None:
        """Install one record atomically. A cache that cannot be written costs only speed."""
        rec = {
            "format": CACHE_RECORD_FORMAT,
            "version": CACHE_RECORD_VERSION,
            "key": key,
            "sha256": sha256.lower(),
            "artifact_bytes": artifact_bytes,
            "verified_at_unix_secs": int(time.time()),
        }
        data = (json.dumps(rec, sort_keys=True) + "\n").encode("utf-8")
        try:
            atomic_write_bytes(self._record_path(key), data, durable=False)
        except OSError as exc:
            log.warning("verification cache %s is not writable: %s", self.root, exc)


# --- report ------------------------------------------------------------
@dataclass(frozen=True)
class ArtifactCheck:
    role: str
    layer_index: int | None
    path: str  # manifest-relative
    artifact_bytes: int
    expected_sha256: str
    status: Status
    actual_sha256: str | None = None  # None for cache hits

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "role": self.role,
            "layer_index": self.layer_index,
            "path": self.path,
            "artifact_bytes": self.artifact_bytes,
            "status": self.status,
        }
        if self.status == "mismatch":
            out["expected_sha256"] = self.expected_sha256
            out["actual_sha256"] = self.actual_sha256
        return out


@dataclass
class VerifyReport:
    artifacts: list[ArtifactCheck] = field(default_factory=list)
    bytes_hashed: int = 0
    seconds: float = 0.0

    @property
    def hashed(self) -> int:
        return sum(1 for a in self.artifacts if a.status == "hashed")

    @property
    def cached(self) -> int:
        return sum(1 for a in self.artifacts if a.status == "cached")

    @property
    def mismatches(self) -> list[ArtifactCheck]:
        return [a for a in self.artifacts if a.status == "mismatch"]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def raise_for_mismatch(self) -> None:
        bad = self.mismatches
        if not bad:
            return
        first = bad[0]
        more = f" (and {len(bad) - 1} more artifacts)" if len(bad) > 1 else ""
        raise IntegrityError(
            f"{first.path} has SHA-256 {first.actual_sha256}, the manifest declares "
            f"{first.expected_sha256}{more}: the file is corrupt or was replaced",
            code="artifact_sha256_mismatch",
            path=first.path,
            paths=tuple(c.path for c in bad),
            expected=first.expected_sha256,
            actual=first.actual_sha256,
            remediation="delete the file and fetch the package again; never load it as is",
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "hashed": self.hashed,
            "cached": self.cached,
            "bytes_hashed": self.bytes_hashed,
            "seconds": round(self.seconds, 4),
            "artifacts": [a.to_dict() for a in self.artifacts],
        }


# --- verification ------------------------------------------------------------
def _stat_artifact(
    root: Path, ref: ArtifactRef, containment_root: Path | None
) -> tuple[Path, FileStamp]:
    p, st = stat_artifact(root, ref, containment_root=containment_root)
    return p, FileStamp.of(st)


def check_refs(
    root: Path,
    refs: Sequence[ArtifactRef],
    *,
    manifest_sha256: str,
    cache: VerifyCache | None,
    containment_root: Path | None = None,
    workers: int = DEFAULT_WORKERS,
) -> VerifyReport:
    """Verify ``refs`` (each file once), hashing cache misses in parallel; mismatches are in
    the report, not raised. Missing, unsafe or wrongly sized files raise (no hashing needed
    to know they are wrong). Every artifact that verified gets a record, also when another
    one did not."""
    t0 = time.perf_counter()
    report = VerifyReport()
    unique: dict[str, ArtifactRef] = {}
    for ref in refs:
        unique.setdefault(ref.path, ref)
    stamped = [(ref, *_stat_artifact(root, ref, containment_root)) for ref in unique.values()]

    results: dict[str, ArtifactCheck] = {}
    misses: list[tuple[ArtifactRef, Path, FileStamp, str | None]] = []
    for ref, path, stamp in stamped:
        key = cache_key(manifest_sha256, ref, stamp) if cache is not None else None
        if cache is not None and key is not None and cache.hit(key, ref.artifact.sha256):
            results[ref.path] = _check(ref, "cached")
        else:
            misses.append((ref, path, stamp, key))

    with byte_bar(sum(m[2].size for m in misses), "sha256") as on_bytes:
        digests = sha256_files([m[1] for m in misses], workers=workers, on_bytes=on_bytes)
    to_record: list[tuple[str, ArtifactRef]] = []
    for (ref, path, before, key), digest in zip(misses, digests, strict=True):
        report.bytes_hashed += before.size
        if digest.lower() != ref.artifact.sha256.lower():
            results[ref.path] = _check(ref, "mismatch", digest)
            continue
        results[ref.path] = _check(ref, "hashed", digest)
        # Only cache what provably did not change while we read it.
        if key is not None and _restat(path) == before:
            to_record.append((key, ref))

    report.artifacts = [results[ref.path] for ref in unique.values()]
    # Each record stands for one file's bytes under this manifest, so a mismatch elsewhere
    # does not make a verified file worth hashing again (the bad one gets no record).
    if cache is not None:
        for key, ref in to_record:
            cache.record(key, ref.artifact.sha256, ref.artifact.artifact_bytes)
    report.seconds = time.perf_counter() - t0
    return report


def _check(ref: ArtifactRef, status: Status, actual: str | None = None) -> ArtifactCheck:
    return ArtifactCheck(
        role=ref.role,
        layer_index=ref.layer_index,
        path=ref.path,
        artifact_bytes=ref.artifact.artifact_bytes,
        expected_sha256=ref.artifact.sha256,
        status=status,
        actual_sha256=actual,
    )


def _restat(path: Path) -> FileStamp | None:
    try:
        return FileStamp.of(path.stat())
    except OSError:
        return None


def verify_selection(
    root: Path,
    selection: StageSelection,
    *,
    manifest_sha256: str,
    cache: VerifyCache | None,
    containment_root: Path | None = None,
) -> VerifyReport:
    """Verify every artifact a stage will load (its parts and its projector, if any) against
    the manifest's SHA-256; raise ``IntegrityError`` (``artifact_sha256_mismatch``) naming the
    path, expected and actual digest on the first mismatch. ``containment_root`` is for hub
    caches whose snapshot files are symlinks into ``blobs/`` (see ``skippy.paths``)."""
    report = check_refs(
        root,
        selection.all_refs,
        manifest_sha256=manifest_sha256,
        cache=cache,
        containment_root=containment_root,
    )
    report.raise_for_mismatch()
    return report
