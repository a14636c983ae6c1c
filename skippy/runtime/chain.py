"""N stages chained in one process (stage 0 -> ... -> last): a split seen working without a
mesh. The same calls a mesh pipeline makes over links (``skippy.runtime.stage``), made
in-process: token ids into stage 0, f32 activations between stages, logits and the sampled
token out of the last one; prefill for the prompt, then one decode per token (or one verify
window per step when speculating), as the one generation loop (``skippy.runtime.token_loop``)
drives it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from skippy.errors import UsageError
from skippy.runtime.boundary import Generation, StageLoad
from skippy.runtime.sampling import Sampler, SamplingParams
from skippy.runtime.stage import Stage, StageConfig, StageOutput
from skippy.runtime.token_loop import DEFAULT_SESSION, generate
from skippy.runtime.tokenizer import LlamaTokenizer

ENGINES = ("ggml", "numpy", "llama")


def open_stage(
    engine: str,
    load: StageLoad,
    config: StageConfig,
    *,
    package_ref: str = "",
    stage_index: int = 0,
    stage_count: int = 1,
) -> Stage:
    """A loaded stage of the named engine (imported here, so each costs only when used)."""
    kw: dict[str, Any] = {
        "package_ref": package_ref,
        "stage_index": stage_index,
        "stage_count": stage_count,
    }
    if engine == "ggml":
        from skippy.runtime.ggml_engine import GgmlStage

        return GgmlStage(load, config, **kw)
    if engine == "numpy":
        from skippy.runtime.numpy_engine import NumpyStage

        return NumpyStage(load, config, **kw)
    if engine == "llama":  # a whole model in llama.cpp (one node, any family it runs)
        from skippy.runtime.llama_stage import LlamaStage

        return LlamaStage(load, config, **kw)
    raise UsageError(
        f"unknown stage engine {engine!r} (known: {', '.join(ENGINES)})", code="usage"
    )


class StageChain:
    """Stages of one package covering every layer once, in order, plus its tokenizer."""

    def __init__(self, stages: Sequence[Stage], tokenizer: LlamaTokenizer | None) -> None:
        if not stages:
            raise UsageError("a chain needs at least one stage", code="invalid_stage_chain")
        first, last = stages[0].descriptor, stages[-1].descriptor
        if not first.layers.owns_input or not last.layers.owns_output:
            raise UsageError(
                f"a chain must run from layer 0 to {first.layers.layer_count}; it runs "
                f"{first.layers.start}..{last.layers.stop}",
                code="invalid_stage_chain",
            )
        for up, down in itertools.pairwise(stages):
            down.descriptor.check_follows(up.descriptor)
        self.stages = tuple(stages)
        self.tokenizer = tokenizer
        self.n_ctx = min(s.descriptor.n_ctx for s in stages)

    # --- text ------------------------------------------------------------------------------------
    def _tok(self) -> LlamaTokenizer:
        if self.tokenizer is None:
            raise UsageError("this chain has no tokenizer", code="no_tokenizer")
        return self.tokenizer

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self._tok().tokenize(text, add_special=add_special, max_tokens=self.n_ctx)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._tok().detokenize(tokens)

    # --- running ---------------------------------------------------------------------------------
    def _through(
        self,
        call: str,
        session: str,
        start: int,
        inputs: npt.NDArray[Any],
        *,
        all_logits: bool = False,
        sampler: Sampler | None = None,
    ) -> StageOutput:
        x: npt.NDArray[Any] = inputs
        out = StageOutput()
        for i, stage in enumerate(self.stages):
            last = i == len(self.stages) - 1
            if call == "prefill":
                out = stage.prefill(
                    session,
                    start,
                    x,
                    all_logits=all_logits and last,
                    sampler=sampler if last else None,
                )
            else:
                out = stage.decode(session, start, x, sampler=sampler if last else None)
            if not last:
                if out.activations is None:  # a non-final stage always returns activations
                    raise UsageError(f"stage {i} returned no activations", code="stage_mismatch")
                x = out.activations
        return out

    def prefill(
        self,
        session: str,
        tokens: Sequence[int],
        *,
        start: int = 0,
        all_logits: bool = False,
        sampler: Sampler | None = None,
    ) -> StageOutput:
        ids = np.asarray(list(tokens), dtype=np.int64)
        return self._through("prefill", session, start, ids, all_logits=all_logits, sampler=sampler)

    def decode(
        self, session: str, position: int, token: int, *, sampler: Sampler | None = None
    ) -> StageOutput:
        ids = np.asarray([token], dtype=np.int64)
        return self._through("decode", session, position, ids, sampler=sampler)

    def truncate(self, session: str, length: int) -> None:
        """Forget positions ``length..`` in every stage (a rejected draft's KV)."""
        for s in self.stages:
            s.truncate(session, length)

    def verify(
        self, session: str, start: int, tokens: Sequence[int], *, exact: bool
    ) -> StageOutput:
        """Logits at every position of ``tokens`` (a verify window) from one pass through the
        chain: as one multi-row graph per stage, or with ``exact`` as one-position steps
        whose logits equal plain decoding's bit for bit (``Stage.decode_steps``)."""
        if not exact:
            return self.prefill(session, tokens, start=start, all_logits=True)
        x: npt.NDArray[Any] = np.asarray(list(tokens), dtype=np.int64)
        out = StageOutput()
        for i, stage in enumerate(self.stages):
            out = stage.decode_steps(session, start, x)
            if i < len(self.stages) - 1:
                if out.activations is None:
                    raise UsageError(f"stage {i} returned no activations", code="stage_mismatch")
                x = out.activations
        return out

    def free(self, session: str) -> None:
        for s in self.stages:
            s.free(session)

    def logits(
        self, tokens: Sequence[int], *, all_positions: bool = False
    ) -> npt.NDArray[np.float32]:
        """Logits after a fresh evaluation of ``tokens``: the last position ``(vocab,)``, or
        every position ``(n, vocab)``."""
        session = "logits"
        try:
            out = self.prefill(session, tokens, all_logits=all_positions)
        finally:
            self.free(session)
        if out.logits is None:
            raise UsageError("the last stage returned no logits", code="stage_mismatch")
        return out.logits if all_positions else out.logits[-1]

    def generate(
        self,
        tokens: Sequence[int],
        *,
        max_tokens: int,
        sampling: SamplingParams | None = None,
        session: str = DEFAULT_SESSION,
    ) -> Generation:
        """A completion from a fresh session (greedy unless ``sampling`` says otherwise): the
        one generation loop (``skippy.runtime.token_loop``), plain decoding."""
        return generate(self, tokens, max_tokens=max_tokens, sampling=sampling, session=session)[0]

    def close(self) -> None:
        for s in self.stages:
            s.close()
        if self.tokenizer is not None:
            self.tokenizer.close()

    def __enter__(self) -> StageChain:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
