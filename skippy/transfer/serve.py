"""The serving side: from a decoded request to a response header and a bounded body reader.

The core of ``mesh_node.transfer.serve`` (file I/O, no network), its shell.

File I/O only, no network and no clock: the mesh shell reads the request frame off a stream,
calls ``ArtifactServer.serve`` (on a worker thread: it may hash a file whose verification is
not cached yet), sends ``outcome.header``, then sends ``outcome.body.read(n)`` chunks until
one is empty, under its own write-idle timeout. Each open body holds one file descriptor and
no buffer, so many concurrent requests cost memory only for the chunk each shell task has in
flight.

After ``authorize`` allows a request, the file itself is checked: the
snapshot entry resolves inside the package's ``models--ns--repo`` folder after following
symlinks, it is a regular file whose size and SHA-256 equal the manifest's declaration (the
verification cache answers at once when nothing changed; ``warm`` fills it when a topology
becomes active), and the descriptor opened is that same verified file (device, inode, size,
timestamps). The manifest is served from the exact bytes that were hashed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from skippy.constants import MANIFEST_NAME
from skippy.consume.verify import FileStamp, VerifyCache, VerifyReport, check_refs
from skippy.errors import (
    ArtifactMissing,
    InputUnreadable,
    IntegrityError,
    ManifestError,
    PackageInvalid,
    SkippyError,
    UnsafePath,
)
from skippy.package.manifest import ArtifactRef
from skippy.package.topology import SplitTopology
from skippy.paths import is_within
from skippy.produce.validate import stat_artifact
from skippy.transfer.authorize import Decision, ManifestProblem, authorize, refuse
from skippy.transfer.errors import ArtifactWireError
from skippy.transfer.hubcache import LoadedManifest, RepoCache, load_held_manifest
from skippy.transfer.policy import NodePolicy, PeerFacts
from skippy.transfer.wire import WIRE_GEN, ArtifactRequest, ArtifactResponse, encode_response

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES: Final = 256 * 1024
MAX_CHUNK_BYTES: Final = 4 * 1024 * 1024


class Body(Protocol):
    """What the shell streams after an accepted header: ``read`` until it returns b""."""

    @property
    def remaining(self) -> int: ...

    def read(self, max_bytes: int = DEFAULT_CHUNK_BYTES) -> bytes: ...

    def close(self) -> None: ...


class FileBody:
    """The bytes of one verified file from ``offset``, read with ``pread`` in bounded chunks
    (no mmap: pages are not counted in the server's RSS)."""

    def __init__(self, fd: int, offset: int, total: int) -> None:
        self._fd: int | None = fd
        self._pos = offset
        self._total = total

    @property
    def remaining(self) -> int:
        return self._total - self._pos

    def read(self, max_bytes: int = DEFAULT_CHUNK_BYTES) -> bytes:
        if self._fd is None:
            raise InputUnreadable("the artifact body is closed", code="artifact_unreadable")
        want = min(max(1, max_bytes), MAX_CHUNK_BYTES, self.remaining)
        if want <= 0:
            return b""
        data = os.pread(self._fd, want, self._pos)
        if not data:  # the file shrank under us: the requester must not get a short body
            raise InputUnreadable(
                f"the artifact ended {self.remaining} bytes early", code="artifact_unreadable"
            )
        self._pos += len(data)
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> FileBody:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BytesBody:
    """The manifest's exact hashed bytes from ``offset`` (to ``end``)."""

    def __init__(self, data: bytes, offset: int, end: int | None = None) -> None:
        self._data = memoryview(data)[: len(data) if end is None else end]
        self._pos = offset

    @property
    def remaining(self) -> int:
        return len(self._data) - self._pos

    def read(self, max_bytes: int = DEFAULT_CHUNK_BYTES) -> bytes:
        want = min(max(1, max_bytes), MAX_CHUNK_BYTES, self.remaining)
        chunk = bytes(self._data[self._pos : self._pos + want])
        self._pos += len(chunk)
        return chunk

    def close(self) -> None:
        self._pos = len(self._data)


@dataclass(frozen=True)
class ServeOutcome:
    """The decision record, the response the peer gets, and the body when accepted."""

    decision: Decision
    response: ArtifactResponse
    body: Body | None = None

    @property
    def header(self) -> bytes:
        """The response frame to send first."""
        return encode_response(self.response)


def _refused(decision: Decision) -> ServeOutcome:
    return ServeOutcome(decision, ArtifactResponse.refusal(decision.peer_message))


# Fixed sentences for malformed requests: they name the rule, never echo the peer's bytes.
_WIRE_MESSAGES: Final = {
    "ineligible_package_ref": "only hf://namespace/repo@<40-hex commit> package refs are "
    "eligible for peer transfer",
    "artifact_wire_unsupported_gen": f"unsupported artifact request generation (this node "
    f"speaks {WIRE_GEN})",
}


def refuse_malformed(policy: NodePolicy, error: ArtifactWireError) -> ServeOutcome:
    """The answer to a request that did not decode (``RequestReader`` raised ``error``). A
    disabled node says only that it is disabled."""
    if policy.mode == "disabled":
        return _refused(refuse("transfer_disabled", "artifact transfer is disabled on this node"))
    message = _WIRE_MESSAGES.get(error.code, f"malformed artifact request ({error.code})")
    return _refused(refuse("malformed_request", error.message, peer_message=message))


# ``partial-serve``: (artifact SHA-256, start, stop) -> a body of chunks this node
# verified in a partial it is still receiving, or None (``mesh_node.transfer.partials``).
PartialOpener = Callable[[str, int, int], "Body | None"]


@dataclass
class _Held:
    stamp: FileStamp | None
    loaded: LoadedManifest | ManifestProblem


class ArtifactServer:
    """Serves the packages in one hub cache. Thread-safe: the shell may call ``serve`` for
    many requests at once from worker threads."""

    def __init__(self, hub_cache_dir: Path, *, verify_cache: VerifyCache | None) -> None:
        self.hub_cache_dir = hub_cache_dir
        self.verify_cache = verify_cache
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], _Held] = {}
        # The node's partials being received (``mesh_node.transfer.partials``);
        # only peers that were listed as a holder's counterparts ask for such ranges.
        self.partials: PartialOpener | None = None

    # --- the manifest ---------------------------------------------------------------------
    def held(self, topology: SplitTopology) -> LoadedManifest | ManifestProblem:
        """The topology's manifest as this node holds it, re-read only when the file changed."""
        try:
            cache = RepoCache.for_ref(self.hub_cache_dir, topology.package_ref)
        except ArtifactWireError as exc:
            return ManifestProblem("package_mismatch", exc.message)
        key = (topology.package_ref, topology.manifest_sha256)
        stamp = _stamp(cache.snapshot_path(MANIFEST_NAME))
        with self._lock:
            entry = self._held.get(key)
        if entry is not None and stamp is not None and entry.stamp == stamp:
            return entry.loaded
        loaded = _load(cache, topology.manifest_sha256)
        with self._lock:
            self._held[key] = _Held(stamp, loaded)
        return loaded

    def warm(self, topology: SplitTopology) -> VerifyReport:
        """Verify every artifact of the topology's package once (call it when the topology
        becomes active) so that requests are answered from the verification cache. Raises
        the manifest's problem, or ``IntegrityError`` naming every corrupt artifact."""
        held = self.held(topology)
        if isinstance(held, ManifestProblem):
            raise PackageInvalid(held.detail, [], code=held.reason)
        cache = RepoCache.for_ref(self.hub_cache_dir, topology.package_ref)
        report = check_refs(
            cache.snapshot_dir,
            list(held.held.manifest.artifacts()),
            manifest_sha256=held.held.sha256,
            cache=self.verify_cache,
            containment_root=cache.repo_root,
        )
        report.raise_for_mismatch()
        return report

    def verified_path(self, topology: SplitTopology, ref: ArtifactRef) -> tuple[Path, FileStamp]:
        """``ref``'s file in this node's cache, verified (its record, else hashed now) and
        its stamp then (chunk digests computed from it need not hash it again;
        the caller checks the stamp after reading). Raises what is wrong with it."""
        cache = RepoCache.for_ref(self.hub_cache_dir, topology.package_ref)
        path, st = stat_artifact(cache.snapshot_dir, ref, containment_root=cache.repo_root)
        report = check_refs(
            cache.snapshot_dir,
            [ref],
            manifest_sha256=topology.manifest_sha256,
            cache=self.verify_cache,
            containment_root=cache.repo_root,
        )
        report.raise_for_mismatch()
        return path, FileStamp.of(st)

    # --- one request ----------------------------------------------------------------------
    def serve(
        self,
        policy: NodePolicy,
        peer: PeerFacts,
        topology: SplitTopology | None,
        request: ArtifactRequest,
    ) -> ServeOutcome:
        """Decide ``request`` and, when allowed, open what to stream. Never raises for
        anything the peer or the disk did: every problem is a refusal with its reason.
        With ``partials`` set (``partial-serve``), a range of a file not installed
        here yet is served from the verified chunks of its partial, after the same
        authorization, when it has every chunk of the range."""
        held: LoadedManifest | ManifestProblem | None = None
        if topology is not None and policy.mode != "disabled":
            held = self.held(topology)
        facts = held.held if isinstance(held, LoadedManifest) else held
        decision = authorize(policy, peer, topology, facts, request)
        if not decision.allowed:
            return _refused(decision)
        if decision.artifact is None:  # the manifest: its exact hashed bytes
            if not isinstance(held, LoadedManifest):
                raise IntegrityError("authorize allowed a manifest this node does not hold")
            body = BytesBody(held.raw, request.offset, _end(request, len(held.raw)))
            return ServeOutcome(
                decision, ArtifactResponse.accept(len(held.raw), held.held.sha256), body
            )
        if topology is None:
            raise IntegrityError("authorize allowed a request without a topology")
        cache = RepoCache.for_ref(self.hub_cache_dir, topology.package_ref)
        opened = self._open_artifact(
            cache,
            decision,
            topology.manifest_sha256,
            request.offset,
            _end(request, decision.artifact.artifact.artifact_bytes),
        )
        ref = decision.artifact
        if isinstance(opened, Decision) and opened.reason == "artifact_missing":
            chunks = _from_partial(self.partials, request, ref.artifact.sha256.lower())
            if chunks is not None:
                response = ArtifactResponse.accept(
                    ref.artifact.artifact_bytes, ref.artifact.sha256.lower()
                )
                return ServeOutcome(decision, response, chunks)
        if isinstance(opened, Decision):
            log.warning("artifact check failed: %s", opened.to_log())
            return _refused(opened)
        return ServeOutcome(
            decision,
            ArtifactResponse.accept(ref.artifact.artifact_bytes, ref.artifact.sha256.lower()),
            opened,
        )

    def _open_artifact(
        self,
        cache: RepoCache,
        decision: Decision,
        manifest_sha256: str,
        offset: int,
        end: int | None = None,
    ) -> FileBody | Decision:
        ref = decision.artifact
        stage = decision.stage
        if ref is None:
            raise IntegrityError("no artifact to open")
        root, boundary = cache.snapshot_dir, cache.repo_root
        try:
            path, st = stat_artifact(root, ref, containment_root=boundary)
            report = check_refs(
                root,
                [ref],
                manifest_sha256=manifest_sha256,
                cache=self.verify_cache,
                containment_root=boundary,
            )
        except UnsafePath as exc:
            return refuse("resolved_outside_repo", exc.message, stage=stage)
        except IntegrityError as exc:
            return refuse("artifact_size_mismatch", exc.message, stage=stage)
        except ArtifactMissing as exc:
            return refuse("artifact_missing", exc.message, stage=stage)
        except (InputUnreadable, ManifestError) as exc:
            return refuse("artifact_unreadable", exc.message, stage=stage)
        if not report.ok:
            bad = report.mismatches[0]
            return refuse(
                "artifact_sha256_mismatch",
                f"{ref.path} hashes to {bad.actual_sha256}, the manifest declares "
                f"{bad.expected_sha256}",
                stage=stage,
            )
        return _open_verified(path, st, boundary, ref, offset, decision, end)


def _open_verified(
    path: Path,
    st: os.stat_result,
    boundary: Path,
    ref: ArtifactRef,
    offset: int,
    decision: Decision,
    end: int | None = None,
) -> FileBody | Decision:
    """Open the real file behind ``path`` and prove it is the one just verified."""
    real = os.path.realpath(path)
    if not is_within(Path(real), boundary):  # re-checked at open time: links can change
        return refuse("resolved_outside_repo", f"{ref.path} leads to {real}", stage=decision.stage)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return refuse(
            "artifact_unreadable", f"cannot open {ref.path}: {exc.strerror}", stage=decision.stage
        )
    if FileStamp.of(os.fstat(fd)) != FileStamp.of(st):
        os.close(fd)
        return refuse(
            "artifact_changed", f"{ref.path} changed after it was verified", stage=decision.stage
        )
    return FileBody(fd, offset, st.st_size if end is None else min(end, st.st_size))


def _from_partial(
    partial: PartialOpener | None, request: ArtifactRequest, sha256: str
) -> Body | None:
    """A range request's verified chunks from a partial (only ranges: a whole-file request
    wants bytes a partial does not have)."""
    if partial is None or request.length is None:
        return None
    return partial(sha256, request.offset, request.offset + request.length)


def _end(request: ArtifactRequest, size: int) -> int | None:
    """Where the body stops: the range's end (chunk requests), else the file's."""
    return None if request.length is None else min(size, request.offset + request.length)


def _stamp(path: Path) -> FileStamp | None:
    try:
        return FileStamp.of(path.stat())
    except OSError:
        return None


def _load(cache: RepoCache, expected_sha256: str) -> LoadedManifest | ManifestProblem:
    try:
        return load_held_manifest(cache, expected_sha256)
    except UnsafePath as exc:
        return ManifestProblem("resolved_outside_repo", exc.message)
    except ManifestError as exc:
        if exc.code == "missing_manifest":
            return ManifestProblem("manifest_not_held", exc.message)
        if exc.code == "manifest_too_large":
            return ManifestProblem("manifest_too_large", exc.message)
        return ManifestProblem("held_manifest_invalid", exc.message)
    except IntegrityError as exc:
        return ManifestProblem("held_manifest_mismatch", exc.message)
    except SkippyError as exc:  # unreadable, or check_manifest found errors
        return ManifestProblem("held_manifest_invalid", exc.message)
