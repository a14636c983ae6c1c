"""The NextN (MTP) draft head (skippy/runtime/nextn.py) and native-mtp speculation on the ggml
stage runtime.

- On the canary's synthetic glm4moe and deepseek2 (four trunk layers and one NextN layer; the
  head is the family's own layer, MLA for deepseek2), the first draft's logits after a prompt
  are llama.cpp's own MTP head's bit for bit (its MTP context fed the target's h_nextn rows:
  ``LlamaOracle.mtp_logits``), every dtype, whole and split.
- The head's logits equal an f32 numpy reference of llama.cpp's ``graph_mtp`` (enorm of the
  token's embedding and hnorm of the trunk's output-normed hidden state before it,
  concatenated, ``eh_proj``, the family's layer over the block's weights with the head's own
  cache, ``shared_head_norm`` and the head) within the engine's quantized-activation error,
  over two consecutive positions (the head's cache catches up on a committed token).
- The trunk never runs the NextN block: whole and split, the logits are those of the same
  model without it.
- ``native-mtp`` generation is plain decoding's output, greedy and seeded, whole and split;
  with a head that drafts the target's own tokens every draft is accepted through the verify
  windows; a final stage without a head is refused with ``native_mtp_unavailable``.

The other tests use a llama-shaped package with one NextN block (``synth_gguf.nextn_like``:
the numpy reference has no glm4moe); its weights are random, so the real head's drafts are
rarely accepted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import synth_gguf
from pkgtools import make_package
from stagetools import chain, stage_loads

from skippy.errors import UsageError
from skippy.generation import SpeculativePlan, parse_generation, resolve_speculative_plan
from skippy.package.manifest import parse_manifest
from skippy.runtime.canary import synth
from skippy.runtime.canary.check import package_model
from skippy.runtime.canary.oracle import LlamaOracle
from skippy.runtime.chain import StageChain
from skippy.runtime.families.base import T
from skippy.runtime.model import tensor_name
from skippy.runtime.numpy_engine import NumpyStage, rms_norm
from skippy.runtime.sampling import SamplingParams
from skippy.runtime.stage import StageConfig
from skippy.runtime.token_loop import generate_speculative

pytestmark = pytest.mark.llama

LAYERS = 5  # four trunk layers and the NextN block (layer 4)
IDS = [1, 5, 9, 17, 33, 65, 3, 100]
N = 24
# ggml quantizes activations to Q8 for quantized matmuls and keeps K/V in F16; numpy does not
# (tests/skippy/runtime/test_stage_synth.py measured 0.016-0.019 on whole models)
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nextn")
    src = synth_gguf.nextn_like(root / "m.gguf", arch="llama", n_layers=LAYERS)
    make_package(src, root / "pkg", model_id="acme/mtp-GGUF:Q8_0")
    return root / "pkg"


@pytest.fixture(scope="module")
def plan(pkg: Path) -> SpeculativePlan:
    manifest = parse_manifest((pkg / "model-package.json").read_bytes())
    generation = parse_generation(manifest.generation, layer_count=manifest.layer_count)
    resolved = resolve_speculative_plan(package=generation)  # auto: the package's default
    assert (resolved.mode, resolved.strategy_id) == ("native-mtp", "mtp")
    return resolved


@pytest.fixture
def whole(pkg: Path) -> Iterator[StageChain]:
    with chain("ggml", pkg, [f"0..{LAYERS}"]) as ch:
        yield ch


def _reference(pkg: Path, drafts: Sequence[int]) -> list[np.ndarray]:
    """The head's logits in f32 numpy: the trunk over ``IDS + drafts[:-1]``; the block over
    the prompt's tokens (each with the trunk's hidden state before it, zeros for the first),
    then at positions len(IDS).. over (drafts[i], the hidden state before it)."""
    with NumpyStage(stage_loads(pkg, [f"0..{LAYERS}"])[0], StageConfig(n_ctx=64)) as ref:
        w, eps = ref._w, ref.spec.rms_eps
        seq = [*IDS, *drafts[:-1]]
        x = w[tensor_name(T.TOKEN_EMBD)][seq].astype(np.float32)
        trunk = ref._new_session()
        positions = np.arange(len(seq))
        for il in range(LAYERS - 1):
            x = ref._block(il, x, positions, trunk, 0)
        hidden = rms_norm(x, w[tensor_name(T.OUTPUT_NORM)], eps)
        head_cache = ref._new_session()
        il = LAYERS - 1
        before = np.concatenate([np.zeros((1, hidden.shape[1]), np.float32), hidden])

        def head(first: int, tokens: Sequence[int]) -> np.ndarray:
            p = np.arange(first, first + len(tokens))
            e = rms_norm(
                w[tensor_name(T.TOKEN_EMBD)][list(tokens)], w[tensor_name(T.NEXTN_ENORM, il)], eps
            )
            h = rms_norm(before[p], w[tensor_name(T.NEXTN_HNORM, il)], eps)
            z = np.concatenate([e, h], axis=1) @ w[tensor_name(T.NEXTN_EH_PROJ, il)].T
            y = ref._block(il, z.astype(np.float32), p, head_cache, first)
            y = rms_norm(y[-1:], w[tensor_name(T.NEXTN_SHARED_HEAD_NORM, il)], eps)
            return (y @ w[tensor_name(T.OUTPUT)].T)[0]

        head(0, IDS)  # the prompt's positions, in the head's cache
        return [head(len(IDS) + i, [token]) for i, token in enumerate(drafts)]


HEADS = [(f, d) for f in ("glm4moe", "deepseek2") for d in synth.family(f).dtypes]


@pytest.mark.parametrize(("family", "dtype"), HEADS, ids=[f"{f}-{d}" for f, d in HEADS])
def test_the_nextn_head_equals_llama_cpps_mtp_head(tmp_path: Path, family: str, dtype: str) -> None:
    spec = synth.family(family)
    src, glm = package_model(spec, dtype, tmp_path)
    trunk = spec.dims().n_layers
    prompts = ([1, 5, 9, 17, 33, 65, 3, 100], [4, 8, 15, 16, 23, 42, 7, 9, 11, 2, 99, 101, 6])
    pending = 7  # any token: the head does not ask whether it was the target's
    with LlamaOracle(src, load_mtp=True) as oracle:
        want = [oracle.mtp_logits(ids, pending) for ids in prompts]
    for ranges in ([f"0..{trunk + 1}"], ["0..2", f"2..{trunk + 1}"]):
        with chain("ggml", glm, ranges) as ch:
            stage: Any = ch.stages[-1]
            assert stage.drafts
            for ids, ref in zip(prompts, want, strict=True):
                stage.expect_drafts("s")
                ch.prefill("s", ids)
                got = stage.draft("s", 0, [*ids, pending])  # the prompt, then the pending
                ch.free("s")
                np.testing.assert_array_equal(got, ref, err_msg=f"{ranges} {len(ids)}")


def test_the_head_matches_a_numpy_reference_over_two_positions(
    pkg: Path, whole: StageChain
) -> None:
    stage: Any = whole.stages[-1]
    assert stage.drafts and stage.spec.n_layer_nextn == 1
    drafts = [7, 11]
    stage.expect_drafts("s")  # before the prompt: the head's cache covers it
    whole.prefill("s", IDS)
    first = stage.draft("s", 0, [*IDS, drafts[0]])  # the prompt, then the pending token
    whole.decode("s", len(IDS), drafts[0])  # the trunk commits it
    second = stage.draft("s", len(IDS), drafts)  # the head's cache catches up on it
    want = _reference(pkg, drafts)
    for got, ref in zip((first, second), want, strict=True):
        assert np.abs(got - ref).max() < TOLERANCE * max(1.0, float(np.abs(ref).max()))
        assert int(np.argmax(got)) == int(np.argmax(ref))
    assert not np.array_equal(first, second)


def test_the_head_refuses_a_pending_token_the_trunk_is_not_at(whole: StageChain) -> None:
    stage: Any = whole.stages[-1]
    whole.prefill("s", IDS)
    with pytest.raises(UsageError) as err:
        stage.draft("s", len(IDS), [7])  # no expect_drafts: the trunk kept no hidden rows
    assert err.value.code == "bad_stage_input" and "expect_drafts" in err.value.message
    whole.free("s")
    stage.expect_drafts("s")
    whole.prefill("s", IDS)
    with pytest.raises(UsageError) as err:
        stage.draft("s", len(IDS) + 1, [7])  # the trunk holds len(IDS) positions
    assert err.value.code == "bad_stage_input"
    with pytest.raises(UsageError) as err:
        stage.draft("s", len(IDS), [10_000])
    assert err.value.code == "token_out_of_range"


def test_the_trunk_never_runs_the_nextn_block(pkg: Path) -> None:
    """Whole and split (the block with the final stage), the same logits: the block's weights
    never reach the trunk, and the numpy reference skips it too."""
    with chain("ggml", pkg, [f"0..{LAYERS}"]) as ch:
        whole = ch.logits(IDS, all_positions=True)
    with chain("ggml", pkg, ["0..2", f"2..{LAYERS}"]) as ch:
        split = ch.logits(IDS, all_positions=True)
    with chain("numpy", pkg, [f"0..{LAYERS}"]) as ch:
        ref = ch.logits(IDS, all_positions=True)
    np.testing.assert_array_equal(whole, split)
    assert np.abs(whole - ref).max() < TOLERANCE * max(1.0, float(np.abs(ref).max()))


def test_plain_sessions_batch_and_a_drafting_one_decodes_alone(pkg: Path) -> None:
    """Two plain sessions' steps on a final stage with a head run as one batch graph, each
    equal to its decode alone; with a drafting session among them the steps run one graph
    each (the head's hidden rows), with the same outputs."""
    from skippy.runtime.stage import DecodeStep

    ids = np.asarray(IDS, dtype=np.int64)
    with chain("ggml", pkg, [f"0..{LAYERS}"]) as ch:
        stage: Any = ch.stages[-1]
        alone = []
        for name, token in (("a", 7), ("b", 9)):
            stage.prefill(name, 0, ids)
            alone.append(stage.decode(name, len(IDS), np.asarray([token])).logits)
            stage.truncate(name, len(IDS))
        steps = [DecodeStep(n, len(IDS), np.asarray([t])) for n, t in (("a", 7), ("b", 9))]
        together = stage.decode_batch(steps)
        assert len(stage._batch_graphs) == 1
        for got, want in zip(together, alone, strict=True):
            np.testing.assert_array_equal(got.logits, want)
        stage.free("a")
        stage.expect_drafts("a")
        stage.prefill("a", 0, ids)
        stage.truncate("b", len(IDS))
        mixed = stage.decode_batch(steps)
        assert len(stage._batch_graphs) == 0  # the old pair's graph went with session a
        for got, want in zip(mixed, alone, strict=True):
            np.testing.assert_array_equal(got.logits, want)
        assert int(np.argmax(stage.draft("a", 0, [*IDS, 7, 3]))) >= 0  # its rows were kept


def test_a_stage_of_only_the_nextn_block_is_refused(pkg: Path) -> None:
    with pytest.raises(UsageError) as err, chain("ggml", pkg, ["0..4", "4..5"]):
        pass
    assert err.value.code == "nextn_stage_cut"


@pytest.mark.parametrize("ranges", [[f"0..{LAYERS}"], ["0..2", f"2..{LAYERS}"]])
def test_native_mtp_gives_plain_decodings_tokens(
    pkg: Path, plan: SpeculativePlan, ranges: list[str]
) -> None:
    with chain("ggml", pkg, ranges) as ch:
        for sampling in (None, SamplingParams(temperature=0.9, seed=7, top_k=20)):
            plain = ch.generate(IDS, max_tokens=N, sampling=sampling).tokens
            gen, stats = generate_speculative(ch, IDS, max_tokens=N, plan=plan, sampling=sampling)
            assert gen.tokens == plain
            assert stats.strategy == "mtp" and stats.mode == "native-mtp"
            # one draft per step, each verified (random weights: rarely accepted)
            assert stats.max_window == 1 and stats.verify_passes == stats.proposed_tokens > 0
            assert stats.verify_passes + stats.decode_steps + stats.accepted_tokens == N - 1


class _Oracle:
    """The final stage with a head that drafts ``right`` tokens: the target's own next token
    at positions ``right`` selects, else a wrong one; everything else is the stage's."""

    def __init__(self, stage: Any, start: int, target: Sequence[int], right: Any) -> None:
        self._stage, self._start, self._target, self._right = stage, start, target, right
        self.drafted: list[tuple[int, int]] = []  # (index into the target, draft)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stage, name)

    def draft(self, session: str, start: int, tokens: Sequence[int]) -> np.ndarray:
        self._stage.draft(session, start, tokens)  # the real head still runs (its cache)
        i = start + len(tokens) - self._start  # the draft is the (i+1)-th generated token
        token = self._target[i] if self._right(i) else (self._target[i] + 1) % 128
        self.drafted.append((i, token))
        logits = np.zeros(128, dtype=np.float32)
        logits[token] = 1.0
        return logits


@pytest.mark.parametrize("every", [1, 3])
def test_an_accepted_draft_is_committed_through_the_verify_window(
    pkg: Path, plan: SpeculativePlan, every: int
) -> None:
    """every 1: each draft is the target's token; every 3: those at indices divisible by 3
    are wrong (an accepted draft moves the index by 2, a rejected one by 1: a mix)."""
    with chain("ggml", pkg, ["0..2", f"2..{LAYERS}"]) as ch:
        target = ch.generate(IDS, max_tokens=N).tokens
        oracle = _Oracle(ch.stages[-1], len(IDS), target, lambda i: every == 1 or i % every)
        spec = StageChain([ch.stages[0], oracle], None)
        gen, stats = generate_speculative(spec, IDS, max_tokens=N, plan=plan)
    assert gen.tokens == target
    right = sum(1 for i, d in oracle.drafted if d == target[i])
    assert stats.accepted_tokens == right > 0
    assert every == 1 or right < len(oracle.drafted)
    assert stats.proposed_tokens == len(oracle.drafted)
    if every == 1:  # every draft accepted: each verify window commits two tokens
        assert stats.acceptance == 1.0 and stats.verify_passes <= N // 2


def test_a_final_stage_without_a_head_is_refused_with_its_reason(
    pkg: Path, plan: SpeculativePlan
) -> None:
    with chain("numpy", pkg, [f"0..{LAYERS}"]) as ch, pytest.raises(UsageError) as err:
        generate_speculative(ch, IDS, max_tokens=4, plan=plan)
    assert err.value.code == "native_mtp_unavailable"
    assert "numpy" in err.value.message


def test_run_executes_native_mtp_or_falls_back_with_its_reason(
    pkg: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """`run` resolves the package's default (auto -> mtp): the ggml engine drafts with the head
    and reports it; the numpy engine has no head, so it decodes plainly and says why, in the
    log line and in the JSON."""
    import json

    from skippy.cli import main

    out = {}
    for engine in ("ggml", "numpy"):
        rc = main(["run", str(pkg), "--prompt", "Ω a", "--max-tokens", "12", "--engine", engine,
                   "--threads", "1", "--json"])  # fmt: skip
        assert rc == 0
        out[engine] = json.loads(capsys.readouterr().out)
    ggml, numpy_ = out["ggml"]["speculative"], out["numpy"]["speculative"]
    assert (ggml["mode"], ggml["strategy"]) == ("native-mtp", "mtp")
    assert ggml["proposed_tokens"] == ggml["verify_passes"] > 0 and "fallback_reason" not in ggml
    assert numpy_["mode"] == "native-mtp" and "proposed_tokens" not in numpy_
    assert "numpy" in numpy_["fallback_reason"]
    assert any(
        "native_mtp_unavailable" in r.getMessage() and "fallback" in r.getMessage()
        for r in caplog.records
    )
