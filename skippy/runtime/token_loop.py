"""The one generation loop: a prompt's token ids in, generated tokens out.

Every path that turns a prompt into tokens makes the same decisions, here: ``TokenLoop`` holds
one request's committed tokens and decides when it stops (``StopReason``: the token budget,
an end-of-generation token, the context; a stop string is its caller's word), where the pending
token goes, and what the next pass carries: the pending token alone (a plain decode), or the
pending token and the drafts of ``skippy.runtime.speculation`` (a verify window). Plain
decoding is the loop with no drafter.

Who drives it:

- ``generate`` here, over stages in one process (``StageChain.generate``, ``run``): prefill,
  then one pass per step (``StageChain.decode`` or ``StageChain.verify``), plain or speculative;
- ``mesh_node.serving.generator``: a split over the mesh, the same decisions for each frame
  it sends, with failover (one loop per request, a fresh drafter per attempt);
- ``skippy.runtime.llama_cpp``: llama.cpp's own sampling loop, whose tokens it commits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from skippy.errors import UsageError
from skippy.generation import SpeculativePlan
from skippy.runtime.boundary import Generation, StopReason
from skippy.runtime.nextn import NextnProposer, native_mtp_unavailable
from skippy.runtime.sampling import Sampler, SamplingParams
from skippy.runtime.speculation import (
    EXECUTABLE_MODES,
    NATIVE_MTP,
    VERIFY_BATCHED,
    VERIFY_EXACT,
    Speculation,
    SpeculativeStats,
    accept_draft,
)

if TYPE_CHECKING:
    from skippy.runtime.stage import StageOutput

DEFAULT_SESSION = "run"


def check_generation_request(tokens: Sequence[int], max_tokens: int, n_ctx: int) -> list[int]:
    """The prompt as ints, refused when empty or too long for the context."""
    ids = [int(t) for t in tokens]
    if not ids:
        raise UsageError("the prompt has no tokens", code="empty_prompt")
    if max_tokens < 1:
        raise UsageError("max_tokens must be at least 1", code="invalid_max_tokens")
    if len(ids) >= n_ctx:
        raise UsageError(
            f"the prompt has {len(ids)} tokens; the context holds {n_ctx}",
            code="prompt_too_long",
            remediation="shorten the prompt or raise the context with --n-ctx",
        )
    return ids


class EndTokens(Protocol):
    """What the loop needs of a tokenizer (``skippy.runtime.tokenizer.LlamaTokenizer``)."""

    @property
    def n_vocab(self) -> int: ...

    def is_eog(self, token: int) -> bool: ...


def end_of_generation(tokenizer: EndTokens | None) -> Callable[[int], bool]:
    """Whether a sampled token ends generation (the model's end-of-generation tokens)."""
    if tokenizer is None:
        return lambda token: False
    return lambda token: 0 <= token < tokenizer.n_vocab and tokenizer.is_eog(token)


class TokenLoop:
    """One request's generation decisions: commit, stop, the next pass (module doc)."""

    def __init__(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        n_ctx: int,
        is_eog: Callable[[int], bool],
        speculation: Speculation | None = None,
    ) -> None:
        self.prompt = tuple(prompt)
        self.max_tokens = max_tokens
        self.n_ctx = n_ctx
        self.is_eog = is_eog
        self.speculation = speculation  # None: plain decoding
        self.tokens: list[int] = []  # committed generated tokens
        self.stop_reason: StopReason | None = None
        self.proposed = self.accepted = self.verify_passes = self.decode_steps = self.widest = 0

    @property
    def position(self) -> int:
        """Where the pending token (the newest committed one) goes in every stage's KV."""
        return len(self.prompt) + len(self.tokens) - 1

    def take(self, token: int) -> bool:
        """Commit one token of the target's; False (stop ``eos``) when it ends generation
        instead, uncommitted."""
        if self.is_eog(token):
            self.stop_reason = "eos"
            return False
        self.tokens.append(token)
        if self.speculation is not None:
            self.speculation.drafter.extend((token,))
        return True

    def full(self) -> bool:
        """Whether the token budget is spent (stop ``length``)."""
        if len(self.tokens) >= self.max_tokens:
            self.stop_reason = "length"
            return True
        return False

    def stop(self, reason: StopReason) -> None:
        self.stop_reason = reason

    def commit(self, batch: Iterable[int], on_token: Callable[[int], Any] | None = None) -> bool:
        """Commit a pass's tokens in order (``on_token`` sees each committed one); True when
        the request stops. A caller whose check between tokens awaits (a stop string) makes
        the same three calls itself: ``take``, its check, ``full``."""
        for token in batch:
            if not self.take(token):
                return True
            if on_token is not None:
                on_token(token)
            if self.full():
                return True
        return False

    def next_pass(self, frame_cap: int | None = None) -> list[int] | None:
        """The drafts the next pass carries after the pending token (``[]``: a plain decode),
        or None when the context is full (stop ``context``). ``frame_cap``: the most tokens
        one pass may carry."""
        if self.position >= self.n_ctx:
            self.stop_reason = "context"
            return None
        if self.speculation is None:
            return []
        # never draft past the token budget, the context or a frame: every draft could be
        # accepted
        limit = min(self.max_tokens - len(self.tokens) - 1, self.n_ctx - self.position - 1)
        if frame_cap is not None:
            limit = min(limit, frame_cap - 1)
        return self.speculation.draft(limit)

    def passed(self, drafted: int, committed: int) -> None:
        """Account for one pass after the first: ``drafted`` drafts carried, ``committed``
        tokens it gave (the accepted drafts and the target's own); the window learns."""
        if not drafted:
            self.decode_steps += 1
            return
        accepted = committed - 1
        self.proposed += drafted
        self.accepted += accepted
        self.verify_passes += 1
        self.widest = max(self.widest, drafted)
        if self.speculation is not None:
            self.speculation.window.update(drafted, accepted)

    def stats(self, plan: SpeculativePlan, *, verify: str = VERIFY_EXACT) -> SpeculativeStats:
        return SpeculativeStats(
            strategy=plan.strategy_id,
            mode=plan.mode,
            verify=verify,
            proposed_tokens=self.proposed,
            accepted_tokens=self.accepted,
            verify_passes=self.verify_passes,
            decode_steps=self.decode_steps,
            max_window=self.widest,
        )


class Target(Protocol):
    """The stages ``generate`` drives (``skippy.runtime.chain.StageChain``)."""

    n_ctx: int

    @property
    def tokenizer(self) -> EndTokens | None: ...

    def prefill(
        self, session: str, tokens: Sequence[int], *, sampler: Sampler | None = None
    ) -> StageOutput: ...

    def decode(
        self, session: str, position: int, token: int, *, sampler: Sampler | None = None
    ) -> StageOutput: ...

    def verify(
        self, session: str, start: int, tokens: Sequence[int], *, exact: bool
    ) -> StageOutput: ...

    def truncate(self, session: str, length: int) -> None: ...

    def free(self, session: str) -> None: ...

    def detokenize(self, tokens: Sequence[int]) -> str: ...


def _sampled(out: StageOutput) -> int:
    if out.token is None:
        raise UsageError("the last stage sampled no token", code="stage_mismatch")
    return out.token


def generate(
    target: Target,
    tokens: Sequence[int],
    *,
    max_tokens: int,
    sampling: SamplingParams | None = None,
    plan: SpeculativePlan | None = None,
    exact: bool = True,
    session: str = DEFAULT_SESSION,
) -> tuple[Generation, SpeculativeStats | None]:
    """A completion from a fresh session: prefill, then one pass per step until a stop.
    Speculative with ``plan`` when the stage runtime executes it (its stats returned), plain
    otherwise (None). ``exact`` verifies with one-position steps per stage, whose logits are
    plain decoding's bit for bit; without it a window is one multi-row graph per stage
    (``skippy.runtime.speculation``: cheaper, and the same tokens unless a near-tie flips)."""
    ids = check_generation_request(tokens, max_tokens, target.n_ctx)
    speculation = Speculation.for_plan(plan, ids, _nextn_drafter(target, plan, session))
    gen, loop = _run(target, ids, max_tokens, sampling, speculation, exact, session)
    if plan is None or speculation is None:
        return gen, None
    return gen, loop.stats(plan, verify=VERIFY_EXACT if exact else VERIFY_BATCHED)


def generate_speculative(
    target: Target,
    tokens: Sequence[int],
    *,
    max_tokens: int,
    plan: SpeculativePlan,
    sampling: SamplingParams | None = None,
    session: str = DEFAULT_SESSION,
    exact: bool = True,
) -> tuple[Generation, SpeculativeStats]:
    """``generate`` with ``plan``'s drafter and verify window; a plan the stage runtime does
    not execute is refused."""
    final = _final_stage(target)
    missing = None
    if plan.mode == NATIVE_MTP:
        missing = "no stages" if final is None else native_mtp_unavailable(final)
    if missing is not None:
        raise UsageError(
            f"native-mtp cannot run here: {missing}",
            code="native_mtp_unavailable",
            remediation="decode with speculation disabled (the same tokens), or use a package "
            "whose final stage holds its NextN layer",
        )
    if plan.mode not in EXECUTABLE_MODES or plan.window is None:
        raise UsageError(
            f"speculative mode {plan.mode!r} is not executable by the stage runtime "
            f"(it runs {', '.join(sorted(EXECUTABLE_MODES))})",
            code="speculation_unsupported",
        )
    ids = check_generation_request(tokens, max_tokens, target.n_ctx)
    speculation = Speculation.for_plan(plan, ids, _nextn_drafter(target, plan, session))
    gen, loop = _run(target, ids, max_tokens, sampling, speculation, exact, session)
    return gen, loop.stats(plan, verify=VERIFY_EXACT if exact else VERIFY_BATCHED)


def _final_stage(target: Target) -> Any:
    stages = getattr(target, "stages", ())
    return stages[-1] if stages else None


def _nextn_drafter(
    target: Target, plan: SpeculativePlan | None, session: str
) -> NextnProposer | None:
    """A native-mtp plan's drafter: the target's final stage's NextN head (None where it
    has none: the plan then decodes plainly)."""
    final = _final_stage(target)
    if plan is None or plan.mode != NATIVE_MTP or final is None:
        return None
    return NextnProposer(final, session) if native_mtp_unavailable(final) is None else None


def _run(
    target: Target,
    ids: list[int],
    max_tokens: int,
    sampling: SamplingParams | None,
    speculation: Speculation | None,
    exact: bool,
    session: str,
) -> tuple[Generation, TokenLoop]:
    sampler = Sampler(sampling, history=ids)
    loop = TokenLoop(
        ids,
        max_tokens=max_tokens,
        n_ctx=target.n_ctx,
        is_eog=end_of_generation(target.tokenizer),
        speculation=speculation,
    )
    target.free(session)
    t0 = time.perf_counter()
    try:
        emitted = [_sampled(target.prefill(session, ids, sampler=sampler))]
        t_first = time.perf_counter()
        while not loop.commit(emitted, sampler.accept):
            draft = loop.next_pass()
            if draft is None:
                break
            pending, position = loop.tokens[-1], loop.position
            if not draft:
                emitted = [_sampled(target.decode(session, position, pending, sampler=sampler))]
                loop.passed(0, 1)
                continue
            result = target.verify(session, position, [pending, *draft], exact=exact)
            if result.logits is None:
                raise UsageError("the last stage returned no logits", code="stage_mismatch")
            window_tokens: list[int] = []  # a row's penalties see the window's tokens before it

            def sample(row: Any, before: list[int] = window_tokens) -> int:
                token = sampler.sample(row, after=before)
                before.append(token)
                return token

            emitted = accept_draft(result.logits, draft, sample)
            # every stage's KV forgets the rejected drafts: no recompute
            target.truncate(session, position + len(emitted))
            loop.passed(len(draft), len(emitted))
    finally:
        target.free(session)
    t_end = time.perf_counter()
    gen = Generation(
        prompt_tokens=tuple(ids),
        tokens=tuple(loop.tokens),
        text=target.detokenize(loop.tokens) if target.tokenizer is not None else "",
        stop_reason=loop.stop_reason or "length",  # set by the stop that ended the loop
        prefill_s=t_first - t0,
        decode_s=t_end - t_first,
    )
    return gen, loop
