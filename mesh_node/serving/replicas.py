"""Replicas of a split: R equal, independent pipelines of one package (``SplitSpec``).

The shell of ``skippy.serving.replicas``, its pure core.

Each replica is a ``RouteManager`` built from the same spec with its own topology service:
its own topology (stage 0 on this coordinator, the other stages on peers no other replica
holds), its own bring-up, failover and heal. A worker serves one stage of one topology, so
the replicas' worker sets are disjoint: each plans over the capable peers but those the
others hold (its ``held_elsewhere`` duty). What only one replica may do is a duty given to
the first one built (``mesh_node.serving.split.SplitDuties``): it plans with the node's own
topology service, so the artifact service loads stage 0 for it (``LoadsStage0``), it keeps
the run file, and its plan is the layout the others copy; every other replica plans with a
sibling service (``TopologyService.sibling``: the node's control streams hand it its stage
reports) and shares that loaded stage 0 (``SharesStage0``).

Requests: each request takes a ``Lease`` (the generator's ``RouteSource`` for that request),
which picks the ready replica with the fewest outstanding tokens
(``skippy.serving.replicas.choose_replica``) and counts the request's tokens there until it
ends. When the replica's route breaks under a request and another replica is ready, the
request replays on that one (exact replay: greedy output is the same on every replica);
otherwise it waits for its own replica's new route, as a single split does.

::

    request -> Lease.check_ready -> choose_replica(ready, outstanding) -> replica k's route
                                                                          |
    replica k: RouteManager(spec, its TopologyService, its duties) -- plans over peers no
               other replica holds
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import trio

from mesh_node.node import MeshNode
from mesh_node.serving.generator import Route, route_level
from mesh_node.serving.host import StageHost
from mesh_node.serving.routes import RouteManager, SplitFailed, SplitNotReady
from mesh_node.serving.split import (
    LoadsStage0,
    SharedTokenizer,
    SharesStage0,
    SplitDuties,
    SplitSpec,
)
from mesh_node.serving.state import RunFile
from mesh_node.topology import TopologyService
from mesh_node.transfer.partials import speaks_partials
from mesh_node.transfer.siblings import speaks_siblings
from skippy.errors import SkippyError
from skippy.package.topology import SplitTopology
from skippy.runtime.tokenizer import LlamaTokenizer
from skippy.serving.replicas import (
    ReplicaLoad,
    choose_replica,
    peers_needed,
    waits_for_first,
)

log = logging.getLogger("mesh_node.serving.replicas")


class ReplicaSet:
    """The coordinator's replicas of one split and the per-replica request load."""

    def __init__(
        self, node: MeshNode, host: StageHost, topology: TopologyService, spec: SplitSpec
    ) -> None:
        self.node = node
        self.topology = topology  # the node's own: it sees every capable peer
        self.spec = spec
        tokenizer = SharedTokenizer()
        first = RouteManager(
            node,
            host,
            spec,
            topology,
            SplitDuties(
                LoadsStage0(host),
                tokenizer,
                run_file=RunFile(node.settings.data_dir),
                held_elsewhere=partial(self._held_by_others, 0),
            ),
        )
        self.managers: list[RouteManager] = [first]
        for k in range(1, spec.replicas):
            duties = SplitDuties(
                SharesStage0(host),
                tokenizer,
                layout=partial(self._layout_of, first),
                held_elsewhere=partial(self._held_by_others, k),
            )
            self.managers.append(RouteManager(node, host, spec, topology.sibling(), duties))
        self.outstanding = [0] * spec.replicas  # tokens still to process, per replica
        self.in_flight = [0] * spec.replicas
        self.requests_total = [0] * spec.replicas
        self._first_planned_at: float | None = None  # trio clock: the layout's plan seen

    def _layout_of(self, lead: RouteManager) -> SplitTopology | None:
        """``lead``'s plan, for another replica to copy its layer ranges (None until it has
        one, and, when every capable peer serves sibling replicas, until ``lead`` is ready or
        ``STAGGER_MAX_S`` passed: its nodes then serve the others' files,
        ``skippy.serving.replicas.waits_for_first``)."""
        active = lead.topology.active
        if active is None:
            self._first_planned_at = None
            return None
        now = trio.current_time()
        if self._first_planned_at is None:
            self._first_planned_at = now
        capable = [c.node_id for c in lead.capable(False)]
        if waits_for_first(
            first_ready=active.all_ready,
            waited_s=now - self._first_planned_at,
            siblings_serve=bool(capable) and all(speaks_siblings(self.node, n) for n in capable),
            partials_serve=bool(capable) and all(speaks_partials(self.node, n) for n in capable),
        ):
            return None
        return active.topology

    def _held_by_others(self, k: int) -> set[str]:
        held: set[str] = set()
        for j, manager in enumerate(self.managers):
            if j != k:
                held |= manager.held()
        return held

    # --- the split's view, over every replica --------------------------------------------------
    def loads(self) -> list[ReplicaLoad]:
        return [
            ReplicaLoad(k, m.route is not None, self.outstanding[k], self.in_flight[k])
            for k, m in enumerate(self.managers)
        ]

    @property
    def route(self) -> Route | None:
        """A ready replica's route (``None``: no replica is ready)."""
        return next((m.route for m in self.managers if m.route is not None), None)

    @property
    def tokenizer(self) -> LlamaTokenizer | None:
        return next((m.tokenizer for m in self.managers if m.tokenizer is not None), None)

    @property
    def failed(self) -> SplitFailed | None:
        """The first replica's failure, when every replica failed for good (none can become
        ready before a capable peer joins)."""
        if self.route is not None or any(m.failed is None for m in self.managers):
            return None
        return next((m.failed for m in self.managers if m.failed is not None), None)

    @property
    def waiting(self) -> SkippyError | None:
        """Why a replica cannot be placed now (the first that waits), when none is ready."""
        if self.route is not None:
            return None
        return next((m.waiting for m in self.managers if m.waiting is not None), None)

    @property
    def reason(self) -> str:
        """Why no replica is ready (each one's reason, with more than one)."""
        views = [m.status() for m in self.managers]
        if len(views) == 1:
            return str(views[0]["reason"])
        parts = [f"replica {k}: {v['reason']}" for k, v in enumerate(views)]
        return "; ".join(parts) + self._peers_note()

    def _peers_note(self) -> str:
        stages = self.spec.stages
        if stages is None:
            return ""
        need = peers_needed(len(self.managers), stages)
        linked = {p.node_id for p in self.node.peers(connected_only=True)}
        held = {n for m in self.managers for n in m.held()}
        capable = {c.node_id for c in self.topology.capable_nodes(False)}
        have = len(capable | (held & linked))
        if have >= need:
            return ""
        return (
            f" ({len(self.managers)} replicas of {stages} stages need {need} capable "
            f"peers, {have} linked)"
        )

    def check_ready(self) -> Route:
        route = self.route
        if route is not None:
            return route
        if len(self.managers) == 1:  # a single split's own words
            return self.managers[0].check_ready()
        failed = self.failed
        if failed is not None:
            raise SplitFailed(f"no replica is ready: {self.reason}", code=failed.code)
        waiting = self.waiting
        if waiting is not None:
            raise SplitNotReady(f"no replica is ready: {self.reason}", code=waiting.code)
        raise SplitNotReady(f"no replica is ready: {self.reason}")

    def status(self) -> dict[str, Any]:
        """The split's fields as a single split reports them (``RouteManager.status``), over
        every replica: ready with the first ready replica's route; else failed when every
        replica failed, waiting when one waits, not ready otherwise. Plus ``replicas``: each
        one's state, topology, stage nodes, requests in flight, outstanding tokens and
        total."""
        views = [m.status() for m in self.managers]
        out = next((dict(v) for v in views if v["state"] == "ready"), None)
        if out is None:
            failed, waiting = self.failed, self.waiting
            restored = next((v["restored_run"] for v in views if v["restored_run"]), None)
            blocked = failed if failed is not None else waiting
            out = {
                "state": "failed" if failed else "waiting" if waiting else "not_ready",
                "reason": self.reason,
                "code": blocked.code if blocked is not None else "split_not_ready",
                "topology_id": None,
                "stages": None,
                "restored_run": restored,
                "growth": next((v["growth"] for v in views if v["growth"]), None),
            }
        out["replicas"] = [self.replica_status(k) for k in range(len(self.managers))]
        return out

    def health(self) -> dict[str, Any]:
        """``/health``'s ``replicas`` (only with more than one): each one's state and why."""
        if len(self.managers) == 1:
            return {}
        out = []
        for k, manager in enumerate(self.managers):
            st = manager.status()
            out.append({"replica": k, "state": st["state"], "reason": st["reason"]})
        return {"replicas": out}

    def replica_status(self, k: int) -> dict[str, Any]:
        manager = self.managers[k]
        active = manager.topology.active
        return {
            "replica": k,
            **manager.status(),
            "nodes": [] if active is None else [s.node_id for s in active.topology.stages],
            "stages": [] if active is None else [s.to_dict() for s in active.topology.stages],
            "requests_in_flight": self.in_flight[k],
            "outstanding_tokens": self.outstanding[k],
            "requests_total": self.requests_total[k],
        }

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Every replica's route manager, until cancelled."""
        stages = self.spec.stages
        if len(self.managers) > 1 and stages is not None:
            log.info(
                "serving %d replicas of %d stages: they need %d capable peers",
                len(self.managers),
                stages,
                peers_needed(len(self.managers), stages),
            )
        async with trio.open_nursery() as nursery:
            for manager in self.managers:
                await nursery.start(manager.run)
            task_status.started()

    async def await_new_route(self, broken: Route, cause: BaseException) -> Route:
        """The route after ``broken`` failed, for a request without a lease: from the
        replica that ran it (the first, when none holds its topology any more)."""
        own = self.owner(broken)
        return await self.managers[own or 0].await_new_route(broken, cause)

    def lease(self, tokens: int) -> Lease:
        return Lease(self, tokens)

    def owner(self, route: Route) -> int | None:
        for k, manager in enumerate(self.managers):
            active = manager.topology.active
            if (manager.route is not None and manager.route.topology_id == route.topology_id) or (
                active is not None and active.topology.topology_id == route.topology_id
            ):
                return k
        return None


class Lease:
    """One request's route source (``generator.RouteSource``): the replica it runs on and the
    tokens it still counts there. ``release`` when the request ends."""

    def __init__(self, replicas: ReplicaSet, tokens: int) -> None:
        self.replicas = replicas
        self.remaining = max(0, tokens)
        self.replica: int | None = None

    @property
    def tokenizer(self) -> LlamaTokenizer | None:
        return self.replicas.tokenizer

    def _move(self, k: int | None) -> None:
        rs = self.replicas
        if self.replica is not None:
            rs.outstanding[self.replica] -= self.remaining
            rs.in_flight[self.replica] -= 1
        self.replica = k
        if k is not None:
            rs.outstanding[k] += self.remaining
            rs.in_flight[k] += 1

    def check_ready(self) -> Route:
        rs = self.replicas
        k = choose_replica(rs.loads())
        if k is None:
            return rs.check_ready()  # raises SplitNotReady (today's 503)
        route = rs.managers[k].route
        assert route is not None  # chosen among the ready ones (typing)
        self._move(k)
        rs.requests_total[k] += 1
        return route

    def produced(self, n: int = 1) -> None:
        """The request processed ``n`` more tokens (its replica's load drops by them)."""
        n = min(n, self.remaining)
        self.remaining -= n
        if self.replica is not None:
            self.replicas.outstanding[self.replica] -= n

    def release(self) -> None:
        self._move(None)

    async def await_new_route(self, broken: Route, cause: BaseException) -> Route:
        """Another ready replica at once when the route broke (a node or link lost); else
        the own replica's next route (``RouteManager.await_new_route``)."""
        rs = self.replicas
        own = rs.owner(broken)
        if own is None:  # healed past it: the replica this request ran on
            own = self.replica
        if own is None:  # never placed on a replica
            found = await rs.await_new_route(broken, cause)
            self._move(rs.owner(found))
            return found
        if route_level(cause):
            k = choose_replica([load for load in rs.loads() if load.index != own])
            if k is not None:
                route = rs.managers[k].route
                assert route is not None  # chosen among the ready ones (typing)
                rs.managers[own].wake()
                log.info("request moves from replica %d to replica %d", own, k)
                self._move(k)
                return route
        route = await rs.managers[own].await_new_route(broken, cause)
        self._move(own)
        return route
