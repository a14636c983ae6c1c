"""One pinned package inside a Hugging Face hub cache, as peer transfer reads and fills it.

The layout is huggingface_hub's own (docs/runtime-facts.md): ``models--ns--name/{blobs/<etag>,
refs/<branch>, snapshots/<commit>/<path> -> ../../blobs/<etag>}``. Peer transfer names a
received blob by its SHA-256, which is what the Hub's ETag is for an LFS file, so a later
``hf_hub_download`` of the same file finds the blob, and takes the same lock
(``.locks/models--ns--name/<sha256>.lock``) as a concurrent huggingface_hub download of it.
Only pinned refs (``@<40-hex commit>``) are transferred, and huggingface_hub looks a commit up
in ``snapshots/`` directly: no ``refs/`` entry is written (we could not know what a branch
points at).

Also here: the read side every node shares. ``load_held_manifest`` reads a package's
manifest through the bounded reader and proves it is the topology's; ``verified_present``
says which artifacts are already in the cache with the declared size and SHA-256 (the
verification cache makes that instant when nothing changed).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from skippy.constants import MANIFEST_MAX_BYTES, MANIFEST_NAME
from skippy.consume.cache_layout import repo_cache_root
from skippy.consume.verify import FileStamp, Status, VerifyCache, cache_key, check_refs
from skippy.errors import (
    ArtifactMissing,
    InputUnreadable,
    IntegrityError,
    ManifestError,
    SkippyError,
    UnsafePath,
)
from skippy.findings import raise_for_findings
from skippy.hashing import sha256_file
from skippy.package.manifest import ArtifactRef, check_manifest, parse_manifest, read_manifest_bytes
from skippy.package.refs import HfPackageRef
from skippy.paths import check_relative_path
from skippy.produce.validate import stat_artifact
from skippy.transfer.authorize import HeldManifest
from skippy.transfer.fetch_plan import FetchItem
from skippy.transfer.wire import eligible_package_ref

log = logging.getLogger(__name__)
PEER_SNAPSHOTS = "peer-snapshots"  # beside huggingface_hub's snapshots/, never read by it
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class RepoCache:
    """Where one pinned package lives in the hub cache rooted at ``cache_dir``."""

    cache_dir: Path
    ref: HfPackageRef
    # "the cache tells the truth about commits": bytes named by a coordinator this
    # node does not trust are never linked under ``snapshots/<commit>/`` (where huggingface_hub
    # and our resolver look a commit up), but under ``peer-snapshots/<manifest sha256>/``:
    # named by what they are proven to be, not by what a stranger says the commit holds.
    peer_area: str | None = None

    @classmethod
    def for_ref(
        cls, cache_dir: Path, package_ref: str, *, untrusted_manifest: str | None = None
    ) -> RepoCache:
        """From an eligible ``hf://ns/repo@<commit>`` (``ArtifactWireError`` otherwise).
        ``untrusted_manifest`` (the manifest SHA-256 an untrusted coordinator named) selects
        the peer area instead of the commit's snapshot."""
        area = None
        if untrusted_manifest is not None:
            if not _SHA256_RE.match(untrusted_manifest):
                raise ManifestError("not a SHA-256", code="invalid_manifest_sha256")
            area = untrusted_manifest
        return cls(cache_dir, eligible_package_ref(package_ref), area)

    def __post_init__(self) -> None:
        if not self.ref.is_pinned:
            raise ManifestError(
                f"{self.ref} is not pinned to a commit", code="ineligible_package_ref"
            )

    @property
    def commit(self) -> str:
        return self.ref.revision or ""  # pinned: never empty

    @property
    def repo_root(self) -> Path:
        """``models--ns--name``: every cached file must resolve inside it."""
        return repo_cache_root(self.cache_dir, self.ref.repo_id)

    @property
    def snapshot_dir(self) -> Path:
        if self.peer_area is not None:
            return self.repo_root / PEER_SNAPSHOTS / self.peer_area
        return self.repo_root / "snapshots" / self.commit

    def snapshot_path(self, rel: str) -> Path:
        return self.snapshot_dir / check_relative_path(rel)

    def blob_path(self, sha256: str) -> Path:
        return self.repo_root / "blobs" / sha256.lower()

    def lock_path(self, sha256: str) -> Path:
        root = self.repo_root
        return root.parent / ".locks" / root.name / f"{sha256.lower()}.lock"


@dataclass(frozen=True)
class LoadedManifest:
    """A held manifest with the exact bytes it was parsed from (what a server streams)."""

    held: HeldManifest
    raw: bytes


def load_held_manifest(cache: RepoCache, expected_sha256: str) -> LoadedManifest:
    """Read ``model-package.json`` of the pinned package through the bounded reader and prove
    it: at most 16 MiB (spec "Peer Cache Transfer"), hashing to ``expected_sha256`` (the
    topology's), parsing as schema 1 with no error finding. Raises a coded ``SkippyError``:
    ``missing_manifest``, ``manifest_too_large``, ``manifest_sha256_mismatch``, ``unsafe_
    artifact_path`` (the snapshot entry leads outside the repo folder), or the parse error."""
    raw = read_manifest_bytes(cache.snapshot_dir, containment_root=cache.repo_root)
    if len(raw) > MANIFEST_MAX_BYTES:
        raise ManifestError(
            f"{cache.ref}: {MANIFEST_NAME} is over the {MANIFEST_MAX_BYTES}-byte cap",
            code="manifest_too_large",
            path=MANIFEST_NAME,
        )
    sha = hashlib.sha256(raw).hexdigest()
    if sha != expected_sha256.lower():
        raise IntegrityError(
            f"{cache.ref}: {MANIFEST_NAME} hashes to {sha}, the topology names "
            f"{expected_sha256}",
            code="manifest_sha256_mismatch",
            path=MANIFEST_NAME,
            expected=expected_sha256,
            actual=sha,
        )
    manifest = parse_manifest(raw)
    raise_for_findings(check_manifest(manifest), f"{cache.ref} manifest")
    return LoadedManifest(HeldManifest(manifest, sha, len(raw)), raw)


def manifest_present(cache: RepoCache, expected_sha256: str) -> bool:
    """Whether the cache already holds the topology's manifest (bytes proven, not trusted)."""
    try:
        load_held_manifest(cache, expected_sha256)
    except SkippyError:
        return False
    return True


def verified_present(
    cache: RepoCache,
    refs: Iterable[ArtifactRef],
    *,
    manifest_sha256: str,
    verify_cache: VerifyCache | None,
) -> dict[str, Status]:
    """The paths of ``refs`` present in the cache with the declared size and SHA-256, with
    how that was known (``cached``: a verification record, no read; ``hashed``). Missing,
    wrongly sized, escaping or corrupt files are simply absent from the answer: a fetch
    replaces them."""
    candidates: list[ArtifactRef] = []
    for ref in refs:
        try:
            stat_artifact(cache.snapshot_dir, ref, containment_root=cache.repo_root)
        except (ArtifactMissing, IntegrityError, UnsafePath, InputUnreadable):
            continue
        candidates.append(ref)
    if not candidates:
        return {}
    try:
        report = check_refs(
            cache.snapshot_dir,
            candidates,
            manifest_sha256=manifest_sha256,
            cache=verify_cache,
            containment_root=cache.repo_root,
        )
    except SkippyError as exc:  # a file vanished or changed between the two looks
        if len(candidates) == 1:
            return {}
        log.info("cache changed while checking %s (%s); checking one by one", cache.ref, exc)
        out: dict[str, Status] = {}
        for ref in candidates:
            out.update(
                verified_present(
                    cache, [ref], manifest_sha256=manifest_sha256, verify_cache=verify_cache
                )
            )
        return out
    return {c.path: c.status for c in report.artifacts if c.status != "mismatch"}


def verified_file(
    path: Path,
    item: FetchItem,
    *,
    manifest_sha256: str,
    verify_cache: VerifyCache | None,
) -> bool:
    """Whether ``path`` (followed if a link) is a regular file with ``item``'s size and
    SHA-256: a verification record answers without reading; otherwise it is hashed once and,
    if it did not change meanwhile, recorded."""
    try:
        st = path.stat()
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size > item.max_size:
        return False
    if item.size is not None and st.st_size != item.size:
        return False
    key = None
    if item.ref is not None and verify_cache is not None:
        key = cache_key(manifest_sha256, item.ref, FileStamp.of(st))
        if verify_cache.hit(key, item.sha256):
            return True
    try:
        digest = sha256_file(path)
    except InputUnreadable:
        return False
    if digest != item.sha256:
        return False
    if key is not None and verify_cache is not None:
        with contextlib.suppress(OSError):
            if FileStamp.of(path.stat()) == FileStamp.of(st):
                verify_cache.record(key, item.sha256, st.st_size)
    return True
