"""Generation over a route, with failover (exact replay).

``Generator.generate`` runs one request: a session through every stage of the current route.
Stage 0 (this node) embeds the prompt and runs its layers chunk by chunk; each chunk crosses to
stage 1 while stage 0 computes the next one (at most ``max_inflight_frames`` unacknowledged);
the final stage samples and sends the token id straight back here on a return stream; then
one-token decode frames until a stop.

When the route breaks under a request (a node or link lost, a reset, a token timeout), the
generator asks its ``RouteSource`` for the next route (the route manager replaces the lost
stage, or re-admits the node when it returns) and **replays** the request's committed tokens
through it with exactly the calls the lost route made (``skippy.serving.replay.schedule``:
the prompt in the same chunks, then each generated token as its own one-token decode step),
then continues. Every stage of the new route recomputes from a fresh session, surviving
stages included: they held the lost session's KV, but a session is tied to its chain of
streams, which the loss broke; a fresh session costs one prompt's prefill plus one decode per
generated token and is exact by construction (chosen over resuming a surviving stage's KV,
which would need a resume protocol and a cut point every stage agrees on).

The route source is a protocol so failover can be tested on its own (tests feed it routes).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import numpy as np
import trio

from mesh_node.errors import MeshError, StreamReset, first_exception, skippy_error_in
from mesh_node.link import MeshStream
from mesh_node.node import MeshNode
from mesh_node.peers import InboundStream
from mesh_node.serving.host import (
    LoadedStage,
    SessionDrafter,
    StageHost,
    drop_rejected,
    sampler_at,
)
from mesh_node.serving.links import ChainSender, FrameReader, HopStats
from mesh_node.settings import ServingSettings
from protocol import constants as pc
from skippy.errors import SkippyError, UsageError
from skippy.generation import SpeculativePlan
from skippy.runtime.boundary import StopReason
from skippy.runtime.speculation import EXECUTABLE_MODES, NATIVE_MTP, Speculation, answers
from skippy.runtime.token_loop import TokenLoop, check_generation_request, end_of_generation
from skippy.runtime.tokenizer import LlamaTokenizer
from skippy.serving.replay import Phase, Step, schedule, tokens_before
from skippy.stage import stage_frames as t

log = logging.getLogger("mesh_node.serving.generator")
MAX_FAILOVERS: Final = 3  # per request
Emit = Callable[[int], Awaitable[bool]]  # a new token -> True to stop (a stop string matched)
# What the final stage returns per pass: the sampled tokens, and its NextN draft after them
# (native-mtp) or None
Returned = tuple[list[int], int | None]


class ServingFault(MeshError):
    """A server-side fault of the serving core (HTTP 5xx): never the client's doing. Client
    errors are ``UsageError``s (HTTP 4xx); the class tells them apart, the code says which."""

    code = "serving_fault"


class GenerationFailed(ServingFault):
    """A request failed mid-way and could not be continued (HTTP 503)."""

    code = "generation_failed"


class BadGenerationRequest(UsageError):
    """The request itself cannot be run (an empty prompt, longer than the context): HTTP 400."""

    code = "bad_generation_request"


@dataclass(frozen=True)
class Route:
    topology_id: str
    node_ids: tuple[str, ...]  # stage order; node_ids[0] is this node
    stage0: LoadedStage

    @property
    def single(self) -> bool:
        return len(self.node_ids) == 1


class RouteSource(Protocol):
    """Where the generator gets its routes (``mesh_node.serving.routes.RouteManager``)."""

    @property
    def tokenizer(self) -> LlamaTokenizer | None: ...

    def check_ready(self) -> Route:
        """The current route, or ``SplitNotReady``."""
        ...

    async def await_new_route(self, broken: Route, cause: BaseException) -> Route:
        """The route after ``broken`` failed with ``cause``, or ``GenerationFailed``."""
        ...


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
    # speculative decoding: drafted tokens proposed / accepted, verify windows
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verify_passes: int = 0


@dataclass
class _Session:
    session_id: int
    request_id: int
    final_node: str  # the final stage of this session's route: the only one that may return
    tokens: trio.MemorySendChannel[Returned | BaseException]  # one item per TOKENS frame


class _RouteBroken(Exception):
    """Internal: the route failed under a request (link loss, reset, timeout)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Generator:
    """Runs requests over the routes a ``RouteSource`` gives (stage 0 here)."""

    def __init__(
        self,
        node: MeshNode,
        host: StageHost,
        settings: ServingSettings,
        routes: RouteSource,
        *,
        speculative: SpeculativePlan | None = None,
    ) -> None:
        self.node = node
        self.host = host
        self.settings = settings
        self.routes = routes
        # an N-gram plan to execute; other plans decode plainly
        self.speculative = (
            speculative
            if speculative is not None and speculative.mode in EXECUTABLE_MODES
            else None
        )
        self.hops = host.hops  # per downstream node: stage 0's hop is this node's
        self._sessions: dict[int, _Session] = {}
        host.return_handler = self.on_return

    def chunk(self, route: Route) -> int:
        """Prompt tokens per prefill call: the same on every attempt (exact replay)."""
        per_frame = self.host.limits.tokens_per_frame(route.stage0.facts.width)
        return max(1, min(self.settings.prefill_chunk, per_frame))

    async def generate(
        self,
        prompt: list[int],
        params: GenerationParams,
        emit: Emit,
        *,
        routes: RouteSource | None = None,
    ) -> GenerationResult:
        """``routes``: this request's route source (a replica's lease), else the
        generator's own."""
        source = routes if routes is not None else self.routes
        route = source.check_ready()
        n_ctx = route.stage0.facts.n_ctx
        try:  # the one loop's request checks, as this request's client error
            check_generation_request(prompt, params.max_tokens, n_ctx)
        except UsageError as exc:
            raise BadGenerationRequest(exc.message, code=exc.code) from None
        # one loop per request, across its attempts: its tokens are what a replay recomputes
        loop = TokenLoop(
            prompt,
            max_tokens=params.max_tokens,
            n_ctx=n_ctx,
            is_eog=end_of_generation(self.routes.tokenizer),
        )
        # the result's tokens are the loop's list: what it commits, the result holds
        result = GenerationResult(len(prompt), loop.tokens, "length", 0.0, 0.0, 0.0)
        t0 = time.perf_counter()
        while True:
            try:
                await self._run(route, loop, emit, params.sampling, result, t0)
                result.stop_reason = loop.stop_reason or "length"
                result.proposed_tokens = loop.proposed
                result.accepted_tokens = loop.accepted
                result.verify_passes = loop.verify_passes
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
                route = await source.await_new_route(route, broken.cause)

    # --- one attempt on one route --------------------------------------------------------------
    async def _run(
        self,
        route: Route,
        loop: TokenLoop,
        emit: Emit,
        sampling: t.Sampling,
        result: GenerationResult,
        t0: float,
    ) -> None:
        loaded = route.stage0
        stage = loaded.stage
        session_id = secrets.randbits(63)
        request_id = secrets.randbits(63)
        name = t.session_name(session_id)
        prompt = list(loop.prompt)
        loop.n_ctx = loaded.facts.n_ctx  # this route's context
        send_tokens, recv_tokens = trio.open_memory_channel[Returned | BaseException](4)
        # each attempt drafts afresh, from the committed tokens
        plan = self.speculative if self._route_verifies(route) else None
        # native-mtp: the final stage's NextN head drafts and returns its draft after each
        # pass's tokens (on a one-stage route this stage is the final one)
        mtp = plan is not None and plan.mode == NATIVE_MTP
        head = ReturnedDraft() if mtp else None
        local_drafter = SessionDrafter.of_stage(stage, name) if mtp and route.single else None
        loop.speculation = Speculation.for_plan(plan, [*prompt, *loop.tokens], head)
        frame_cap = self.host.limits.tokens_per_frame(loaded.facts.width)
        self._check_controls(route, sampling)
        # the tokens the penalties read before a position (every attempt: the same)
        last_n = sampling.repeat_last_n if sampling.penalized else 0

        def before(position: int) -> list[int]:
            return tokens_before(prompt, loop.tokens, position, last_n)

        self._sessions[session_id] = _Session(
            session_id, request_id, route.node_ids[-1], send_tokens
        )
        self.host.hold(loaded)  # a grown split's new stage 0 does not close this one under us
        out: MeshStream | None = None
        sender: ChainSender | None = None
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
                                sampling=sampling,
                                topology_id=route.topology_id,
                                drafts=mtp,
                            )
                        )
                    except (MeshError, trio.TooSlowError) as exc:
                        raise _RouteBroken(exc) from None
                    nursery.start_soon(_watch_acks, sender)

                async def forward(step: Step) -> None:
                    x = np.asarray(step.tokens, dtype=np.int64)
                    sampler = (
                        sampler_at(sampling, step.end, before(step.end)) if step.sample else None
                    )
                    decode = step.phase == "decode"
                    verify = step.phase == "verify"
                    if local_drafter is not None:  # one stage: its head reads the tokens
                        local_drafter.put(step.start, step.tokens)

                    def run() -> Any:
                        drop_rejected(stage, name, step.start)
                        return stage.prefill(name, step.start, x, sampler=sampler)

                    try:  # decode steps and verify windows are batched with other sessions'
                        output: Any
                        if decode:  #
                            output = await self.host.decode(stage, name, step.start, x, sampler)
                        elif verify:  # a speculative window: exact one-position steps
                            output = await self.host.verify(
                                stage,
                                name,
                                sampling,
                                step.start,
                                x,
                                list(step.tokens),
                                before(step.start),
                            )
                        else:
                            output = await self.host.compute(run)
                    except SkippyError as exc:  # this node's own stage refused: ours, not theirs
                        raise GenerationFailed(
                            f"stage 0 refused the request: {exc.message}",
                            code="stage_failed",
                            actual=exc.code,
                        ) from None
                    if verify:
                        rows, committed = output
                        if sender is None:  # one stage: accepted here
                            if committed is not None:
                                draft = await self.host.draft(
                                    local_drafter,
                                    step.start + 1,
                                    committed,
                                    truncate=step.start + len(committed),
                                )
                                await send_tokens.send((committed, draft))
                            return
                        frame = t.encode_verify(
                            request_id,
                            session_id,
                            start=step.start,
                            activations=rows,
                            tokens=step.tokens,
                        )
                        try:
                            await sender.send_activations(frame, decode=True)
                        except MeshError as exc:
                            raise _RouteBroken(exc) from None
                        return
                    if sender is None:  # one stage: sampled here
                        if step.sample and output.token is not None:
                            sampled = [int(output.token)]
                            draft = await self.host.draft(local_drafter, step.end, sampled)
                            await send_tokens.send((sampled, draft))
                        return
                    frame = t.encode_activations(
                        request_id,
                        session_id,
                        phase=t.Phase.DECODE if decode else t.Phase.PREFILL,
                        start=step.start,
                        activations=output.activations,
                        flags=t.Flag.SAMPLE if step.sample else t.Flag.NONE,
                        # the final stage's penalties read them
                        tokens=step.tokens if last_n or mtp else None,
                    )
                    try:
                        await sender.send_activations(frame, decode=decode)
                    except MeshError as exc:
                        raise _RouteBroken(exc) from None

                tp = time.perf_counter()
                # The first attempt and every replay make the same calls (exact replay).
                for step in schedule(prompt, loop.tokens, self.chunk(route)):
                    await forward(step)
                first = True
                td = tp
                draft: list[int] = []  # the drafts of the pass in flight ([]: a decode)
                while True:
                    batch, head_draft = await self._next_tokens(recv_tokens)
                    if not first and not answers(draft, batch):
                        raise _RouteBroken(
                            t.TransportError(
                                f"the final stage returned {len(batch)} tokens for a window of "
                                f"{len(draft)} drafts that they do not continue",
                                code="transport_unexpected",
                            )
                        )
                    now = time.perf_counter()
                    if first:
                        if not loop.tokens:
                            result.ttft_s = now - t0
                        result.prefill_s += now - tp
                        td, first = now, False
                    else:
                        loop.passed(len(draft), len(batch))
                    if await _commit(loop, batch, emit):
                        break
                    if head is not None:  # the final stage's draft after these tokens
                        head.draft = head_draft
                    next_draft = loop.next_pass(frame_cap)
                    if next_draft is None:
                        break
                    draft = next_draft
                    token, position = loop.tokens[-1], loop.position
                    phase: Phase = "verify" if draft else "decode"
                    await forward(Step(phase, position, (token, *draft), True))
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
            await self.host.release(loaded)
            if out is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await out.aclose()

    def _check_controls(self, route: Route, sampling: t.Sampling) -> None:
        """Sampling controls beyond temperature, top-k, top-p and the seed need every other
        node of the route to read them (feature bit ``sampling-controls``): a node of an older
        version would refuse the session's frames, so the request is refused first, naming
        it."""
        if not sampling.controls:
            return
        bit = frozenset({pc.BIT_SAMPLING_CONTROLS})
        for node_id in route.node_ids[1:]:
            info = self.node.peer(node_id)
            if info is None or not info.has_features(pc.FEATURE_SKIPPY_STAGE, bit):
                raise BadGenerationRequest(
                    f"node {node_id[:12]} of this split does not implement min_p, typical_p, "
                    "penalties or logit_bias (an older version): upgrade it, or send the "
                    "request without them",
                    code="unsupported_parameter",
                )

    def _route_verifies(self, route: Route) -> bool:
        """Every other node of the route takes verify windows (feature bit), and for
        native-mtp passes the request for NextN drafts on to the final stage."""
        if self.speculative is None:
            return False
        bit = frozenset({pc.BIT_VERIFY_WINDOW})
        if self.speculative.mode == NATIVE_MTP:
            bit = frozenset({pc.BIT_VERIFY_WINDOW, pc.BIT_NEXTN_DRAFTS})
        for node_id in route.node_ids[1:]:
            info = self.node.peer(node_id)
            if info is None or not info.has_features(pc.FEATURE_SKIPPY_STAGE, bit):
                return False
        return True

    async def _next_tokens(
        self, tokens: trio.MemoryReceiveChannel[Returned | BaseException]
    ) -> Returned:
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

    # --- the return stream (final stage -> here) -------------------------------------------------
    async def on_return(self, inbound: InboundStream, reader: FrameReader, first: t.Frame) -> None:
        session = self._sessions.get(first.session_id)
        if session is None or session.request_id != first.request_id:
            raise t.TransportError(
                "a return stream for no session of this node", code="unknown_session"
            )
        if inbound.peer.node_id != session.final_node:
            raise t.TransportError("only the final stage returns tokens", code="not_final_stage")
        try:
            while (frame := await reader.next()) is not None:
                if frame.kind is not t.Kind.TOKENS or frame.session_id != session.session_id:
                    raise t.TransportError(
                        f"a {frame.kind.name} frame on a return stream", code="unknown_session"
                    )
                session.tokens.send_nowait(frame.sampled())
        except (MeshError, t.TransportError, trio.WouldBlock) as exc:
            with_error = (
                exc
                if not isinstance(exc, trio.WouldBlock)
                else t.TransportError(
                    "tokens arrived faster than they were asked for", code="transport_unexpected"
                )
            )
            with contextlib.suppress(
                trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError
            ):
                session.tokens.send_nowait(with_error)
            if isinstance(with_error, t.TransportError):
                inbound.stream.reset(with_error.code, with_error.message[:200])


async def _commit(loop: TokenLoop, batch: list[int], emit: Emit) -> bool:
    """Commit a pass's tokens in order, each emitted (a stop string ends it: stop ``stop``);
    True when the request stops (``TokenLoop.commit``, with an awaited check)."""
    for token in batch:
        if not loop.take(token):
            return True
        if await emit(token):
            loop.stop("stop")
            return True
        if loop.full():
            return True
    return False


async def _watch_acks(sender: ChainSender) -> None:
    try:
        await sender.read_acks()
    except (MeshError, t.TransportError) as exc:
        raise _RouteBroken(exc) from None


# Failures that mean "the route broke" (a node or link went away): wait for a replacement.
# Anything else (a stage refusing the session: context, bad activations...) fails the request.
ROUTE_CODES: Final = frozenset(
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


def route_level(cause: BaseException) -> bool:
    """Whether ``cause`` means the route broke (wait for the next) rather than a stage
    refusing the request (fail it)."""
    if isinstance(cause, TimeoutError | trio.TooSlowError):
        return True
    if isinstance(cause, StreamReset):
        return (cause.actual or cause.code) in ROUTE_CODES
    if isinstance(cause, SkippyError):
        return cause.code in ROUTE_CODES
    return False


class ReturnedDraft:
    """native-mtp's drafter at stage 0: the draft the final stage's NextN head returned after
    the last pass's tokens (``Proposer``'s two calls; the head itself sees the tokens)."""

    def __init__(self) -> None:
        self.draft: int | None = None

    def extend(self, tokens: Iterable[int]) -> None:
        """The final stage records the committed tokens itself."""

    def propose(self, limit: int) -> list[int]:
        draft, self.draft = self.draft, None
        return [draft] if draft is not None and limit > 0 else []
