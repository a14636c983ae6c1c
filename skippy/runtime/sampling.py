"""Choosing the next token from logits: llama.cpp's sampler chain on one row, in numpy.

The order is llama.cpp's (``common/sampling.cpp``, its default chain), each step on what the
one before left:

1. ``logit_bias``: added to the named tokens' logits.
2. penalties over the last ``repeat_last_n`` tokens before this position (prompt and
   generated alike): a token seen there has its logit divided by ``repeat_penalty`` when
   positive, multiplied when not, then ``count * frequency_penalty + presence_penalty``
   subtracted.
3. ``top_k``: the k largest logits.
4. ``typical_p``: the locally typical set (probabilities at temperature 1).
5. ``top_p``: the smallest set of the largest logits whose probability (temperature 1)
   reaches ``top_p``.
6. ``min_p``: logits at least ``max + ln(min_p)`` (a probability at least ``min_p`` times
   the largest).
7. temperature: 0 takes the largest logit left (the first such token id); otherwise one
   draw from ``softmax(logit / temperature)`` with a generator seeded once per ``Sampler``.

Each step is a pure function below. Greedy without a bias, penalties or ``typical_p`` is the
plain ``argmax`` (the first maximum), which the engine may take itself (``plain_greedy``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from skippy.errors import UsageError

MAX_TEMPERATURE: Final = 100.0
MAX_REPEAT_PENALTY: Final = 10.0  # llama.cpp takes any; past this it is a ban, not a penalty
MAX_PRESENCE_FREQUENCY: Final = 2.0  # OpenAI's range, -2..2
MAX_LOGIT_BIAS: Final = 100.0  # OpenAI's range, -100..100
MAX_LOGIT_BIAS_TOKENS: Final = 1024
MAX_REPEAT_LAST_N: Final = 1 << 24
DEFAULT_REPEAT_LAST_N: Final = 64  # llama.cpp's
Candidates = tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]  # ids, logits


def _bad(message: str) -> UsageError:
    return UsageError(message, code="invalid_sampling")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    typical_p: float = 1.0  # 1.0: off
    repeat_penalty: float = 1.0  # 1.0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = DEFAULT_REPEAT_LAST_N  # 0: no penalties
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise _bad(f"temperature {self.temperature} is outside 0..{MAX_TEMPERATURE:g}")
        if self.top_k < 0:
            raise _bad(f"top_k {self.top_k} is negative")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise _bad(f"top_p {self.top_p} is outside (0, 1]")
        for name in ("min_p", "typical_p"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                raise _bad(f"{name} {value} is outside 0..1")
        rp = self.repeat_penalty
        if not (math.isfinite(rp) and 0 < rp <= MAX_REPEAT_PENALTY):
            raise _bad(f"repeat_penalty {rp} is outside (0, {MAX_REPEAT_PENALTY:g}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and abs(value) <= MAX_PRESENCE_FREQUENCY):
                raise _bad(f"{name} {value} is outside -2..2")
        if not 0 <= self.repeat_last_n <= MAX_REPEAT_LAST_N:
            raise _bad(f"repeat_last_n {self.repeat_last_n} is outside 0..{MAX_REPEAT_LAST_N}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise _bad(
                f"logit_bias names {len(self.logit_bias)} tokens "
                f"(at most {MAX_LOGIT_BIAS_TOKENS})"
            )
        previous = -1
        for token, bias in self.logit_bias:
            if not previous < token < 1 << 32:
                raise _bad("logit_bias token ids must be distinct u32 values, ascending")
            if not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
                raise _bad(f"logit_bias {bias} for token {token} is outside -100..100")
            previous = token
        if not 0 <= self.seed < 2**63:
            raise _bad(f"seed {self.seed} is outside 0..2^63-1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the penalties change anything (then a sampler needs the tokens before it)."""
        return self.repeat_last_n > 0 and (
            self.repeat_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: the token is their first maximum, so an engine may take
        the argmax itself. A bias, penalties or ``typical_p`` (which may drop the largest
        logit) need the logits here."""
        return (
            self.greedy and not self.logit_bias and not self.penalized and self.typical_p >= 1.0
        )

    @property
    def controls(self) -> bool:
        """Whether any control beyond temperature, top-k, top-p and the seed is set."""
        return (
            self.min_p != 0.0
            or self.typical_p != 1.0
            or self.penalized
            or bool(self.logit_bias)
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = (
            {"strategy": "greedy"}
            if self.greedy
            else {
                "strategy": "sample",
                "temperature": self.temperature,
                "top_k": self.top_k,
                "top_p": self.top_p,
                "seed": self.seed,
            }
        )
        if self.controls:
            out.update(
                min_p=self.min_p,
                typical_p=self.typical_p,
                repeat_penalty=self.repeat_penalty,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repeat_last_n=self.repeat_last_n,
                logit_bias={str(t): b for t, b in self.logit_bias},
            )
        return out


# --- the chain's steps (pure) -------------------------------------------------------------------
def apply_logit_bias(
    row: npt.NDArray[np.float64], bias: Sequence[tuple[int, float]]
) -> npt.NDArray[np.float64]:
    """``row`` with each ``(token, bias)`` added; a token outside the row is refused."""
    out = row.copy()
    if not bias:
        return out
    ids = np.fromiter((token for token, _ in bias), dtype=np.int64, count=len(bias))
    if int(ids.max()) >= out.size:
        raise UsageError(
            f"logit_bias names token {int(ids.max())}; the vocabulary has {out.size}",
            code="token_out_of_range",
        )
    out[ids] += np.fromiter((value for _, value in bias), dtype=np.float64, count=len(bias))
    return out  # ids are distinct (SamplingParams): one addition each


def apply_penalties(
    row: npt.NDArray[np.float64],
    history: Sequence[int],
    *,
    repeat: float,
    frequency: float,
    presence: float,
) -> npt.NDArray[np.float64]:
    """llama.cpp's penalties for the tokens of ``history`` (the window already cut):
    ``repeat`` divides a positive logit and multiplies a non-positive one, then
    ``count * frequency + presence`` is subtracted."""
    out = row.copy()
    ids, counts = np.unique(np.asarray(history, dtype=np.int64), return_counts=True)
    keep = (ids >= 0) & (ids < out.size)  # an id the model cannot produce has no logit
    ids, counts = ids[keep], counts[keep]
    values = out[ids]
    values = np.where(values <= 0, values * repeat, values / repeat)
    out[ids] = values - (counts * frequency + presence)
    return out


def softmax(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    z = np.exp(values - values.max())
    return z / z.sum()  # type: ignore[no-any-return]


def top_k(cands: Candidates, k: int) -> Candidates:
    """The ``k`` largest logits (all when ``k`` is 0 or at least their number)."""
    ids, values = cands
    if 0 < k < ids.size:
        keep = np.argpartition(-values, k - 1)[:k]
        return ids[keep], values[keep]
    return cands


def by_logit(cands: Candidates) -> Candidates:
    """Largest logit first (ties keep their order)."""
    ids, values = cands
    order = np.argsort(-values, kind="stable")
    return ids[order], values[order]


def typical(cands: Candidates, p: float) -> Candidates:
    """Locally typical sampling (llama.cpp's ``typical``): the candidates ordered by how far
    their surprise ``-ln q`` is from the entropy, and the shortest such prefix whose mass
    exceeds ``p``; ``q`` is the candidates' softmax at temperature 1. Off at ``p >= 1``."""
    if p >= 1.0:
        return cands
    ids, values = cands
    q = softmax(values)
    with np.errstate(divide="ignore", invalid="ignore"):  # q underflows to 0 far down
        surprise = -np.log(q)
        entropy = float(np.sum(np.where(q > 0, q * surprise, 0.0)))
    order = np.argsort(np.abs(surprise - entropy), kind="stable")
    mass = np.cumsum(q[order])
    over = np.nonzero(mass > p)[0]
    cut = int(over[0]) + 1 if over.size else ids.size
    keep = order[:cut]
    return ids[keep], values[keep]


def top_p(cands: Candidates, p: float) -> Candidates:
    """The largest logits whose softmax (temperature 1) first reaches ``p`` (at least one).
    ``cands`` sorted by logit; off at ``p >= 1``."""
    if p >= 1.0:
        return cands
    ids, values = cands
    cut = int(np.searchsorted(np.cumsum(softmax(values)), p)) + 1
    return ids[:cut], values[:cut]


def min_p(cands: Candidates, p: float) -> Candidates:
    """The logits at least ``max + ln(p)``; off at ``p <= 0``."""
    if p <= 0.0:
        return cands
    ids, values = cands
    keep = values >= values.max() + math.log(p)
    return ids[keep], values[keep]


def shaped_logits(
    logits: npt.NDArray[np.float32], params: SamplingParams, history: Sequence[int]
) -> npt.NDArray[np.float64]:
    """Steps 1-2: the row (f64) after the bias and the penalties over ``history``'s last
    ``repeat_last_n`` tokens."""
    row = np.asarray(logits, dtype=np.float64).reshape(-1)
    if params.logit_bias:
        row = apply_logit_bias(row, params.logit_bias)
    if params.penalized:
        window = history[-params.repeat_last_n :] if history else ()
        row = apply_penalties(
            row,
            window,
            repeat=params.repeat_penalty,
            frequency=params.frequency_penalty,
            presence=params.presence_penalty,
        )
    return row


def candidates(row: npt.NDArray[np.float64], params: SamplingParams) -> Candidates:
    """Steps 3-6 on a shaped row: the survivors, largest logit first."""
    cands = by_logit(top_k((np.arange(row.size), row), params.top_k))
    if params.typical_p < 1.0:  # it reorders them
        cands = by_logit(typical(cands, params.typical_p))
    cands = top_p(cands, params.top_p)
    return min_p(cands, params.min_p)


class Sampler:
    """One generation's sampler: its random generator (made at the first draw) and the
    tokens before the next position (``history``; ``accept`` adds one), which the penalties
    read."""

    def __init__(self, params: SamplingParams | None = None, history: Sequence[int] = ()) -> None:
        self.params = params or SamplingParams()
        # Only the window the penalties read is kept.
        n = self.params.repeat_last_n if self.params.penalized else 0
        self.history: list[int] = list(history[-n:]) if n else []
        # Made at the first draw: greedy never draws, and a node makes a sampler per token
        # (seeded by the position), where a generator costs ~0.13 ms with the caches just
        # flushed by a stage's graph, twice per token of a split (docs/performance.md).
        self._rng: np.random.Generator | None = None

    def accept(self, token: int) -> None:
        """``token`` is the sequence's next one (the penalties' window moves on)."""
        n = self.params.repeat_last_n if self.params.penalized else 0
        if n:
            self.history.append(token)
            del self.history[:-n]

    def sample(self, logits: npt.NDArray[np.float32], after: Sequence[int] = ()) -> int:
        """The next token; ``after``: tokens that follow ``history`` but are not accepted
        yet (a verify window's drafts, while they are checked)."""
        row = np.asarray(logits, dtype=np.float32).reshape(-1)
        if row.size == 0:
            raise UsageError("cannot sample from empty logits", code="invalid_sampling")
        p = self.params
        if p.plain_greedy:
            return int(np.argmax(row))
        shaped = shaped_logits(row, p, [*self.history, *after] if after else self.history)
        if p.greedy:
            if p.typical_p >= 1.0:  # top-k, top-p and min-p always keep the largest logit
                return int(np.argmax(shaped))
            ids, values = candidates(shaped, p)
            return int(ids[values == values.max()].min())
        ids, values = candidates(shaped, p)
        probs = softmax((values - values[0]) / p.temperature)
        if self._rng is None:
            self._rng = np.random.default_rng(p.seed)
        return int(ids[self._rng.choice(len(ids), p=probs)])
