"""Choosing the next token from logits: greedy, or temperature / top-k / top-p with a seed.

Pure numpy on one row of logits. Greedy is ``argmax`` (the first maximum, as llama.cpp's
greedy sampler). Otherwise the order is llama.cpp's common chain: top-k, then top-p over the
survivors' softmax at the given temperature, then one draw from a generator seeded once per
``Sampler`` (the same seed and logits give the same tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from skippy.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise UsageError(
                f"temperature {self.temperature} is outside 0..100", code="invalid_sampling"
            )
        if self.top_k < 0:
            raise UsageError(f"top_k {self.top_k} is negative", code="invalid_sampling")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise UsageError(f"top_p {self.top_p} is outside (0, 1]", code="invalid_sampling")
        if not 0 <= self.seed < 2**63:
            raise UsageError(f"seed {self.seed} is outside 0..2^63-1", code="invalid_sampling")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        if self.greedy:
            return {"strategy": "greedy"}
        return {
            "strategy": "sample",
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "seed": self.seed,
        }


class Sampler:
    """Stateful only through its random generator (one per generation)."""

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.params = params or SamplingParams()
        # Made at the first draw: greedy never draws, and a node makes a sampler per token
        # (seeded by the position), where a generator costs ~0.13 ms with the caches just
        # flushed by a stage's graph, twice per token of a split (docs/performance.md).
        self._rng: np.random.Generator | None = None

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        row = np.asarray(logits, dtype=np.float32).reshape(-1)
        if row.size == 0:
            raise UsageError("cannot sample from empty logits", code="invalid_sampling")
        p = self.params
        if p.greedy:
            return int(np.argmax(row))
        candidates = np.arange(row.size)
        values = row.astype(np.float64)
        if 0 < p.top_k < row.size:
            keep = np.argpartition(-values, p.top_k - 1)[: p.top_k]
            candidates, values = candidates[keep], values[keep]
        order = np.argsort(-values, kind="stable")
        candidates, values = candidates[order], values[order]
        z = (values - values[0]) / p.temperature
        probs = np.exp(z)
        probs /= probs.sum()
        if p.top_p < 1.0:
            # the smallest prefix whose mass reaches top_p (at least one token)
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            candidates, probs = candidates[:cut], probs[:cut] / probs[:cut].sum()
        if self._rng is None:
            self._rng = np.random.default_rng(self.params.seed)
        return int(candidates[self._rng.choice(len(candidates), p=probs)])
