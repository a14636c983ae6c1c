"""The one generation loop's decisions (``skippy.runtime.token_loop.TokenLoop``), pure: what is
committed, why a request stops, where the pending token goes, and how much the next pass may
draft. The chain and the mesh drive these same calls; their identity with plain decoding is
tested over real stages in test_speculation.py and tests/mesh_node/serving/."""

from __future__ import annotations

from collections.abc import Iterable

from skippy.generation.proposers import VerifyWindow
from skippy.generation.schema import WindowPolicy
from skippy.runtime.speculation import Speculation
from skippy.runtime.token_loop import TokenLoop, end_of_generation

EOG = 99


class Script:
    """A drafter that proposes from a fixed continuation and records what it was given."""

    def __init__(self, continuation: list[int]) -> None:
        self.continuation = continuation
        self.seen: list[int] = []
        self.limits: list[int] = []

    def extend(self, tokens: Iterable[int]) -> None:
        self.seen.extend(tokens)

    def propose(self, limit: int) -> list[int]:
        self.limits.append(limit)
        return self.continuation[:limit]


def loop(max_tokens: int = 8, n_ctx: int = 64, **kw: object) -> TokenLoop:
    return TokenLoop([1, 2, 3], max_tokens=max_tokens, n_ctx=n_ctx, is_eog=lambda t: t == EOG, **kw)  # type: ignore[arg-type]


def window(size: int, mode: str = "fixed") -> VerifyWindow:
    return VerifyWindow(WindowPolicy(mode=mode, initial_window=size, min_window=1, max_window=8))


def test_an_end_of_generation_token_stops_uncommitted() -> None:
    lp = loop()
    seen: list[int] = []
    assert lp.commit([5, EOG, 6], seen.append)
    assert lp.tokens == [5] and seen == [5] and lp.stop_reason == "eos"


def test_the_budget_stops_after_its_last_token_mid_batch() -> None:
    lp = loop(max_tokens=2)
    assert not lp.commit([5])
    assert lp.commit([6, 7])  # a verify pass may give more than the budget holds
    assert lp.tokens == [5, 6] and lp.stop_reason == "length"


def test_the_pending_token_goes_after_the_prompt_and_the_committed_tokens() -> None:
    lp = loop()
    lp.commit([5])
    assert lp.position == 3  # the first generated token is fed at the prompt's end
    lp.commit([6, 7])
    assert lp.position == 5


def test_a_full_context_stops_before_the_next_pass() -> None:
    lp = loop(n_ctx=5)
    lp.commit([5, 6])
    assert lp.next_pass() == [] and lp.stop_reason is None  # position 4 < 5: one more decode
    lp.commit([7])
    assert lp.next_pass() is None and lp.stop_reason == "context"


def test_plain_decoding_drafts_nothing() -> None:
    lp = loop()
    lp.commit([5])
    assert lp.next_pass() == []


def test_a_draft_never_passes_the_window_budget_context_or_frame() -> None:
    drafter = Script([10, 11, 12, 13, 14, 15, 16, 17])
    lp = loop(max_tokens=7, n_ctx=64, speculation=Speculation(drafter, window(5)))
    lp.commit([5])
    assert lp.next_pass() == [10, 11, 12, 13, 14]  # the window: 5
    lp.commit([6, 7])
    assert lp.next_pass() == [10, 11, 12]  # the budget: 7 - 3 committed - the target's own
    assert lp.next_pass(frame_cap=3) == [10, 11]  # one frame carries the pending token too
    tight = loop(max_tokens=50, n_ctx=7, speculation=Speculation(Script([10] * 8), window(5)))
    tight.commit([5])  # the pending token at 3 of 0..6: drafts at 4, 5 and 6
    assert tight.next_pass() == [10, 10, 10]
    assert drafter.seen == [5, 6, 7]  # every committed token, in order


def test_passes_are_counted_and_the_window_learns_from_them() -> None:
    spec = Speculation(Script([10, 11, 12, 13]), window(2, mode="adaptive"))
    lp = loop(speculation=spec)
    lp.passed(0, 1)  # a plain decode step
    lp.passed(2, 3)  # both drafts accepted, then the target's own: the window grows
    lp.passed(3, 1)  # none accepted
    assert (lp.decode_steps, lp.verify_passes, lp.proposed, lp.accepted, lp.widest) == (
        1,
        2,
        5,
        2,
        3,
    )
    assert spec.window.size == 1  # adaptive: down to min_window after a draft with nothing kept


def test_without_a_tokenizer_nothing_ends_generation() -> None:
    assert not end_of_generation(None)(0)
