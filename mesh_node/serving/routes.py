"""The route manager of a serving coordinator: route lifecycle and admission of routes.

``RouteManager.run`` brings the split up and keeps it up, with no operator:

- **Bring-up.** It waits for the capable peers and plans the package over them with stage 0
  on this node (``TopologyService.propose(first_node=...)``), or, when this coordinator ran the
  same package before (same identity, package and stage count: ``data_dir/serving/split.json``,
  read by the split given the ``run_file`` duty), waits for that run's nodes and re-forms the
  same split
  (``TopologyService.restore``: their verified parts stay in their caches, nothing is
  transferred again). ``serve`` waits like a service: after ``ready_timeout_s`` it logs a
  WARNING naming what is missing and keeps forming the split as peers arrive.
- **Admission of routes.** The route is published only when every stage reported ready with an
  admission descriptor that matches the topology and this node's runtime (same model, width
  and dtype, runtime version, enough context), and stage 0 is this node's. Until then requests
  get ``SplitNotReady`` (HTTP 503) with what the split waits for.
- **Healing.** A stage node lost (link loss or heartbeat) withdraws the route; the lost stage
  moves to a capable spare, or, when none can take it, the split waits (503
  ``no_capable_peer``, naming the node it waits for) until the node comes back with the same
  id or a capable peer joins, and is then planned in again (``TopologyService.heal``), checked
  on every membership event and every heartbeat interval, with a backoff when a try fails.
- **Failed stages.** A stage node that reports its stage failed says why with a code
  (``skippy.serving.failures.classify_failure``). A permanent failure (a model family the stage
  runtime does not run, an invalid package, a plan that does not fit) fails the split at once:
  ``SplitFailed`` with the stage's code and reason (the 503's body, ``/health`` ``failed``,
  the status's ``state``), and the split is planned again only when a capable peer joins. A
  transient one (a fetch that failed, a peer that did not answer) re-plans the same nodes
  after a backoff.
- **Growing.** With no fixed stage count, a capable peer that joins a serving split makes this
  node plan again over the nodes linked now; a plan with more stages is proposed while the
  old route keeps serving (``skippy.package.grow`` decides, and bounds the churn). The route
  switches once the new topology is ready; requests in flight finish on the old route, whose
  stages stay open while they are held or until the route moves on (``StageHost.hold``,
  ``StageHost.supersede``).

``generator.Generator`` asks it for routes (``RouteSource``).
"""

from __future__ import annotations

import logging
from collections.abc import Set
from typing import Any, Final

import trio

from mesh_node.errors import TopologyRefused
from mesh_node.node import MeshNode
from mesh_node.peers import PeerDown
from mesh_node.serving.generator import (
    GenerationFailed,
    Route,
    ServingFault,
    route_level,
)
from mesh_node.serving.host import LoadedStage, StageHost
from mesh_node.serving.split import SplitDuties, SplitSpec
from mesh_node.serving.state import SplitState
from mesh_node.topology import ActiveTopology, StageReport, TopologyService
from skippy.errors import EXIT_INVALID, EXIT_USAGE, SkippyError
from skippy.package.grow import grow_check, grows, growth_summary
from skippy.package.heal import missing_nodes
from skippy.package.topology import NodeCapacity
from skippy.runtime.admission import runtime_problem
from skippy.runtime.tokenizer import LlamaTokenizer
from skippy.serving.failures import classify_failure

log = logging.getLogger("mesh_node.serving.routes")
MAX_RETRY_S: Final = 30.0  # the longest wait between two failed tries to place the split


class SplitNotReady(ServingFault):
    """The split cannot take requests now (HTTP 503); the message says what it waits for."""

    code = "split_not_ready"
    exit_code = EXIT_USAGE


class SplitFailed(SplitNotReady):
    """A stage cannot be brought up for a reason that trying again cannot fix (HTTP 503, no
    Retry-After); the code is the stage's own (``unsupported_architecture``...)."""

    code = "split_failed"
    exit_code = EXIT_INVALID  # the model or package is the problem


class RouteManager:
    """One split's topology and route, kept up (see the module docstring): ``spec`` says
    what it plans, ``topology`` is its own topology service, ``duties`` what it does for the
    coordinator's replicas (``mesh_node.serving.split``)."""

    def __init__(
        self,
        node: MeshNode,
        host: StageHost,
        spec: SplitSpec,
        topology: TopologyService,
        duties: SplitDuties,
    ) -> None:
        self.node = node
        self.host = host
        self.spec = spec
        self.settings = spec.settings
        self.topology = topology
        self.duties = duties
        self.route: Route | None = None
        self.reason = "the split is starting"
        self.waiting: SkippyError | None = None  # why the split cannot be placed now
        # A stage failed for good: set until a capable peer joins (then planned again).
        self.failed: SplitFailed | None = None
        self._failed_among: frozenset[str] = frozenset()  # the capable nodes when it failed
        self._stage_retries = 0  # transient stage failures since the route was last ready
        self.tokenizer: LlamaTokenizer | None = None
        self.restored: str | None = None  # the run id re-formed after a restart
        self._changed = trio.Event()
        self._wake = trio.Event()
        self._restore_from: SplitState | None = None
        self._retry_at = 0.0  # trio clock: no new try to place the split before this
        self._retry_s = 0.0
        self._not_ready_since: float | None = None
        self._warned = False
        # Stage nodes of the active topology (by its id) seen unlinked by a step; see _relinked.
        self._unlinked: tuple[str, set[str]] = ("", set())
        self._pinned: LoadedStage | None = None  # the published route's stage 0, held open
        # Growing (skippy.package.grow): the capable nodes and time of the last grow plan, and
        # the last grow (its summary and topology id; "loading", then "serving").
        self._grow_members: frozenset[str] | None = None
        self._grow_at: float | None = None
        self.growth: dict[str, Any] | None = None

    # --- state ---------------------------------------------------------------------------------
    def _set_route(self, route: Route | None, reason: str = "") -> None:
        self.route = route
        if route is not None:
            self.waiting = None
            self._stage_retries = 0
            self._not_ready_since, self._warned = None, False
        elif self._not_ready_since is None:
            self._not_ready_since = trio.current_time()
        self.reason = reason
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def wake(self) -> None:
        self._wake.set()

    def held(self) -> set[str]:
        """The nodes this split holds: its active topology's, and those of the run it waits
        to re-form after a restart (taken too: no other replica may plan over them)."""
        held: set[str] = set()
        active = self.topology.active
        if active is not None:
            held |= {s.node_id for s in active.topology.stages}
        if self._restore_from is not None:
            held |= {s.node_id for s in self._restore_from.topology.stages}
        return held

    def capable(self, include_self: bool) -> list[NodeCapacity]:
        """The capable nodes this split may plan over: none another replica holds."""
        return self.topology.capable_nodes(include_self, self._elsewhere())

    def _elsewhere(self) -> Set[str]:
        return self.duties.held_elsewhere()

    @property
    def blocked(self) -> SkippyError | None:
        """Why the split cannot form now: it failed, or it waits (``None``: it is forming)."""
        return self.failed if self.failed is not None else self.waiting

    def status(self) -> dict[str, Any]:
        route, blocked = self.route, self.blocked
        if route is not None:
            state = "ready"
        elif self.failed is not None:
            state = "failed"
        else:
            state = "waiting" if self.waiting else "not_ready"
        return {
            "state": state,
            "reason": None if route else (blocked.message if blocked else self.reason),
            "code": None if route else (blocked.code if blocked else "split_not_ready"),
            "topology_id": route.topology_id if route else None,
            "stages": len(route.node_ids) if route else None,
            "restored_run": self.restored,
            "growth": self.growth,
        }

    def check_ready(self) -> Route:
        if self.route is not None:
            return self.route
        if self.failed is not None:  # a new instance: one raised each time would grow its traceback
            raise SplitFailed(self.failed.message, code=self.failed.code)
        if self.waiting is not None:
            raise SplitNotReady(self.waiting.message, code=self.waiting.code)
        raise SplitNotReady(f"the split is not ready: {self.reason}")

    # --- running -------------------------------------------------------------------------------
    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Bring the split up and keep it up until cancelled."""
        run_file = self.duties.run_file
        state = run_file.load() if run_file is not None else None
        spec = self.spec
        if state is not None and state.matches(
            self.node.node_id, spec.package_ref, spec.manifest_sha256, spec.stages
        ):
            self._restore_from = state
            log.info(
                "re-forming run %s of %s (topology %s) from %s",
                state.topology.run_id,
                state.package_ref,
                state.topology.topology_id,
                self.node.settings.data_dir,
            )
        self._not_ready_since = trio.current_time()
        tick = max(0.05, min(1.0, self.node.settings.heartbeat_interval_s))
        async with self.node.subscribe() as events, trio.open_nursery() as nursery:
            task_status.started()

            async def keeper() -> None:
                while True:
                    self._wake = trio.Event()
                    await self._step()
                    with trio.move_on_after(tick):
                        await self._wake.wait()

            nursery.start_soon(keeper)
            async for event in events:
                if isinstance(event, PeerDown):
                    self._on_peer_down(event.node_id)
                self.wake()

    def _linked(self) -> set[str]:
        return {p.node_id for p in self.node.peers(connected_only=True)} | {self.node.node_id}

    def _ours(self) -> ActiveTopology | None:
        active = self.topology.active
        if active is None or active.role != "coordinator":
            return None
        return active

    async def _step(self) -> None:
        """One look at the split: place it if it is not placed (bring-up, restore, heal),
        publish the route when it is ready, warn once when it has not been for too long."""
        try:
            active = self._ours()
            if self.failed is not None:
                if not self._capable_joined():
                    return
                log.info("a capable peer joined: planning the failed split again")
                self.failed = None
                self._retry_at = 0.0  # a new peer is a reason to try now, whatever waited before
                self._notify()
                await self._bring_up()
            elif active is None:
                await self._bring_up()
            else:
                capable = {c.node_id for c in self.capable(True)}
                gone = missing_nodes(active.topology, capable)
                back = self._relinked(active.topology.topology_id, gone)
                if await self._stage_failed(active):
                    return
                if gone or back or active.state != "active":
                    await self._heal(active, gone)
                else:
                    await self._grow(active, capable)
            await self._refresh()
            await self._pin_route()
        finally:
            self._warn_if_slow()

    def _capable_joined(self) -> bool:
        capable = {c.node_id for c in self.capable(False)}
        return bool(capable - self._failed_among)

    async def _stage_failed(self, active: ActiveTopology) -> bool:
        """A stage of ``active`` reported failed: a permanent failure fails the split (True);
        a transient one is planned again over the same nodes after a backoff (True until
        then). False when no stage failed."""
        failed = [
            (s, r)
            for s in active.topology.stages
            if (r := active.reports.get(s.node_id)) is not None and r.state == "failed"
        ]
        if not failed:
            return False
        if self.route is not None and self.route.topology_id != active.topology.topology_id:
            return self._grow_failed(active, failed[0][0], failed[0][1])
        permanent = [(s, r) for s, r in failed if classify_failure(r.code) == "permanent"]
        if permanent:
            stage, report = permanent[0]
            self._fail(stage.stage_index, stage.node_id, report.code, report.message)
            return True
        if not self._may_try():
            return True
        stage, report = failed[0]
        self._stage_retries += 1
        log.warning(
            "stage %d (node %s) failed (%s): planning it again",
            stage.stage_index,
            stage.node_id[:12],
            report.code,
        )
        self._retry_s = min(MAX_RETRY_S, 0.5 * 2 ** (self._stage_retries - 1))
        self._retry_at = trio.current_time() + self._retry_s
        self._set_route(None, f"stage {stage.stage_index} failed ({report.code}): retrying")
        try:
            healed = await self.topology.heal(self._elsewhere())
        except TopologyRefused as exc:
            self._wait_for(exc, None)
            return True
        self.waiting = None
        self._persist(healed)
        self.reason = f"waiting for {len(healed.topology.stages)} stage(s) to be ready"
        return True

    def _fail(self, index: int, node_id: str, code: str | None, why: str | None) -> None:
        """The split failed for good (see the module docstring): say so, with the stage's
        code and reason, until a capable peer joins."""
        where = "this node" if node_id == self.node.node_id else f"node {node_id[:12]}"
        reason = why or "no reason given"
        self.failed = SplitFailed(
            f"stage {index} ({where}) cannot be brought up: {reason}",
            code=code or "stage_failed",
        )
        self._failed_among = frozenset(c.node_id for c in self.capable(False))
        self._set_route(None, self.failed.message)
        log.error(
            "the split failed: %s [%s]; it is planned again when a capable peer joins",
            self.failed.message,
            self.failed.code,
        )
    def _grow_failed(self, active: ActiveTopology, stage: Any, report: StageReport) -> bool:
        """A stage of a grown topology failed while the old route still serves: keep serving
        on the old route (the grow is not tried again until the membership changes)."""
        growth = self.growth
        if growth is not None and growth.get("state") == "loading":
            growth["state"] = "failed"
            growth["reason"] = f"stage {stage.stage_index} failed ({report.code})"
            log.warning(
                "the grown topology %s failed: stage %d (node %s) [%s]; serving on the old route",
                active.topology.topology_id,
                stage.stage_index,
                stage.node_id[:12],
                report.code,
            )
        return True

    async def _grow(self, active: ActiveTopology, capable: set[str]) -> None:
        """Plan again when capable peers joined a split of no fixed stage count; propose the
        plan if it has more stages (``skippy.package.grow``). The old route serves until the
        new topology is ready (``_refresh`` then switches)."""
        tid = active.topology.topology_id
        serving = self.route is not None and self.route.topology_id == tid
        growth = self.growth
        if growth and growth["state"] == "loading" and serving and growth["topology_id"] == tid:
            growth["state"] = "serving"
            log.info("split grown: %s (topology %s)", growth["summary"], tid)
        now = trio.current_time()
        check = grow_check(
            active.topology,
            capable,
            stages=self.spec.stages,
            replicas=self.spec.replicas,
            serving=serving,
            last_members=self._grow_members,
            since_last_s=None if self._grow_at is None else now - self._grow_at,
        )
        if not check.plan:
            return
        self._grow_members, self._grow_at = frozenset(capable), now
        try:
            planned, prediction = self.topology.plan_again(self.spec.stages, self._elsewhere())
        except TopologyRefused as exc:
            log.info("no grow (%s): the plan failed: %s", check.reason, exc.message)
            return
        if not grows(active.topology, planned):
            log.info(
                "no grow (%s): the planner keeps %d stage(s)", check.reason, len(planned.stages)
            )
            return
        summary = growth_summary(active.topology, planned)
        log.info("split growing: %s; the route switches when every stage is ready", summary)
        grown = await self.topology.offer(planned, prediction)
        self.growth = {
            "summary": summary,
            "from_stages": len(active.topology.stages),
            "to_stages": len(planned.stages),
            "topology_id": grown.topology.topology_id,
            "state": "loading",
        }
        self._placed(grown)

    async def _pin_route(self) -> None:
        """Hold the published route's stage 0 open (a grow loads a new one beside it), and
        release the one the route no longer uses."""
        stage0 = self.route.stage0 if self.route is not None else None
        if stage0 is self._pinned:
            return
        old, self._pinned = self._pinned, stage0
        if stage0 is not None:
            self.host.hold(stage0)
            if stage0 is self.host.loaded:
                await self.host.supersede()
        if old is not None:
            await self.host.release(old)

    def _relinked(self, topology_id: str, gone: list[str]) -> set[str]:
        """Stage nodes seen unlinked under this topology and linked again. A link that broke
        and came back within ``peer_loss_timeout_s`` is no peer loss for the mesh, but the
        socket cannot tell a reset from a crash: the node may be a restarted process holding
        no stage, so its old ready report proves nothing. Such a node is planned in again
        (``heal``: a new topology id, the same nodes) and must report ready anew; its verified
        parts stay in its cache, so nothing is transferred again."""
        tid, seen = self._unlinked
        if tid != topology_id:
            tid, seen = topology_id, set()
        seen |= set(gone)
        self._unlinked = (tid, seen)
        return seen - set(gone)

    def _may_try(self) -> bool:
        return trio.current_time() >= self._retry_at

    def _tried(self, ok: bool) -> None:
        if ok:
            self._retry_s, self._retry_at = 0.0, 0.0
        else:
            self._retry_s = min(MAX_RETRY_S, max(0.5, 2 * self._retry_s))
            self._retry_at = trio.current_time() + self._retry_s

    async def _bring_up(self) -> None:
        state = self._restore_from
        capable = {c.node_id for c in self.capable(False)}
        if state is not None:
            absent = [n for n in missing_nodes(state.topology, capable) if n != self.node.node_id]
            overdue = self._overdue()
            if absent and not overdue:
                self.reason = (
                    f"re-forming run {state.topology.run_id} after a restart: waiting for "
                    + ", ".join(f"node {n[:12]}" for n in absent)
                )
                return
            if not self._may_try():
                return
            self.reason = f"re-forming run {state.topology.run_id}"
            try:
                active = await self.topology.restore(
                    state.topology,
                    self.spec.sizes,
                    first_node=self.node.node_id,
                    exclude=self._elsewhere(),
                )
            except TopologyRefused as exc:
                self._wait_for(exc, None)
                return
            self.restored = state.topology.run_id
            self._restore_from = None
            self._placed(active)
            return
        want = (self.spec.stages or 1) - 1
        have = len(capable)
        if have < want:
            self.reason = (
                f"waiting for {want - have} more capable peer(s) ({have} of {want} linked)"
            )
            return
        like = None
        if self.duties.layout is not None:
            like = self.duties.layout()
            if like is None:
                self.reason = (
                    "waiting for replica 0's plan, or for replica 0 to be ready (the replicas "
                    "share its stages, and its nodes serve theirs)"
                )
                return
        if not self._may_try():
            return
        self.reason = "planning the split"
        try:
            active = await self.topology.propose(
                package_ref=self.spec.package_ref,
                manifest_sha256=self.spec.manifest_sha256,
                sizes=self.spec.sizes,
                stages=self.spec.stages,
                first_node=self.node.node_id,
                like=like,
                exclude=self._elsewhere(),
            )
        except TopologyRefused as exc:
            self._wait_for(exc, None)
            return
        self._placed(active)

    async def _heal(self, active: ActiveTopology, gone: list[str]) -> None:
        self._withdraw(active, gone)
        if not self._may_try():
            return
        try:
            healed = await self.topology.heal(self._elsewhere())
        except TopologyRefused as exc:
            self._wait_for(exc, gone[0] if gone else None)
            return
        moved = [
            f"stage {a.stage_index} to node {b.node_id[:12]}"
            for a, b in zip(active.topology.stages, healed.topology.stages, strict=True)
            if a.node_id != b.node_id
        ]
        log.info(
            "split healed: topology %s (%s)",
            healed.topology.topology_id,
            ", ".join(moved) or "same nodes",
        )
        self._placed(healed)

    def _withdraw(self, active: ActiveTopology, gone: list[str]) -> None:
        if self.route is not None and self.route.topology_id == active.topology.topology_id:
            lost = ", ".join(
                f"stage {s.stage_index} (node {s.node_id[:12]})"
                for s in active.topology.stages
                if s.node_id in gone
            )
            self._set_route(None, f"lost {lost or 'a stage node'}")

    def _placed(self, active: ActiveTopology) -> None:
        self._tried(active.state == "active")
        if active.state != "active":
            self.waiting = None
            refused = {w: a for w, a in active.acks.items() if a != "accepted"}
            self.reason = "not every stage node accepted the topology: " + "; ".join(
                f"{w[:12]} {a}" for w, a in sorted(refused.items())
            )
            return
        self.waiting = None
        self.reason = f"waiting for {len(active.topology.stages)} stage(s) to be ready"
        self._persist(active)
        self._notify()

    def _wait_for(self, exc: TopologyRefused, node_id: str | None) -> None:
        """The split cannot be placed now: say what it waits for (the 503's text)."""
        self._tried(False)
        if exc.code == "no_capable_peer":
            back = f"node {node_id[:12]} to come back or " if node_id else ""
            exc = TopologyRefused(
                f"{exc.message}; waiting for {back}a capable peer to join",
                code=exc.code,
                expected=exc.expected,
            )
        if self.waiting is None or self.waiting.message != exc.message:
            log.warning("the split waits: %s", exc.message)
        self.waiting = exc
        self._notify()

    def _persist(self, active: ActiveTopology) -> None:
        """The run, for a restart, when this split keeps it (its ``run_file`` duty)."""
        run_file = self.duties.run_file
        if run_file is None:
            return
        spec = self.spec
        run_file.save(
            SplitState(
                self.node.node_id,
                spec.package_ref,
                spec.manifest_sha256,
                spec.stages,
                active.topology,
                active.signature,
            )
        )

    def _overdue(self) -> bool:
        since = self._not_ready_since
        return since is not None and trio.current_time() - since > self.settings.ready_timeout_s

    def _warn_if_slow(self) -> None:
        if self.route is None and not self._warned and self._overdue():
            self._warned = True
            why = self.waiting.message if self.waiting is not None else self.reason
            log.warning(
                "the split is not ready after %g s (serving.ready_timeout_s): %s; still "
                "forming it as peers arrive",
                self.settings.ready_timeout_s,
                why,
            )

    # --- publishing the route ------------------------------------------------------------------
    async def _refresh(self) -> None:
        """Publish the route when every stage of the active topology is ready."""
        active = self._ours()
        if active is None:
            return
        topo = active.topology
        if self.route is not None and self.route.topology_id == topo.topology_id:
            return
        if active.state != "active":  # incomplete (a worker did not accept) or degraded (lost)
            return
        if topo.stages[0].node_id != self.node.node_id:
            # Stage 0 must be here (it embeds the prompt; the API and tokenizer are here).
            self.reason = "stage 0 is not on this node: the topology cannot serve"
            return
        if any(s.node_id not in self._linked() for s in topo.stages):
            self.reason = "a stage node is not linked"
            return
        tid, seen = self._unlinked
        if tid == topo.topology_id and seen:  # relinked: planned in again first (_relinked)
            self.reason = "re-planning " + ", ".join(f"node {n[:12]}" for n in sorted(seen))
            return
        loaded = self.duties.stage0.ready(active)
        if isinstance(loaded, str):
            self.reason = loaded
            return
        if self.tokenizer is None:
            self.tokenizer = await self.duties.tokenizer.load(loaded.load.part_paths[0])
        self.topology.admission_expect = loaded.facts
        waiting = []
        for stage in topo.stages:
            report = active.reports.get(stage.node_id)
            if report is None or report.state != "ready":
                state = "not reported" if report is None else f"{report.state} ({report.code})"
                waiting.append(f"stage {stage.stage_index} (node {stage.node_id[:12]}): {state}")
                continue
            desc = report.descriptor
            if desc is None and stage.node_id == self.node.node_id:
                continue  # a shared stage 0: the loaded stage itself (``SharesStage0``)
            problem = runtime_problem(desc.runtime if desc else None, loaded.facts)
            if problem is not None:
                active.reports[stage.node_id] = StageReport("rejected", problem[0], desc)
                waiting.append(f"stage {stage.stage_index}: rejected ({problem[1]})")
        if waiting:
            self.reason = "waiting for " + "; ".join(waiting)
            return
        route = Route(topo.topology_id, tuple(s.node_id for s in topo.stages), loaded)
        self._set_route(route)
        log.info("route %s ready: %d stage(s)", topo.topology_id, len(route.node_ids))

    def _on_peer_down(self, node_id: str) -> None:
        active = self._ours()
        if active is None:
            return
        stage = active.topology.stage_of(node_id)
        if stage is None:
            return
        # The topology service sees the same event; mark it degraded now, whichever
        # subscriber runs first, so the lost route is never published again.
        self.topology.on_peer_down(node_id)
        if self.route is not None and node_id in self.route.node_ids:
            self._set_route(None, f"stage {stage.stage_index} (node {node_id[:12]}) was lost")
        log.warning("stage %d lost with node %s", stage.stage_index, node_id[:12])

    # --- for requests in flight -----------------------------------------------------------------
    async def await_new_route(self, broken: Route, cause: BaseException) -> Route:
        """The route after ``broken`` failed (``RouteSource``): a new one within
        ``failover_timeout_s``, or ``GenerationFailed`` (no capable peer, a stage's own
        refusal, the timeout)."""
        grace = self.node.settings.peer_loss_timeout_s + 1.0
        start = trio.current_time()
        self.wake()
        with trio.move_on_after(self.settings.failover_timeout_s):
            while True:
                blocked = self.blocked
                if blocked is not None:
                    raise GenerationFailed(blocked.message, code=blocked.code)
                route = self.route
                if route is not None and route.topology_id != broken.topology_id:
                    return route
                if route is not None and (
                    not route_level(cause)
                    or (
                        trio.current_time() - start > grace
                        and self._route_connected(route)
                        and not self._superseded(route)
                    )
                ):
                    # The route still stands with every node linked: no node was lost, the
                    # failure was the stage's. (A node that is down is being replaced.)
                    raise GenerationFailed(
                        f"a stage failed the request: {cause}", code="stage_failed"
                    )
                with trio.move_on_after(0.1):
                    await self._changed.wait()
        raise GenerationFailed(
            f"no route within {self.settings.failover_timeout_s:g} s: {self.reason}",
            code="failover_timeout",
        )

    def _superseded(self, route: Route) -> bool:
        """A newer topology (a grow) is loading beside ``route``: a stage that moved on may
        refuse it meanwhile; the request waits for the new route."""
        active = self._ours()
        return active is not None and active.topology.topology_id != route.topology_id

    def _route_connected(self, route: Route) -> bool:
        linked = self._linked()
        return all(n in linked for n in route.node_ids)
