"""The topology service: the coordinator plans, signs and sends a split topology
over skippy-stage/2 control streams (kind 0x01); a worker verifies the signature against the
coordinator's *authenticated* node id and the exact-once coverage, stores it as its active
topology and acknowledges. Each stage's node later reports on the same kind of stream that its
stage is ready (``StageReady``); the coordinator checks the report's descriptor
against the topology and records it. Peer loss marks the topology degraded; ``replan`` places
the split again over the remaining capable peers.

The shell of ``skippy.package.topology``, its pure core.

Planning is pure (``skippy.package.topology.plan_topology``; with every capable node
calibrated, the cost planner ``skippy.package.cost_plan`` through ``mesh_node.cost_inputs``);
this module does the I/O.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence, Set
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import trio
from prometheus_client.registry import Collector

from mesh_node.coordination import (
    EpochStore,
    admits,
    bounds_problem,
    offer_refusal,
    placeable,
    sign_topology,
)
from mesh_node.cost_inputs import (
    CostInputs,
    cost_choice,
    gather,
    memory_plan_reason,
    predict_topology,
)
from mesh_node.device_adverts import capacity, planned_placement
from mesh_node.errors import MeshError, TopologyRefused
from mesh_node.identity import LocalIdentity
from mesh_node.link import LinkTimeouts, MeshStream
from mesh_node.metrics import SectionCollector, topology_families
from mesh_node.node_service import FeatureBits, StreamKind
from mesh_node.peers import (
    AuthenticatedPeer,
    InboundStream,
    NodeEvent,
    PeerDown,
    PeerInfo,
    StageReported,
    TopologyChanged,
)
from mesh_node.settings import NodeSettings
from protocol import constants as pc
from protocol.certificates import verify_domain
from protocol.errors import ProtocolError
from protocol.messages import (
    ComputeCost,
    Devices,
    StageReady,
    TopologyAck,
    TopologyOffer,
    decode_control_message,
)
from skippy.errors import TopologyError
from skippy.package.cost_plan import topology_from_candidate
from skippy.package.heal import heal_topology
from skippy.package.plan import ModelSizes
from skippy.package.topology import (
    NodeCapacity,
    SplitTopology,
    plan_like,
    plan_topology,
)
from skippy.runtime.admission import RuntimeFacts
from skippy.stage.descriptor import StageDescriptor, admission_problem

log = logging.getLogger("mesh_node.topology")
Role = Literal["coordinator", "worker"]
State = Literal["active", "degraded", "incomplete"]


@dataclass
class ActiveTopology:
    topology: SplitTopology
    signature: bytes
    coordinator_id: str
    role: Role
    state: State
    acks: dict[str, str] = field(default_factory=dict)  # worker -> accepted | refused: ... | ...
    lost: set[str] = field(default_factory=set)
    sizes: ModelSizes | None = None  # the package's bytes, when this node planned it
    own_id: str = ""  # this node's id
    # Coordinator: each stage node's last report (its own stage included).
    reports: dict[str, StageReport] = field(default_factory=dict)
    # Whether the coordinator was trusted when the topology was accepted: only
    # then may its bytes be installed under the hub commit (mesh_node.transfer.fetch).
    coordinator_trusted: bool = True
    # The coordinator's planner record (which planner, predicted ms/token, why);
    # ``None`` on a worker.
    prediction: dict[str, Any] | None = None
    # Coordinator: where each stage node was planned to hold its stage, by node id (its
    # device, mode and bytes there: ``mesh_node.device_adverts.planned_placement``).
    placement: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def all_ready(self) -> bool:
        """Every stage's node reported ready (with a descriptor matching the topology)."""
        return all(
            (r := self.reports.get(s.node_id)) is not None and r.state == "ready"
            for s in self.topology.stages
        )

    def stage_status(self) -> list[dict[str, Any]]:
        """Per stage, for operators: its bytes (``None`` when this node does not know the
        package's sizes), its state and whether it is ready. A coordinator knows each stage's
        report (``ready`` / ``failed`` / ``rejected``, with ``code``), else its ack (``accepted``,
        a refusal, ``pending``); a worker knows only that it accepted its own stage (``ready``:
        ``None``, not known here; its fetch is in the document's ``transfers.stage``)."""
        out: list[dict[str, Any]] = []
        for stage in self.topology.stages:
            nid = stage.node_id
            report = self.reports.get(nid)
            ready: bool | None
            code = None
            if nid in self.lost:
                state, ready = "lost", False
            elif report is not None:
                state, ready, code = report.state, report.state == "ready", report.code
            elif self.role == "coordinator":
                state = "accepted" if nid == self.own_id else self.acks.get(nid, "pending")
                ready = False
            else:
                state = "accepted" if nid == self.own_id else "unknown"
                ready = None
            out.append(
                {
                    "stage_index": stage.stage_index,
                    "bytes": None if self.sizes is None else self.sizes.stage_bytes(stage.layers),
                    "state": state,
                    "code": code,
                    "ready": ready,
                    "placement": self.placement.get(nid),
                }
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.topology.to_dict(),
            "coordinator_id": self.coordinator_id,
            "role": self.role,
            "state": self.state,
            "acks": dict(sorted(self.acks.items())),
            "lost_nodes": sorted(self.lost),
            "ready": {k: v.to_dict() for k, v in sorted(self.reports.items())},
            "all_ready": self.all_ready,
            "stage_status": self.stage_status(),
            "prediction": self.prediction,
        }


@dataclass(frozen=True)
class StageReport:
    """What the coordinator knows of one stage node: ``ready`` (descriptor checked),
    ``failed`` (the node said so; ``code``, and ``message`` when it said why), or
    ``rejected`` (the descriptor did not match)."""

    state: Literal["ready", "failed", "rejected"]
    code: str | None = None
    descriptor: StageDescriptor | None = None
    message: str | None = None  # a peer's words: escape them before showing them on a terminal

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "code": self.code,
            "message": self.message,
            "artifact_bytes": None if self.descriptor is None else self.descriptor.artifact_bytes,
        }


@dataclass(frozen=True)
class _PlanRequest:
    package_ref: str
    manifest_sha256: str
    sizes: ModelSizes
    include_self: bool
    stages: int | None
    run_id: str
    first_node: str | None = None


def topology_signature_valid(topology: SplitTopology, signer_id: str, signature: bytes) -> bool:
    return verify_domain(
        bytes.fromhex(signer_id), signature, pc.SIG_DOMAIN_TOPOLOGY, topology.canonical_bytes()
    )


class NodeView(Protocol):
    """The part of ``MeshNode`` the service uses (keeps the arrow one way: node -> topology)."""

    node_id: str
    compute: ComputeCost | None  # this node's calibration, for cost planning
    devices: Devices | None  # this node's devices, for placing stages by device memory
    identity: LocalIdentity
    settings: NodeSettings
    limits: pc.Limits
    timeouts: LinkTimeouts
    wall_clock: Callable[[], float]

    def peers(self, *, connected_only: bool = False) -> list[PeerInfo]: ...
    def authenticated(self, node_id: str) -> AuthenticatedPeer | None: ...
    def verified_node_ids(self) -> set[str]: ...
    async def open_stream(self, node_id: str, kind: int) -> MeshStream: ...
    def emit(self, event: NodeEvent) -> None: ...
    def subscribe(self) -> AbstractAsyncContextManager[trio.MemoryReceiveChannel[NodeEvent]]: ...


def _refused(exc: TopologyError) -> TopologyRefused:
    """A planning error as this coordinator's refusal, with the same code and facts."""
    return TopologyRefused(
        exc.message, code=exc.code, expected=exc.expected, actual=exc.actual, path=exc.path
    )


class TopologyService:
    """A node service (``mesh_node.node_service``): the control streams (kind 0x01), the
    ``topology`` status section and its metrics; ``run`` marks the topology degraded when a
    stage's node is lost."""

    # It reads [security]'s scopes, a table the node core shares: none of its own.
    config_table: str | None = None

    def __init__(self, node: NodeView, *, epochs: EpochStore | None = None) -> None:
        self.node = node
        self.active: ActiveTopology | None = None
        self._last_request: _PlanRequest | None = None
        # A serving coordinator sets its own runtime facts: stage reports must agree with them.
        self.admission_expect: RuntimeFacts | None = None
        self.epochs = epochs if epochs is not None else EpochStore(node.settings.data_dir)
        self._siblings: list[TopologyService] = []

    def sibling(self) -> TopologyService:
        """A topology service for another replica of this coordinator's split
        (``mesh_node.serving.replicas``). It is never added to the node: it shares this
        service's epochs (one sequence per coordinator), and the stage reports for its
        topology arrive on this service's control streams, which hand them on."""
        sibling = TopologyService(self.node, epochs=self.epochs)
        self._siblings.append(sibling)
        return sibling

    @property
    def siblings(self) -> tuple[TopologyService, ...]:
        """The services ``sibling`` made, in order."""
        return tuple(self._siblings)

    # --- as a node service ------------------------------------------------------------------
    def streams(self) -> Sequence[StreamKind]:
        return [StreamKind(pc.KIND_CONTROL, self._handle_control)]

    def features(self, now_s: float) -> FeatureBits:
        return {}

    def status_sections(self) -> Mapping[str, Any]:
        return {"topology": self.status()}

    def collectors(self) -> Sequence[Collector]:
        return [SectionCollector(self.status, topology_families)]

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        security = self.node.settings.security
        if security.accept_topologies_from == "any":
            log.warning(
                "accept_topologies_from = any: any authenticated peer may coordinate this node "
                "(for labs only)"
            )
        if security.place_stages_on == "any":
            log.warning(
                "place_stages_on = any: stages may be placed on untrusted peers (for labs only)"
            )
        task_status.started()
        await self.watch()

    def status(self) -> dict[str, Any] | None:
        return None if self.active is None else self.active.to_dict()

    def active_for(self, node_id: str) -> ActiveTopology | None:
        """The active topology ``node_id`` holds a stage in: a replica's (``siblings``)
        when that one has it, else this service's own."""
        for sibling in self._siblings:
            other = sibling.active
            if other is not None and other.topology.stage_of(node_id) is not None:
                return other
        return self.active

    def capable_nodes(
        self, include_self: bool, exclude: Set[str] = frozenset()
    ) -> list[NodeCapacity]:
        """Connected peers advertising the complete stage bundle that ``place_stages_on``
        admits (``mesh_node.coordination.placeable``), but those in ``exclude`` (the nodes
        another replica holds), and this node, if asked."""
        scope = self.node.settings.security.place_stages_on
        nodes = [
            capacity(p.node_id, p.memory_budget_bytes, p.devices)
            for p in placeable(self.node.peers(connected_only=True), scope)
            if p.has_features(pc.FEATURE_SKIPPY_STAGE, pc.STAGE_BUNDLE)
        ]
        taken = set(exclude) - {self.node.node_id}
        nodes = [n for n in nodes if n.node_id not in taken]
        if include_self:
            own = self.node.settings.memory_budget_bytes
            nodes.append(capacity(self.node.node_id, own, self.node.devices))
        return nodes

    # --- coordinator -----------------------------------------------------------------------------
    async def propose(
        self,
        *,
        package_ref: str,
        manifest_sha256: str,
        sizes: ModelSizes,
        include_self: bool = True,
        stages: int | None = None,
        run_id: str | None = None,
        first_node: str | None = None,
        like: SplitTopology | None = None,
        exclude: Set[str] = frozenset(),
    ) -> ActiveTopology:
        """Plan over the capable peers, sign, send to every worker and collect their acks.
        ``first_node`` pins stage 0 (a serving coordinator holds it); ``like``: another
        replica's plan, whose layer ranges this one takes (``plan_like``); ``exclude``: nodes
        not to plan over (another replica's)."""
        request = _PlanRequest(
            package_ref,
            manifest_sha256,
            sizes,
            include_self,
            stages,
            run_id or f"run-{uuid.uuid4().hex[:16]}",
            first_node,
        )
        self._last_request = request
        topology, prediction = self._plan(request, like, exclude)
        return await self._distribute(topology, sizes, prediction)

    def _plan(
        self, r: _PlanRequest, like: SplitTopology | None, exclude: Set[str]
    ) -> tuple[SplitTopology, dict[str, Any] | None]:
        """``r`` planned over the capable nodes linked now but ``exclude`` (a new topology
        id), and the planner's record; ``TopologyRefused`` when it cannot be placed."""
        capable = self.capable_nodes(r.include_self, exclude)
        topology_id = f"topo-{uuid.uuid4().hex[:16]}"
        # With every capable node calibrated, the cost planner decides (stage
        # count, nodes, order, speed-weighted ranges); else the byte-balanced memory plan.
        inputs = self.cost_inputs(capable, r.sizes)
        try:
            choice = cost_choice(inputs, r.sizes, stages=r.stages, first_node=r.first_node)
            if choice is not None:
                topology = topology_from_candidate(
                    choice.chosen,
                    r.sizes,
                    topology_id=topology_id,
                    run_id=r.run_id,
                    package_ref=r.package_ref,
                    manifest_sha256=r.manifest_sha256,
                )
            else:
                topology = plan_topology(
                    r.sizes,
                    capable,
                    topology_id=topology_id,
                    run_id=r.run_id,
                    package_ref=r.package_ref,
                    manifest_sha256=r.manifest_sha256,
                    stages=r.stages,
                    first_node=r.first_node,
                )
            planned = topology
            if like is not None:
                topology = plan_like(topology, like, capable, r.sizes)
        except TopologyError as exc:
            raise _refused(exc) from None
        prediction: dict[str, Any] | None = (
            choice.prediction() if choice is not None else memory_plan_reason(inputs)
        )
        if topology is not planned:  # stage 0 moved: predict what is sent
            prediction = self._repredict(topology, r.sizes, exclude)
        return topology, prediction

    def plan_again(
        self, stages: int | None, exclude: Set[str] = frozenset()
    ) -> tuple[SplitTopology, dict[str, Any] | None]:
        """The last request (package, run, stage 0's node) planned again with ``stages`` over
        the capable nodes linked now, and the planner's record, sent to no one: a serving
        coordinator compares it with the active topology before growing the split
        (``skippy.package.grow``) and then ``offer``s it."""
        r = self._last_request
        if r is None:
            raise TopologyRefused(
                "nothing to re-plan: no topology was proposed", code="no_topology"
            )
        return self._plan(replace(r, stages=stages), None, exclude)

    async def offer(
        self, topology: SplitTopology, prediction: dict[str, Any] | None
    ) -> ActiveTopology:
        """Sign and send a topology ``plan_again`` made: the new active topology."""
        r = self._last_request
        if r is None:
            raise TopologyRefused(
                "nothing to re-plan: no topology was proposed", code="no_topology"
            )
        return await self._distribute(topology, r.sizes, prediction)

    def cost_inputs(self, capable: list[NodeCapacity], sizes: ModelSizes) -> CostInputs:
        """What the cost planner knows now (``mesh_node.cost_inputs.gather``)."""
        peers = self.node.peers(connected_only=True)
        return gather(
            self.node.node_id, self.node.compute, peers, capable, sizes, self.node.devices
        )

    def _repredict(
        self, topology: SplitTopology, sizes: ModelSizes, exclude: Set[str]
    ) -> dict[str, Any] | None:
        """A healed or replaced topology's prediction, when its nodes are calibrated."""
        capable = self.capable_nodes(True, exclude)
        return predict_topology(self.cost_inputs(capable, sizes), sizes, topology)

    async def heal(self, exclude: Set[str] = frozenset()) -> ActiveTopology:
        """The active topology again over the nodes linked now: stages
        whose node is linked stay (a returning node keeps its own), each other one moves to a
        capable spare (``skippy.package.heal``); a new topology id, signed and sent to every
        stage node; never onto a node in ``exclude``. ``TopologyRefused`` (``no_capable_peer``)
        when a stage has no taker."""
        active, r = self.active, self._last_request
        if active is None or r is None or active.role != "coordinator":
            raise TopologyRefused("this node coordinates no topology", code="no_topology")
        try:
            topology = heal_topology(
                active.topology,
                self.capable_nodes(True, exclude),
                r.sizes,
                topology_id=f"topo-{uuid.uuid4().hex[:16]}",
            )
        except TopologyError as exc:
            raise _refused(exc) from None
        prediction = self._repredict(topology, r.sizes, exclude)
        return await self._distribute(topology, r.sizes, prediction)

    async def restore(
        self,
        topology: SplitTopology,
        sizes: ModelSizes,
        *,
        first_node: str | None,
        exclude: Set[str] = frozenset(),
    ) -> ActiveTopology:
        """A restarted coordinator takes up the split it ran before: the
        same stages on the same nodes, same run id, a new topology id, signed again (through
        ``sign_topology`` like every topology this node offers)."""
        self._last_request = _PlanRequest(
            topology.package_ref,
            topology.manifest_sha256,
            sizes,
            any(s.node_id == self.node.node_id for s in topology.stages),
            len(topology.stages),
            topology.run_id,
            first_node,
        )
        self.active = ActiveTopology(
            topology,
            b"",
            self.node.node_id,
            "coordinator",
            "degraded",
            sizes=sizes,
            own_id=self.node.node_id,
        )
        return await self.heal(exclude)

    def sign_topology(self, topology: SplitTopology) -> tuple[SplitTopology, bytes]:
        """The one place this node signs a topology (every offer, re-plans, heals and a
        restarted coordinator's re-offer all pass here), stamped with this coordinator's next
        epoch (workers refuse an older or equal one)."""
        return sign_topology(self.node.identity.key, topology, self.epochs, self.node.wall_clock())

    async def _distribute(
        self,
        topology: SplitTopology,
        sizes: ModelSizes,
        prediction: dict[str, Any] | None = None,
    ) -> ActiveTopology:
        """Sign ``topology``, make it active here, send it to every worker, collect acks."""
        topology, signature = self.sign_topology(topology)
        active = ActiveTopology(
            topology,
            signature,
            self.node.node_id,
            "coordinator",
            "incomplete",
            sizes=sizes,
            own_id=self.node.node_id,
            prediction=prediction,
            placement=planned_placement(topology, self.capable_nodes(True), sizes),
        )
        workers = [s.node_id for s in topology.stages if s.node_id != self.node.node_id]
        offer = TopologyOffer(topology.to_dict(), signature).encode()
        # Active before any worker hears of it: a worker fetches its artifacts as
        # soon as it accepts, and the artifact server authorizes against this topology.
        self.active = active
        self.node.emit(TopologyChanged(active.state, topology.topology_id))
        async with trio.open_nursery() as nursery:
            for worker in workers:
                nursery.start_soon(self._send_offer, worker, offer, topology, active)
        active.state = (
            "active" if all(active.acks.get(w) == "accepted" for w in workers) else ("incomplete")
        )
        self.node.emit(TopologyChanged(active.state, topology.topology_id))
        log.info("topology %s: %s (%s)", topology.topology_id, active.state, active.acks)
        return active

    async def replan(self) -> ActiveTopology:
        if self._last_request is None:
            raise TopologyRefused(
                "nothing to re-plan: no topology was proposed", code="no_topology"
            )
        r = self._last_request
        return await self.propose(
            package_ref=r.package_ref,
            manifest_sha256=r.manifest_sha256,
            sizes=r.sizes,
            include_self=r.include_self,
            stages=r.stages,
            run_id=r.run_id,
            first_node=r.first_node,
        )

    async def _send_offer(
        self, worker: str, offer: bytes, topology: SplitTopology, active: ActiveTopology
    ) -> None:
        try:
            with trio.fail_after(self.node.timeouts.handshake_s):
                stream = await self.node.open_stream(worker, pc.KIND_CONTROL)
                async with stream:
                    await stream.send_message(offer)
                    await stream.send_eof()
                    reply = await stream.receive_message()
            if reply is None:
                active.acks[worker] = "no answer"
                return
            ack = decode_control_message(reply, self.node.limits)
            if not isinstance(ack, TopologyAck) or ack.topology_id != topology.topology_id:
                active.acks[worker] = "refused: unexpected reply"
            elif ack.accepted:
                active.acks[worker] = "accepted"
            else:
                active.acks[worker] = f"refused: {ack.code}: {ack.message}"
        except trio.TooSlowError:
            active.acks[worker] = "no answer: timeout"
        except (MeshError, ProtocolError) as exc:
            active.acks[worker] = f"unreachable: {exc}"

    # --- worker ------------------------------------------------------------------------------
    async def _handle_control(self, inbound: InboundStream) -> None:
        stream = inbound.stream
        with trio.fail_after(self.node.timeouts.handshake_s):
            payload = await stream.receive_message()
        if payload is None:
            return
        try:
            message = decode_control_message(payload, self.node.limits)
        except ProtocolError as exc:
            stream.reset(exc.code, exc.message)
            return
        peer = self.node.authenticated(inbound.peer.node_id) or inbound.peer  # trust as of now
        if isinstance(message, TopologyOffer):
            ack = self.accept_offer(message, peer.node_id)
        elif isinstance(message, StageReady):
            if admits(self.node.settings.security.place_stages_on, peer.trusted):
                ack = self.record_stage(peer.node_id, message)
            else:  # in trusted mode only trusted stage nodes count
                ack = TopologyAck(
                    message.topology_id, False, "untrusted_peer", "this node is not trusted here"
                )
        else:
            stream.reset(
                "unexpected_message", "a control stream starts with a topology offer or report"
            )
            return
        await stream.send_message(ack.encode())
        await stream.send_eof()
        await stream.receive_some()  # the coordinator's end of stream (or its reset)

    def accept_offer(self, offer: TopologyOffer, coordinator_id: str) -> TopologyAck:
        """Verify an offer received from the authenticated ``coordinator_id``; store it."""
        raw_id = offer.topology.get("topology_id")
        topology_id = raw_id if isinstance(raw_id, str) and raw_id else "?"
        try:
            topology = SplitTopology.from_dict(offer.topology)
        except TopologyError as exc:
            return TopologyAck(topology_id[:128], False, exc.code, exc.message)
        if not topology_signature_valid(topology, coordinator_id, offer.signature):
            return TopologyAck(
                topology.topology_id,
                False,
                "topology_signature",
                "the signature does not verify against the sending coordinator's id",
            )
        # Who may coordinate us, epochs, sanity bounds; all before any fetch.
        coordinator = self.node.authenticated(coordinator_id) or AuthenticatedPeer(
            coordinator_id, None, "unverified", False, "not linked"
        )
        refusal = offer_refusal(
            scope=self.node.settings.security.accept_topologies_from,
            coordinator=coordinator,
            coordinating=self.active is not None and self.active.role == "coordinator",
            epoch=topology.epoch,
            last_epoch=self.epochs.last_accepted(coordinator_id),
        ) or bounds_problem(
            topology,
            self.node.verified_node_ids() | {coordinator_id},
            coordinator_trusted=coordinator.trusted,
        )
        if refusal is not None:
            log.warning(
                "refused topology %s from %s: %s: %s",
                topology.topology_id,
                coordinator_id[:12],
                *refusal,
            )
            return TopologyAck(topology.topology_id, False, *refusal)
        if topology.stage_of(self.node.node_id) is None:
            return TopologyAck(
                topology.topology_id, False, "not_in_topology", "this node holds no stage"
            )
        self.epochs.record_accepted(coordinator_id, topology.epoch)
        self.active = ActiveTopology(
            topology,
            offer.signature,
            coordinator_id,
            "worker",
            "active",
            own_id=self.node.node_id,
            coordinator_trusted=coordinator.trusted,
        )
        self.node.emit(TopologyChanged("active", topology.topology_id))
        log.info(
            "accepted topology %s (epoch %d) from %s (%s)",
            topology.topology_id,
            topology.epoch,
            coordinator_id[:12],
            "trusted" if coordinator.trusted else "untrusted",
        )
        return TopologyAck(topology.topology_id, True)

    # --- stage reports (ready, with the admission descriptor) -----------------------
    def record_stage(self, node_id: str, report: StageReady) -> TopologyAck:
        """A stage node's report (``node_id`` authenticated, or this node itself): check it
        against the active topology this node coordinates and record it."""
        active = self.active
        tid = report.topology_id
        problem: tuple[str, str] | None = None
        for sibling in self._siblings:  # another replica's topology
            if sibling.active is not None and sibling.active.topology.topology_id == tid:
                return sibling.record_stage(node_id, report)
        if active is None or active.role != "coordinator" or active.topology.topology_id != tid:
            return TopologyAck(tid, False, "stale_topology", "not the topology this node runs")
        stage = active.topology.stage_of(node_id)
        if stage is None or stage.stage_id != report.stage_id:
            return TopologyAck(tid, False, "not_in_topology", "the reporter holds no such stage")
        if not report.ready:
            result = StageReport("failed", report.code or "stage_failed", message=report.message)
        else:
            try:
                descriptor = StageDescriptor.from_dict(report.descriptor)
            except TopologyError as exc:
                return TopologyAck(tid, False, exc.code, exc.message)
            problem = admission_problem(
                descriptor, active.topology, node_id, expect=self.admission_expect
            )
            result = (
                StageReport("ready", None, descriptor)
                if problem is None
                else StageReport("rejected", problem[0], descriptor)
            )
        active.reports[node_id] = result
        log.info(
            "topology %s: stage %d on %s %s%s",
            tid,
            stage.stage_index,
            node_id[:12],
            result.state,
            f" ({result.code})" if result.code else "",
        )
        self.node.emit(StageReported(tid, node_id, result.state, result.code))
        if problem is not None:
            return TopologyAck(tid, False, problem[0], problem[1])
        return TopologyAck(tid, True)

    # --- peer loss --------------------------------------------------------------------------------
    async def watch(self) -> None:
        async with self.node.subscribe() as events:
            async for event in events:
                if isinstance(event, PeerDown):
                    self.on_peer_down(event.node_id)

    def on_peer_down(self, node_id: str) -> None:
        active = self.active
        if active is None:
            return
        involved = active.topology.stage_of(node_id) is not None or node_id == (
            active.coordinator_id
        )
        if not involved or node_id == self.node.node_id or node_id in active.lost:
            return
        active.lost.add(node_id)
        active.state = "degraded"
        log.warning("topology %s degraded: lost %s", active.topology.topology_id, node_id[:12])
        self.node.emit(TopologyChanged("degraded", active.topology.topology_id))
