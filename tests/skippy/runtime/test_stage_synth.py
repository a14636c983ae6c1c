"""The stage runtime on tiny synthetic models of every supported architecture.

References no one here wrote: llama.cpp's logits at every position (llama-cpp-python, one
batch). Without weight repacking llama.cpp runs the same ggml kernels on the same bytes, so
the ggml engine must equal it bit for bit; with repacking (its default) top-1 must agree at
every position. The numpy engine is an f32 oracle: close to both, never bit-equal.
Split == whole: for each engine, chaining stages at boundaries 1, L/2, L-1 and three stages
gives logits bit-identical to the whole range.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

import synth_gguf
from pkgtools import make_package
from stagetools import all_logits, chain, llama_logits, split_ranges, stage_loads

from skippy.errors import UsageError
from skippy.runtime.chain import StageChain
from skippy.runtime.ggml_engine import GgmlStage
from skippy.runtime.numpy_engine import NumpyStage
from skippy.runtime.sampling import Sampler, SamplingParams
from skippy.runtime.stage import Stage, StageConfig

pytestmark = pytest.mark.llama

IDS = [1, 5, 9, 17, 33, 65, 3, 100, 7, 12, 90, 44]  # a short prompt, as ids (the synthetic
# vocabulary cannot encode most text: see tests/skippy/runtime/test_prompt_guard.py)
ARCHS = ("llama", "qwen3", "qwen2", "gemma3")
# |numpy f32 - llama.cpp| on these models, measured: 0.016-0.019 (ggml quantizes activations to
# Q8 for quantized matmuls and keeps the KV cache in F16; the oracle does neither).
NUMPY_TOLERANCE = 0.05


@dataclass(frozen=True)
class Synth:
    arch: str
    gguf: Path
    pkg: Path
    layers: int = 4


@pytest.fixture(scope="module")
def synth(synth_dir, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Synth]:
    root = tmp_path_factory.mktemp("stage_synth")
    sources = {
        "llama": synth_dir.llama,
        "gemma3": synth_dir.gemma,  # written with general.alignment = 64
        "qwen3": synth_gguf.qwen3_like(root / "qwen3.gguf"),
        "qwen2": synth_gguf.qwen2_like(root / "qwen2.gguf"),
    }
    out = {}
    for arch, src in sources.items():
        pkg = root / f"pkg-{arch}"
        make_package(src, pkg, model_id=f"acme/{arch}-GGUF:Q8_0")
        out[arch] = Synth(arch, src, pkg)
    return out


@pytest.fixture(scope="module")
def reference(synth: dict[str, Synth]) -> dict[tuple[str, bool], np.ndarray]:
    """llama.cpp's logits per (arch, repack)."""
    return {
        (a, repack): llama_logits(s.gguf, IDS, repack=repack, n_ctx=128)
        for a, s in synth.items()
        for repack in (False, True)
    }


@pytest.fixture(scope="module")
def whole(synth: dict[str, Synth]) -> dict[tuple[str, str], np.ndarray]:
    """Each engine's logits over the whole range, per (arch, engine)."""
    return {
        (a, engine): all_logits(engine, s.pkg, [f"0..{s.layers}"], IDS)
        for a, s in synth.items()
        for engine in ("ggml", "numpy")
    }


# --- against llama.cpp --------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_ggml_equals_llama_cpp_bit_for_bit(arch: str, whole, reference) -> None:
    got = whole[(arch, "ggml")]
    assert got.shape == (len(IDS), 128) and got.dtype == np.float32
    assert np.array_equal(got, reference[(arch, False)])


@pytest.mark.parametrize("arch", ARCHS)
def test_top1_agrees_with_default_llama_cpp_at_every_position(arch: str, whole, reference) -> None:
    ref = reference[(arch, True)]
    assert list(whole[(arch, "ggml")].argmax(axis=1)) == list(ref.argmax(axis=1))


@pytest.mark.parametrize("arch", ARCHS)
def test_numpy_oracle_is_close_to_llama_cpp(arch: str, whole, reference) -> None:
    got, ref = whole[(arch, "numpy")], reference[(arch, False)]
    err = np.abs(got - ref)
    assert float(err.max()) <= NUMPY_TOLERANCE
    assert float(err.max()) > 0  # an independent computation, not the same kernels
    # top-1 agrees wherever llama.cpp's top two are further apart than the tolerance
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * NUMPY_TOLERANCE
    assert clear.any()
    assert np.array_equal(got.argmax(1)[clear], ref.argmax(1)[clear])


# --- split == whole -------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["ggml", "numpy"])
@pytest.mark.parametrize("arch", ARCHS)
def test_split_equals_whole_bit_for_bit(arch: str, engine: str, synth, whole) -> None:
    s = synth[arch]
    for ranges in split_ranges(s.layers):
        got = all_logits(engine, s.pkg, ranges, IDS)
        assert np.array_equal(got, whole[(arch, engine)]), ranges


def test_each_stage_loads_only_its_own_selection(synth) -> None:
    s = synth["llama"]
    loads = stage_loads(s.pkg, ["0..1", "1..3", "3..4"])
    roles = [load.part_roles for load in loads]
    assert roles[0] == ("metadata", "embeddings", "layer")
    assert roles[1] == ("metadata", "layer", "layer")
    assert roles[2] == ("metadata", "layer", "output")  # untied: no embeddings
    with chain("ggml", s.pkg, ["0..1", "1..3", "3..4"]) as ch:
        mid = ch.stages[1]
        assert isinstance(mid, GgmlStage)
        assert mid.weights is not None
        names = set(mid.weights.tensors)
        assert names and all(n.startswith(("blk.1.", "blk.2.", "rope_freqs")) for n in names)
        d = mid.descriptor
        assert (d.input_kind, d.output_kind, d.vocab) == ("activations", "activations", None)
        assert ch.stages[0].descriptor.input_kind == "tokens"
        assert ch.stages[2].descriptor.output_kind == "logits"


# --- sessions: chunked prefill, decode, truncate, several sessions ------------------------------
@pytest.mark.parametrize("engine", ["ggml", "numpy"])
def test_decode_continues_prefill(engine: str, synth, whole) -> None:
    """Prefill 5 tokens, decode the rest one by one: each step's logits match the one-batch
    logits at that position (not bit-equal: other matmul shapes)."""
    want = whole[("llama", engine)]
    with chain(engine, synth["llama"].pkg, ["0..2", "2..4"]) as ch:
        first = ch.prefill("s", IDS[:5])
        assert first.logits is not None and first.logits.shape == (1, 128)
        rows = [first.logits[-1]]
        for pos in range(5, len(IDS)):
            out = ch.decode("s", pos, IDS[pos])
            assert out.logits is not None
            rows.append(out.logits[-1])
    np.testing.assert_allclose(np.stack(rows), want[4:], atol=2e-3)


def test_chunked_prefill_matches_one_batch(synth, whole) -> None:
    with chain(
        "ggml", synth["qwen3"].pkg, ["0..4"], StageConfig(n_ctx=64, n_batch=5, n_threads=1)
    ) as ch:
        got = ch.logits(IDS, all_positions=True)
    np.testing.assert_allclose(got, whole[("qwen3", "ggml")], atol=2e-3)


def test_truncate_then_replay_is_bit_identical(synth) -> None:
    with chain("ggml", synth["gemma3"].pkg, ["0..2", "2..4"]) as ch:
        a = ch.prefill("s", IDS, all_logits=True).logits
        for s in ch.stages:
            s.truncate("s", 4)
            assert s.session_length("s") == 4
        b = ch.prefill("s", IDS[4:], start=4, all_logits=True).logits
        ch.free("s")
        c = ch.prefill("s", IDS[:4]).logits
    assert a is not None and b is not None and c is not None
    assert np.array_equal(a[4:], b)


def test_sessions_are_independent(synth) -> None:
    with chain("ggml", synth["llama"].pkg, ["0..4"]) as ch:
        alone = ch.prefill("a", IDS, all_logits=True).logits
        ch.free("a")
        ch.prefill("x", IDS[::-1])
        ch.prefill("a", IDS[:6])
        ch.decode("x", len(IDS), 3)
        rest = ch.prefill("a", IDS[6:], start=6, all_logits=True).logits
    assert alone is not None and rest is not None
    np.testing.assert_allclose(rest, alone[6:], atol=2e-3)


# --- the stage API refuses bad calls with codes -------------------------------------------------
@pytest.fixture(scope="module")
def stages(synth) -> list[Stage]:
    loads = stage_loads(synth["llama"].pkg, ["0..2", "2..4"])
    cfg = StageConfig(n_ctx=16, max_sessions=2, n_threads=1)
    made: list[Stage] = [GgmlStage(loads[0], cfg), NumpyStage(loads[1], cfg)]
    yield made
    for s in made:
        s.close()


@pytest.mark.parametrize(
    "call,code",
    [
        (lambda s0, s1: s0.prefill("a", 0, np.array([[1.0]])), "bad_stage_input"),
        (lambda s0, s1: s0.prefill("a", 0, np.array([], dtype=np.int32)), "empty_prompt"),
        (lambda s0, s1: s0.prefill("a", 0, np.array([128])), "token_out_of_range"),
        (lambda s0, s1: s0.prefill("a", 0, np.array([-1])), "token_out_of_range"),
        (lambda s0, s1: s0.prefill("a", 3, np.array([1])), "position_mismatch"),
        (lambda s0, s1: s0.prefill("a", 0, np.arange(17)), "context_full"),
        (lambda s0, s1: s0.decode("a", 0, np.array([1, 2])), "bad_stage_input"),
        (lambda s0, s1: s0.prefill("bad id", 0, np.array([1])), "invalid_session_id"),
        (lambda s0, s1: s0.truncate("a", 1), "invalid_truncate"),
        (lambda s0, s1: s1.prefill("a", 0, np.array([1, 2])), "bad_stage_input"),
        (
            lambda s0, s1: s1.prefill("a", 0, np.zeros((2, 64), dtype=np.float64)),
            "bad_stage_input",
        ),
        (
            lambda s0, s1: s1.prefill("a", 0, np.full((1, 64), np.nan, dtype=np.float32)),
            "non_finite_activations",
        ),
    ],
)
def test_bad_calls_are_coded_errors(stages, call, code: str) -> None:
    with pytest.raises(UsageError) as e:
        call(*stages)
    assert e.value.code == code and e.value.exit_code == 2
    for s in stages:
        assert s.session_length("a") == 0  # nothing half-done


def test_session_cap_and_free(stages) -> None:
    s0 = stages[0]
    for sid in ("p", "q"):
        s0.prefill(sid, 0, np.array([1, 2]))
    with pytest.raises(UsageError) as e:
        s0.prefill("r", 0, np.array([1]))
    assert e.value.code == "too_many_sessions"
    s0.free("p")
    s0.free("p")  # freeing twice is a no-op
    s0.prefill("r", 0, np.array([1]))
    for sid in ("q", "r"):
        s0.free(sid)


def test_descriptors_must_fit_together(stages, synth) -> None:
    s0, s1 = stages
    with pytest.raises(UsageError) as e:  # adjacent and the same width, but other engines
        s1.descriptor.check_follows(s0.descriptor)
    assert e.value.code == "stage_mismatch" and s0.descriptor.runtime_version in e.value.message
    other = stage_loads(synth["qwen3"].pkg, ["2..4"])[0]
    with GgmlStage(other, StageConfig(n_ctx=16, n_threads=1)) as q:
        with pytest.raises(UsageError) as e:
            q.descriptor.check_follows(s0.descriptor)
        assert e.value.code == "stage_mismatch"
        assert "manifests" in e.value.message
    d = s0.descriptor.to_dict()
    assert d["layer_start"] == 0 and d["layer_end"] == 2 and d["activation_dtype"] == "f32"
    assert d["engine"] == "ggml" and "ggml/0.25.3" in d["runtime_version"]
    assert d["manifest_sha256"] and d["input"] == "tokens" and d["output"] == "activations"


# --- sampling through the last stage --------------------------------------------------------------
def test_seeded_sampling_is_reproducible(synth) -> None:
    params = SamplingParams(temperature=1.5, top_k=20, top_p=0.9, seed=7)
    with chain("ggml", synth["llama"].pkg, ["0..4"]) as ch:
        a = ch.generate(IDS, max_tokens=12, sampling=params)
        b = ch.generate(IDS, max_tokens=12, sampling=params)
        greedy = ch.generate(IDS, max_tokens=12)
        logits = ch.logits(IDS)
    assert a.tokens == b.tokens and len(a.tokens) >= 1
    assert greedy.tokens[0] == int(np.argmax(logits))
    assert Sampler(SamplingParams(temperature=1.0, top_k=1)).sample(logits) == greedy.tokens[0]


# --- the reused decode graph and the greedy head on ggml ---------------------
def _decode_rows(ch: StageChain, ids: list[int], prefill: int) -> np.ndarray:
    """The prefill's last logits row, then each one-token decode's, through ``ch``."""
    out = ch.prefill("d", ids[:prefill]).logits
    assert out is not None
    rows = [out[-1]]
    for pos in range(prefill, len(ids)):
        step = ch.decode("d", pos, ids[pos])
        assert step.logits is not None
        rows.append(step.logits[-1])
    ch.free("d")
    return np.stack(rows)


def _greedy_decode(ch: StageChain, ids: list[int], prefill: int) -> list[int]:
    ch.prefill("g", ids[:prefill])
    tokens = []
    for pos in range(prefill, len(ids)):
        step = ch.decode("g", pos, ids[pos], sampler=Sampler())
        assert step.token is not None and step.logits is None  # no logits crossed into Python
        tokens.append(step.token)
    ch.free("g")
    return tokens


@pytest.fixture(scope="module")
def gemma_swa(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """The synthetic gemma3 with a 4-position sliding window, so decode crosses it."""
    root = tmp_path_factory.mktemp("gemma_swa")
    src = synth_gguf.gemma_like(root / "gemma-swa.gguf", sliding_window=4)
    make_package(src, root / "pkg", model_id="acme/gemma3-swa-GGUF:Q8_0")
    return Synth("gemma3", src, root / "pkg")


@pytest.mark.parametrize("arch", [*ARCHS, "gemma3-swa"])
def test_reused_decode_graph_equals_llama_cpp(arch: str, synth, gemma_swa) -> None:
    """Decoding through one graph per session (resized, inputs reset per token) gives the
    logits of llama.cpp decoding token by token (repacking off), bit for bit; in a 2-stage
    split too. The greedy head on ggml picks
    numpy's argmax of those logits."""
    s = gemma_swa if arch == "gemma3-swa" else synth[arch]
    prefill, cfg = 3, StageConfig(n_ctx=32, n_threads=1)
    ref = llama_logits(s.gguf, IDS, repack=False, n_ctx=32, prefill=prefill)
    with chain("ggml", s.pkg, ["0..4"], cfg) as ch:
        reused = _decode_rows(ch, IDS, prefill)
        greedy = _greedy_decode(ch, IDS, prefill)
    with chain("ggml", s.pkg, ["0..2", "2..4"], cfg) as ch:
        split = _decode_rows(ch, IDS, prefill)
    assert np.array_equal(reused, ref)
    assert np.array_equal(split, reused)
    assert greedy == [int(i) for i in np.argmax(reused[1:], axis=1)]


def test_greedy_head_on_ties_takes_the_first_maximum(tmp_path: Path) -> None:
    """An all-zero head makes every logit 0: ggml's own argmax would pick the last id; the
    greedy decode answers numpy's (and llama.cpp's greedy sampler's) first maximum."""
    src = synth_gguf.llama_like(tmp_path / "flat.gguf", zero_head=True)
    make_package(src, tmp_path / "pkg", model_id="acme/flat-GGUF:Q8_0")
    with chain("ggml", tmp_path / "pkg", ["0..4"], StageConfig(n_ctx=16, n_threads=1)) as ch:
        logits = _decode_rows(ch, IDS[:4], 2)
        tokens = _greedy_decode(ch, IDS[:4], 2)
    assert not logits.any()
    assert tokens == [0, 0]


def test_adaptive_threads_change_nothing_but_the_thread_count(synth) -> None:
    """A stage whose threads follow the machine's load computes the same
    logits as a fixed one-thread stage: each output row is one thread's dot products."""
    cfg = StageConfig(n_ctx=32, n_threads=2, adaptive_threads=True)
    with chain("ggml", synth["qwen3"].pkg, ["0..4"], cfg) as ch:
        stage = ch.stages[0]
        assert isinstance(stage, GgmlStage) and stage.threads_now in (1, 2)
        adaptive = _decode_rows(ch, IDS, 3)
    with chain("ggml", synth["qwen3"].pkg, ["0..4"], StageConfig(n_ctx=32, n_threads=1)) as ch:
        fixed = _decode_rows(ch, IDS, 3)
    assert np.array_equal(adaptive, fixed)
