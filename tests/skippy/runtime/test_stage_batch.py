"""Batched decode of concurrent sessions: ``Stage.decode_batch`` runs several
sessions' one-position steps in one ggml graph, and each session's output equals its own
``decode`` bit for bit, whole and split, while sessions join and leave the batch between
steps (synthetic models; the real gemma3 check is in docs/performance.md's bench row)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

import synth_gguf
from pkgtools import make_package
from stagetools import chain

from skippy.errors import UsageError
from skippy.runtime.ggml_engine import GgmlStage
from skippy.runtime.sampling import Sampler
from skippy.runtime.stage import DecodeStep, Stage, StageConfig

pytestmark = pytest.mark.llama

CFG = StageConfig(n_ctx=32, n_threads=1)
# per session: prompt ids, then the ids fed one decode step at a time
PROMPTS = {
    "a": [1, 5, 9, 17],
    "b": [33, 65],
    "c": [3, 100, 7, 12, 90, 44],
}
FEED = [12, 90, 44, 8, 3, 61, 27, 5]
# which sessions step together, per step: c joins late, a leaves early, b runs alone once
SCHEDULE = [
    ("a", "b"),
    ("a", "b"),
    ("a", "b", "c"),
    ("b", "c", "a"),
    ("c", "b"),
    ("b",),
    ("c", "b"),
]


@pytest.fixture(scope="module")
def pkgs(synth_dir, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stage_batch")
    out = {}
    # gemma3 with a 3-position sliding window, so decode crosses it
    swa = synth_gguf.gemma_like(root / "gemma-swa.gguf", sliding_window=3)
    for name, src in (("llama", synth_dir.llama), ("gemma3", swa)):
        make_package(src, root / name, model_id=f"acme/{name}-GGUF:Q8_0")
        out[name] = root / name
    return out


def _steps_alone(stages: list[Stage]) -> dict[tuple[str, int], np.ndarray]:
    """Every (session, position)'s logits, each session decoded on its own."""
    out = {}
    counts = {s: sum(s in step for step in SCHEDULE) for s in PROMPTS}
    for name, prompt in PROMPTS.items():
        _prefill(stages, name, prompt)
        for i in range(counts[name]):
            pos = len(prompt) + i
            x: np.ndarray = np.array([FEED[i]])
            for st in stages:
                o = st.decode(name, pos, x)
                x = o.activations if o.activations is not None else o.logits  # type: ignore[assignment]
            out[(name, pos)] = x[-1]
        for st in stages:
            st.free(name)
    return out


def _prefill(stages: list[Stage], name: str, prompt: list[int]) -> None:
    x: np.ndarray = np.array(prompt)
    for st in stages:
        o = st.prefill(name, 0, x)
        x = o.activations if o.activations is not None else np.empty(0)  # type: ignore[assignment]


def _steps_batched(stages: list[Stage]) -> dict[tuple[str, int], np.ndarray]:
    """The same steps, run by SCHEDULE: each step one decode_batch per stage."""
    out = {}
    done = {s: 0 for s in PROMPTS}
    for batch in SCHEDULE:
        for name in batch:
            if done[name] == 0 and stages[0].session_length(name) == 0:
                _prefill(stages, name, PROMPTS[name])  # joins between steps
        positions = [len(PROMPTS[n]) + done[n] for n in batch]
        xs = [np.array([FEED[done[n]]]) for n in batch]
        for st in stages:
            outs = st.decode_batch(
                [DecodeStep(n, p, x) for n, p, x in zip(batch, positions, xs, strict=True)]
            )
            xs = [o.activations if o.activations is not None else o.logits for o in outs]  # type: ignore[misc]
        for n, p, x in zip(batch, positions, xs, strict=True):
            out[(n, p)] = x[-1]
            done[n] += 1
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("ranges", [["0..4"], ["0..2", "2..4"]], ids=["whole", "split"])
def test_batched_decode_equals_each_session_alone(arch: str, ranges: list[str], pkgs) -> None:
    """Sessions joining and leaving a batch between steps get, at every position, the logits
    of decoding alone, bit for bit (whole and split: activations cross between stages)."""
    with chain("ggml", pkgs[arch], ranges, CFG) as ch:
        stages = list(ch.stages)
        alone = _steps_alone(stages)
        batched = _steps_batched(stages)
        graphs = [list(st._batch_graphs.values()) for st in stages if isinstance(st, GgmlStage)]
    assert batched.keys() == alone.keys()
    for key, row in alone.items():
        assert np.array_equal(batched[key], row), key
    assert all(len(kept) >= 1 for kept in graphs)  # batches really ran as batched graphs
    # both layouts ran: the models mix types ggml multiplies exactly as [k, B] (Q8_0, Q4_0)
    # with F16/BF16, whose GEMM sums differently and so stays broadcast (batch_layout)
    kept_graphs = [bg for kept in graphs for bg in kept]
    assert all(bg.gemm_matmuls > 0 for bg in kept_graphs)
    assert any(bg.broadcast_matmuls > 0 for bg in kept_graphs)


def test_batched_greedy_tokens_are_each_sessions_argmax(pkgs) -> None:
    """A greedy batch returns tokens only (no logits), each the first maximum of the logits the
    session gets alone; mixed greedy / logits steps in one batch get what each asked for."""
    with chain("ggml", pkgs["gemma3"], ["0..4"], CFG) as ch:
        st = ch.stages[0]
        for name, prompt in PROMPTS.items():
            st.prefill(name, 0, np.array(prompt))
        steps = [
            DecodeStep("a", 4, np.array([12]), Sampler()),
            DecodeStep("b", 2, np.array([90])),
            DecodeStep("c", 6, np.array([44]), Sampler()),
        ]
        outs = st.decode_batch(steps)
        for s in steps:
            st.truncate(s.session, s.position)
        alone = [st.decode(s.session, s.position, s.inputs) for s in steps]
    assert outs[0].logits is None and outs[2].logits is None
    assert outs[0].token == int(np.argmax(alone[0].logits[-1]))  # type: ignore[index]
    assert outs[2].token == int(np.argmax(alone[2].logits[-1]))  # type: ignore[index]
    assert outs[1].token is None and np.array_equal(outs[1].logits, alone[1].logits)  # type: ignore[arg-type]


def test_a_bad_step_refuses_the_batch_before_any_runs(pkgs) -> None:
    """A position mismatch in one step refuses the whole call, and no session moved."""
    with chain("ggml", pkgs["llama"], ["0..4"], CFG) as ch:
        st = ch.stages[0]
        st.prefill("a", 0, np.array(PROMPTS["a"]))
        st.prefill("b", 0, np.array(PROMPTS["b"]))
        with pytest.raises(UsageError) as err:
            st.decode_batch([DecodeStep("a", 4, np.array([1])), DecodeStep("b", 5, np.array([1]))])
        assert err.value.code == "position_mismatch"
        with pytest.raises(UsageError) as dup:
            st.decode_batch([DecodeStep("a", 4, np.array([1])), DecodeStep("a", 4, np.array([1]))])
        assert dup.value.code == "bad_stage_input"
        assert (st.session_length("a"), st.session_length("b")) == (4, 2)
