"""The ``llama`` stage engine (skippy.runtime.llama_stage): a whole model in llama.cpp behind the
stage API, checked against llama.cpp's own generation (skippy.runtime.llama_cpp, the
`run --engine llama` path) on real synthetic GGUF packages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

import synth_gguf
from pkgtools import make_package
from stagetools import stage_loads

from skippy.errors import UsageError
from skippy.runtime.llama_cpp import LlamaRuntimeConfig, LlamaStageRuntime
from skippy.runtime.llama_stage import LlamaStage
from skippy.runtime.sampling import Sampler
from skippy.runtime.stage import DecodeStep, StageConfig

pytestmark = pytest.mark.llama

IDS = [1, 5, 9, 17, 33, 65, 3, 100, 7, 12, 90, 44]
N = 24


@pytest.fixture(scope="module", params=["llama", "exaone"])
def pkg(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(f"llama_stage_{request.param}")
    if request.param == "llama":
        src = synth_gguf.llama_like(root / "m.gguf")
    else:
        src = synth_gguf.uncovered_like(root / "m.gguf", arch=request.param)
    make_package(src, root / "pkg", model_id="acme/m-GGUF:Q8_0")
    return root / "pkg"


def _stage(pkg: Path, max_sessions: int = 4) -> LlamaStage:
    (load,) = stage_loads(pkg, ["0..4"])
    config = StageConfig(n_ctx=64, n_threads=1, n_batch=8, max_sessions=max_sessions)
    return LlamaStage(load, config)


def _greedy(stage: LlamaStage, session: str, ids: list[int], n: int) -> list[int]:
    greedy = Sampler(None)
    out = [stage.prefill(session, 0, np.array(ids), sampler=greedy).token]
    for position in range(len(ids), len(ids) + n - 1):
        out.append(stage.decode(session, position, np.array([out[-1]]), sampler=greedy).token)
    return [int(t) for t in out if t is not None]


def test_greedy_tokens_equal_llama_cpp_s_own_generation(pkg: Path) -> None:
    (load,) = stage_loads(pkg, ["0..4"])
    with LlamaStageRuntime(LlamaRuntimeConfig(n_ctx=64, n_threads=1)) as ref:
        ref.load(load)
        expected = list(ref.generate(IDS, max_tokens=N).tokens)
    stage = _stage(pkg)
    try:
        assert stage.descriptor.engine == "llama" and stage.descriptor.vocab == 128
        # the 12-token prompt goes in chunks of n_batch = 8: two llama_decode calls
        assert _greedy(stage, "a", IDS, N) == expected
        assert stage.session_length("a") == len(IDS) + N - 1
    finally:
        stage.close()


def test_a_decode_batch_equals_each_session_alone(pkg: Path) -> None:
    stage = _stage(pkg)
    try:
        alone_a = _greedy(stage, "a", IDS, 8)
        alone_b = _greedy(stage, "b", IDS[:5], 8)
        stage.free("a")
        stage.free("b")
        greedy = Sampler(None)
        a = [stage.prefill("a", 0, np.array(IDS), sampler=greedy).token]
        b = [stage.prefill("b", 0, np.array(IDS[:5]), sampler=greedy).token]
        for i in range(7):
            outs = stage.decode_batch(
                [
                    DecodeStep("a", len(IDS) + i, np.array([a[-1]]), greedy),
                    DecodeStep("b", 5 + i, np.array([b[-1]]), greedy),
                ]
            )
            a.append(outs[0].token)
            b.append(outs[1].token)
        assert (a, b) == (alone_a, alone_b)
    finally:
        stage.close()


def test_truncate_forgets_positions_and_free_returns_the_sequence(pkg: Path) -> None:
    stage = _stage(pkg, max_sessions=2)
    try:
        tokens = _greedy(stage, "a", IDS, 6)
        stage.truncate("a", len(IDS) + 1)  # keep the prompt and the first decoded token
        again = stage.decode("a", len(IDS) + 1, np.array([tokens[1]]), sampler=Sampler(None))
        assert again.token == tokens[2]
        stage.prefill("b", 0, np.array(IDS[:3]))
        with pytest.raises(UsageError) as err:
            stage.prefill("c", 0, np.array(IDS[:3]))
        assert err.value.code == "too_many_sessions"
        stage.free("a")  # its sequence is free again, and empty: c starts from nothing
        assert _greedy(stage, "c", IDS, 6) == tokens
    finally:
        stage.close()


def test_bad_input_is_refused_with_codes(pkg: Path) -> None:
    stage = _stage(pkg)
    try:
        for call, code in (
            (lambda: stage.prefill("a", 0, np.array([500])), "token_out_of_range"),
            (lambda: stage.prefill("a", 3, np.array(IDS)), "position_mismatch"),
            (lambda: stage.prefill("a", 0, np.array(list(range(1, 66)))), "context_full"),
            (lambda: stage.prefill("bad id", 0, np.array(IDS)), "invalid_session_id"),
            (lambda: stage.truncate("a", 1), "invalid_truncate"),
        ):
            with pytest.raises(UsageError) as err:
                call()
            assert err.value.code == code
        (partial,) = stage_loads(pkg, ["0..2"])
        with pytest.raises(UsageError) as err:
            LlamaStage(partial, StageConfig(n_ctx=64, n_threads=1))
        assert err.value.code == "partial_range_unsupported"
    finally:
        stage.close()


def test_llama_cpp_s_own_loop_stops_at_the_context_where_the_chain_does(pkg: Path) -> None:
    """`run --engine llama` samples in llama.cpp's loop, the chain in the stage runtime's; both
    commit through the one generation loop, so both stop at the same token when the context is
    full (the pending token at the last position still gives one)."""
    from skippy.runtime.chain import StageChain
    from skippy.runtime.tokenizer import LlamaTokenizer

    (load,) = stage_loads(pkg, ["0..4"])
    n_ctx = len(IDS) + 6
    with LlamaStageRuntime(LlamaRuntimeConfig(n_ctx=n_ctx, n_threads=1)) as ref:
        ref.load(load)
        got = ref.generate(IDS, max_tokens=50)
    config = StageConfig(n_ctx=n_ctx, n_threads=1, n_batch=8)
    with StageChain([LlamaStage(load, config)], LlamaTokenizer(load.part_paths[0])) as ch:
        want = ch.generate(IDS, max_tokens=50)
    assert got.tokens == want.tokens and got.stop_reason == want.stop_reason
    if want.stop_reason == "context":
        assert len(got.tokens) == n_ctx - len(IDS) + 1
