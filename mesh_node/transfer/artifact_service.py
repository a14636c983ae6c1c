"""Peer artifact transfer as a node service (``mesh_node.node_service``): serving,
fetching, the ready report, the ``transfers`` and ``cache`` status sections and their metrics.

- Serving: the kind 0x03 handler is served exactly when ``would_serve``, the same decision
  that advertises the ``artifact-transfer`` feature bit (``features``); when this node
  coordinates a new topology it verifies the package once (``ArtifactHandler.warm``).
- Fetching: on every new topology in which this node holds a stage, the previous fetch is
  cancelled (its partials stay for a resume) and ``StageFetcher.fetch_stage`` runs.
- Reporting: when the stage is installed and verified, the node reports ``StageReady`` with
  its descriptor to the coordinator over a control stream (kind 0x01), or records it
  directly when it is the coordinator; a failed fetch is reported too, with its code.

For split serving: ``result`` is the last ready stage (its ``StageLoad`` for the runtime), and
``ready_hook`` (if given) runs between "installed and verified" and the report: it can load
the stage into a runtime and return the descriptor extended into the admission descriptor.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

import trio
from prometheus_client.registry import Collector

from mesh_node.errors import MeshError
from mesh_node.metrics import (
    SectionCollector,
    TransferDurations,
    cache_families,
    transfer_families,
)
from mesh_node.node import MeshNode
from mesh_node.node_service import FeatureBits, StreamKind
from mesh_node.request_gate import RequestGate
from mesh_node.topology import ActiveTopology, TopologyService
from mesh_node.transfer.fetch import StageFetcher, StageResult
from mesh_node.transfer.partials import PartialRegistry
from mesh_node.transfer.policy import node_policy
from mesh_node.transfer.records import TransferLog
from mesh_node.transfer.serve import ArtifactHandler
from mesh_node.transfer.siblings import SiblingTopologyHandler
from mesh_node.transfer.swarm import SourcesHandler
from protocol import constants as pc
from protocol.errors import ProtocolError
from protocol.messages import StageReady, TopologyAck, decode_control_message
from skippy.config import Environment
from skippy.consume.verify import VerifyCache
from skippy.errors import SkippyError
from skippy.package.topology import SplitTopology
from skippy.serving.failures import classify_failure
from skippy.stage.descriptor import StageDescriptor
from skippy.transfer import sha256_chain
from skippy.transfer.chunks import ChunkDigestStore
from skippy.transfer.policy import would_serve
from skippy.transfer.serve import ArtifactServer

log = logging.getLogger("mesh_node.transfer")
REPORT_ATTEMPTS: Final = 3
WORKERS_FIRST_S: Final = 10.0  # the longest a coordinator's own stage waits for the digests
ReadyHook = Callable[[StageResult], Awaitable[StageDescriptor]]
GENERIC_FAILURE: Final = "stage failed"
MAX_FAILURE_MESSAGE: Final = 4 * pc.DEFAULT_LIMITS.max_reason_chars  # StageReady's bound


class ArtifactService:
    # Its keys are top-level node keys (artifact_transfer, swarm_transfer): no table of its own.
    config_table: str | None = None

    def __init__(
        self,
        node: MeshNode,
        topology: TopologyService,
        env: Environment,
        *,
        server: ArtifactServer | None = None,
        verify_cache: VerifyCache | None = None,
        ready_hook: ReadyHook | None = None,
    ) -> None:
        self.node = node
        self.topology = topology
        # Events the transfer log's state cannot tell (each transfer's duration): /metrics.
        self.durations = TransferDurations()
        self.records = TransferLog(
            wall_clock=node.wall_clock, on_finish=self.durations.transfer_finished
        )
        vc = verify_cache if verify_cache is not None else VerifyCache.under(env.skippy_cache_dir)
        self.server = server or ArtifactServer(node.settings.hub_cache_dir, verify_cache=vc)
        # One budget of refused requests for the three kinds (mesh_node.request_gate).
        self.gate = RequestGate()
        self.handler = ArtifactHandler(node, self.server, self.records, gate=self.gate)
        self.fetcher = StageFetcher(node, env, self.records, verify_cache=vc)
        policy = node_policy(node.settings, node.identity, node.wall_clock())
        self.serving = would_serve(policy)
        # The coordinator's source lists, beside the serving handler (the
        # swarm-transfer bit is advertised with artifact-transfer, ``features``).
        self.sources = SourcesHandler(
            node, self.server, self.records, ChunkDigestStore.beside(vc.root), gate=self.gate
        )
        self._streams: list[StreamKind] = []
        if self.serving:
            admit = self.gate.admit
            self._streams.append(StreamKind(pc.KIND_ARTIFACT_TRANSFER, self.handler, admit=admit))
            if node.settings.swarm_transfer:
                # The verified chunks of this node's partials, served to peers
                # that advertise partial-serve and reported to its coordinator.
                partials = PartialRegistry()
                self.fetcher.partials = partials
                self.server.partials = partials.open_range
                self._streams.append(
                    StreamKind(pc.KIND_SWARM_SOURCES, self.sources, admit=admit)
                )
                # and sibling replicas' topologies for their holders
                siblings = SiblingTopologyHandler(node, self.gate)
                self._streams.append(
                    StreamKind(pc.KIND_SIBLING_TOPOLOGY, siblings, admit=admit)
                )
        self.result: StageResult | None = None
        self.ready_hook = ready_hook
        self._nursery: trio.Nursery | None = None
        self._topology_id: str | None = None
        self._job: trio.CancelScope | None = None

    # --- as a node service ------------------------------------------------------------------
    def streams(self) -> Sequence[StreamKind]:
        return list(self._streams)

    def features(self, now_s: float) -> FeatureBits:
        """``artifact-transfer`` exactly when this node would serve artifacts (spec "Peer Cache
        Transfer": ``would_serve``, the same decision that serves kind 0x03), with the swarm
        bits when ``swarm_transfer`` is on; ``chunk-chain`` wherever SHA-256 chains run."""
        settings = self.node.settings
        bits: set[str] = set()
        if sha256_chain.available():  # chunks checked along a SHA-256 chain
            bits.add(pc.BIT_CHUNK_CHAIN)
        if would_serve(node_policy(settings, self.node.identity, now_s)):
            bits.add(pc.BIT_ARTIFACT_TRANSFER)
            if settings.swarm_transfer:  # chunk ranges and source lists
                bits.add(pc.BIT_SWARM_TRANSFER)
                bits.add(pc.BIT_SIBLING_SERVE)  # and serving sibling replicas' stages
                bits.add(pc.BIT_CHUNK_RUNS)  # and runs of chunks on one stream
                bits.add(pc.BIT_PARTIAL_SERVE)  # and verified chunks of its partials
        return {pc.FEATURE_SKIPPY_STAGE: frozenset(bits)}

    def status_sections(self) -> Mapping[str, Any]:
        return {"transfers": self.records.status(), "cache": self.fetcher.cache_budget.status()}

    def collectors(self) -> Sequence[Collector]:
        return [
            self.durations,
            SectionCollector(self.records.status, transfer_families),
            SectionCollector(self.fetcher.cache_budget.status, cache_families),
        ]

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow the node's topology until cancelled."""
        await trio.to_thread.run_sync(self.fetcher.cache_budget.start)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.gate.run)  # the refusals' summary lines
            task_status.started()
            while True:  # a subscriber that fell behind is closed: subscribe again
                async with self.node.subscribe() as events:
                    self._follow()
                    async for _event in events:
                        self._follow()

    def _follow(self) -> None:
        """React to the active topology as it is now (events only say that it changed)."""
        active = self.topology.active
        tid = active.topology.topology_id if active is not None else None
        if tid == self._topology_id:
            return
        self._topology_id = tid
        if self._job is not None:
            self._job.cancel()
            self._job = None
        if active is None or self._nursery is None:
            return
        if self.serving and active.role == "coordinator":
            if self.node.settings.swarm_transfer:
                self.sources.expect(active.topology)  # before this node's own stage waits
            self._nursery.start_soon(self._warm, active.topology)
        if active.topology.stage_of(self.node.node_id) is not None:
            self._job = trio.CancelScope()
            self._nursery.start_soon(self._fetch_and_report, active, self._job)

    async def _warm(self, topology: SplitTopology) -> None:
        """A coordinator's package verified for serving, then (swarm) its workers' chunk
        digests computed before any worker asks (``SourcesHandler.prepare``)."""
        await self.handler.warm(topology)
        if self.node.settings.swarm_transfer:
            await self.sources.prepare(topology)

    async def _fetch_and_report(self, active: ActiveTopology, scope: trio.CancelScope) -> None:
        topology = active.topology
        with scope:
            if active.role == "coordinator":
                # The workers' chunk digests first (their source lists wait for
                # them, and until then nothing moves); this stage is needed only once every
                # worker is ready. At once without swarm transfer.
                with trio.move_on_after(WORKERS_FIRST_S):
                    await self.sources.prepared(topology.topology_id)
            log.info("topology %s: fetching this node's stage", topology.topology_id)
            try:
                result = await self.fetcher.fetch_stage(active)
                descriptor = result.descriptor
                if self.ready_hook is not None:
                    descriptor = await self.ready_hook(result)
            except SkippyError as exc:
                log.warning("topology %s: stage not ready: %s", topology.topology_id, exc)
                self._mark_failed(topology.topology_id, exc.code)  # the load's, after the fetch
                await self._report_failure(active, exc.code, failure_message(exc))
                return
            except Exception:  # a bug here must not take the node down (as a link's handler)
                log.exception("topology %s: fetching the stage failed", topology.topology_id)
                self._mark_failed(topology.topology_id, "internal_error")
                await self._report_failure(active, "internal_error")
                return
            self.result = result
            log.info(
                "topology %s: stage %d ready (%d artifacts, %d bytes)",
                topology.topology_id,
                result.stage.stage_index,
                descriptor.artifact_count,
                descriptor.artifact_bytes,
            )
            await self._report(
                active,
                StageReady(
                    topology.topology_id, result.stage.stage_id, True, descriptor.to_dict()
                ),
            )

    def _mark_failed(self, topology_id: str, code: str) -> None:
        """The stage's record says failed, with ``code``: a fetch that failed set it already;
        a stage fetched, then refused by the ready hook (the runtime's load), was "ready"."""
        state = self.records.stage
        if state is not None and state.topology_id == topology_id:
            state.state, state.error = "failed", code

    async def _report_failure(
        self, active: ActiveTopology, code: str, message: str = GENERIC_FAILURE
    ) -> None:
        stage_id = _stage_id(active, self.node.node_id)
        tid = active.topology.topology_id
        await self._report(active, StageReady(tid, stage_id, False, None, code, message))

    async def _report(self, active: ActiveTopology, report: StageReady) -> None:
        answer = await self._send_report(active, report)
        state = self.records.stage
        if state is not None and state.topology_id == report.topology_id:
            state.report = answer
        log.info("topology %s: ready report answered %s", report.topology_id, answer)

    async def _send_report(self, active: ActiveTopology, report: StageReady) -> str:
        coordinator = active.coordinator_id
        if coordinator == self.node.node_id:
            return _answer(self.topology.record_stage(coordinator, report))
        timeouts = self.node.timeouts
        for _ in range(REPORT_ATTEMPTS):
            try:
                with trio.fail_after(timeouts.handshake_s + timeouts.idle_s):
                    stream = await self.node.open_stream(coordinator, pc.KIND_CONTROL)
                    async with stream:
                        await stream.send_message(report.encode())
                        await stream.send_eof()
                        reply = await stream.receive_message()
                if reply is None:
                    return "no answer"
                ack = decode_control_message(reply, self.node.limits)
                if not isinstance(ack, TopologyAck):
                    return "unexpected answer"
                return _answer(ack)
            except (MeshError, ProtocolError, trio.TooSlowError) as exc:
                log.info("ready report to %s failed: %s", coordinator[:12], exc)
                await self.fetcher.wait_for_link(coordinator)
        return "unreachable"


def failure_message(exc: SkippyError) -> str:
    """What a failed stage's report says beside its code. A permanent failure's own words
    (the model's or package's facts, and the hint), so the coordinator can say why without
    the worker's log; any other failure only that it failed: its text may name this node's
    local paths."""
    if classify_failure(exc.code) != "permanent":
        return GENERIC_FAILURE
    text = exc.message + (f"; hint: {exc.remediation}" if exc.remediation else "")
    return text[:MAX_FAILURE_MESSAGE]


def _answer(ack: TopologyAck) -> str:
    return "accepted" if ack.accepted else f"refused: {ack.code}"


def _stage_id(active: ActiveTopology, node_id: str) -> str:
    stage = active.topology.stage_of(node_id)
    return stage.stage_id if stage is not None else "none"
