"""A position's logits do not depend on how its prompt was chunked, and equal llama.cpp's.

The reference is llama.cpp (llama-cpp-python, weight repacking off) evaluating the whole
prompt in one batch: every position's logits, and the last position's alone (llama.cpp then
runs its last layer's feed-forward on that one row, which changes the bits of F32 and
K-quant matmuls). The ggml engine prefills the same prompt in chunks of 1, 7, 8, 9, 128 and
512 rows and must give both bit for bit, for prompts of 1 to 1,000 tokens, on synthetic
models that cover every kernel family (32-block quants, K-quants, F16, BF16, F32 weights; a
sliding window shorter than the prompt), then decode on across the KV view's 256-cell step.
SmolLM2-135M (where the chunk dependence was first seen) and gemma3-270m check the same on
real long prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

import synth_gguf
from pkgtools import make_package
from stagetools import chain, llama_logits

from skippy.runtime.graph_shapes import KV_PAD, PREFILL_MIN_ROWS, kv_length, prefill_rows
from skippy.runtime.stage import StageConfig

pytestmark = pytest.mark.llama

CHUNKS = (1, 7, 8, 9, 128, 512)
LENGTHS = (1, 6, 13, 300, 1000)
N_CTX = 1024


@dataclass(frozen=True)
class Model:
    gguf: Path
    pkg: Path
    layers: int
    vocab: int


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    root = tmp_path_factory.mktemp("prefill_chunks")
    sources = {
        # Q8_0, Q5_0, Q4_0, Q4_1, F16 and K-quant (Q4_K, Q6_K) matrices, head dim 16
        "quants": (synth_gguf.llama_like(root / "quants.gguf"), 4, 128),
        # gemma3: BF16 and Q6_K matrices, a 64-position window (shorter than the long prompts)
        "gemma-swa": (synth_gguf.gemma_like(root / "swa.gguf", sliding_window=64), 4, 128),
        # every matrix F32 (the engine was up to 8.1e-5 from llama.cpp there), head dim 64
        "f32": (synth_gguf.high_precision(root / "f32.gguf", dtype="F32", n_layers=2), 2, 512),
    }
    out = {}
    for name, (src, layers, vocab) in sources.items():
        make_package(src, root / f"pkg-{name}", model_id=f"acme/{name}-GGUF:X")
        out[name] = Model(src, root / f"pkg-{name}", layers, vocab)
    return out


def _ids(length: int, vocab: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(length).integers(3, vocab, length)]


def _ggml(m: Model, ids: Sequence[int], chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Every position's logits, and the last position's alone, prefilled in ``chunk``s."""
    cfg = StageConfig(n_ctx=N_CTX, n_batch=chunk, n_threads=1)
    with chain("ggml", m.pkg, [f"0..{m.layers}"], cfg) as ch:
        return ch.logits(ids, all_positions=True), ch.logits(ids)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("name", ["quants", "gemma-swa", "f32"])
def test_every_chunking_gives_llama_cpps_logits_bit_for_bit(
    models: dict[str, Model], name: str, length: int
) -> None:
    m = models[name]
    ids = _ids(length, m.vocab)
    every = llama_logits(m.gguf, ids, repack=False, n_ctx=N_CTX)
    last = llama_logits(m.gguf, ids, repack=False, n_ctx=N_CTX, prefill=length)[0]
    for chunk in CHUNKS:
        got_every, got_last = _ggml(m, ids, chunk)
        assert np.array_equal(got_every, every), (chunk, np.abs(got_every - every).max())
        assert np.array_equal(got_last, last), (chunk, np.abs(got_last - last).max())


@pytest.mark.parametrize("name", ["quants", "f32"])
def test_decode_after_a_chunked_prefill_crosses_the_kv_step_like_llama_cpp(
    models: dict[str, Model], name: str
) -> None:
    """Prefill 250 positions in chunks of 7, then decode one token at a time past position
    256, where the KV view grows by a step: each logits row equals llama.cpp's decode."""
    m = models[name]
    ids, prefill = _ids(266, m.vocab), 250
    ref = llama_logits(m.gguf, ids, repack=False, n_ctx=N_CTX, prefill=prefill)
    cfg = StageConfig(n_ctx=N_CTX, n_batch=7, n_threads=1)
    with chain("ggml", m.pkg, [f"0..{m.layers // 2}", f"{m.layers // 2}..{m.layers}"], cfg) as ch:
        first = ch.prefill("s", ids[:prefill]).logits
        assert first is not None
        rows = [first[-1]]
        for pos in range(prefill, len(ids)):
            step = ch.decode("s", pos, ids[pos]).logits
            assert step is not None
            rows.append(step[-1])
    assert np.array_equal(np.stack(rows), ref)


@pytest.mark.parametrize("calls", [(128, 3), (8, 1, 1, 120, 1)])
@pytest.mark.parametrize("name", ["quants", "f32"])
def test_a_prompt_sent_in_several_prefill_calls_equals_one_batch(
    models: dict[str, Model], name: str, calls: tuple[int, ...]
) -> None:
    """Serving sends a prompt to a stage as prefill calls of its prefill_chunk, the last one
    short: each call's logits rows equal llama.cpp's one batch of the whole prompt."""
    m = models[name]
    ids = _ids(sum(calls), m.vocab)
    ref = llama_logits(m.gguf, ids, repack=False, n_ctx=N_CTX)
    cfg = StageConfig(n_ctx=N_CTX, n_threads=1)
    rows = []
    with chain("ggml", m.pkg, [f"0..{m.layers // 2}", f"{m.layers // 2}..{m.layers}"], cfg) as ch:
        start = 0
        for n in calls:
            out = ch.prefill("s", ids[start : start + n], start=start, all_logits=True).logits
            assert out is not None
            rows.append(out)
            start += n
    assert np.array_equal(np.concatenate(rows), ref)


def test_the_shapes_follow_llama_cpp() -> None:
    """The cells a context holds and attention views (llama.cpp pads both to 256), and the
    rows a prefill chunk computes."""
    assert [kv_length(p) for p in (0, 1, 255, 256, 257, 512, 1000)] == [
        256, 256, 256, 256, 512, 512, 1024,
    ]  # fmt: skip
    assert KV_PAD == 256 and PREFILL_MIN_ROWS == 8
    # a chunk computes at least 8 rows, or the whole prompt so far when that is shorter
    assert prefill_rows(1, 1) == 1
    assert prefill_rows(1, 5) == 5
    assert prefill_rows(3, 300) == 8
    assert prefill_rows(7, 7) == 7
    assert prefill_rows(9, 9) == 9
    assert prefill_rows(128, 300) == 128
    for bad in ((0, 5), (6, 5)):
        with pytest.raises(ValueError):
            prefill_rows(*bad)


# --- SmolLM2-135M (llama architecture, Q4_1 layers, F16 KV) ---------------------------------------
# row 7 of the 8- and the 9-token prompt differed by 0.668 logits in the old engine
DRIFT_IDS = [6403, 1980, 253, 655, 28, 260, 2240, 282, 23324]


@pytest.mark.slow
def test_smollm_position_7_does_not_depend_on_the_prompt_length(
    smollm_package: Path, smollm_gguf: Path
) -> None:
    """Row 7 of the 8- and of the 9-token prompt: equal, as llama.cpp's are (the old engine:
    0.668 apart, equal to llama.cpp only at lengths <= 8 or multiples of 8)."""
    ref = llama_logits(smollm_gguf, DRIFT_IDS, repack=False)
    with chain("ggml", smollm_package, ["0..30"], StageConfig(n_ctx=512, n_threads=1)) as ch:
        eight = ch.logits(DRIFT_IDS[:8], all_positions=True)
        nine = ch.logits(DRIFT_IDS, all_positions=True)
    assert np.array_equal(eight[7], nine[7])
    assert np.array_equal(nine, ref)


@pytest.mark.slow
def test_smollm_long_prompt_chunked_as_serving_and_run_equals_llama_cpp(
    smollm_package: Path, smollm_gguf: Path
) -> None:
    """A 300-token prompt prefilled in serving's 128-row chunks and in run's 512: every
    position's logits equal llama.cpp's one batch."""
    ids = _ids(300, 49152)
    ref = llama_logits(smollm_gguf, ids, repack=False)
    for chunk in (128, 512):
        cfg = StageConfig(n_ctx=512, n_batch=chunk, n_threads=1)
        with chain("ggml", smollm_package, ["0..15", "15..30"], cfg) as ch:
            got = ch.logits(ids, all_positions=True)
        assert np.array_equal(got, ref), (chunk, np.abs(got - ref).max())


@pytest.mark.slow
def test_gemma_long_prompt_in_serving_chunks_equals_llama_cpp(
    gemma_package: Path, gemma_gguf: Path
) -> None:
    """gemma3-270m (Q4_K and Q6_K matrices, sliding and global layers): 300 positions in
    128-row chunks over two stages equal llama.cpp's one batch (before: up to 1.86 apart; in
    one 512-row chunk 4.08)."""
    ids = _ids(300, 262144)
    ref = llama_logits(gemma_gguf, ids, repack=False)
    cfg = StageConfig(n_ctx=512, n_batch=128, n_threads=1)
    with chain("ggml", gemma_package, ["0..9", "9..18"], cfg) as ch:
        got = ch.logits(ids, all_positions=True)
    assert np.array_equal(got, ref), np.abs(got - ref).max()
