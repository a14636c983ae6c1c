"""Replicas of a split: R independent pipelines of one package.

Each replica is a ``RouteManager`` with its own topology service: its own topology (stage 0
on this coordinator, the other stages on peers no other replica holds), its own bring-up,
failover and heal. Replica 0 is the node's own topology service (it persists the run and
loads stage 0 through the transfer service); the others share that loaded stage 0 (same
manifest and layers) and get their stage reports through the node's control streams
(``TopologyService.siblings``). A worker serves one stage of one topology, so the replicas'
worker sets are disjoint (``TopologyService.exclude``: the nodes the other replicas hold).

Requests: each request takes a ``Lease`` (the generator's ``RouteSource`` for that request),
which picks the ready replica with the fewest outstanding tokens
(``skippy.serving.replicas.choose_replica``) and counts the request's tokens there until it
ends. When the replica's route breaks under a request and another replica is ready, the
request replays on that one (exact replay: greedy output is the same on every replica);
otherwise it waits for its own replica's new route, as a single split does.

::

    request -> Lease.check_ready -> choose_replica(ready, outstanding) -> replica k's route
                                                                          |
    replica k: RouteManager(TopologyService k) -- plan/heal over capable peers - others' nodes
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

import trio

from mesh_node.node import MeshNode
from mesh_node.serving.generator import Route, route_level
from mesh_node.serving.host import StageHost
from mesh_node.serving.routes import RouteManager, SplitFailed, SplitNotReady, load_tokenizer
from mesh_node.settings import ServingSettings
from mesh_node.topology import TopologyService
from mesh_node.transfer.partials import speaks_partials
from mesh_node.transfer.siblings import speaks_siblings
from skippy.errors import SkippyError
from skippy.package.plan import ModelSizes
from skippy.package.topology import SplitTopology
from skippy.runtime.tokenizer import LlamaTokenizer
from skippy.serving.replicas import (
    ReplicaLoad,
    choose_replica,
    peers_needed,
    waits_for_first,
)

log = logging.getLogger("mesh_node.serving.replicas")



class SharedTokenizer:
    """One tokenizer for every replica: the first to ask loads it, the others wait for that
    load. Each replica's route manager reached its tokenizer while replica 0's was still
    loading and loaded its own (gemma3's: ~3 s of CPU each here, on the cores the workers'
    transfers needed at bring-up)."""

    def __init__(self) -> None:
        self._lock = trio.Lock()
        self._loaded: tuple[Path, LlamaTokenizer] | None = None

    async def load(self, metadata_path: Path) -> LlamaTokenizer:
        async with self._lock:
            if self._loaded is None or self._loaded[0] != metadata_path:
                self._loaded = (metadata_path, await load_tokenizer(metadata_path))
            return self._loaded[1]


class ReplicaSet:
    """The coordinator's replicas and the per-replica request load."""

    def __init__(
        self,
        node: MeshNode,
        host: StageHost,
        settings: ServingSettings,
        *,
        package_ref: str,
        manifest_sha256: str,
        sizes: ModelSizes,
        stages: int | None,
        replicas: int,
    ) -> None:
        self.node = node
        self.stages = stages
        self.managers: list[RouteManager] = []
        self._tokenizer = SharedTokenizer()
        main = node.service(TopologyService)
        for k in range(replicas):
            service = main if k == 0 else TopologyService(node, epochs=main.epochs)
            if k:
                main.siblings.append(service)
            self.managers.append(
                RouteManager(
                    node,
                    host,
                    settings,
                    package_ref=package_ref,
                    manifest_sha256=manifest_sha256,
                    sizes=sizes,
                    stages=stages,
                    topology=service,
                    replica=k,
                    replicas=replicas,
                )
            )
        if replicas > 1:
            for k, manager in enumerate(self.managers):
                manager.topology.exclude = partial(self._held_by_others, k)
                # one tokenizer: stage 0 (and its metadata) is the same loaded stage
                manager.load_tokenizer = self._tokenizer.load
                if k:
                    manager.plan_like = self._plan_for  # and the same layer ranges
        self.outstanding = [0] * replicas  # tokens still to process, per replica
        self.in_flight = [0] * replicas
        self.requests_total = [0] * replicas
        self._first_planned_at: float | None = None  # trio clock: replica 0's plan seen

    def _plan_for(self) -> SplitTopology | None:
        """Replica 0's plan, for another replica to copy its layer ranges (None until it has
        one, and, when every capable peer serves sibling replicas, until replica 0 is ready
        or ``STAGGER_MAX_S`` passed: its nodes then serve the others' files,
        ``skippy.serving.replicas.waits_for_first``)."""
        active = self.managers[0].topology.active
        if active is None:
            self._first_planned_at = None
            return None
        now = trio.current_time()
        if self._first_planned_at is None:
            self._first_planned_at = now
        capable = [c.node_id for c in self.managers[0].topology.capable_nodes(False)]
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
            if j == k:
                continue
            active = manager.topology.active
            if active is not None:
                held |= {s.node_id for s in active.topology.stages}
            pending = manager.restoring  # a restarted coordinator waits for these (replica 0)
            if pending is not None:
                held |= {s.node_id for s in pending.stages}
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
        """Replica 0's failure, when every replica failed for good (none can become ready
        before a capable peer joins)."""
        if self.route is not None or any(m.failed is None for m in self.managers):
            return None
        return self.managers[0].failed

    @property
    def waiting(self) -> SkippyError | None:
        """Why no replica can be placed now, when none is ready and replica 0 waits."""
        if self.route is not None:
            return None
        return self.managers[0].waiting

    @property
    def reason(self) -> str:
        if len(self.managers) == 1:
            return self.managers[0].reason
        parts = [f"replica {k}: {m.status()['reason']}" for k, m in enumerate(self.managers)]
        return "; ".join(parts) + self._peers_note()

    def _peers_note(self) -> str:
        if self.stages is None:
            return ""
        need = peers_needed(len(self.managers), self.stages)
        linked = {p.node_id for p in self.node.peers(connected_only=True)}
        free = {c.node_id for c in self.managers[0].topology.capable_nodes(False)}
        have = len(free | (self._held_by_others(0) & linked))
        if have >= need:
            return ""
        return (
            f" ({len(self.managers)} replicas of {self.stages} stages need {need} capable "
            f"peers, {have} linked)"
        )

    def check_ready(self) -> Route:
        route = self.route
        if route is not None:
            return route
        if len(self.managers) == 1:
            return self.managers[0].check_ready()
        failed = self.failed
        if failed is not None:
            raise SplitFailed(f"no replica is ready: {self.reason}", code=failed.code)
        waiting = self.waiting
        if waiting is not None:
            raise SplitNotReady(f"no replica is ready: {self.reason}", code=waiting.code)
        raise SplitNotReady(f"no replica is ready: {self.reason}")

    def status(self) -> dict[str, Any]:
        """Replica 0's fields (as a single split reports them) plus ``replicas``: each one's
        state, topology, stage nodes, requests in flight, outstanding tokens and total."""
        out = self.managers[0].status()
        if len(self.managers) > 1:
            ready = self.route is not None
            if not ready and out["state"] == "failed" and self.failed is None:
                # replica 0 failed for good, another may still become ready
                out["state"], out["code"] = "not_ready", "split_not_ready"
            out["state"] = "ready" if ready else out["state"]
            out["reason"] = None if ready else self.reason
            out["code"] = None if ready else out["code"]
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
        if len(self.managers) > 1 and self.stages is not None:
            log.info(
                "serving %d replicas of %d stages: they need %d capable peers",
                len(self.managers),
                self.stages,
                peers_needed(len(self.managers), self.stages),
            )
        async with trio.open_nursery() as nursery:
            for manager in self.managers:
                await nursery.start(manager.run)
            task_status.started()

    async def await_new_route(self, broken: Route, cause: BaseException) -> Route:
        """The route after ``broken`` failed, for a request without a lease."""
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
        if own is None:
            own = self.replica if self.replica is not None else 0
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
