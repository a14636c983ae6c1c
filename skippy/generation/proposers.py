"""Request-local N-gram proposers and the verify-window policy (spec "Speculative Decoding").

Pure and per request: a proposer sees only the tokens one request has committed (prompt plus
accepted output, fed through ``extend``), never another request's, and drafts continuation
tokens from them. No proposer is authoritative: the target verifies every draft and commits
only the accepted prefix (``skippy.runtime.speculation``).

- ``ngram-cache`` (llama.cpp's ngram cache, match window ``ngram_min..ngram_max <= 4``): for
  each n, counts of the token that followed each n-gram; a draft repeatedly looks up the
  last n tokens, longest n first, and appends the most frequent follower (ties: the most
  recently seen).
- ``ngram-suffix`` (``3 <= ngram_min <= ngram_max <= 64``): an exact-seed index maps each
  ``ngram_min``-gram to where it ended; a draft takes the earlier occurrence whose match with
  the current suffix extends furthest back (up to ``ngram_max``; ties: the most recent) and
  proposes the tokens that followed it.

Both return at most ``max_proposal_tokens`` tokens (and at most the caller's ``limit``).
``VerifyWindow`` sizes each draft: ``fixed`` keeps ``initial_window``; ``adaptive`` grows by
one after a fully accepted draft, halves (not below ``min_window``) after a partial one and
drops to ``min_window`` when nothing was accepted.

Back-off: on text that does not repeat, an N-gram match is a coincidence and its draft is
rejected; each rejected draft costs the verify pass its drafted positions (and, split, a
wider frame) for no token. ``make_proposer`` therefore wraps every proposer in
``BackoffProposer``: after a draft of which nothing was accepted it skips the next proposals
(1, 2, 4, ... up to ``MAX_BACKOFF_PROPOSALS`` after consecutive unhelpful drafts; any accepted
draft resets it), so such a workload decodes one token per pass with a few percent of waste
at most (spec: the layers "may bound ... cooldown", ``tail_backoff_proposals``). A skipped
or matchless proposal is ``[]``, and an empty draft is a plain decode step: no verify window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final, Protocol

from skippy.generation import vocab as v
from skippy.generation.schema import NgramSource, WindowPolicy

# An ngram-suffix draft compares the current suffix against at most this many earlier
# occurrences of its seed (the most recent ones): bounds a draft's cost on long, repetitive
# histories, where the most recent occurrences are also the likeliest to continue alike.
MAX_SUFFIX_CANDIDATES: Final = 64
# The longest back-off after consecutive unhelpful drafts, in skipped proposals (one plain
# decode step each): at most one wasted draft per 33 steps on text that never repeats, and
# a workload that turns repetitive again is drafted for within 32 tokens.
MAX_BACKOFF_PROPOSALS: Final = 32


class Proposer(Protocol):
    """What the speculative loop needs from a proposal source."""

    def extend(self, tokens: Iterable[int]) -> None:
        """Append target-committed tokens to the request's history."""
        ...

    def propose(self, limit: int) -> list[int]:
        """Up to ``limit`` (and the proposer's own cap) drafted continuation tokens."""
        ...


class NgramCacheProposer:
    """``ngram-cache``: follower counts per n-gram, n in ``ngram_min..ngram_max``."""

    def __init__(self, source: NgramSource) -> None:
        if source.type != v.NGRAM_CACHE:
            raise ValueError(f"NgramCacheProposer needs an ngram-cache source, got {source.type}")
        self.source = source
        self.history: list[int] = []
        # n -> n-gram -> follower -> (count, last position seen)
        self._followers: dict[int, dict[tuple[int, ...], dict[int, tuple[int, int]]]] = {
            n: {} for n in range(source.ngram_min, source.ngram_max + 1)
        }

    def extend(self, tokens: Iterable[int]) -> None:
        h = self.history
        for raw in tokens:
            token, end = int(raw), len(h)  # end: the follower's position
            for n, table in self._followers.items():
                if end >= n:
                    counts = table.setdefault(tuple(h[end - n : end]), {})
                    count, _ = counts.get(token, (0, 0))
                    counts[token] = (count + 1, end)
            h.append(token)

    def _next(self, context: Sequence[int]) -> int | None:
        for n in range(self.source.ngram_max, self.source.ngram_min - 1, -1):
            if len(context) < n:
                continue
            counts = self._followers[n].get(tuple(context[len(context) - n :]))
            if counts:
                return max(counts.items(), key=lambda kv: kv[1])[0]
        return None

    def propose(self, limit: int) -> list[int]:
        budget = min(limit, self.source.max_proposal_tokens)
        context = self.history[-self.source.ngram_max :] if self.history else []
        draft: list[int] = []
        while len(draft) < budget:
            token = self._next(context)
            if token is None:
                break
            draft.append(token)
            context = [*context, token][-self.source.ngram_max :]
        return draft


class NgramSuffixProposer:
    """``ngram-suffix``: the longest earlier match of the current suffix, via a seed index."""

    def __init__(self, source: NgramSource) -> None:
        if source.type != v.NGRAM_SUFFIX:
            raise ValueError(f"NgramSuffixProposer needs an ngram-suffix source, got {source.type}")
        self.source = source
        self.history: list[int] = []
        self._seeds: dict[tuple[int, ...], list[int]] = {}  # seed -> end positions (exclusive)

    def extend(self, tokens: Iterable[int]) -> None:
        h, m = self.history, self.source.ngram_min
        for token in tokens:
            h.append(int(token))
            if len(h) >= m:
                self._seeds.setdefault(tuple(h[-m:]), []).append(len(h))

    def _match(self) -> int | None:
        """End (exclusive) of the earlier occurrence matching the current suffix longest."""
        h, m, hi = self.history, self.source.ngram_min, self.source.ngram_max
        n = len(h)
        if n < m + 1:
            return None
        ends = self._seeds.get(tuple(h[n - m :]), [])
        best_end, best_len = None, 0
        for end in reversed(ends[-MAX_SUFFIX_CANDIDATES - 1 :]):
            if end >= n:  # the current suffix itself
                continue
            length = m
            while length < hi and end - length > 0 and h[end - length - 1] == h[n - length - 1]:
                length += 1
            if length > best_len:  # strictly longer: ties keep the more recent occurrence
                best_end, best_len = end, length
                if length == hi:
                    break
        return best_end

    def propose(self, limit: int) -> list[int]:
        budget = min(limit, self.source.max_proposal_tokens)
        end = self._match() if budget > 0 else None
        if end is None:
            return []
        return self.history[end : end + budget]


class DraftBackoff:
    """Pure back-off state: how many proposals to skip after unhelpful drafts (module doc)."""

    def __init__(self, max_skip: int = MAX_BACKOFF_PROPOSALS) -> None:
        self.max_skip = max_skip
        self.skip = 0  # proposals still to skip
        self._next = 1  # the skip after the next unhelpful draft

    def outcome(self, helpful: bool) -> None:
        """A draft's fate: at least one token accepted (helpful) or none."""
        if helpful:
            self._next = 1
        else:
            self.skip = self._next
            self._next = min(self.max_skip, 2 * self._next)

    def take(self) -> bool:
        """Whether this proposal may draft (consumes one skip if not)."""
        if self.skip > 0:
            self.skip -= 1
            return False
        return True


class BackoffProposer:
    """A proposer that stops drafting for a while after its drafts are rejected outright.

    It learns each draft's fate from the committed tokens themselves: the first token
    committed after a draft equals the draft's first token iff the target accepted at least
    one drafted token (verification commits the accepted prefix, then its own token)."""

    def __init__(self, inner: Proposer, backoff: DraftBackoff | None = None) -> None:
        self.inner = inner
        self.backoff = backoff or DraftBackoff()
        self._draft: list[int] = []  # the last draft, until its first committed token

    def extend(self, tokens: Iterable[int]) -> None:
        batch = [int(t) for t in tokens]
        if self._draft and batch:
            self.backoff.outcome(batch[0] == self._draft[0])
            self._draft = []
        self.inner.extend(batch)

    def propose(self, limit: int) -> list[int]:
        if limit <= 0 or not self.backoff.take():
            return []
        self._draft = self.inner.propose(limit)
        return list(self._draft)


def make_proposer(source: NgramSource, history: Iterable[int] = ()) -> Proposer:
    """A fresh request-local proposer for ``source``, fed ``history`` (the prompt), with the
    back-off after unhelpful drafts (module doc)."""
    inner: Proposer = (
        NgramCacheProposer(source) if source.type == v.NGRAM_CACHE else NgramSuffixProposer(source)
    )
    inner.extend(history)
    return BackoffProposer(inner)


class VerifyWindow:
    """How many drafted tokens the next verify pass may carry (spec ``window_policy``)."""

    def __init__(self, policy: WindowPolicy) -> None:
        self.policy = policy
        self.size = policy.initial_window

    @property
    def adaptive(self) -> bool:
        return self.policy.mode == v.WINDOW_ADAPTIVE

    def update(self, proposed: int, accepted: int) -> None:
        """After a verify pass: grow after a full acceptance, halve after a partial one, and
        drop to ``min_window`` when nothing was accepted (a coincidental match: the next
        draft is likely no better, so it should cost as little as possible)."""
        if not self.adaptive or proposed == 0:
            return
        p = self.policy
        if accepted >= proposed:
            self.size = min(p.max_window, self.size + 1)
        elif accepted == 0:
            self.size = p.min_window
        else:
            self.size = max(p.min_window, self.size // 2)
