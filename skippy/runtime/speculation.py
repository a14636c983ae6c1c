"""Speculative decoding, written once: draft, verify window, accept (pure, no stage calls).

Spec "Speculative Decoding". ``Speculation`` is one request's drafting: a drafter proposes up
to the verify window's k tokens; the target runs the pending token plus the k drafts as one
verify window and returns logits at every position of it; ``accept_draft`` samples position by
position while the drafts agree; the window learns from what was accepted. The one
generation loop (``skippy.runtime.token_loop``) drives this for the in-process chain and for a
split over the mesh (``mesh_node.serving.generator``, whose final stage calls
``accept_draft`` through ``mesh_node.serving.host.accept_window``).

A drafter is anything with the ``skippy.generation.proposers.Proposer`` interface, two calls:
``extend(tokens)`` is given every token the target commits, in order (the prompt first), and
``propose(limit)`` returns up to ``limit`` continuation tokens (``[]``: no draft, the step is a
plain decode). The target verifies every draft, so a drafter is never authoritative: a bad
one costs speed, never tokens. ``Speculation.for_plan`` picks the drafter a resolved plan
names: an N-gram proposer, or for ``native-mtp`` the caller's drafter over the final stage's
NextN head (``skippy.runtime.nextn.NextnProposer`` in one process; over the mesh, the draft
the final stage returns with each pass's tokens).

Exactness: each emitted token is the target's own choice at its position, drawn in the same
order and with the same sampler as plain decoding (one draw per emitted token), so greedy and
seeded sampling give the same tokens as without speculation *provided* the verify window's
logits equal one-position decoding's. Exact verify (one-position steps) gives that by
construction; a batched window (one multi-row graph) holds bit for bit on some models and only
to ~1e-7..1e-3 on others (docs/generation.md "Speculative decoding"), so a near-tie can flip a
greedy token where plain decoding would not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from skippy.generation import SpeculativePlan
from skippy.generation.proposers import Proposer, VerifyWindow, make_proposer

# Plan modes the stage runtime executes (native-mtp with a drafter from the final stage's
# NextN head: ``skippy.runtime.nextn``); the others keep the logged fallback to plain decoding
# (spec "Generation Defaults").
NATIVE_MTP: Final = "native-mtp"
EXECUTABLE_MODES: Final = frozenset({"ngram-cache", "ngram-suffix", NATIVE_MTP})
VERIFY_EXACT: Final = "exact"
VERIFY_BATCHED: Final = "batched"
VERIFY_MODES: Final = (VERIFY_EXACT, VERIFY_BATCHED)


@dataclass
class Speculation:
    """One request's drafting: its drafter and the verify window that sizes the drafts."""

    drafter: Proposer
    window: VerifyWindow

    @classmethod
    def for_plan(
        cls,
        plan: SpeculativePlan | None,
        history: Iterable[int],
        head: Proposer | None = None,
    ) -> Speculation | None:
        """The drafting ``plan`` names, its drafter fed ``history`` (the committed tokens);
        None when the stage runtime does not execute the plan. A ``native-mtp`` plan drafts
        with ``head``, the caller's drafter over the final stage's NextN head (None: no head
        there, so no drafting)."""
        if plan is None or plan.mode not in EXECUTABLE_MODES or plan.window is None:
            return None
        if plan.mode == NATIVE_MTP:
            if head is None:
                return None
            head.extend(list(history))
            return cls(head, VerifyWindow(plan.window))
        if plan.ngram is None:
            return None
        return cls(make_proposer(plan.ngram, history), VerifyWindow(plan.window))

    def draft(self, limit: int) -> list[int]:
        """Up to ``limit`` drafts (and the window's size): ``[]`` is a plain decode step."""
        k = min(self.window.size, limit)
        return self.drafter.propose(k) if k > 0 else []


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


def answers(draft: Sequence[int], batch: Sequence[int]) -> bool:
    """Whether ``batch`` can be what a pass that carried ``draft`` committed (what
    ``accept_draft`` can return): an agreeing prefix of the drafts plus one token of the
    target's (a plain decode: exactly one token). A final stage's answer is checked with it."""
    n = len(batch)
    return 1 <= n <= len(draft) + 1 and list(batch[:-1]) == list(draft[: n - 1])
