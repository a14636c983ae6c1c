"""The coordinator of a split: stage 0, the route, admission, and generation with failover.

``SplitServer.run`` brings the split up: it waits for the capable peers, plans the package
over them with stage 0 on this node (``TopologyService.propose(first_node=...)``), and
publishes the *route* only when every stage reported ready with an admission descriptor that
matches the topology and this node's runtime (same model, activation width and dtype, runtime
version, enough context). Until then, and while a lost stage is being replaced, requests are
refused with ``SplitNotReady`` (HTTP 503) and the reason.

``generate`` runs one request: a session through every stage. Stage 0 (here) embeds the
prompt and runs its layers chunk by chunk; each chunk crosses to stage 1 while stage 0
computes the next one (at most ``max_inflight_frames`` unacknowledged); the final stage
samples and sends the token id straight back here on a return stream; then one-token decode
frames until a stop. When a stage node is lost mid-generation (link loss or heartbeat), the
coordinator moves only that stage to a capable spare peer (``replace_lost``), which brings
its parts in and loads them; the request then replays its committed tokens (prompt + every
token generated so far) through the new route and continues: greedy output is exactly the
undisturbed run's. No capable peer: the request fails with ``no_capable_peer``. Every wait
has a timeout (``ServingSettings``).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np
import trio

from mesh_node.errors import (
    MeshError,
    StreamReset,
    TopologyRefused,
    first_exception,
    skippy_error_in,
)
from mesh_node.link import MeshStream
from mesh_node.node import MeshNode
from mesh_node.peers import InboundStream, PeerDown, PeerUp
from mesh_node.serving.host import LoadedStage, StageHost, hop_summary, sampler_at
from mesh_node.serving.links import ChainSender, FrameReader, HopStats
from mesh_node.topology import StageReport
from protocol import constants as pc
from skippy.config import ServingSettings
from skippy.errors import EXIT_USAGE, SkippyError
from skippy.package.plan import ModelSizes
from skippy.runtime.tokenizer import LlamaTokenizer
from skippy.stage import transport as t
from skippy.stage.descriptor import runtime_problem

log = logging.getLogger("mesh_node.serving.pipeline")
StopReason = Literal["length", "eos", "stop", "context"]
MAX_FAILOVERS: Final = 3  # per request
RECENT: Final = 256  # requests whose figures the status keeps
Emit = Callable[[int], Awaitable[bool]]  # a new token -> True to stop (a stop string matched)


class SplitNotReady(MeshError):
    """The split cannot take requests now (HTTP 503); the message says why."""

    code = "split_not_ready"
    exit_code = EXIT_USAGE


class ServerBusy(MeshError):
    """Every slot and queue place is taken (HTTP 429)."""

    code = "server_busy"


class GenerationFailed(MeshError):
    """A request failed mid-way and could not be continued (HTTP 502/503)."""

    code = "generation_failed"


class _RouteBroken(Exception):
    """Internal: the route failed under a request (link loss, reset, timeout)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


@dataclass(frozen=True)
class Route:
    topology_id: str
    node_ids: tuple[str, ...]  # stage order
    stage0: LoadedStage

    @property
    def single(self) -> bool:
        return len(self.node_ids) == 1


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int
    sampling: t.Sampling = field(default_factory=t.Sampling)


@dataclass
class GenerationResult:
    prompt_tokens: int
    tokens: list[int]
    stop_reason: StopReason
    ttft_s: float
    prefill_s: float
    decode_s: float
    failovers: int = 0


@dataclass
class _Session:
    session_id: int
    request_id: int
    tokens: trio.MemorySendChannel[int | BaseException]


@dataclass
class ServingStats:
    """What admission needs (running, queued) and the recent requests' timings. Request and
    token counts, time to first token and latencies are the node's metrics
    (``MeshNode.metrics``: the status page and /metrics read them)."""

    failovers_total: int = 0
    in_flight: int = 0
    queued: int = 0
    recent: deque[GenerationResult] = field(default_factory=lambda: deque(maxlen=RECENT))

    def to_dict(self) -> dict[str, Any]:
        decode_tok = sum(max(0, len(r.tokens) - 1) for r in self.recent)
        decode_s = sum(r.decode_s for r in self.recent)
        prefill_tok = sum(r.prompt_tokens for r in self.recent)
        prefill_s = sum(r.prefill_s for r in self.recent)
        return {
            "requests_queued": self.queued,
            "failovers_total": self.failovers_total,
            "decode_tokens_per_s": round(decode_tok / decode_s, 2) if decode_s > 0 else None,
            "prefill_tokens_per_s": round(prefill_tok / prefill_s, 2) if prefill_s > 0 else None,
        }


class SplitServer:
    """Stage 0 and the API's view of the split (one per serving coordinator)."""

    def __init__(
        self,
        node: MeshNode,
        host: StageHost,
        settings: ServingSettings,
        *,
        package_ref: str,
        manifest_sha256: str,
        sizes: ModelSizes,
        model_name: str,
        stages: int | None = None,
    ) -> None:
        self.node = node
        self.host = host
        self.settings = settings
        self.package_ref = package_ref
        self.manifest_sha256 = manifest_sha256
        self.sizes = sizes
        self.model_name = model_name
        self.stages = stages
        self.route: Route | None = None
        self.reason = "the split is starting"
        self.failed: SkippyError | None = None  # no capable peer / failover timed out
        self.tokenizer: LlamaTokenizer | None = None
        self.stats = ServingStats()
        self._changed = trio.Event()
        self._sessions: dict[int, _Session] = {}
        self._slots = trio.Semaphore(settings.max_sessions)
        self.hops = host.hops  # per downstream node: stage 0's hop is this node's
        host.return_handler = self._on_return

    # --- state ---------------------------------------------------------------------------------
    def _set_route(self, route: Route | None, reason: str = "") -> None:
        self.route = route
        if route is not None:
            self.failed = None
        self.reason = reason
        self._changed.set()
        self._changed = trio.Event()

    def status(self) -> dict[str, Any]:
        route = self.route
        return {
            "model": self.model_name,
            "state": "ready" if route else ("failed" if self.failed else "not_ready"),
            "reason": None if route else (self.failed.message if self.failed else self.reason),
            "topology_id": route.topology_id if route else None,
            "stages": len(route.node_ids) if route else None,
            **self.node.metrics.serving_status(),
            **self.stats.to_dict(),
            "hops": hop_summary(self.hops),
        }

    # --- bringing the split up, and keeping it up -------------------------------------------------
    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Plan the split once enough peers are up, then follow stage reports and peer
        losses until cancelled."""
        async with self.node.subscribe() as events:
            task_status.started()
            await self._plan()
            async for event in events:
                if isinstance(event, PeerDown):
                    await self._on_peer_down(event.node_id)
                elif isinstance(event, PeerUp) and self.failed is not None:
                    await self._retry_lost()
                await self._refresh()

    def _capable_peers(self) -> int:
        return len(self.node.topology.capable_nodes(False))

    async def _plan(self) -> None:
        want = (self.stages or 1) - 1
        self.reason = f"waiting for {want} capable peer(s)"
        try:
            with trio.fail_after(self.settings.ready_timeout_s):
                while self._capable_peers() < want:
                    await trio.sleep(0.05)
            self.reason = "planning the split"
            active = await self.node.topology.propose(
                package_ref=self.package_ref,
                manifest_sha256=self.manifest_sha256,
                sizes=self.sizes,
                stages=self.stages,
                first_node=self.node.node_id,
            )
        except trio.TooSlowError:
            self.failed = SplitNotReady(
                f"fewer than {want} capable peers joined within "
                f"{self.settings.ready_timeout_s:g} s",
                code="not_enough_peers",
            )
            self._changed.set()
            return
        except TopologyRefused as exc:
            self.failed = exc
            self._changed.set()
            return
        self.reason = f"waiting for {len(active.topology.stages)} stage(s) to be ready"
        await self._refresh()

    async def _refresh(self) -> None:
        """Publish the route when every stage of the active topology is ready."""
        active = self.node.topology.active
        if active is None or active.role != "coordinator":
            return
        topo = active.topology
        if self.route is not None and self.route.topology_id == topo.topology_id:
            return
        if active.state != "active":  # incomplete (a worker did not accept) or degraded (lost)
            return
        linked = {p.node_id for p in self.node.peers(connected_only=True)} | {self.node.node_id}
        if any(s.node_id not in linked for s in topo.stages):
            self.reason = "a stage node is not linked"
            return
        loaded = self.host.loaded
        if loaded is None or loaded.topology.topology_id != topo.topology_id:
            own = active.reports.get(self.node.node_id)
            failed = own is not None and own.state != "ready"
            self.reason = f"stage 0 failed to load ({own.code})" if failed and own else (
                "stage 0 is loading"
            )
            return
        if self.tokenizer is None:
            self.tokenizer = await trio.to_thread.run_sync(
                LlamaTokenizer, loaded.load.part_paths[0]
            )
        self.node.topology.admission_expect = loaded.facts
        waiting = []
        for stage in topo.stages:
            report = active.reports.get(stage.node_id)
            if report is None or report.state != "ready":
                state = "not reported" if report is None else f"{report.state} ({report.code})"
                waiting.append(f"stage {stage.stage_index}: {state}")
                continue
            desc = report.descriptor
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

    async def _on_peer_down(self, node_id: str) -> None:
        active = self.node.topology.active
        if active is None or active.role != "coordinator":
            return
        stage = active.topology.stage_of(node_id)
        if stage is None:
            return
        # The topology service sees the same event; mark it degraded now, whichever
        # subscriber runs first, so the lost route is never published again.
        self.node.topology.on_peer_down(node_id)
        self._set_route(None, f"stage {stage.stage_index} (node {node_id[:12]}) was lost")
        log.warning("stage %d lost with node %s: replacing it", stage.stage_index, node_id[:12])
        try:
            new = await self.node.topology.replace_lost(node_id)
        except TopologyRefused as exc:
            log.warning("no replacement for stage %d: %s", stage.stage_index, exc)
            self.failed = exc
            self._changed.set()
            return
        moved = new.topology.stages[stage.stage_index].node_id
        self.reason = f"stage {stage.stage_index} moves to node {moved[:12]} (loading)"

    async def _retry_lost(self) -> None:
        """A peer joined while a lost stage had no taker: try to place it again."""
        active = self.node.topology.active
        if active is None or active.role != "coordinator" or active.state != "degraded":
            return
        for node_id in sorted(active.lost):
            if active.topology.stage_of(node_id) is not None:
                try:
                    await self.node.topology.replace_lost(node_id)
                except TopologyRefused as exc:
                    self.failed = exc
                    return
                self.failed = None
                self.reason = f"a lost stage moves to a new peer (was {node_id[:12]})"
                return

    # --- admission -----------------------------------------------------------------------------
    def _check_ready(self) -> Route:
        if self.route is not None:
            return self.route
        if self.failed is not None:
            raise SplitNotReady(self.failed.message, code=self.failed.code)
        raise SplitNotReady(f"the split is not ready: {self.reason}")

    async def generate(
        self, prompt: list[int], params: GenerationParams, emit: Emit
    ) -> GenerationResult:
        """One request through the split; ``emit`` gets each new token (and may stop it).
        Counted in the node's metrics (requests by outcome, tokens, time to first token)."""
        with self.node.metrics.request(len(prompt)) as record:
            try:
                await self._admit()
            except (SplitNotReady, ServerBusy):
                record.outcome = "rejected"
                raise

            async def counted(token: int) -> bool:
                record.tokens(1)
                return await emit(token)

            st = self.stats
            st.in_flight += 1
            try:
                result = await self._generate(prompt, params, counted)
            finally:
                st.in_flight -= 1
                self._slots.release()
            st.failovers_total += result.failovers
            st.recent.append(result)
            return result

    async def _admit(self) -> None:
        """Ready, and a slot free or a place in the queue (then wait for a slot)."""
        self._check_ready()
        st = self.stats
        if st.in_flight + st.queued >= self.settings.max_sessions + self.settings.max_queue:
            raise ServerBusy(
                f"{st.in_flight} requests running and {st.queued} queued (the limit)",
                remediation="retry later",
            )
        st.queued += 1
        try:
            with trio.fail_after(self.settings.queue_timeout_s):
                await self._slots.acquire()
        except trio.TooSlowError:
            raise ServerBusy(
                f"no slot within {self.settings.queue_timeout_s:g} s", remediation="retry later"
            ) from None
        finally:
            st.queued -= 1

    async def _generate(
        self, prompt: list[int], params: GenerationParams, emit: Emit
    ) -> GenerationResult:
        route = self._check_ready()
        n_ctx = route.stage0.facts.n_ctx
        if not prompt:
            raise GenerationFailed("the prompt has no tokens", code="empty_prompt")
        if len(prompt) >= n_ctx:
            raise GenerationFailed(
                f"the prompt has {len(prompt)} tokens; the context holds {n_ctx}",
                code="prompt_too_long",
            )
        result = GenerationResult(len(prompt), [], "length", 0.0, 0.0, 0.0)
        t0 = time.perf_counter()
        while True:
            try:
                await self._run(route, prompt, params, emit, result, t0)
                return result
            except _RouteBroken as broken:
                if result.failovers >= MAX_FAILOVERS:
                    raise GenerationFailed(
                        f"the route failed {result.failovers + 1} times: {broken.cause}",
                        code="route_failed",
                    ) from None
                result.failovers += 1
                log.warning(
                    "request lost its route %s after %d tokens (%s); waiting for a new one",
                    route.topology_id,
                    len(result.tokens),
                    broken.cause,
                )
                route = await self._await_new_route(route, broken.cause)

    async def _await_new_route(self, broken: Route, cause: BaseException) -> Route:
        grace = self.node.settings.peer_loss_timeout_s + 1.0
        start = trio.current_time()
        with trio.move_on_after(self.settings.failover_timeout_s):
            while True:
                if self.failed is not None:
                    raise GenerationFailed(self.failed.message, code=self.failed.code)
                route = self.route
                if route is not None and route.topology_id != broken.topology_id:
                    return route
                if route is not None and (
                    not _route_level(cause)
                    or (trio.current_time() - start > grace and self._route_connected(route))
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

    def _route_connected(self, route: Route) -> bool:
        linked = {p.node_id for p in self.node.peers(connected_only=True)}
        return all(n in linked or n == self.node.node_id for n in route.node_ids)

    # --- one attempt on one route --------------------------------------------------------------
    async def _run(
        self,
        route: Route,
        prompt: list[int],
        params: GenerationParams,
        emit: Emit,
        result: GenerationResult,
        t0: float,
    ) -> None:
        committed = prompt + result.tokens  # a replay recomputes every committed position
        loaded = route.stage0
        stage = loaded.stage
        session_id = secrets.randbits(63)
        request_id = secrets.randbits(63)
        name = t.session_name(session_id)
        per_frame = self.host.limits.tokens_per_frame(loaded.facts.width)
        chunk = min(self.settings.prefill_chunk, per_frame)
        n_ctx = loaded.facts.n_ctx
        tok = self.tokenizer
        send_tokens, recv_tokens = trio.open_memory_channel[int | BaseException](4)
        session = _Session(session_id, request_id, send_tokens)
        out: MeshStream | None = None
        sender: ChainSender | None = None
        self._sessions[session_id] = session
        try:
            async with trio.open_nursery() as nursery:
                if not route.single:
                    try:
                        with trio.fail_after(self.node.timeouts.handshake_s):
                            out = await self.node.open_stream(route.node_ids[1], pc.KIND_TRANSPORT)
                        stats = self.hops.setdefault(route.node_ids[1], HopStats())
                        sender = ChainSender(out, self.host.limits.max_inflight_frames, stats)
                        await sender.send(
                            t.encode_begin(
                                request_id,
                                session_id,
                                width=loaded.facts.width,
                                sampling=params.sampling,
                                topology_id=route.topology_id,
                            )
                        )
                    except (MeshError, trio.TooSlowError) as exc:
                        raise _RouteBroken(exc) from None
                    nursery.start_soon(self._watch_acks, sender, send_tokens)

                async def forward(phase: t.Phase, start: int, ids: list[int], last: bool) -> None:
                    x = np.asarray(ids, dtype=np.int64)
                    sampler = sampler_at(params.sampling, start + len(ids)) if last else None

                    def run() -> Any:
                        if phase is t.Phase.DECODE:
                            return stage.decode(name, start, x, sampler=sampler)
                        return stage.prefill(name, start, x, sampler=sampler)

                    output = await self.host.compute(run)
                    if sender is None:  # one stage: sampled here, after the last chunk
                        if last and output.token is not None:
                            await send_tokens.send(int(output.token))
                        return
                    frame = t.encode_activations(
                        request_id,
                        session_id,
                        phase=phase,
                        start=start,
                        activations=output.activations,
                        flags=t.Flag.SAMPLE if last else t.Flag.NONE,
                    )
                    try:
                        await sender.send_activations(frame, decode=phase is t.Phase.DECODE)
                    except MeshError as exc:
                        raise _RouteBroken(exc) from None

                tp = time.perf_counter()
                for lo in range(0, len(committed), chunk):
                    ids = committed[lo : lo + chunk]
                    await forward(t.Phase.PREFILL, lo, ids, lo + chunk >= len(committed))
                position = len(committed)
                first = True
                while True:
                    token = await self._next_token(recv_tokens)
                    now = time.perf_counter()
                    if first:
                        if not result.tokens:
                            result.ttft_s = now - t0
                        result.prefill_s += now - tp
                        td, first = now, False
                    if tok is not None and 0 <= token < tok.n_vocab and tok.is_eog(token):
                        result.stop_reason = "eos"
                        break
                    result.tokens.append(token)
                    if await emit(token):
                        result.stop_reason = "stop"
                        break
                    if len(result.tokens) >= params.max_tokens:
                        result.stop_reason = "length"
                        break
                    if position >= n_ctx:
                        result.stop_reason = "context"
                        break
                    await forward(t.Phase.DECODE, position, [token], True)
                    position += 1
                result.decode_s += time.perf_counter() - td
                if sender is not None:
                    with trio.move_on_after(self.node.timeouts.idle_s):
                        await sender.send(t.encode_free(request_id, session_id))
                        await sender.finish()
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            broken = first_exception(group, _RouteBroken)
            if broken is not None:
                raise broken from None
            err = skippy_error_in(group)
            if err is not None:
                raise err from None
            raise
        finally:
            self._sessions.pop(session_id, None)
            await self.host.free(stage, name)
            if out is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await out.aclose()

    async def _next_token(self, tokens: trio.MemoryReceiveChannel[int | BaseException]) -> int:
        try:
            with trio.fail_after(self.settings.token_timeout_s):
                item = await tokens.receive()
        except trio.TooSlowError:
            raise _RouteBroken(
                TimeoutError(f"no token within {self.settings.token_timeout_s:g} s")
            ) from None
        if isinstance(item, BaseException):
            raise _RouteBroken(item)
        return item

    async def _watch_acks(
        self, sender: ChainSender, tokens: trio.MemorySendChannel[int | BaseException]
    ) -> None:
        try:
            await sender.read_acks()
        except (MeshError, t.TransportError) as exc:
            raise _RouteBroken(exc) from None

    # --- the return stream (final stage -> here) -------------------------------------------------
    async def _on_return(self, inbound: InboundStream, reader: FrameReader, first: t.Frame) -> None:
        route = self.route
        session = self._sessions.get(first.session_id)
        if session is None or session.request_id != first.request_id:
            raise t.TransportError("a return stream for no session of this node",
                                   code="unknown_session")
        if route is None or inbound.peer.node_id != route.node_ids[-1]:
            raise t.TransportError("only the final stage returns tokens", code="not_final_stage")
        try:
            while (frame := await reader.next()) is not None:
                if frame.kind is not t.Kind.TOKENS or frame.session_id != session.session_id:
                    raise t.TransportError(
                        f"a {frame.kind.name} frame on a return stream", code="unknown_session"
                    )
                for token in frame.tokens():
                    session.tokens.send_nowait(token)
        except (MeshError, t.TransportError, trio.WouldBlock) as exc:
            with_error = exc if not isinstance(exc, trio.WouldBlock) else t.TransportError(
                "tokens arrived faster than they were asked for", code="transport_unexpected"
            )
            with contextlib.suppress(
                trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError
            ):
                session.tokens.send_nowait(with_error)
            if isinstance(with_error, t.TransportError):
                inbound.stream.reset(with_error.code, with_error.message[:200])


# Failures that mean "the route broke" (a node or link went away): wait for a replacement.
# Anything else (a stage refusing the session: context, bad activations...) fails the request.
_ROUTE_CODES: Final = frozenset(
    {
        "link_closed",
        "peer_unavailable",
        "stream_refused",
        "stream_stalled",
        "transport_timeout",
        "stale_topology",
        "stage_not_ready",
        "not_upstream",
        "timeout",
        "closed",
    }
)


def _route_level(cause: BaseException) -> bool:
    if isinstance(cause, TimeoutError | trio.TooSlowError):
        return True
    if isinstance(cause, StreamReset):
        return (cause.actual or cause.code) in _ROUTE_CODES
    if isinstance(cause, SkippyError):
        return cause.code in _ROUTE_CODES
    return False

