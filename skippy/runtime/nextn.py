"""The NextN (multi-token prediction) draft head: one position's draft from the trunk's
hidden state and the next token (llama.cpp's ``graph_mtp`` of ``src/models/glm4-moe.cpp``).

A package whose family carries NextN blocks (GLM-4.5's ``blk.{L-1}.nextn.*``; ModelSpec's
``n_layer_nextn``) keeps them as its last layers; the trunk never runs them. The final stage holds
them and, per draft, computes for position ``p``::

    e = enorm(embed(x_p))            # the token at p: the pending one, or a committed one
    h = hnorm(h_{p-1})               # the trunk's hidden state at p - 1, after output_norm
    y = layer(eh_proj([e; h]))       # one transformer layer of the family, own KV cache
    logits = head(head_norm(y))      # shared_head_norm / shared_head_head, else the model's

whose argmax is the draft for position ``p + 1``. The trunk's hidden state is llama.cpp's
``h_nextn``: the last layer's output after the output norm (what vLLM's MTP takes too).

This module is pure graph composition over ``GraphBuilder`` plus the per-session bookkeeping
(which positions the head's cache holds, which trunk rows it still needs); the engine
(``skippy.runtime.ggml_engine``) feeds it and runs the graphs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from skippy.runtime.families.base import BuildLayer, T
from skippy.runtime.graph import GraphBuilder, LayerWeights

# The depth the head drafts: one token per pass (the spec's prediction_depth 1)
PREDICTION_DEPTH: Final = 1


@dataclass(frozen=True)
class NextnWeights:
    """What the head reads besides its layer: the block's own tensors, or the model's
    embeddings / output norm / output head where the block has none (llama.cpp's fallbacks)."""

    eh_proj: int
    enorm: int
    hnorm: int
    embed: int  # nextn.embed_tokens, else token_embd
    head_norm: int  # nextn.shared_head_norm, else output_norm
    head: int  # nextn.shared_head_head, else output (or the tied embeddings)


def build_nextn(
    b: GraphBuilder,
    w: NextnWeights,
    layer: LayerWeights,
    build_layer: BuildLayer,
    tokens: int,
    h: int,
) -> tuple[int, int]:
    """The head over ``tokens`` (I32 ``[rows]``) and the trunk rows ``h`` (F32
    ``[width, rows]``, row i the hidden state before token i's position): the logits of the
    last row ``[vocab, 1]`` and the head's normed hidden ``[width, rows]``. ``build_layer`` is
    the family's layer builder, run over the block's ``layer`` weights."""
    g, ctx = b.g, b.ctx
    e = b.norm(g.ggml_get_rows(ctx, w.embed, tokens), w.enorm)  # [width, rows]
    hn = b.norm(h, w.hnorm)
    x = b.mm(w.eh_proj, g.ggml_concat(ctx, e, hn, 0))  # [2 width, rows] -> [width, rows]
    y = b.norm(build_layer(b, layer, layer.il, x), w.head_norm)
    rows, width = b.rows, b.spec.width
    last = g.ggml_view_2d(ctx, y, width, 1, 4 * width, 4 * width * (rows - 1))
    return b.mm(w.head, last), y


@dataclass
class NextnSession:
    """One session's head state: its cache holds positions ``start..length-1`` (each
    ``(x_p, h_{p-1})`` of committed tokens), and the trunk's hidden rows by position, kept
    until the head has consumed them."""

    start: int | None = None  # the first position in the head's cache (None: empty)
    length: int = 0
    hidden: dict[int, npt.NDArray[np.float32]] = field(default_factory=dict)
    # the session drafts (``GgmlStage.expect_drafts``): only then does the trunk keep its rows
    enabled: bool = False

    def keep_hidden(self, first: int, rows: npt.NDArray[np.float32]) -> None:
        """The trunk's hidden rows for positions ``first..`` (a drafting session's)."""
        if not self.enabled:
            return
        for i in range(rows.shape[0]):
            self.hidden[first + i] = rows[i].copy()

    def truncate(self, length: int) -> None:
        """Positions ``length..`` are no longer committed (a rejected draft's)."""
        if self.start is not None and length < self.length:
            self.length = max(length, self.start)
        for p in [p for p in self.hidden if p >= length]:
            del self.hidden[p]

    def paired(self, p: int) -> bool:
        """Whether position ``p`` has the trunk's hidden state before it (position 0 pairs
        with zeros, as llama.cpp's drafter starts)."""
        return p == 0 or p - 1 in self.hidden

    def plan(self, start: int, tokens: Sequence[int]) -> tuple[int, list[int]]:
        """The positions the next draft computes and their tokens: from the first one the
        cache lacks through the pending token, the last of ``tokens`` (at ``start +
        len(tokens) - 1``). Without a cache to extend, it starts afresh at the oldest
        position from which every one has its hidden state before it (the prompt's first,
        where the trunk kept every row)."""
        end = start + len(tokens)  # one past the pending token's position
        first = self.length if self.start is not None and start <= self.length < end else None
        if first is None or not all(self.paired(p) for p in range(first, end)):
            first = end - 1
            while first > start and self.paired(first - 1):
                first -= 1
            self.start = first
        return first, list(tokens[first - start :])

    def committed(self, first: int, n: int) -> None:
        """The head's cache now holds positions ``first..first+n-1``; drop the trunk rows it
        no longer needs (it keeps the newest, which the next draft pairs with)."""
        self.length = first + n
        for p in [p for p in self.hidden if p < self.length - 1]:
            del self.hidden[p]


def head_weights(tensors: dict[str, int], il: int, output_head: int | None) -> NextnWeights:
    """The block's ``NextnWeights`` from a stage's placed tensors."""
    from skippy.runtime.model import tensor_name

    def own(t: T, fallback: int | None) -> int:
        found = tensors.get(tensor_name(t, il), fallback)
        if found is None:
            raise KeyError(tensor_name(t, il))
        return found

    return NextnWeights(
        eh_proj=own(T.NEXTN_EH_PROJ, None),
        enorm=own(T.NEXTN_ENORM, None),
        hnorm=own(T.NEXTN_HNORM, None),
        embed=own(T.NEXTN_EMBED_TOKENS, tensors.get(tensor_name(T.TOKEN_EMBD))),
        head_norm=own(T.NEXTN_SHARED_HEAD_NORM, tensors.get(tensor_name(T.OUTPUT_NORM))),
        head=own(T.NEXTN_SHARED_HEAD_HEAD, output_head),
    )


def native_mtp_unavailable(stage: Any) -> str | None:
    """Why ``stage`` (a chain's final stage) cannot draft for ``native-mtp``, or None when it
    runs a NextN head."""
    if getattr(stage, "drafts", False):
        return None
    reason = getattr(stage, "nextn_unavailable", None)
    return reason or f"the {stage.descriptor.engine} engine runs no NextN draft head"


class NextnProposer:
    """``native-mtp``'s drafter (``skippy.generation.proposers.Proposer``'s two calls): the
    final stage's NextN head drafts one token, greedily (the head's argmax, as llama.cpp's MTP
    drafter takes its top token), after the session's tokens so far from position ``start``
    (the prompt's, then those committed: the head pairs each with the trunk's hidden state
    before it). Made before the session's prompt (``expect_drafts``), so the head covers it."""

    def __init__(self, stage: Any, session: str, start: int = 0) -> None:
        self.stage = stage
        self.session = session
        self.start = start  # the position of tokens[0]
        self.tokens: list[int] = []
        stage.expect_drafts(session)

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def put(self, start: int, tokens: Sequence[int]) -> None:
        """``tokens`` at positions ``start..``, replacing any from there on (a rewind into
        the last verify window); a gap, or a start before the first, starts the record
        there."""
        if not self.tokens or not self.start <= start <= self.start + len(self.tokens):
            self.start, self.tokens = start, []
        del self.tokens[start - self.start :]
        self.extend(tokens)

    def propose(self, limit: int) -> list[int]:
        if limit < 1 or not self.tokens:
            return []
        logits = self.stage.draft(self.session, self.start, self.tokens)
        return [int(np.argmax(logits))]
