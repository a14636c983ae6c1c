"""Speculative decoding over a stage chain: draft, verify in one pass, commit the accepted prefix.

Spec "Speculative Decoding". Per step the proposer drafts up to the verify window's k tokens:
the request-local N-gram proposer (``skippy.generation.proposers``), or for ``native-mtp``
the final stage's NextN draft head (``skippy.runtime.nextn``: one token from the trunk's last
hidden state and the pending token; the package's window is fixed at 1). The chain runs
the pending token plus the k drafts as one chunk through every stage (one VerifyWindow) and
returns logits at every position of it; the final stage's sampler picks the target token at
each position in order and accepts drafts while they equal it (``accept_draft``); every
stage's KV is truncated past the last accepted position, so the rejected tail costs no
recompute. A step with no draft is an ordinary one-token decode.

Exactness: each emitted token is the target's own choice at its position, drawn in the same
order and with the same sampler as plain decoding (one draw per emitted token), so greedy and
seeded sampling give the same tokens as without speculation *provided* the k+1-row graph
gives the same logits as k+1 one-row graphs. With the ggml engine that holds bit for bit on
some models and only to ~1e-7..1e-3 on others (different matmul shapes sum in a different
order; docs/generation.md "Speculative decoding" has the measurements), so a near-tie can
flip a greedy token where plain decoding would not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt

from skippy.errors import UsageError
from skippy.generation import SpeculativePlan
from skippy.generation.proposers import Proposer, VerifyWindow, make_proposer
from skippy.runtime.boundary import Generation, StopReason
from skippy.runtime.chain import DEFAULT_SESSION, StageChain, check_generation_request
from skippy.runtime.sampling import Sampler, SamplingParams
from skippy.runtime.stage import NATIVE_MTP_MODE, SPECULATIVE_MODES, Stage

# Plan modes this runtime executes (native-mtp where the final stage runs a NextN head:
# ``native_mtp_unavailable``); the others keep the logged fallback to plain decoding (spec
# "Generation Defaults").
EXECUTABLE_MODES: Final = SPECULATIVE_MODES | {NATIVE_MTP_MODE}
VERIFY_EXACT: Final = "exact"
VERIFY_BATCHED: Final = "batched"
VERIFY_MODES: Final = (VERIFY_EXACT, VERIFY_BATCHED)


@dataclass(frozen=True)
class SpeculativeStats:
    """What one speculative generation did: drafts proposed and accepted, verify passes."""

    strategy: str | None
    mode: str
    verify: str = VERIFY_EXACT  # "exact" (one-position steps) or "batched" (one graph)
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verify_passes: int = 0
    decode_steps: int = 0  # one-token passes (no draft)
    max_window: int = 0  # the widest draft verified

    @property
    def acceptance(self) -> float | None:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "verify": self.verify,
            "proposed_tokens": self.proposed_tokens,
            "accepted_tokens": self.accepted_tokens,
            "verify_passes": self.verify_passes,
            "decode_steps": self.decode_steps,
            "max_window_used": self.max_window,
            "acceptance": self.acceptance,
        }

    def summary(self) -> str:
        rate = f" ({self.acceptance:.0%})" if self.acceptance is not None else ""
        return (
            f"speculative {self.strategy} ({self.verify} verify): {self.accepted_tokens}/"
            f"{self.proposed_tokens} drafted tokens accepted{rate} in {self.verify_passes} "
            "verify passes"
        )


def accept_draft(
    rows: npt.NDArray[np.float32], draft: Sequence[int], sample: Callable[[Any], int]
) -> list[int]:
    """The tokens a verify pass commits: the target's token at each position in order, while
    the draft agrees. ``rows[i]`` are the logits after the pending token and ``draft[:i]``
    (``len(rows) == len(draft) + 1``). Returns the accepted drafts plus one token of the
    target's own (the correction at the first mismatch, or the bonus after a full match);
    rows after a mismatch are never sampled, so a seeded sampler draws exactly once per token.
    """
    if len(rows) != len(draft) + 1:
        raise ValueError(f"{len(rows)} logit rows for a draft of {len(draft)}")
    out: list[int] = []
    for i, row in enumerate(rows):
        token = sample(row)
        out.append(token)
        if i == len(draft) or token != draft[i]:
            break
    return out


def native_mtp_unavailable(stage: Stage) -> str | None:
    """Why ``stage`` (a chain's final stage) cannot draft for ``native-mtp``, or None when it
    runs a NextN head."""
    if getattr(stage, "drafts", False):
        return None
    reason = getattr(stage, "nextn_unavailable", None)
    return reason or f"the {stage.descriptor.engine} engine runs no NextN draft head"


class NextnProposer:
    """``native-mtp``'s proposer: the final stage's NextN head drafts one token, greedily
    (the head's argmax, as llama.cpp's MTP drafter takes its top token), after the tokens
    so far from position ``start`` (the prompt's, and those generated: the head pairs each
    with the trunk's hidden state before it)."""

    def __init__(
        self, stage: Any, session: str, start: int = 0, tokens: Sequence[int] = ()
    ) -> None:
        self.stage = stage
        self.session = session
        self.start = start  # the position of tokens[0]
        self.tokens: list[int] = [int(t) for t in tokens]

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def put(self, start: int, tokens: Sequence[int]) -> None:
        """``tokens`` at positions ``start..``, replacing any from there on (a rewind into
        the last verify window); a gap, or a start before the first, starts the record
        there."""
        if not self.tokens or not self.start <= start <= self.start + len(self.tokens):
            self.start, self.tokens = start, []
        del self.tokens[start - self.start :]
        self.extend(tokens)

    def propose(self, k: int) -> list[int]:
        if k < 1 or not self.tokens:
            return []
        logits = self.stage.draft(self.session, self.start, self.tokens)
        return [int(np.argmax(logits))]


def generate_speculative(
    chain: StageChain,
    tokens: Sequence[int],
    *,
    max_tokens: int,
    plan: SpeculativePlan,
    sampling: SamplingParams | None = None,
    session: str = DEFAULT_SESSION,
    exact: bool = True,
) -> tuple[Generation, SpeculativeStats]:
    """``StageChain.generate`` with ``plan``'s N-gram proposer and verify window.

    ``exact`` (the default) verifies with one-position steps per stage, whose logits are
    plain decoding's bit for bit, so the tokens are identical by construction; without it a
    window is one multi-row graph per stage (cheaper compute, and the same tokens unless a
    near-tie flips: module doc)."""
    mtp = plan.mode == NATIVE_MTP_MODE
    if plan.mode not in EXECUTABLE_MODES or plan.window is None or (plan.ngram is None and not mtp):
        raise UsageError(
            f"speculative mode {plan.mode!r} is not executable by the stage runtime",
            code="speculation_unsupported",
        )
    missing = native_mtp_unavailable(chain.stages[-1]) if mtp else None
    if missing is not None:
        raise UsageError(
            f"native-mtp cannot run here: {missing}",
            code="native_mtp_unavailable",
            remediation="serve with --speculative disabled (the same tokens), or use a package "
            "whose final stage holds its NextN layer",
        )
    ids = check_generation_request(tokens, max_tokens, chain.n_ctx)
    sampler = Sampler(sampling, history=ids)
    proposer: Proposer | NextnProposer = (
        NextnProposer(chain.stages[-1], session, 0, ids)
        if mtp
        else make_proposer(_ngram(plan), ids)
    )
    window = VerifyWindow(plan.window)
    tok = chain.tokenizer
    out: list[int] = []
    stop: StopReason = "length"
    proposed = accepted = passes = steps = widest = 0
    chain.free(session)
    if mtp:  # before the prompt: the head's cache covers it
        cast(Any, chain.stages[-1]).expect_drafts(session)
    t0 = time.perf_counter()
    try:
        first = chain.prefill(session, ids, sampler=sampler)
        t_first = time.perf_counter()
        position = len(ids)  # positions in every stage's KV; the pending token goes here
        emitted = [first.token]
        while True:
            done = False
            for token in emitted:
                if token is None:
                    raise UsageError("the last stage sampled no token", code="stage_mismatch")
                if tok is not None and 0 <= token < tok.n_vocab and tok.is_eog(token):
                    stop, done = "eos", True
                    break
                out.append(token)
                sampler.accept(token)
                proposer.extend((token,))
                if len(out) >= max_tokens:
                    done = True
                    break
            if done:
                break
            if position >= chain.n_ctx:
                stop = "context"
                break
            pending = out[-1]
            # never draft past the token budget or the context: every draft could be accepted
            k = min(window.size, max_tokens - len(out) - 1, chain.n_ctx - position - 1)
            draft = proposer.propose(k) if k > 0 else []
            if not draft:
                emitted = [chain.decode(session, position, pending, sampler=sampler).token]
                position, steps = position + 1, steps + 1
                continue
            result = chain.verify(session, position, [pending, *draft], exact=exact)
            if result.logits is None:
                raise UsageError("the last stage returned no logits", code="stage_mismatch")
            window_tokens: list[int] = []  # a row's penalties see the window's tokens before it

            def sample(row: Any, before: list[int] = window_tokens) -> int:
                token = sampler.sample(row, after=before)
                before.append(token)
                return token

            emitted = list(accept_draft(result.logits, draft, sample))
            n_ok = len(emitted) - 1
            position += n_ok + 1
            chain.truncate(session, position)
            proposed, accepted, passes = proposed + len(draft), accepted + n_ok, passes + 1
            widest = max(widest, len(draft))
            window.update(len(draft), n_ok)
    finally:
        chain.free(session)
    t_end = time.perf_counter()
    gen = Generation(
        prompt_tokens=tuple(ids),
        tokens=tuple(out),
        text=chain.detokenize(out) if tok is not None else "",
        stop_reason=stop,
        prefill_s=t_first - t0,
        decode_s=t_end - t_first,
    )
    stats = SpeculativeStats(
        strategy=plan.strategy_id,
        mode=plan.mode,
        verify=VERIFY_EXACT if exact else VERIFY_BATCHED,
        proposed_tokens=proposed,
        accepted_tokens=accepted,
        verify_passes=passes,
        decode_steps=steps,
        max_window=widest,
    )
    return gen, stats


def _ngram(plan: SpeculativePlan) -> Any:
    if plan.ngram is None:
        raise UsageError(f"{plan.mode} plan has no N-gram proposer", code="speculation_unsupported")
    return plan.ngram
