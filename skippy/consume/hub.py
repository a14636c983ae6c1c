"""Hub resolution and download: a thin wrapper over ``huggingface_hub``, never hand-written HTTP.

Files land in the standard hub cache (``models--ns--name/snapshots/<commit>/<path>``) so the
``hf`` tooling sees them. ``endpoint`` is passed on every call because ``huggingface_hub``
reads ``HF_ENDPOINT``/``HF_HUB_OFFLINE`` once at import time. Every ``huggingface_hub``
exception is translated into a ``SkippyError`` here; none escapes.

The client checks downloads by size only, so callers MUST verify SHA-256 against the manifest
(spec: "Consumers MUST verify SHA-256 checksums ... including cache-hit resolutions").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final, NoReturn

import httpx2
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    FileMetadataError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    RevisionResolutionError,
)
from huggingface_hub.utils.tqdm import disable_progress_bars, enable_progress_bars

from skippy import progress
from skippy.config import HubPolicy
from skippy.consume.cache_layout import repo_cache_root
from skippy.consume.hub_policy import HubGaveUp, install
from skippy.errors import EXIT_USAGE, ArtifactMissing, SkippyError, UnsafePath, UsageError
from skippy.package.refs import COMMIT_SHA_RE, HfPackageRef
from skippy.paths import check_relative_path, is_within

# huggingface_hub 2.x builds its user agent by fetching ``{ENDPOINT}/api/agent-harnesses`` (the
# endpoint read at import time, huggingface.co by default, whatever endpoint a call is given)
# unless telemetry is off: a node must never call a hub it was not pointed at. The flag is read
# at each call, so setting it here (the one module that talks to huggingface_hub) covers all.
constants.HF_HUB_DISABLE_TELEMETRY = True

logger = logging.getLogger(__name__)


# Everything huggingface_hub (and the httpx2 client under it) raises for a failed lookup or
# download. OSError covers its offline/connection errors and size-check failures, and disk
# errors while writing the cache. Programming errors (TypeError...) still propagate.
_HUB_FAILURES: Final = (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RevisionResolutionError,
    FileMetadataError,
    HFValidationError,
    httpx2.HTTPError,
    OSError,
)


class HubError(SkippyError):
    """The Hub answered with an error, sent something unusable, or could not be reached."""

    code = "hub_http_error"
    exit_code = EXIT_USAGE


class HubRefNotFound(ArtifactMissing):
    """The reference names a repository or revision the hub does not have: a bad reference
    (exit 2), unlike a file the manifest names but the repo lacks (an invalid package, 1)."""

    code = "hub_repo_not_found"
    exit_code = EXIT_USAGE


class OfflineCacheMiss(ArtifactMissing):
    """Offline mode and the cache lacks what was asked for; ``missing`` lists every path.
    Unreadable input (exit 2): nothing says the package is wrong."""

    code = "not_in_offline_cache"
    exit_code = EXIT_USAGE

    def __init__(self, message: str, missing: Iterable[str], **kwargs: Any) -> None:
        self.missing = tuple(missing)
        super().__init__(message, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "missing": list(self.missing)}


def resolve_revision(
    ref: HfPackageRef,
    *,
    endpoint: str | None = None,
    cache_dir: Path | str | None = None,
    offline: bool = False,
    policy: HubPolicy | None = None,
) -> str:
    """The 40-hex commit ``ref`` names now; offline, from the cache's ``refs/`` or ``snapshots/``.

    Online, a branch/tag is asked of the Hub and the answer is recorded in ``refs/`` (which is
    what makes a later offline resolution possible). As in ``huggingface_hub``, a Hub that is
    down (5xx, unreachable) falls back to the cached ref with a warning. A full commit sha
    needs no lookup.
    """
    install(policy or HubPolicy())
    api = HfApi(endpoint=endpoint)
    try:
        resolved = api.resolve_revision(
            ref.repo_id,
            revision=ref.revision,
            cache_dir=cache_dir,
            local_files_only=offline,
        )
    except RevisionResolutionError as exc:
        cause = exc.__cause__
        if offline or isinstance(cause, OfflineModeIsEnabled):
            raise OfflineCacheMiss(
                f"{ref}: revision {ref.revision or 'main'!r} is not in the offline cache "
                f"({repo_cache_root(cache_dir, ref.repo_id)}/refs).",
                missing=(f"refs/{ref.revision or 'main'}",),
                remediation="Resolve it once online, or pin a commit that is already cached.",
            ) from None
        _raise_hub_error(ref, cause if cause is not None else exc, None)
    except _HUB_FAILURES as exc:
        _raise_hub_error(ref, exc, None)
    commit = str(resolved.resolved)
    if (
        offline
        and ref.is_pinned
        and not (repo_cache_root(cache_dir, ref.repo_id) / "snapshots" / commit).is_dir()
    ):
        raise OfflineCacheMiss(
            f"{ref}: commit {commit} has no snapshot in the offline cache "
            f"({repo_cache_root(cache_dir, ref.repo_id)}/snapshots).",
            missing=(f"snapshots/{commit}",),
            remediation="Download the package once online before running offline.",
        )
    if not ref.is_pinned:
        logger.warning(
            "%s is a moving reference (now %s); production configs should pin a commit: %s",
            ref,
            commit,
            ref.at(commit),
        )
    return commit


def list_files(
    ref: HfPackageRef,
    commit: str,
    *,
    endpoint: str | None = None,
    offline: bool = False,
    policy: HubPolicy | None = None,
) -> list[str]:
    """Every file path of the repo at ``commit`` (the hub's listing; needs the network)."""
    if offline:
        raise HubError(
            f"{ref.repo_id}: listing the repo's files needs the hub, and offline mode is on",
            code="hub_listing_offline",
            remediation="unset HF_HUB_OFFLINE, or pass the downloaded GGUF as a local SOURCE",
        )
    install(policy or HubPolicy())
    try:
        info = HfApi(endpoint=endpoint).model_info(ref.repo_id, revision=commit)
    except _HUB_FAILURES as exc:
        _raise_hub_error(ref.at(commit), exc, None)
    return sorted(s.rfilename for s in info.siblings or [])


def remote_size(
    ref: HfPackageRef,
    commit: str,
    relpath: str,
    *,
    endpoint: str | None = None,
    policy: HubPolicy | None = None,
) -> int | None:
    """Size of one file on the hub at ``commit`` without downloading it (one HEAD request);
    None when the hub does not say."""
    check_relative_path(relpath)
    install(policy or HubPolicy())
    url = hf_hub_url(ref.repo_id, relpath, revision=commit, endpoint=endpoint)
    try:
        meta = get_hf_file_metadata(url, endpoint=endpoint)
    except _HUB_FAILURES as exc:
        _raise_hub_error(ref.at(commit), exc, relpath)
    return meta.size


def download_file(
    ref: HfPackageRef,
    commit: str,
    relpath: str,
    *,
    endpoint: str | None = None,
    cache_dir: Path | str | None = None,
    offline: bool = False,
    policy: HubPolicy | None = None,
) -> Path:
    """Fetch ``relpath`` at ``commit`` into the hub cache (or find it there); return the
    snapshot path (a symlink into ``blobs/``). Requests follow ``policy``
    (``skippy.consume.hub_policy``): huggingface_hub's own ~23 s retry loop never runs."""
    _check_commit(commit)
    check_relative_path(relpath)  # the one gate, before the name reaches the client
    install(policy or HubPolicy())
    # huggingface_hub draws its own download bars: only where ours are shown (skippy.progress).
    if progress.enabled():
        enable_progress_bars()
    else:
        disable_progress_bars()
    try:
        local = hf_hub_download(
            ref.repo_id,
            relpath,
            revision=commit,
            cache_dir=cache_dir,
            endpoint=endpoint,
            local_files_only=offline,
        )
    except _HUB_FAILURES as exc:
        if _is_offline_miss(exc, offline):
            raise OfflineCacheMiss(
                f"{ref.at(commit)}: {relpath} is not in the offline cache "
                f"({repo_cache_root(cache_dir, ref.repo_id)}).",
                missing=(relpath,),
                path=relpath,
                remediation="Download the package once online before running offline.",
            ) from None
        _raise_hub_error(ref.at(commit), exc, relpath)
    path = Path(local)
    root = repo_cache_root(cache_dir, ref.repo_id)
    if not is_within(path, root):
        raise UnsafePath(
            f"{relpath} resolved to {path.resolve()}, outside the repo cache {root}.",
            path=relpath,
        )
    return path


def download_many(
    ref: HfPackageRef,
    commit: str,
    relpaths: Iterable[str],
    *,
    endpoint: str | None = None,
    cache_dir: Path | str | None = None,
    offline: bool = False,
    policy: HubPolicy | None = None,
) -> dict[str, Path]:
    """``download_file`` for each path, in order. Offline, every miss is reported in one error."""
    out: dict[str, Path] = {}
    missing: list[str] = []
    for relpath in relpaths:
        if relpath in out:
            continue
        try:
            out[relpath] = download_file(
                ref,
                commit,
                relpath,
                endpoint=endpoint,
                cache_dir=cache_dir,
                offline=offline,
                policy=policy,
            )
        except OfflineCacheMiss:
            missing.append(relpath)
    if missing:
        raise OfflineCacheMiss(
            f"{ref.at(commit)}: {len(missing)} file(s) not in the offline cache "
            f"({repo_cache_root(cache_dir, ref.repo_id)}): {', '.join(missing)}.",
            missing=missing,
            remediation="Download the package once online before running offline.",
        )
    return out


def _check_commit(commit: str) -> None:
    if not COMMIT_SHA_RE.match(commit):
        raise UsageError(
            f"{commit!r} is not a 40-hex commit sha; resolve the revision first.",
            code="invalid_commit",
            actual=commit,
        )


def _is_offline_miss(exc: BaseException, offline: bool) -> bool:
    if not isinstance(exc, LocalEntryNotFoundError):
        return False
    return offline or isinstance(exc.__cause__, OfflineModeIsEnabled)


def _raise_hub_error(ref: HfPackageRef, exc: BaseException, relpath: str | None) -> NoReturn:
    """Map a huggingface_hub/httpx failure to our hierarchy; the cause is dropped on purpose."""
    if isinstance(exc, LocalEntryNotFoundError) and exc.__cause__ is not None:
        exc = exc.__cause__  # online LocalEntryNotFound wraps the real failure of the HEAD call
    if isinstance(exc, HubGaveUp):  # the policy's last attempt failed: name the endpoint
        raise HubError(
            f"{ref}: {exc}",
            code="hub_http_error" if exc.status is not None else "hub_unreachable",
            path=relpath,
            actual=exc.status,
            remediation=(
                "The hub answered with a transient error every time: retry later, or raise "
                "SKIPPY_HUB_ATTEMPTS / SKIPPY_HUB_BACKOFF_S."
                if exc.status is not None
                else "Check the network and HF_ENDPOINT, or run offline from a filled cache."
            ),
        ) from None
    if isinstance(exc, RemoteEntryNotFoundError):
        raise ArtifactMissing(
            f"{ref}: {relpath} does not exist in the repo. The manifest names a file the "
            "repo does not have: republish the package or check the revision.",
            path=relpath,
        ) from None
    if isinstance(exc, RevisionNotFoundError):
        raise HubRefNotFound(
            f"{ref}: the revision does not exist in {ref.repo_id}.",
            code="hub_revision_not_found",
            actual=ref.revision,
            remediation="Check the branch, tag or commit in the package ref.",
        ) from None
    if isinstance(exc, RepositoryNotFoundError):
        raise HubRefNotFound(
            f"{ref}: repository {ref.repo_id} not found (or private/gated without access).",
            code="hub_repo_not_found",
            actual=ref.repo_id,
            remediation="Check the repo id, or set HF_TOKEN for a private repo.",
        ) from None
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        raise HubError(
            f"{ref}: the Hub answered HTTP {status} for {relpath or 'the revision'}: "
            f"{_first_line(exc)}",
            path=relpath,
            actual=status,
            remediation="Retry later; if it persists, check the endpoint and your access.",
        ) from None
    if isinstance(exc, (httpx2.TransportError, OfflineModeIsEnabled)):
        raise HubError(
            f"{ref}: cannot reach the Hub ({type(exc).__name__}: {_first_line(exc)}).",
            code="hub_unreachable",
            path=relpath,
            remediation="Check the network and HF_ENDPOINT, or run offline from a filled cache.",
        ) from None
    if isinstance(exc, FileMetadataError):
        raise HubError(
            f"{ref}: the endpoint's answer for {relpath} lacks Hub metadata: {_first_line(exc)}",
            code="hub_bad_response",
            path=relpath,
        ) from None
    if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
        raise HubError(
            f"{ref}: download of {relpath} ended early or ran long: {_first_line(exc)}",
            code="hub_incomplete_download",
            path=relpath,
            remediation="Retry the download.",
        ) from None
    raise HubError(
        f"{ref}: Hub access failed for {relpath or 'the revision'} ({type(exc).__name__}: "
        f"{_first_line(exc)})",
        code="hub_download_failed",
        path=relpath,
    ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
