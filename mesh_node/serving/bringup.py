"""Bringing this node's stage up: follow the topology, bring the stage's parts in, load them,
report ready with the admission descriptor (issue #10 section 1).

``stage_ready`` is the one step every path shares: it loads a verified ``StageLoad`` into the
node's ``StageHost`` and extends the ready report's ``StageDescriptor`` with the runtime's
facts. ``LocalBringup`` brings the parts in through the consumer path
(``skippy.consume.resolve.resolve_stage``: a package directory every node can read, or the
node's hub cache and hub) and sends the ``StageReady`` report over a control stream; peer
artifact transfer (issue #8) brings them in over the mesh instead and calls the same step.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Final

import trio

from mesh_node.errors import MeshError
from mesh_node.node import MeshNode
from mesh_node.serving.host import StageHost
from mesh_node.topology import ActiveTopology
from protocol import constants as pc
from protocol.errors import ProtocolError
from protocol.messages import StageReady, TopologyAck, decode_control_message
from skippy.config import Environment
from skippy.errors import SkippyError
from skippy.package.topology import SplitTopology, StageAssignment
from skippy.runtime.boundary import StageLoad
from skippy.stage.descriptor import StageDescriptor

log = logging.getLogger("mesh_node.serving.bringup")
REPORT_ATTEMPTS: Final = 3


async def stage_ready(
    host: StageHost,
    topology: SplitTopology,
    stage: StageAssignment,
    load: StageLoad,
    descriptor: StageDescriptor,
) -> StageDescriptor:
    """Load the verified stage and return the admission descriptor for the ready report."""
    loaded = await host.load(topology, stage, load, descriptor.artifact_bytes)
    return replace(descriptor, runtime=loaded.facts)


def _resolve(topology: SplitTopology, stage: StageAssignment, env: Environment) -> tuple[
    StageLoad, StageDescriptor
]:
    from skippy.consume.resolve import resolve_stage

    layers = f"{stage.layers.start}..{stage.layers.stop}"
    resolved = resolve_stage(topology.package_ref, env, layers_text=layers, text_only=True)
    package = resolved.stage.package
    if package.manifest_sha256 != topology.manifest_sha256:
        raise MeshError(
            "the package this node resolves is not the one the topology names",
            code="manifest_mismatch",
            expected=topology.manifest_sha256,
            actual=package.manifest_sha256,
        )
    selection = resolved.stage.selection
    load = StageLoad.from_selection(
        selection, resolved.files(), manifest_sha256=package.manifest_sha256
    )
    refs = selection.all_refs
    descriptor = StageDescriptor(
        package_ref=topology.package_ref,
        manifest_sha256=topology.manifest_sha256,
        stage_index=stage.stage_index,
        layers=stage.layers,
        artifact_count=len(refs),
        artifact_bytes=selection.total_bytes,
    )
    return load, descriptor


class LocalBringup:
    """Follow the node's active topology; bring this node's stage up through the consumer
    path and report it. One job per topology (a newer topology cancels the older job)."""

    def __init__(self, node: MeshNode, host: StageHost, env: Environment) -> None:
        self.node = node
        self.host = host
        self.env = replace(env, hf_cache_dir=node.settings.hub_cache_dir)
        self._topology_id: str | None = None
        self._job: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:  # a subscriber that fell behind is closed: subscribe again
                async with self.node.subscribe() as events:
                    self._follow()
                    async for _event in events:
                        self._follow()

    def _follow(self) -> None:
        active = self.node.topology.active
        tid = active.topology.topology_id if active is not None else None
        if tid == self._topology_id:
            return
        self._topology_id = tid
        if self._job is not None:
            self._job.cancel()
            self._job = None
        if active is None or self._nursery is None:
            return
        if active.topology.stage_of(self.node.node_id) is not None:
            self._job = trio.CancelScope()
            self._nursery.start_soon(self._bring_up, active, self._job)

    async def _bring_up(self, active: ActiveTopology, scope: trio.CancelScope) -> None:
        topology = active.topology
        stage = topology.stage_of(self.node.node_id)
        assert stage is not None  # checked by _follow (typing)
        with scope:
            try:
                load, descriptor = await trio.to_thread.run_sync(
                    _resolve, topology, stage, self.env
                )
                descriptor = await stage_ready(self.host, topology, stage, load, descriptor)
                report = StageReady(
                    topology.topology_id, stage.stage_id, True, descriptor.to_dict()
                )
            except SkippyError as exc:
                log.warning("topology %s: stage not ready: %s", topology.topology_id, exc)
                report = StageReady(
                    topology.topology_id, stage.stage_id, False, None, exc.code, exc.message[:200]
                )
            answer = await send_report(self.node, active, report)
            log.info("topology %s: ready report answered %s", topology.topology_id, answer)


async def send_report(node: MeshNode, active: ActiveTopology, report: StageReady) -> str:
    """Deliver a stage report to the topology's coordinator (itself: recorded directly)."""
    coordinator = active.coordinator_id
    if coordinator == node.node_id:
        return _answer(node.topology.record_stage(coordinator, report))
    timeouts = node.timeouts
    for _ in range(REPORT_ATTEMPTS):
        try:
            with trio.fail_after(timeouts.handshake_s + timeouts.idle_s):
                stream = await node.open_stream(coordinator, pc.KIND_CONTROL)
                async with stream:
                    await stream.send_message(report.encode())
                    await stream.send_eof()
                    reply = await stream.receive_message()
            if reply is None:
                return "no answer"
            ack = decode_control_message(reply, node.limits)
            return _answer(ack) if isinstance(ack, TopologyAck) else "unexpected answer"
        except (MeshError, ProtocolError, trio.TooSlowError) as exc:
            log.info("ready report to %s failed: %s", coordinator[:12], exc)
            await trio.sleep(timeouts.heartbeat_interval_s)
    return "unreachable"


def _answer(ack: TopologyAck) -> str:
    return "accepted" if ack.accepted else f"refused: {ack.code}"
