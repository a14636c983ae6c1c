"""The hub fallback for one artifact a peer could not deliver ("fall back
to the hub for that artifact; never install a partial or unverified file").

huggingface_hub downloads it into the same cache the peer sink fills (its own hidden
``.incomplete`` file and rename, under the same per-blob lock file), and checks only the size
(runtime-facts.md), so the SHA-256 is proven here before the file counts as present; a corrupt
copy is evicted at once so the next attempt downloads it again.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from skippy.atomic import atomic_symlink
from skippy.consume import hub
from skippy.consume.verify import VerifyCache
from skippy.errors import IntegrityError
from skippy.paths import is_within
from skippy.transfer.fetch_plan import FetchItem
from skippy.transfer.hubcache import RepoCache, verified_file


def fetch_from_hub(
    cache: RepoCache,
    item: FetchItem,
    *,
    manifest_sha256: str,
    verify_cache: VerifyCache | None,
    endpoint: str | None = None,
    offline: bool = False,
) -> Path:
    """Download ``item`` from the hub into ``cache`` (or find it there) and prove it; return
    its snapshot path. Do not call it while holding this artifact's ``open_chunk_sink``: both take
    the same lock file."""
    path = hub.download_file(
        cache.ref,
        cache.commit,
        item.path,
        endpoint=endpoint,
        cache_dir=cache.cache_dir,
        offline=offline,
    )
    if verified_file(path, item, manifest_sha256=manifest_sha256, verify_cache=verify_cache):
        if cache.peer_area is None:
            return path
        # The hub's bytes for the commit are the truth; the peer area links the same blob.
        link = cache.snapshot_path(item.path)
        blob = path.resolve()
        if not is_within(blob, cache.repo_root):
            raise IntegrityError(
                f"{item.path}: the hub cache entry leads outside its repository folder",
                code="unsafe_artifact_path",
                path=item.path,
            )
        link.parent.mkdir(parents=True, exist_ok=True)
        atomic_symlink(os.path.relpath(blob, link.parent), link)
        return link
    with contextlib.suppress(OSError):
        blob = path.resolve()
        path.unlink()
        if is_within(blob, cache.repo_root):
            blob.unlink()
    raise IntegrityError(
        f"{item.path} downloaded from the hub does not match the manifest's size and SHA-256; "
        "the corrupt copy was removed from the hub cache",
        code="artifact_sha256_mismatch",
        path=item.path,
        paths=(item.path,),
        expected=item.sha256,
        remediation="retry; if it persists the hub serves a different file than the manifest",
    )
