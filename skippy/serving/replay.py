"""The schedule of stage calls that computes a request's positions (pure).

One function decides how a request's committed tokens (the prompt, then every token generated
so far) are fed through the stages, for the first attempt and for a replay after a failover
alike: the prompt in chunks of ``chunk`` tokens (``PREFILL``), then each generated token as a
one-token ``DECODE`` step at its own position. The engine's batched prefill of positions
p..q and its one-token decodes of the same positions are not bit-identical (measured:
docs/runtime-facts.md, "The stage engine's numerics"), so a replay that prefilled what was
decoded one token at a time would diverge from the undisturbed run; recomputing exactly the
calls that ran, in the same shapes, reaches the same KV state bit for bit: replays
recompute exactly what ran.

Only the last step samples: its output is the next token (after the prompt alone, the first
token; after ``k`` generated tokens, token ``k``). The sampler of a step is seeded by the
position it samples for (``mesh_node.serving.host.sampler_at``), so seeded sampling draws the
same tokens after a replay too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Phase = Literal["prefill", "decode", "verify"]  # verify: a live speculative window, never replayed


@dataclass(frozen=True)
class Step:
    """One stage call: ``tokens`` at positions ``start .. start + len(tokens)``."""

    phase: Phase
    start: int
    tokens: tuple[int, ...]
    sample: bool  # the last step: its output is the next token

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def schedule(prompt: Sequence[int], generated: Sequence[int], chunk: int) -> list[Step]:
    """The calls that compute every committed position, in the order and shapes the
    undisturbed run made them (see the module docstring). ``chunk`` >= 1; a prompt of at
    least one token."""
    if chunk < 1:
        raise ValueError("chunk must be at least 1")
    if not prompt:
        raise ValueError("a request has at least one prompt token")
    steps = [
        Step("prefill", lo, tuple(prompt[lo : lo + chunk]), False)
        for lo in range(0, len(prompt), chunk)
    ]
    # Each generated token but the newest was fed as its own decode step; the newest is fed
    # (and samples the next token) when the caller continues, so it is here too.
    steps += [Step("decode", len(prompt) + i, (token,), False) for i, token in enumerate(generated)]
    last = steps[-1]
    steps[-1] = Step(last.phase, last.start, last.tokens, True)
    return steps


def tokens_before(
    prompt: Sequence[int], generated: Sequence[int], position: int, n: int
) -> list[int]:
    """The last ``n`` committed tokens at positions before ``position`` (the prompt's, then
    the generated ones'): what the penalties read when sampling for ``position``."""
    lo, split = max(0, position - n), len(prompt)
    if n <= 0 or position <= 0:
        return []
    head = list(prompt[lo : min(position, split)])
    tail = list(generated[max(0, lo - split) : max(0, position - split)])
    return head + tail
