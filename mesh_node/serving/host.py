"""This node's stage of a split, and the transport handler (kind 0x02) that runs it.

Every node (``mesh-node run`` and ``mesh-node serve``) has one ``StageHost``. When the node
holds a stage of the active topology, its parts are brought in (the fetch, or a local
package) and ``load`` opens them in the stage runtime (``skippy.runtime``), returning the
runtime facts for the ready report. A stage already loaded for the same manifest and layers is
kept when a new topology arrives (a failover moves only the lost stage). A stage replaced by
another (a split that grew) stays open while a route or a session ``hold``s it, and one that
served sessions within ``RETIRED_KEEP_S`` also takes new sessions of its own topology until
the route moves on (``supersede``: the first session of the new topology, or the coordinator
publishing its new route); then its last ``release`` closes it. So the old route serves
while the new topology loads, and requests finish on the route they started on.

A chain stream (from the previous stage's node only) carries one session: BEGIN, then
activation frames, then FREE. The reader acknowledges each prefill frame as it takes it (early
ack) and queues it (a decode frame is acknowledged once its output is on its way); the compute
task runs the stage (one call at a time per stage, on the process's compute thread, or for a
short decode step of a single-threaded stage on the loop) and forwards the output: activations
to the next stage, or, on the final stage, the sampled token straight back to stage 0 on a
return stream. The session's decode steps are batched with the other sessions'
(``StageHost.decode``: one graph for every step queued when the stage is free). The
session's KV cache lives only here and is freed when the session ends in any
way (FREE, end of stream, a reset, a refusal), which then travels on down the chain. A
refused frame resets only its own stream: other sessions never notice.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

import numpy as np
import trio
from prometheus_client.registry import Collector

from mesh_node.compute import run_compute
from mesh_node.errors import StreamReset, skippy_error_in
from mesh_node.link import MeshStream
from mesh_node.metrics import SectionCollector, stage_families
from mesh_node.node import MeshNode
from mesh_node.node_service import FeatureBits, StreamKind
from mesh_node.peers import InboundStream
from mesh_node.serving.links import ChainSender, FrameReader, HopStats
from mesh_node.settings import ServingSettings
from protocol import constants as pc
from skippy.errors import SkippyError
from skippy.package.topology import SplitTopology, StageAssignment
from skippy.runtime.admission import RuntimeFacts
from skippy.runtime.boundary import StageLoad
from skippy.runtime.compute_thread import compute_thread
from skippy.runtime.contention import machine_cores, stage_threads
from skippy.runtime.nextn import NextnProposer
from skippy.runtime.sampling import Sampler
from skippy.runtime.speculation import accept_draft
from skippy.runtime.stage import DecodeStep, Stage, StageConfig, StageOutput, context_full
from skippy.stage import stage_frames as t

log = logging.getLogger("mesh_node.serving")
T = TypeVar("T")
ReturnHandler = Callable[[InboundStream, FrameReader, t.Frame], Awaitable[None]]
# A decode step this short blocks the event loop for its length (its result then needs no
# wake-up of the loop through trio, ~250 us here against ~110 for a thread's plain wake-up; a
# single-threaded stage runs it right on the loop, no hand-off at all). A few milliseconds of
# blocked loop delay nothing this stage could run meanwhile: its calls are serialized anyway.
INLINE_STEP_MAX_S = 0.025
STEP_SMOOTHING = 0.2
# Continuous batching: a decode step runs with every other session's step
# queued by the time the stage is free; it waits for sessions that stepped recently (their next
# frame is on its way), never for a lone session: at least BATCH_WINDOW_S, up to this share of
# a recent step's time (a batch member costs a fraction of a step; a step run without it costs
# it a whole one), at most BATCH_WINDOW_MAX_S.
BATCH_WINDOW_S = 0.002
BATCH_WINDOW_SHARE = 0.5
BATCH_WINDOW_MAX_S = 0.05
# A session that has not stepped for this long is not waited for (it prefills, or it ended).
DECODER_IDLE_S = 2.0
# A replaced stage that was held this recently serves its route until the route moves on.
RETIRED_KEEP_S = 30.0


def transport_limits(settings: ServingSettings) -> t.TransportLimits:
    return t.TransportLimits(
        max_frame_bytes=settings.max_frame_bytes,
        max_inflight_frames=settings.max_inflight_frames,
    )


def sampler_at(sampling: t.Sampling, position: int, before: Sequence[int] = ()) -> Sampler:
    """The sampler for the token at ``position``: seeded by (seed, position), so a replay after
    a failover draws the same tokens as the undisturbed run would have (greedy ignores it);
    ``before``: the tokens before ``position`` that the penalties read (at least the last
    ``repeat_last_n``), the same on every attempt."""
    params = replace(sampling, seed=(sampling.seed * 1_000_003 + position) % (1 << 63))
    return Sampler(params, history=before)


@dataclass
class LoadedStage:
    topology: SplitTopology  # the latest topology this stage serves
    assignment: StageAssignment
    load: StageLoad
    stage: Stage
    facts: RuntimeFacts
    artifact_bytes: int
    users: int = 0  # holders (a published route, sessions): a replaced stage waits for them
    held_at: float = -math.inf  # trio clock of the last hold
    superseded: bool = False  # replaced and its route moved on: closed on its last release

    @property
    def key(self) -> tuple[str | None, int, int]:
        return (self.load.manifest_sha256, self.load.layers.start, self.load.layers.stop)

    @property
    def is_final(self) -> bool:
        return self.assignment.stage_index == len(self.topology.stages) - 1


@dataclass
class _QueuedStep:
    """One session's one-position steps waiting for the next batch (one for a decode step,
    a verify window's positions in order), and then their outcomes."""

    stage: Stage
    steps: tuple[DecodeStep, ...]
    outputs: list[StageOutput] = field(default_factory=list)
    error: BaseException | None = None
    done: bool = False
    wake: trio.Event = field(default_factory=trio.Event)  # done, or asked to lead a batch

    @property
    def session(self) -> str:
        return self.steps[0].session


@dataclass(frozen=True)
class _Work:
    """A frame for the compute loop, with its ack when that is sent after the frame's output
    (decode frames) rather than by the reader on arrival."""

    frame: t.Frame
    late_ack: bytes | None


class _Acks:
    """A session's acks to its upstream, sent by the reader (on arrival) and by the compute
    loop (after a decode step's output): one at a time on the stream."""

    def __init__(self, stream: MeshStream) -> None:
        self.stream = stream
        self._lock = trio.Lock()

    async def send(self, ack: bytes) -> None:
        async with self._lock:
            await self.stream.send_all(ack)


class SessionRefused(SkippyError):
    """A chain stream this node will not serve (not from the upstream stage, stale topology,
    no stage loaded)."""

    code = "session_refused"


class StageHost:
    """A node service (``mesh_node.node_service``): the transport streams (kind 0x02), the
    skippy-stage bundle's feature bits and the ``stage`` status section."""

    config_table: str | None = "serving"

    def __init__(self, node: MeshNode, settings: ServingSettings) -> None:
        self.node = node
        self.settings = settings
        # [serving] engine, unless serving chose llama.cpp for a model the stage runtime does
        # not cover (mesh_node.serving.split_service: one node, the whole model).
        self.engine = settings.engine
        self.limits = transport_limits(settings)
        self.loaded: LoadedStage | None = None
        self.retired: list[LoadedStage] = []  # replaced stages still open (see the docstring)
        self.return_handler: ReturnHandler | None = None
        self.hops: dict[str, HopStats] = {}  # per downstream node id
        self._lock = trio.Lock()  # a stage is not thread-safe: one call at a time
        self.sessions = 0  # chain sessions open on this node
        self.busy_s = 0.0  # time spent in stage calls (compute), for the overlap figure
        self.rss_before_load: int | None = None  # KiB, the process just before its stage loaded
        self.calls = 0
        self.step_s = 0.0  # recent one-position step time (s), for the batching window
        self.stage_threads = 0  # the loaded stage's thread cap (1: it never starts OpenMP)
        self.blocking_steps = 0  # decode steps the loop waited for without trio's wake-up
        # One-position (decode) steps alone, so a per-token compute figure is not
        # diluted by prefill chunks (the WAN bench's model t_token reads these).
        self.steps = 0
        self.step_busy_s = 0.0
        self._queued: list[_QueuedStep] = []  # decode steps waiting for the stage
        self._queue_grew = trio.Event()
        self._leader: _QueuedStep | None = None  # the step gathering or running a batch
        self._decoders: dict[str, float] = {}  # session -> when its last decode step ran
        self.batches = 0  # decode batches of two or more sessions
        self.batched_steps = 0  # the steps they held
        self.batched_window_steps = 0  # of those, verify windows' positions

    # --- as a node service ------------------------------------------------------------------
    def streams(self) -> Sequence[StreamKind]:
        return [StreamKind(pc.KIND_TRANSPORT, self._handle)]

    def features(self, now_s: float) -> FeatureBits:
        """Every node hosts a stage when a topology names it: the stage bundle, verify windows,
        NextN drafts and every sampling control of a session."""
        bits = {
            *pc.STAGE_BUNDLE,
            pc.BIT_VERIFY_WINDOW,
            pc.BIT_SAMPLING_CONTROLS,
            pc.BIT_NEXTN_DRAFTS,
        }
        return {pc.FEATURE_SKIPPY_STAGE: frozenset(bits)}

    def status_sections(self) -> Mapping[str, Any]:
        return {"stage": self.status()}

    def collectors(self) -> Sequence[Collector]:
        return [SectionCollector(self.status, stage_families)]

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()  # its work runs in the streams peers open

    # --- loading ------------------------------------------------------------------------------
    def co_located(self, topology: SplitTopology) -> int:
        """Stages of ``topology`` on this machine (this node's included): peers whose Hello
        carried this node's host fingerprint."""
        here = self.node.host_id
        others = 0
        for stage in topology.stages:
            if stage.node_id == self.node.node_id:
                continue
            peer = self.node.peer(stage.node_id)
            others += peer is not None and peer.host_id is not None and peer.host_id == here
        return 1 + others

    def stage_config(self, topology: SplitTopology | None = None) -> StageConfig:
        s, r = self.settings, self.node.settings.runtime
        sharing = self.co_located(topology) if topology is not None else 1
        return StageConfig(
            n_ctx=s.n_ctx,
            n_threads=stage_threads(s.threads, machine_cores(), sharing),
            n_batch=max(s.prefill_chunk, 1),
            # A failover can leave sessions of the old route draining while new ones start.
            max_sessions=2 * s.max_sessions,
            # "auto": also fewer threads while other processes keep cores busy
            adaptive_threads=s.threads is None,
            repack=s.repack,
            device=r.device,
            placement=r.placement,
            cpu_moe=r.cpu_moe,
            device_fallback=r.device_fallback,
        )

    async def load(
        self,
        topology: SplitTopology,
        assignment: StageAssignment,
        load: StageLoad,
        artifact_bytes: int,
    ) -> LoadedStage:
        """Open ``load`` in the stage runtime (or keep the stage already open for the same
        manifest and layers) for ``topology``; return the loaded stage."""
        current = self.loaded
        key = (load.manifest_sha256, load.layers.start, load.layers.stop)
        if current is not None and current.key == key:
            current.topology, current.assignment = topology, assignment
            log.info("stage %s kept for topology %s", load.layers, topology.topology_id)
            return current
        from skippy.runtime.chain import open_stage

        config = self.stage_config(topology)
        log.info(
            "stage threads: %d (serving.threads %s, %d stage(s) on this machine)",
            config.n_threads,
            self.settings.threads if self.settings.threads is not None else "auto",
            self.co_located(topology),
        )

        def open_() -> Stage:
            return open_stage(
                self.engine,
                load,
                config,
                package_ref=topology.package_ref,
                stage_index=assignment.stage_index,
                stage_count=len(topology.stages),
            )

        async with self._lock:
            if self.loaded is not None:
                old, self.loaded = self.loaded, None
                await self._retire(old)
            self.rss_before_load = _vm_kib("VmRSS")
            stage = await run_compute(open_)
            self.stage_threads = config.n_threads
            self.loaded = LoadedStage(
                topology, assignment, load, stage, stage.descriptor.facts, artifact_bytes
            )
        log.info(
            "stage %d (layers %s) loaded for topology %s",
            assignment.stage_index,
            load.layers,
            topology.topology_id,
        )
        return self.loaded

    async def _retire(self, old: LoadedStage) -> None:
        """``old`` was replaced (the lock held): kept open while held or recently used, else
        closed. Stages replaced before it now serve only their holders."""
        for r in self.retired:
            r.superseded = True
        idle = [r for r in self.retired if not r.users]
        self.retired = [r for r in self.retired if r.users]
        if old.users or trio.current_time() - old.held_at < RETIRED_KEEP_S:
            self.retired.append(old)
            log.info(
                "stage %s stays open for topology %s (%d holder(s)) until its route moves on",
                old.load.layers,
                old.topology.topology_id,
                old.users,
            )
        else:
            idle.append(old)
        for r in idle:
            await run_compute(r.stage.close)

    async def supersede(self) -> None:
        """The route moved on to the loaded stage: replaced stages take no new session and
        close once their holders end."""
        if not self.retired:
            return
        for r in self.retired:
            r.superseded = True
        idle = [r for r in self.retired if not r.users]
        self.retired = [r for r in self.retired if r.users]
        for r in idle:
            await self._close_retired(r)

    def hold(self, loaded: LoadedStage) -> None:
        """``loaded`` stays open until ``release``d, even once another stage replaces it."""
        loaded.users += 1
        loaded.held_at = trio.current_time()

    async def release(self, loaded: LoadedStage) -> None:
        """Undo one ``hold``; the last holder of a superseded stage closes it."""
        loaded.users -= 1
        if loaded.users or not loaded.superseded or not any(r is loaded for r in self.retired):
            return
        self.retired = [r for r in self.retired if r is not loaded]
        await self._close_retired(loaded)

    async def _close_retired(self, loaded: LoadedStage) -> None:
        with trio.CancelScope(shield=True):
            async with self._lock:
                await run_compute(loaded.stage.close)
        log.info(
            "stage %s of topology %s closed: the route moved on",
            loaded.load.layers,
            loaded.topology.topology_id,
        )

    async def compute(self, fn: Callable[[], T], *, step: bool = False) -> T:
        """Run one stage call, one at a time, on the process's compute thread (ggml releases
        the GIL). That thread, never trio's worker threads, and the event loop only for a
        single-threaded stage: a second thread running multi-threaded graphs gives libgomp a
        second pool, and the process's barriers then spin too briefly
        (``skippy.runtime.compute_thread``). A short decode ``step`` blocks the loop instead
        of awaiting (``INLINE_STEP_MAX_S``)."""
        async with self._lock:
            return await self._timed(fn, step=step)

    async def _timed(self, fn: Callable[[], T], *, step: bool, graphs: int = 1) -> T:
        """``compute``'s body, the lock held. The time counted is the call's own, taken
        where it ran: the hand-offs are the route's cost, not the stage's. A ``step`` call
        runs ``graphs`` one-position graphs one after the other (a verify window's), each
        counted as a step."""
        elapsed = 0.0

        def timed() -> T:
            nonlocal elapsed
            start = time.perf_counter()
            try:
                return fn()
            finally:
                elapsed = time.perf_counter() - start

        try:
            if step and self.step_s * graphs <= INLINE_STEP_MAX_S:
                self.blocking_steps += 1
                if self.stage_threads == 1:  # ggml runs a 1-thread graph without OpenMP
                    return timed()
                return compute_thread().call(timed)
            return await run_compute(timed)
        finally:
            self.busy_s += elapsed
            self.calls += 1
            if step:  # a moving average, so one slow step does not move every later one
                self.step_s += STEP_SMOOTHING * (elapsed / graphs - self.step_s)
                self.steps += graphs  # graph runs (a batch of sessions' steps is one)
                self.step_busy_s += elapsed

    async def decode(
        self,
        stage: Stage,
        name: str,
        position: int,
        inputs: Any,
        sampler: Sampler | None,
    ) -> StageOutput:
        """One session's decode step (``stage.decode``), batched with the other sessions' steps
        queued when the stage becomes free: one ``decode_batch`` graph for all of them
        (continuous batching; each output equals its own decode bit for bit). Positions a
        rejected verify window left are dropped first (``drop_rejected``)."""
        item = _QueuedStep(stage, (DecodeStep(name, position, inputs, sampler),))
        return (await self._queue(item))[0]

    async def verify(
        self,
        stage: Stage,
        name: str,
        sampling: t.Sampling,
        start: int,
        x: Any,
        window: list[int],
        before: Sequence[int] = (),
    ) -> tuple[Any, list[int] | None]:
        """One verify window: its activation rows for the next stage, or (final stage)
        the committed tokens (``accept_window``), from exact one-position steps that
        join the decode batches: position j of this window in one graph with the other
        sessions' steps queued meanwhile (their decode steps, their windows' position j), so
        concurrent speculating sessions share their weight reads as plain decoding does
. A window that cannot fit the context is refused before any step."""
        rows = np.asarray(x)
        steps = tuple(
            DecodeStep(name, start + i, rows[i : i + 1], None) for i in range(rows.shape[0])
        )
        outs = await self._queue(_QueuedStep(stage, steps))
        if outs[-1].logits is None:
            return np.concatenate([o.activations for o in outs if o.activations is not None]), None
        logits = np.concatenate([o.logits for o in outs if o.logits is not None])
        return None, accept_window(sampling, start, logits, window, before)

    async def _queue(self, item: _QueuedStep) -> list[StageOutput]:
        """Queue ``item`` for the next batch (leading it when no one leads); its outputs."""
        self._queued.append(item)
        self._queue_grew.set()
        try:
            while not item.done:
                if self._leader is not None:  # a batch is being gathered or run: ours next
                    await item.wake.wait()
                    item.wake = trio.Event()
                    continue
                # Lead the next batch. It waits for company with the stage free, so the
                # sessions of the batch that just ended join this one (else two cohorts would
                # alternate, each waiting while the other computes).
                self._leader = item
                try:
                    await self._wait_for_company(item)
                    async with self._lock:
                        await self._run_batch(item.stage)
                finally:
                    self._leader = None
                    self._hand_over()
        finally:
            if item in self._queued:  # cancelled before any batch took it
                self._queued.remove(item)
                self._hand_over()
        if item.error is not None:
            raise item.error
        assert len(item.outputs) == len(item.steps)  # done without an error: _run_batch
        return item.outputs

    def _hand_over(self) -> None:
        """The oldest queued step leads the next batch (when no one leads)."""
        if self._leader is None and self._queued:
            self._queued[0].wake.set()

    async def _wait_for_company(self, item: _QueuedStep) -> None:
        """A short while (see ``BATCH_WINDOW_S``) for the sessions that stepped recently to
        queue theirs."""
        name = item.session
        now = time.perf_counter()
        window = min(max(BATCH_WINDOW_S, BATCH_WINDOW_SHARE * self.step_s), BATCH_WINDOW_MAX_S)
        deadline = trio.current_time() + window
        while not item.done:
            queued = {q.session for q in self._queued}
            waiting = [
                s
                for s, t0 in self._decoders.items()
                if s != name and s not in queued and now - t0 < DECODER_IDLE_S
            ]
            if not waiting or not self._queued:
                return
            if self._queue_grew.is_set():  # one event shared by every waiter
                self._queue_grew = trio.Event()
            with trio.move_on_at(deadline) as scope:
                await self._queue_grew.wait()
            if scope.cancelled_caught:
                return

    async def _run_batch(self, stage: Stage) -> None:
        """Run every step queued for ``stage`` (the lock held) as batches, in session order
        (a steady set of sessions reuses its batched graph): the first position of every
        queued item in one graph, then the second of those that have one (verify windows),
        and so on, all in one compute call. A refusal of a batch runs its steps alone, so
        each session gets its own outcome; a session refused at a position stops there."""
        batch = sorted((q for q in self._queued if q.stage is stage), key=lambda q: q.session)
        self._queued = [q for q in self._queued if q.stage is not stage]
        graphs = max(len(q.steps) for q in batch)
        counts = [0, 0, 0]  # batched graphs of 2+ steps, the steps they held, window steps

        def run() -> None:
            for q in batch:
                first, reach, n_ctx = q.steps[0], q.steps[-1].position + 1, stage.descriptor.n_ctx
                drop_rejected(stage, first.session, first.position)
                if len(q.steps) > 1 and reach > n_ctx:  # a window: refused before any step
                    q.error = context_full(first.session, reach, n_ctx)
            for j in range(graphs):
                live = [q for q in batch if q.error is None and j < len(q.steps)]
                if not live:
                    break
                try:  # alone: exactly decode
                    outs = stage.decode_batch([q.steps[j] for q in live]) if len(live) > 1 else None
                except SkippyError:
                    outs = None
                if outs is not None:
                    counts[0] += 1
                    counts[1] += len(live)
                    counts[2] += sum(len(q.steps) > 1 for q in live)
                for i, q in enumerate(live):
                    try:
                        if outs is not None:
                            q.outputs.append(outs[i])
                        else:
                            s = q.steps[j]
                            q.outputs.append(
                                stage.decode(s.session, s.position, s.inputs, sampler=s.sampler)
                            )
                    except SkippyError as exc:
                        q.error = exc
            for q in batch:
                q.done = True

        try:
            await self._timed(run, step=True, graphs=graphs)
        finally:
            for q in batch:  # a failure outside the stage's refusals reaches every waiter
                if not q.done:
                    q.error = SessionRefused("the decode batch failed", code="stage_failed")
                    q.done = True
                q.wake.set()  # here, not in run(): that runs on the compute thread
        now = time.perf_counter()
        for q in batch:
            self._decoders[q.session] = now
        log.debug("decode batch: %s", ",".join(q.session for q in batch))
        self.batches += counts[0]
        self.batched_steps += counts[1]
        self.batched_window_steps += counts[2]

    def status(self) -> dict[str, Any] | None:
        """This node's stage for the status document (``stage`` section), or None."""
        loaded = self.loaded
        if loaded is None:
            return None
        kv = getattr(loaded.stage, "kv_bytes_per_session", None)
        where = getattr(loaded.stage, "device_status", None)
        # where the ggml engine computes and what it holds there (docs/devices.md); why not
        # the configured device; other engines run on the CPU
        device = (
            where()
            if callable(where)
            else {"device": "CPU", "device_fallback": None, "placement": "cpu"}
        )
        return {
            "topology_id": loaded.topology.topology_id,
            "stage_index": loaded.assignment.stage_index,
            "layer_start": loaded.load.layers.start,
            "layer_end": loaded.load.layers.stop,
            "artifact_bytes": loaded.artifact_bytes,
            "kv_bytes_per_session": kv() if callable(kv) else None,
            "engine": loaded.facts.engine,
            "runtime_version": loaded.facts.runtime_version,
            **device,
            "sessions": self.sessions,
            "rss_before_load_kib": self.rss_before_load,
            "peak_rss_kib": _vm_kib("VmHWM"),
            "compute_calls": self.calls,
            "compute_busy_s": round(self.busy_s, 4),
            "blocking_decode_steps": self.blocking_steps,
            "decode_steps": self.steps,
            "decode_busy_s": round(self.step_busy_s, 6),
            "decode_batches": self.batches,
            "batched_decode_steps": self.batched_steps,
            "batched_verify_steps": self.batched_window_steps,
            "hops": hop_summary(self.hops),
        }

    async def free(self, stage: Stage, name: str) -> None:
        self._decoders.pop(name, None)
        with trio.CancelScope(shield=True):
            async with self._lock:
                stage.free(name)

    async def close(self) -> None:
        with trio.CancelScope(shield=True):
            async with self._lock:
                stages = [*self.retired, *([self.loaded] if self.loaded is not None else [])]
                self.loaded, self.retired = None, []
                for loaded in stages:
                    await run_compute(loaded.stage.close)

    # --- the transport handler ---------------------------------------------------------------
    async def _handle(self, inbound: InboundStream) -> None:
        stream = inbound.stream
        # a replaced stage's width while the new one loads (one model: the same width)
        ref = self.loaded or (self.retired[-1] if self.retired else None)
        width = ref.facts.width if ref is not None else 0
        reader = FrameReader(stream, t.FrameDecoder(width=width, limits=self.limits))
        try:
            with trio.fail_after(self.node.timeouts.handshake_s):
                first = await reader.next()
            if first is None:
                return
            if first.kind is t.Kind.RETURN:
                if self.return_handler is None:
                    raise SessionRefused("this node is not serving a route", code="not_serving")
                await self.return_handler(inbound, reader, first)
                return
            if first.kind is not t.Kind.BEGIN:
                raise t.TransportError(
                    f"a stream starts with BEGIN or RETURN, not {first.kind.name}",
                    code="unknown_session",
                )
            await self._chain(inbound, reader, first)
        except trio.TooSlowError:
            stream.reset("transport_timeout", "no frame within the timeout")
        except (t.TransportError, SessionRefused) as exc:
            if width == 0 and exc.code == "transport_width_mismatch":
                # No stage here (e.g. a restarted process): say so, not "width 0" (its BEGIN
                # was refused by the width check before _chain could look).
                exc = SessionRefused("no stage is loaded on this node", code="stage_not_ready")
            log.info("refused a transport stream from %s: %s", inbound.peer.node_id[:12], exc)
            stream.reset(exc.code, exc.message[:200])

    def stage_for(self, topology_id: str) -> LoadedStage | None:
        """The stage that serves sessions of ``topology_id``: the loaded one, or a replaced
        one whose route has not moved on yet."""
        if self.loaded is not None and self.loaded.topology.topology_id == topology_id:
            return self.loaded
        for r in self.retired:
            if r.topology.topology_id == topology_id and not r.superseded:
                return r
        return None

    async def _chain(self, inbound: InboundStream, reader: FrameReader, begin: t.Frame) -> None:
        sampling, topology_id = begin.begin()
        loaded = self.stage_for(topology_id)
        if loaded is None:
            current = self.loaded
            if current is None:
                raise SessionRefused("no stage is loaded on this node", code="stage_not_ready")
            raise SessionRefused(
                f"topology {topology_id} is not the one this stage serves "
                f"({current.topology.topology_id})",
                code="stale_topology",
            )
        topo, index = loaded.topology, loaded.assignment.stage_index
        if index == 0 or inbound.peer.node_id != topo.stages[index - 1].node_id:
            raise SessionRefused(
                "only the previous stage's node may send activations to this stage",
                code="not_upstream",
            )
        session = t.SessionInbound(max_positions=loaded.facts.n_ctx)
        session.accept(begin)
        name = t.session_name(begin.session_id)
        target = topo.stages[0 if loaded.is_final else index + 1].node_id
        self.sessions += 1
        self.hold(loaded)
        out: MeshStream | None = None
        try:
            if loaded is self.loaded:
                await self.supersede()  # the route moved on to this stage
            with trio.fail_after(self.node.timeouts.handshake_s):
                out = await self.node.open_stream(target, pc.KIND_TRANSPORT)
            if loaded.is_final:
                await out.send_all(t.encode_return(begin.request_id, begin.session_id))
                sender = None
            else:
                sender = ChainSender(
                    out, self.limits.max_inflight_frames, self.hops.setdefault(target, HopStats())
                )
                await sender.send(
                    t.encode_begin(
                        begin.request_id,
                        begin.session_id,
                        width=loaded.facts.width,
                        sampling=sampling,
                        topology_id=topology_id,
                        drafts=begin.wants_drafts,
                    )
                )
            work_send, work_recv = trio.open_memory_channel[_Work](self.limits.max_inflight_frames)
            acks = _Acks(inbound.stream)
            tokens = t.SessionTokens.of(sampling) if loaded.is_final else t.SessionTokens()
            drafter = SessionDrafter.of(loaded, name) if begin.wants_drafts else None
            async with trio.open_nursery() as nursery:
                if sender is not None:
                    nursery.start_soon(sender.read_acks)
                else:
                    nursery.start_soon(_drain, out)
                nursery.start_soon(
                    self._compute_loop,
                    loaded,
                    name,
                    (sampling, tokens, drafter),
                    work_recv,
                    sender,
                    out,
                    begin,
                    acks,
                )
                async with work_send:
                    while True:
                        frame = await _next_within(reader, self.settings.token_timeout_s)
                        if frame is None:
                            break
                        session.accept(frame)
                        if frame.kind is t.Kind.FREE:
                            break
                        ack = t.encode_ack(
                            frame.request_id, frame.session_id, start=frame.start, count=frame.count
                        )
                        if frame.phase is t.Phase.DECODE:
                            # Acknowledged once its output is on its way: the upstream sends
                            # a session's next decode frame only after the token came round,
                            # so the ack is never waited for, and sending it first (~0.2 ms)
                            # would delay every stage's step on every token.
                            await work_send.send(_Work(frame, ack))
                        else:
                            # To the compute thread first, then the ack: the ack's encryption
                            # and send overlap the stage's compute instead of delaying its start.
                            await work_send.send(_Work(frame, None))
                            await acks.send(ack)
        except (SkippyError, BaseExceptionGroup) as caught:
            # A runtime refusal (context, non-finite activations...), a downstream failure:
            # this session ends; the upstream hears why.
            exc = skippy_error_in(caught)
            if exc is None:
                raise
            log.info("session %s ended: %s", name, exc)
            # Pass a downstream peer's own code on (stage 0 tells a node loss from a refusal).
            code = exc.actual if isinstance(exc, StreamReset) and exc.actual else exc.code
            inbound.stream.reset(str(code), exc.message[:200])
        finally:
            self.sessions -= 1
            await self.free(loaded.stage, name)
            await self.release(loaded)
            if out is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await out.aclose()

    async def _verify(
        self,
        loaded: LoadedStage,
        name: str,
        sampling: t.Sampling,
        frame: t.Frame,
        x: Any,
        sender: ChainSender | None,
        out: MeshStream,
        before: list[int],
        drafter: SessionDrafter | None = None,
    ) -> None:
        """One verify window: pass its rows on, or (final stage) return the committed tokens
        (``before``: the tokens before the window that the penalties read), with the next
        NextN draft where the session asked for them."""
        window = frame.tokens()
        rows, tokens = await self.verify(
            loaded.stage, name, sampling, frame.start, x, window, before
        )
        if sender is not None:
            data = t.encode_verify(
                frame.request_id,
                frame.session_id,
                start=frame.start,
                activations=rows,
                tokens=window,
            )
            await sender.send_activations(data, decode=True)
        elif tokens is not None:
            # the rejected drafts' positions go before the head reads the trunk's last one
            committed = frame.start + len(tokens)
            draft = await self.draft(drafter, frame.start + 1, tokens, truncate=committed)
            await out.send_all(
                t.encode_tokens(
                    frame.request_id,
                    frame.session_id,
                    start=frame.start + 1,
                    tokens=tokens,
                    draft=draft,
                )
            )

    async def draft(
        self,
        drafter: SessionDrafter | None,
        start: int,
        tokens: list[int],
        *,
        truncate: int | None = None,
    ) -> int | None:
        """The NextN head's draft after ``tokens`` (committed at ``start``..), on the compute
        thread, or None (no drafter, or the head refused: plain decoding goes on)."""
        if drafter is None:
            return None

        def run() -> int | None:
            if truncate is not None:
                drop_rejected(drafter.stage, drafter.name, truncate)
            return drafter.draft(start, tokens)

        return await self.compute(run)

    async def _compute_loop(
        self,
        loaded: LoadedStage,
        name: str,
        session: tuple[t.Sampling, t.SessionTokens, SessionDrafter | None],
        frames: trio.MemoryReceiveChannel[_Work],
        sender: ChainSender | None,
        out: MeshStream,
        begin: t.Frame,
        acks: _Acks,
    ) -> None:
        async with frames:
            async for work in frames:
                await self._step(loaded, name, session, work.frame, sender, out)
                if work.late_ack is not None:  # a decode frame's: once its output is on its way
                    await acks.send(work.late_ack)
        # The session ended upstream: free it downstream too, and end our side.
        if sender is not None:
            await sender.send(t.encode_free(begin.request_id, begin.session_id))
        await out.send_eof()

    async def _step(
        self,
        loaded: LoadedStage,
        name: str,
        session: tuple[t.Sampling, t.SessionTokens, SessionDrafter | None],
        frame: t.Frame,
        sender: ChainSender | None,
        out: MeshStream,
    ) -> None:
        """One frame through this stage: computed, and its output sent on (with its token
        ids when it carries them). ``session``: its sampling, (final stage) the token ids
        its frames carried, which the penalties read, and its NextN drafter if it asked."""
        sampling, tokens, drafter = session
        stage = loaded.stage
        x = frame.activations()  # a read-only view of the received bytes: no copy
        sample = bool(frame.flags & t.Flag.SAMPLE) and loaded.is_final
        end = frame.start + frame.count
        tokens.take(frame)
        if drafter is not None:
            drafter.observe(frame)
        if frame.phase is t.Phase.VERIFY:
            before = tokens.before(frame.start) if loaded.is_final else []
            await self._verify(loaded, name, sampling, frame, x, sender, out, before, drafter)
            return
        sampler = sampler_at(sampling, end, tokens.before(end)) if sample else None

        def run(f: t.Frame = frame, x: Any = x, s: Sampler | None = sampler) -> Any:
            drop_rejected(stage, name, f.start)
            return stage.prefill(name, f.start, x, sampler=s)

        if frame.phase is t.Phase.DECODE:  # batched with the other sessions' steps
            result: Any = await self.decode(stage, name, frame.start, x, sampler)
        else:
            result = await self.compute(run)
        if sender is not None:
            await sender.send_activations(
                t.encode_activations(
                    frame.request_id,
                    frame.session_id,
                    phase=frame.phase,
                    start=frame.start,
                    activations=result.activations,
                    flags=frame.flags,
                    tokens=frame.tokens() if frame.carries_ids else None,
                ),
                decode=frame.phase is t.Phase.DECODE,
            )
        elif sample:
            draft = await self.draft(drafter, end, [result.token])
            await out.send_all(
                t.encode_tokens(
                    frame.request_id,
                    frame.session_id,
                    start=end,
                    tokens=[result.token],
                    draft=draft,
                )
            )


@dataclass
class SessionDrafter:
    """A final stage's NextN drafts for one session (``native-mtp``): the session's tokens by
    position, as its frames carried them (the prompt's, when stage 0 sends their ids) and as
    it sampled them, which the head pairs with the trunk's hidden states."""

    proposer: NextnProposer
    failed: bool = False  # the head refused once: no more drafts (plain decoding)

    @classmethod
    def of(cls, loaded: LoadedStage, name: str) -> SessionDrafter | None:
        """The final stage's drafter, where its runtime runs a NextN head."""
        return cls.of_stage(loaded.stage, name) if loaded.is_final else None

    @classmethod
    def of_stage(cls, stage: Stage, name: str) -> SessionDrafter | None:
        """A drafter for session ``name`` of ``stage`` (whose trunk then keeps the session's
        hidden states for the head), or None when the stage runs no head."""
        if not getattr(stage, "drafts", False):
            return None
        return cls(NextnProposer(stage, name))

    @property
    def stage(self) -> Stage:
        return cast(Stage, self.proposer.stage)

    @property
    def name(self) -> str:
        return self.proposer.session

    def observe(self, frame: t.Frame) -> None:
        """The token ids a frame carried (its rows' tokens)."""
        if frame.carries_ids:
            self.put(frame.start, frame.tokens())

    def put(self, start: int, tokens: Sequence[int]) -> None:
        """The tokens at positions ``start..`` (a rewind replaces those after)."""
        self.proposer.put(start, tokens)

    def draft(self, start: int, tokens: list[int]) -> int | None:
        if self.failed:
            return None
        self.proposer.put(start, tokens)
        try:
            return self.proposer.propose(1)[0]
        except SkippyError as exc:  # e.g. the context is full: the request decodes on
            log.info("session %s: no more NextN drafts: %s", self.name, exc)
            self.failed = True
            return None


def drop_rejected(stage: Stage, name: str, start: int) -> None:
    """A frame starting inside the last verify window (``SessionInbound`` allows only that):
    forget the rejected drafts' KV first (a length change, no recompute)."""
    if stage.session_length(name) > start:
        stage.truncate(name, start)


def accept_window(
    sampling: t.Sampling,
    start: int,
    logits: Any,
    window: list[int],
    before: Sequence[int] = (),
) -> list[int]:
    """A final stage's verdict on a verify window: the committed tokens (the accepted drafts,
    then the target's own), each drawn like plain decoding's token at its position, its
    penalties reading ``before`` (the tokens before ``start``) and the window's tokens up to
    that position (the drafts are the tokens there while they are accepted)."""
    positions = iter(range(1, len(window) + 1))

    def sample(row: Any) -> int:
        i = next(positions)
        return sampler_at(sampling, start + i, [*before, *window[:i]]).sample(row)

    return accept_draft(logits, window[1:], sample)


def _vm_kib(field: str) -> int | None:
    """This process's ``VmRSS``/``VmHWM`` in KiB (Linux), for the memory figures."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


async def _next_within(reader: FrameReader, timeout_s: float) -> t.Frame | None:
    try:
        with trio.fail_after(timeout_s):
            return await reader.next()
    except trio.TooSlowError:
        raise t.TransportError(
            f"no frame for {timeout_s:g} s: the session is dropped", code="transport_timeout"
        ) from None


async def _drain(stream: MeshStream) -> None:
    """A return stream's other side sends nothing; wait for its end (a reset raises)."""
    while await stream.receive_some():
        pass


def hop_summary(hops: dict[str, HopStats]) -> dict[str, Any]:
    """Per-hop figures for the status document (milliseconds)."""

    def ms(values: Any) -> float | None:
        v = sorted(values)
        return round(1000 * v[len(v) // 2], 3) if v else None

    return {
        node[:16]: {
            "frames": h.frames,
            "bytes_sent": h.bytes_sent,
            "ack_rtt_ms_median": ms(h.rtts_s),
            "decode_ack_rtt_ms_median": ms(h.decode_rtts_s),
        }
        for node, h in hops.items()
    }
