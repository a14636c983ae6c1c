"""The fetching side: a node brings in its stage of a topology.

The calls follow ``docs/architecture.md`` ("Peer artifact transfer", fetching): the manifest
first (proven against the topology's SHA-256), then the stage's required set from the
verified manifest (``plan_fetch``: what the verification cache already vouches for is skipped,
the rest largest first, ``CONCURRENCY`` at a time). Every artifact goes through one engine,
``mesh_node.transfer.swarm.SwarmFetch`` into one sink (``skippy.transfer.chunk_sink``): chunk
by chunk from the holders the coordinator's signed source list names (one holder is a swarm
of one), or, for a file no list names (the manifest, a coordinator without lists), from the
coordinator as one chunk checked against the manifest's SHA-256. Then:

- no holder left and the coordinator cut off, reset, stalled or truncated: wait for its link
  (at most ``peer_loss_timeout_s``) and try again, resuming the partial (its verified chunks
  and the unchecked head of the chunk it ends in), ``PEER_ATTEMPTS`` times in all;
- a refusal (``artifact unavailable``), bytes that fail their check, a trickle, an oversized
  manifest: no more asking that peer for this artifact;
- then the hub (``skippy.transfer.fallback.fetch_from_hub``), which proves the SHA-256 too.

Nothing unverified is ever installed (the sink and the fallback decide that, not this shell).
A second fetch of an artifact that one is installing on this node waits for its lock and then
finds it installed. The stage ends as a ``skippy.runtime.boundary.StageLoad`` built from the
hub cache (consumer validation and SHA-256 from the verification records the sink wrote).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import shutil
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import trio

from mesh_node.errors import (
    LinkClosed,
    MeshError,
    PeerUnavailable,
    StreamRefused,
    StreamReset,
    StreamStalled,
)
from mesh_node.identity import short_id
from mesh_node.transfer.cache_budget import CacheBudget
from mesh_node.transfer.partials import PARTIAL_REFRESH_S, PartialRegistry
from mesh_node.transfer.records import StageFetch, TransferLog, TransferRecord
from mesh_node.transfer.swarm import (
    REFRESH_S,
    VERIFICATION_CODES,
    SourceBook,
    SwarmFailed,
    SwarmFetch,
    alone,
    ask_sources,
    speaks_swarm,
)
from protocol import constants as pc
from protocol.errors import ProtocolError
from skippy.atomic import LockBusy, exclusive_lock, find_partials
from skippy.config import Environment
from skippy.constants import MANIFEST_NAME
from skippy.consume.verify import VerifyCache
from skippy.errors import IntegrityError, ManifestError, SkippyError
from skippy.package.manifest import ArtifactRef, PackageManifest
from skippy.package.topology import SplitTopology, StageAssignment
from skippy.stage.descriptor import StageDescriptor
from skippy.transfer.chunk_sink import ChunkSink, open_chunk_sink
from skippy.transfer.chunks import CHUNK_BYTES
from skippy.transfer.delta import link_from_revisions
from skippy.transfer.disk import cache_usage, evict_partials, stage_disk_problem
from skippy.transfer.errors import ArtifactWireError, InstallBusy, PartialChanged
from skippy.transfer.fetch_plan import FetchItem, manifest_item, plan_fetch
from skippy.transfer.hubcache import RepoCache, load_held_manifest, verified_file, verified_present
from skippy.transfer.partials import stage_file_order
from skippy.transfer.required import stage_refs
from skippy.transfer.sources import ArtifactSources

if TYPE_CHECKING:
    from mesh_node.node import MeshNode
    from mesh_node.topology import ActiveTopology
    from skippy.consume.preflight import LoadedPackage
    from skippy.runtime.boundary import StageLoad

log = logging.getLogger("mesh_node.transfer.fetch")

CONCURRENCY: Final = 4  # artifacts of one stage in flight at once (the server allows 4 per link)
PEER_ATTEMPTS: Final = 3  # asks of the coordinator per artifact before the hub
LOCK_POLL_S: Final = 0.05
# ``partial-serve``: the others' share of a stage's files starts this long after
# the stage's own (their first have-reports, with what they fetch, are in by then).
DEFER_S: Final = 1.0
# Failures after which asking the same peer again may work (the sink keeps the partial).
_RETRY: Final = (
    PeerUnavailable,
    LinkClosed,
    StreamRefused,
    StreamReset,
    StreamStalled,
    ArtifactWireError,
    PartialChanged,
    InstallBusy,
)


class StageFetchFailed(MeshError):
    """The stage could not be brought in (``code`` from the failure that stopped it)."""

    code = "stage_fetch_failed"


@dataclass(frozen=True)
class StageResult:
    """A stage whose required artifacts are all installed and verified on this node."""

    topology: SplitTopology
    stage: StageAssignment
    load: StageLoad  # hand it to a runtime (skippy.runtime.boundary)
    descriptor: StageDescriptor  # what the ready report says (extends it)


@dataclass(frozen=True)
class _Job:
    topology: SplitTopology
    stage: StageAssignment
    coordinator_id: str
    cache: RepoCache
    book: SourceBook | None = None  # the stage's swarm sources, when offered
    report: _Report = dataclasses.field(default_factory=lambda: _Report())


@dataclass
class _Report:
    """``partial-serve``: what this stage fetch tells the coordinator it holds."""

    refs: tuple[ArtifactRef, ...] = ()
    whole: set[str] = dataclasses.field(default_factory=set)  # installed and verified
    chunk_bytes: int | None = None  # the coordinator's (from its first list)


@dataclass(frozen=True)
class _PeersFailed:
    """A try from the holders that did not end installed: the reason the record gives."""

    reason: str
    retry: bool = False  # the coordinator was cut off or stalled: wait for it, ask again


class StageFetcher:
    def __init__(
        self,
        node: MeshNode,
        env: Environment,
        records: TransferLog,
        *,
        verify_cache: VerifyCache | None,
        concurrency: int = CONCURRENCY,
        peer_attempts: int = PEER_ATTEMPTS,
        swarm_refresh_s: float = REFRESH_S,
    ) -> None:
        self.node = node
        self.swarm_refresh_s = swarm_refresh_s
        self.env = env
        self.records = records
        self.verify_cache = verify_cache
        self.peer_attempts = peer_attempts
        self._slots = trio.CapacityLimiter(concurrency)
        settings = node.settings
        self.cache_budget = CacheBudget(
            settings.hub_cache_dir, settings.data_dir, settings.security
        )
        self._in_use: Path | None = None  # the last ready stage's snapshot (it may be running)
        # Set (by ``ArtifactService``) when this node serves its partials' chunks.
        self.partials: PartialRegistry | None = None

    # --- a stage ----------------------------------------------------------------------------
    async def fetch_stage(self, active: ActiveTopology) -> StageResult:
        """Bring in this node's stage of ``active``; ``StageFetchFailed`` (or another coded
        ``SkippyError``) when it cannot. Progress is in ``records.stage``."""
        topology = active.topology
        stage = topology.stage_of(self.node.node_id)
        if stage is None:
            raise StageFetchFailed(
                f"this node holds no stage in topology {topology.topology_id}",
                code="not_in_topology",
            )
        state = StageFetch(
            topology_id=topology.topology_id,
            stage_id=stage.stage_id,
            stage_index=stage.stage_index,
            layer_start=stage.layers.start,
            layer_end=stage.layers.stop,
            coordinator_id=active.coordinator_id,
            started=self.node.wall_clock(),
        )
        self.records.stage = state
        try:
            result = await self._fetch_stage(active, stage, state)
        except SkippyError as exc:
            self._end(state, exc.code)
            raise
        except OSError as exc:  # a disk failure we did not foresee: a clear error, no crash
            self._end(state, "io_error")
            raise StageFetchFailed(
                f"disk error while fetching the stage: {exc}", code="io_error"
            ) from exc
        self._end(state, None)
        return result

    def _end(self, state: StageFetch, error: str | None) -> None:
        state.state = "failed" if error else "ready"
        state.error = error
        state.finished = self.node.wall_clock()

    async def _fetch_stage(
        self, active: ActiveTopology, stage: StageAssignment, state: StageFetch
    ) -> StageResult:
        topology = active.topology
        # The cache tells the truth about commits: an untrusted coordinator's
        # bytes go to the peer area, never under the hub commit.
        untrusted = None if active.coordinator_trusted else topology.manifest_sha256
        try:
            cache = RepoCache.for_ref(
                self.node.settings.hub_cache_dir,
                topology.package_ref,
                untrusted_manifest=untrusted,
            )
        except (ArtifactWireError, ManifestError):
            # A package directory is read in place by the coordinator that planned it, and by
            # a worker that can read the same directory (one machine, a shared filesystem):
            # its manifest must still hash to the signed topology's, its files verify.
            local = await trio.to_thread.run_sync(_is_local_package, topology.package_ref)
            if active.coordinator_id == self.node.node_id or local:
                return await trio.to_thread.run_sync(self._local_stage, topology, stage, state)
            raise StageFetchFailed(
                f"package {topology.package_ref} cannot be transferred: only "
                "hf://namespace/repo@<40-hex commit> packages can (publish it on a hub)",
                code="ineligible_package_ref",
            ) from None
        job = _Job(topology, stage, active.coordinator_id, cache)
        await self._fetch(job, manifest_item(topology))
        loaded = await trio.to_thread.run_sync(
            load_held_manifest, cache, topology.manifest_sha256
        )
        manifest = loaded.held.manifest
        refs = stage_refs(manifest, stage.layers)
        state.required = tuple(r.path for r in refs)
        state.bytes_required = sum(r.artifact.artifact_bytes for r in refs)
        present = await trio.to_thread.run_sync(
            functools.partial(
                verified_present,
                cache,
                refs,
                manifest_sha256=topology.manifest_sha256,
                verify_cache=self.verify_cache,
            )
        )
        # Delta revisions: what another revision holds verified is linked, not moved.
        linked = await trio.to_thread.run_sync(
            functools.partial(
                link_from_revisions,
                cache,
                [r for r in refs if r.path not in present],
                manifest_sha256=topology.manifest_sha256,
                verify_cache=self.verify_cache,
            )
        )
        present = {**present, **dict.fromkeys(linked, "cached")}
        plan = plan_fetch(manifest, loaded.held.sha256, topology, self.node.node_id, present)
        needed = [cache.snapshot_dir, *([self._in_use] if self._in_use else [])]
        await trio.to_thread.run_sync(
            self._check_disk, plan.bytes_required, plan.bytes_to_fetch, needed
        )
        job.report.refs = tuple(refs)
        job.report.whole.update(present)
        if plan.fetch:
            job = dataclasses.replace(job, book=await self._swarm_book(job, manifest))
        for ref in plan.required:
            if ref.path in present:
                revision = linked[ref.path].revision.short if ref.path in linked else None
                self.records.found_in_cache(ref.path, ref.artifact.artifact_bytes, revision)
        failures: list[SkippyError] = []
        order, deferred = self._fetch_order(job, manifest, list(plan.fetch))
        queue = deque(order)
        not_before = trio.current_time() + DEFER_S
        async with trio.open_nursery() as outer:
            if job.book is not None and job.book.latest.partial and job.book.latest.ranks > 1:
                outer.start_soon(self._report_loop, job.book)
            async with trio.open_nursery() as nursery:
                # Workers taking files in order (trio starts tasks in no set order; the order
                # matters when counterparts exchange partials: ``_fetch_order``).
                for _ in range(min(CONCURRENCY, len(queue))):
                    nursery.start_soon(
                        self._fetch_queue, job, queue, failures, deferred, not_before
                    )
            outer.cancel_scope.cancel()
        if failures:
            raise failures[0]
        load = await trio.to_thread.run_sync(self._stage_load, cache, topology, stage)
        await trio.to_thread.run_sync(self.cache_budget.touch, cache.snapshot_dir)
        self._in_use = cache.snapshot_dir
        return StageResult(topology, stage, load, StageDescriptor.for_stage(topology, stage, refs))

    async def _report_loop(self, book: SourceBook) -> None:
        """``partial-serve``: ask for the list (and so report this node's chunks)
        every ``refresh_s`` for as long as the stage's files are fetched, also while no file
        of it is being received (a counterpart waiting for a file this node finished would
        otherwise hear of it only from a later fetch's refresh)."""
        while True:
            await book.refreshed()
            await trio.sleep(book.refresh_s)

    async def _fetch_queue(
        self,
        job: _Job,
        queue: deque[FetchItem],
        failures: list[SkippyError],
        deferred: set[str],
        not_before: float,
    ) -> None:
        while queue:
            item = queue.popleft()
            if item.path in deferred:  # the others' share: once their reports are in
                await trio.sleep_until(not_before)
            await self._fetch_collecting(job, item, failures)

    def _fetch_order(
        self, job: _Job, manifest: PackageManifest, items: list[FetchItem]
    ) -> tuple[list[FetchItem], set[str]]:
        """``plan_fetch``'s order (largest first); while counterparts exchange partials
, ``skippy.transfer.partials.stage_file_order``: the files of several
        chunks first, then this node's share of the one-chunk files, then the others'
        (deferred), so each asks the coordinator for what the others get last. A file
        other worker stages need too is first fetched by rank 0 of the lowest of them."""
        latest = job.book.latest if job.book is not None else None
        if latest is None or not latest.partial or latest.ranks <= 1:
            return items, set()
        workers = [s for s in job.topology.stages if s.node_id != job.coordinator_id]
        needed = {s.stage_index: {r.path for r in stage_refs(manifest, s.layers)} for s in workers}
        shared: dict[str, bool] = {}
        for item in items:
            by = sorted(i for i, paths in needed.items() if item.path in paths)
            if len(by) > 1:
                shared[item.path] = by[0] == job.stage.stage_index and latest.rank == 0
        big = [i.path for i in items if (i.size or 0) > latest.chunk_bytes]
        order, deferred = stage_file_order(
            [i.path for i in items], big=big, shared=shared, rank=latest.rank, ranks=latest.ranks
        )
        by_path = {i.path: i for i in items}
        return [by_path[p] for p in order], deferred

    async def _fetch_collecting(
        self, job: _Job, item: FetchItem, failures: list[SkippyError]
    ) -> None:
        """One artifact; a failure is collected so the others finish (their bytes are kept)."""
        async with self._slots:
            try:
                await self._fetch(job, item)
                job.report.whole.add(item.path)
            except SkippyError as exc:
                failures.append(exc)
            except OSError as exc:
                failures.append(StageFetchFailed(f"{item.path}: {exc}", code="io_error"))

    def _check_disk(self, required: int, to_fetch: int, needed: list[Path]) -> None:
        """The declared sizes against this node's budgets, before a byte is written (thread).
        Over the cache budget, least-recently-used blobs nothing ``needed`` links to are
        evicted first; the refusal stands when that cannot make room."""
        settings = self.node.settings
        root = settings.hub_cache_dir
        root.mkdir(parents=True, exist_ok=True)
        self.cache_budget.make_room(to_fetch, needed)
        problem = stage_disk_problem(
            required_bytes=required,
            fetch_bytes=to_fetch,
            memory_budget_bytes=settings.memory_budget_bytes,
            cache_budget_bytes=self.cache_budget.budget_bytes,
            cache_used_bytes=cache_usage(root) if self.cache_budget.budget_bytes else 0,
            disk_free_bytes=shutil.disk_usage(root).free,
        )
        if problem is not None:
            code, message = problem
            if code == "cache_budget":
                self.cache_budget.refusals += 1
                message += (
                    "; eviction could not make room (what remains is needed by this node's "
                    "topology or its running stage): raise cache_budget or free the disk"
                )
            raise StageFetchFailed(message, code=code)

    def _stage_load(
        self, cache: RepoCache, topology: SplitTopology, stage: StageAssignment
    ) -> StageLoad:
        """The verified stage as the runtime boundary value, from the hub cache (thread)."""
        from skippy.consume.preflight import load_package

        pkg = load_package(
            cache.snapshot_dir,
            containment_root=cache.repo_root,
            origin=topology.package_ref,
            from_hub=True,
        )
        return self._prepared_load(pkg, topology, stage)

    def _local_stage(
        self, topology: SplitTopology, stage: StageAssignment, state: StageFetch
    ) -> StageResult:
        """A local package directory (the coordinator's, or one this worker can read): the
        stage is read in place (verified); nothing is transferred (only hf:// packages can
        be)."""
        from skippy.consume.preflight import load_package

        pkg = load_package(Path(topology.package_ref), origin=topology.package_ref)
        refs = stage_refs(pkg.manifest, stage.layers)
        state.required = tuple(r.path for r in refs)
        state.bytes_required = sum(r.artifact.artifact_bytes for r in refs)
        load = self._prepared_load(pkg, topology, stage)
        for ref in refs:
            self.records.found_in_cache(ref.path, ref.artifact.artifact_bytes)
        return StageResult(topology, stage, load, StageDescriptor.for_stage(topology, stage, refs))

    def _prepared_load(
        self, pkg: LoadedPackage, topology: SplitTopology, stage: StageAssignment
    ) -> StageLoad:
        from skippy.consume.preflight import prepare_stage
        from skippy.runtime.boundary import StageLoad

        if pkg.manifest_sha256 != topology.manifest_sha256:
            raise IntegrityError(
                f"{topology.package_ref}: the manifest hashes to {pkg.manifest_sha256}, the "
                f"topology names {topology.manifest_sha256}",
                code="manifest_sha256_mismatch",
                expected=topology.manifest_sha256,
                actual=pkg.manifest_sha256,
            )
        prepared = prepare_stage(pkg, stage.layers, verify=True, cache=self.verify_cache)
        sel = prepared.selection
        files = {r.path: p for r, p in zip(sel.parts, prepared.part_paths, strict=True)}
        if sel.projector is not None and prepared.projector_path is not None:
            files[sel.projector.path] = prepared.projector_path
        return StageLoad.from_selection(
            sel, files, manifest_sha256=pkg.manifest_sha256, sha256_verified=True
        )

    # --- one artifact -----------------------------------------------------------------------
    async def _fetch(self, job: _Job, item: FetchItem) -> Path:
        rec = self.records.start("fetch", item.path, total=item.size)
        error: str | None = "cancelled"
        try:
            path = await self._fetch_recorded(job, item, rec)
            error = None
            return path
        except SkippyError as exc:
            error = exc.code
            raise
        except OSError:
            error = "io_error"
            raise
        finally:
            self.records.finish(rec, verified=error is None, error=error)

    async def _fetch_recorded(self, job: _Job, item: FetchItem, rec: TransferRecord) -> Path:
        installed = job.cache.snapshot_path(item.path)
        if item.is_manifest and await trio.to_thread.run_sync(self._present, job, item):
            return self._from_cache(installed, rec)
        peer = job.coordinator_id
        reason = "not_advertised" if peer != self.node.node_id else "this_node_coordinates"
        attempts = 0
        while self._peer_serves(peer) and attempts < self.peer_attempts:
            attempts += 1
            try:
                got = await self._from_peers(job, item, rec)
            except (InstallBusy, PartialChanged) as exc:  # this node's own partial or lock
                got = _PeersFailed(exc.code, retry=True)
            if isinstance(got, Path):
                return got
            reason = got.reason
            if not got.retry:
                break
            log.info("%s from %s: %s (attempt %d)", item.path, short_id(peer), reason, attempts)
            if not await self.wait_for_link(peer):
                reason = f"{reason}: no link"
                break
        return await self._from_hub(job, item, rec, reason)

    def _from_cache(self, installed: Path, rec: TransferRecord) -> Path:
        """Already installed and verified (by another fetch, or before): nothing moves."""
        size = installed.stat().st_size
        rec.total = size
        rec.restart("cache", offset=size)
        self.records.counters.fetched_bytes["cache"] += size
        return installed

    def _present(self, job: _Job, item: FetchItem) -> bool:
        return verified_file(
            job.cache.snapshot_path(item.path),
            item,
            manifest_sha256=job.topology.manifest_sha256,
            verify_cache=self.verify_cache,
        )

    def _peer_serves(self, peer_id: str) -> bool:
        """The coordinator (not this node) advertises ``artifact-transfer``."""
        if peer_id == self.node.node_id:
            return False
        info = self.node.peer(peer_id)
        bit = frozenset({pc.BIT_ARTIFACT_TRANSFER})
        return info is not None and info.has_features(pc.FEATURE_SKIPPY_STAGE, bit)

    async def wait_for_link(self, peer_id: str) -> bool:
        """Until the peer is linked again (a redial), at most ``peer_loss_timeout_s``."""
        with trio.move_on_after(self.node.settings.peer_loss_timeout_s):
            while True:
                info = self.node.peer(peer_id)
                if info is not None and info.connected:
                    return True
                await trio.sleep(LOCK_POLL_S)
        return False

    async def _open_sink(
        self, job: _Job, item: FetchItem, entry: ArtifactSources | None, chunk_bytes: int,
        chain: bool,
    ) -> ChunkSink:
        """The sink, waiting (cancellably) while another fetch on this node installs it.
        ``entry``: the signed list's line for the file (its digests); None: one chunk."""
        budget = self.node.settings.security.partials_budget_bytes
        evicted = await trio.to_thread.run_sync(
            evict_partials, self.node.settings.hub_cache_dir, budget, item.max_size
        )
        if evicted:
            log.info("evicted %d old partials (over the %d-byte budget)", len(evicted), budget)
        opener = functools.partial(
            open_chunk_sink,
            job.cache,
            item,
            manifest_sha256=job.topology.manifest_sha256,
            verify_cache=self.verify_cache,
            digests=entry.digests if entry is not None else None,
            chunk_bytes=chunk_bytes if entry is not None else None,
            chain=chain and entry is not None,
        )
        with trio.move_on_after(self.node.timeouts.idle_s):
            while True:
                try:
                    return await trio.to_thread.run_sync(opener)
                except InstallBusy:
                    await trio.sleep(LOCK_POLL_S)
        raise InstallBusy(f"another fetch of {item.path} kept its install lock", path=item.path)

    async def _from_peers(
        self, job: _Job, item: FetchItem, rec: TransferRecord
    ) -> Path | _PeersFailed:
        """One try of ``item`` from its holders (``mesh_node.transfer.swarm``): chunk by
        chunk from every holder the coordinator's signed list names, however many (one is a
        swarm of one); a file the list does not name (the manifest, one the coordinator holds
        no digests for, or no list at all) comes from the coordinator as one chunk checked
        against the manifest's SHA-256. The sink keeps what came for the next try."""
        book = job.book
        # The latest list (asked again at most every ``refresh_s``): a holder that became
        # ready since the stage's first list joins.
        latest = await book.refreshed() if book is not None and not item.is_manifest else None
        entry = latest.by_path().get(item.path) if latest is not None else None
        chunk_bytes = latest.chunk_bytes if latest is not None else CHUNK_BYTES
        sink = await self._open_sink(
            job, item, entry, chunk_bytes, latest is not None and latest.chain
        )
        try:
            # ``installed``: a complete verified partial was found and installed on opening
            if sink.state in ("present", "installed") and sink.installed is not None:
                return self._from_cache(sink.installed, rec)
            coordinator = job.coordinator_id
            if book is None or entry is None:
                book = alone(job.topology, job.stage, self.node.node_id, item, coordinator)
            rec.restart(
                "peer", peer_id=coordinator if entry is None else None, offset=sink.offset
            )
            swarm = SwarmFetch(
                self.node, self.records, job.cache, job.topology, job.stage, item, rec, book,
                verify_cache=self.verify_cache,
            )
            if self.partials is not None and entry is not None:
                self.partials.add(sink, swarm.busy_chunks)
            try:
                try:
                    await swarm.run(sink, coordinator)
                finally:  # before the sink is finished or cut: no range is opened after
                    if self.partials is not None:
                        self.partials.remove(sink)
                path: Path = await trio.to_thread.run_sync(sink.finish)
            except SwarmFailed as exc:
                return self._failed(swarm, exc, item, rec)
            except IntegrityError as exc:  # chunks matched their digests, the file did not
                self.records.counters.verification_failures += 1
                log.warning("%s: %s", item.path, exc)
                return _PeersFailed(exc.code)
            if rec.served_by:  # ``peer_id``: the node that served most (all: ``served_by``)
                rec.peer_id = max(rec.served_by, key=rec.served_by.__getitem__)
            return path
        finally:
            sink.abort()  # keeps the partial unless it was installed or proven wrong
            if item.is_manifest and sink.state != "installed":
                _drop_partials(job.cache, item)  # a manifest is never resumed (the sink's rule)

    def _failed(
        self, swarm: SwarmFetch, exc: SwarmFailed, item: FetchItem, rec: TransferRecord
    ) -> _PeersFailed:
        """Why no holder delivered, and whether asking the coordinator again may work: it
        was cut off or stalled (the sink keeps what came), not refused or caught lying."""
        coordinator = swarm.coordinator_id
        info = self.node.peer(coordinator)
        if not swarm.dropped and (info is None or not info.connected):
            # No holder was even asked: the coordinator's link was down when the fetch
            # began (a partition); its redial is waited for like a cut mid-transfer.
            log.info("%s: the link to %s is down", item.path, short_id(coordinator))
            return _PeersFailed(LinkClosed.code, retry=True)
        why = swarm.errors.get(coordinator)
        reason = rec.dropped.get(coordinator) or next(iter(rec.dropped.values()), exc.code)
        log.warning("%s: %s (%s)", item.path, exc, reason)
        return _PeersFailed(reason, retry=isinstance(why, _RETRY))

    # --- the stage's signed source list -------------------------------------------------------
    async def _swarm_book(self, job: _Job, manifest: PackageManifest) -> SourceBook | None:
        """The coordinator's signed source list for this stage, when it offers one."""
        coordinator = job.coordinator_id
        if not speaks_swarm(self.node, coordinator):
            return None
        have = functools.partial(self._have_report, job.report)
        ask = functools.partial(
            ask_sources, self.node, coordinator, job.topology, job.stage, manifest, have
        )
        try:
            latest = await ask()
        except (SkippyError, MeshError, ProtocolError, trio.TooSlowError) as exc:
            log.info("no swarm source list from %s: %s", short_id(coordinator), exc)
            return None
        job.report.chunk_bytes = latest.chunk_bytes
        refresh_s = self.swarm_refresh_s
        if latest.partial and latest.ranks > 1:  # report and look often
            refresh_s = min(refresh_s, PARTIAL_REFRESH_S)
        return SourceBook(ask, latest, refresh_s=refresh_s)

    def _have_report(self, report: _Report) -> tuple[dict[str, bytes], dict[str, bytes]]:
        """This stage's verified chunks per file, and those being fetched
        (``partial-serve``); nothing before the coordinator's chunk size is known."""
        if self.partials is None or report.chunk_bytes is None:
            return {}, {}
        return self.partials.have(report.refs, report.whole, report.chunk_bytes)

    async def _from_hub(self, job: _Job, item: FetchItem, rec: TransferRecord, reason: str) -> Path:
        rec.restart("hub")
        rec.fallback = reason
        log.info("%s from the hub (%s)", item.path, reason)
        fetch = functools.partial(
            _fetch_from_hub,
            job.cache,
            item,
            manifest_sha256=job.topology.manifest_sha256,
            verify_cache=self.verify_cache,
            endpoint=self.env.hf_endpoint,
            offline=self.env.hf_offline,
        )
        try:
            path: Path = await trio.to_thread.run_sync(fetch)
        except IntegrityError as exc:
            if exc.code in VERIFICATION_CODES:
                self.records.counters.verification_failures += 1
            raise
        size = path.stat().st_size
        rec.total = size
        rec.bytes_done = size
        self.records.counters.fetched_bytes["hub"] += size
        await trio.to_thread.run_sync(_drop_partials, job.cache, item)
        return path


def _fetch_from_hub(*args: Any, **kw: Any) -> Path:
    """``skippy.transfer.fallback.fetch_from_hub``, imported on first use, on the worker
    thread that runs it: the hub client costs ~0.3 s of imports, which a node that never
    falls back to the hub (most) should not pay at start-up, nor its event loop later."""
    from skippy.transfer.fallback import fetch_from_hub

    path: Path = fetch_from_hub(*args, **kw)
    return path


def _drop_partials(cache: RepoCache, item: FetchItem) -> None:
    """After a hub download the peer partials of that blob are useless: delete them (only if
    no other fetch holds the artifact's lock)."""
    try:
        with exclusive_lock(cache.lock_path(item.sha256)):
            for partial in find_partials(cache.blob_path(item.sha256)):
                with contextlib.suppress(FileNotFoundError):
                    partial.unlink()
    except LockBusy:
        pass


def _is_local_package(ref: str) -> bool:
    """``ref`` names a package directory readable on this node (absolute path, a manifest)."""
    path = Path(ref)
    return path.is_absolute() and (path / MANIFEST_NAME).is_file()
