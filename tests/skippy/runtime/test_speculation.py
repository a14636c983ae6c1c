"""Speculative decoding (spec "Speculative Decoding"): the request-local N-gram proposers, the
verify window, acceptance, and identity with plain decoding on the ggml stage runtime.

The identity tests run the real ggml engine on the tiny synthetic models, whole and as a
3-stage chain: for random prompts, proposers, bounds and windows, speculative output must
equal plain decoding token for token, greedy and seeded sampling alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pkgtools import make_package
from stagetools import chain

from skippy.errors import UsageError
from skippy.generation import SpeculativePlan
from skippy.generation.proposers import (
    MAX_BACKOFF_PROPOSALS,
    BackoffProposer,
    DraftBackoff,
    NgramCacheProposer,
    NgramSuffixProposer,
    VerifyWindow,
    make_proposer,
)
from skippy.generation.schema import NgramSource, WindowPolicy
from skippy.runtime.chain import StageChain
from skippy.runtime.sampling import SamplingParams
from skippy.runtime.speculation import accept_draft, answers
from skippy.runtime.stage import StageConfig
from skippy.runtime.token_loop import generate_speculative


def cache(lo: int = 1, hi: int = 3, mpt: int = 8) -> NgramSource:
    return NgramSource(type="ngram-cache", ngram_min=lo, ngram_max=hi, max_proposal_tokens=mpt)


def suffix(lo: int = 3, hi: int = 8, mpt: int = 8) -> NgramSource:
    return NgramSource(type="ngram-suffix", ngram_min=lo, ngram_max=hi, max_proposal_tokens=mpt)


def plan(source: NgramSource, window: WindowPolicy) -> SpeculativePlan:
    return SpeculativePlan(
        mode=source.type,
        requested=source.type,
        requested_source="cli",
        strategy_id=source.type,
        ngram=source,
        window=window,
    )


# --- proposers -----------------------------------------------------------------------------------
def test_ngram_cache_drafts_the_most_frequent_follower_longest_ngram_first() -> None:
    p = make_proposer(cache(1, 2), [5, 1, 2, 5, 1, 3, 5, 1, 3, 9, 5, 1])
    # after (5, 1): 3 twice, 2 once -> 3; then (1, 3): 5 once, 9 once, tie -> 9 (most recent)
    assert p.propose(2) == [3, 9]
    assert p.propose(1) == [3]


def test_ngram_cache_is_bounded_by_max_proposal_tokens_and_the_limit() -> None:
    p = make_proposer(cache(1, 2, mpt=3), [1, 2] * 10)
    assert p.propose(10) == [1, 2, 1]
    assert p.propose(2) == [1, 2]
    assert p.propose(0) == []
    assert make_proposer(cache(2, 2), [1, 2, 3]).propose(5) == []  # (2, 3) never seen


def test_ngram_suffix_takes_the_longest_earlier_match_not_the_latest() -> None:
    history = [9, 8, 1, 2, 3, 40, 41, 7, 1, 2, 3, 50, 51, 0, 9, 8, 1, 2, 3]
    # the seed (1, 2, 3) ended at 5 and 11; the one at 5 matches (9, 8) further back
    assert make_proposer(suffix(3, 8), history).propose(4) == [40, 41, 7, 1]
    # with ngram_max 3 both match 3 long: the tie keeps the most recent occurrence
    assert make_proposer(suffix(3, 3), history).propose(2) == [50, 51]


def test_ngram_suffix_without_an_earlier_occurrence_drafts_nothing() -> None:
    p = make_proposer(suffix(3, 5), [1, 2, 3, 4, 5, 6])
    assert p.propose(4) == []
    p.extend([1, 2, 3])
    assert p.propose(4) == [4, 5, 6, 1]  # bounded by history: the follower runs into the suffix


def test_proposers_keep_request_local_history() -> None:
    """Spec: history_scope "request": two requests of one source never see each other."""
    src = suffix()
    a, b = make_proposer(src, [1, 2, 3, 4, 1, 2, 3]), make_proposer(src, [7, 8, 9])
    assert a.propose(1) == [4] and b.propose(1) == []
    b.extend([6, 7, 8, 9])
    assert b.propose(1) == [6] and a.propose(1) == [4]


def test_a_proposer_refuses_the_other_type() -> None:
    with pytest.raises(ValueError, match="ngram-suffix"):
        NgramSuffixProposer(cache())
    with pytest.raises(ValueError, match="ngram-cache"):
        NgramCacheProposer(suffix())


@given(
    history=st.lists(st.integers(0, 5), max_size=80),
    lo=st.integers(3, 6),
    span=st.integers(0, 10),
    mpt=st.integers(1, 12),
    limit=st.integers(0, 16),
)
def test_ngram_suffix_drafts_continue_an_earlier_matching_suffix(
    history: list[int], lo: int, span: int, mpt: int, limit: int
) -> None:
    draft = make_proposer(suffix(lo, lo + span, mpt), history).propose(limit)
    assert len(draft) <= min(limit, mpt)
    if draft:  # some earlier end e has the same ngram_min tokens before it and draft after it
        n = len(history)
        assert any(
            history[e - lo : e] == history[n - lo :] and history[e : e + len(draft)] == draft
            for e in range(lo, n)
        )


@given(
    history=st.lists(st.integers(0, 4), max_size=60), lo=st.integers(1, 4), mpt=st.integers(1, 9)
)
def test_ngram_cache_drafts_only_seen_continuations(history: list[int], lo: int, mpt: int) -> None:
    src = cache(lo, 4, mpt)
    draft = make_proposer(src, history).propose(16)
    assert len(draft) <= mpt
    seen = {tuple(history[i - n : i + 1]) for n in range(lo, 5) for i in range(n, len(history))}
    context = list(history)
    for token in draft:  # each drafted token followed its context's n-gram somewhere
        assert any(tuple([*context[len(context) - n :], token]) in seen for n in range(lo, 5))
        context.append(token)


# --- back-off after unhelpful drafts -------------------------------------------------------------
def test_backoff_skips_doubling_proposals_after_unhelpful_drafts_and_resets_on_a_hit() -> None:
    b = DraftBackoff(max_skip=4)
    skips = []
    for _ in range(4):
        b.outcome(False)
        skips.append(b.skip)
        while not b.take():
            pass
    assert skips == [1, 2, 4, 4]  # doubling, capped
    assert b.take()  # the skips are used up: the next proposal may draft
    b.outcome(True)
    b.outcome(False)
    assert b.skip == 1  # a helpful draft reset the doubling


class AlwaysWrong:
    """A proposer whose every draft is rejected: it drafts ``-1`` tokens, never committed."""

    def __init__(self) -> None:
        self.asked = 0

    def extend(self, tokens: object) -> None:
        pass

    def propose(self, limit: int) -> list[int]:
        self.asked += 1
        return [-1] * limit


def test_a_proposer_that_is_always_wrong_drafts_rarely() -> None:
    """The non-repetitive worst case: every match a coincidence. Over 400 steps the wrapped
    proposer drafts only when its back-off allows (1 + 2 + 4 + ... + 32, then every 33rd)."""
    inner = AlwaysWrong()
    p = BackoffProposer(inner)
    drafts = 0
    for step in range(400):
        draft = p.propose(4)
        drafts += bool(draft)
        p.extend([step])  # the target's own token: never the drafted -1
    assert drafts == inner.asked
    assert drafts <= 6 + (400 - 63) // (MAX_BACKOFF_PROPOSALS + 1) + 1
    assert drafts >= 400 // (MAX_BACKOFF_PROPOSALS + 1)  # it keeps trying, rarely


def test_a_proposer_whose_drafts_are_accepted_never_backs_off() -> None:
    history = [1, 2, 3, 4, 5] * 4
    p = make_proposer(suffix(3, 8), history)
    for i in range(40):
        draft = p.propose(3)
        assert draft  # a periodic history always matches, and every draft is right
        p.extend(draft[:1] if i % 2 else draft)  # partly or fully accepted: helpful either way


def test_a_rejected_draft_pauses_drafting_even_where_a_match_exists() -> None:
    p = make_proposer(suffix(3, 8), [7, 8, 9, 1, 7, 8, 9])
    assert p.propose(2) == [1, 7]
    p.extend([5])  # the target committed 5, not the drafted 1: nothing accepted
    p.extend([7, 8, 9])  # (7, 8, 9) matches again...
    assert p.propose(2) == []  # ...but this proposal is skipped: a plain decode step
    assert p.propose(2) == [5, 7]  # then drafting resumes (the latest continuation)


# --- the verify window and acceptance ------------------------------------------------------------
def test_fixed_window_never_moves_and_adaptive_backs_off() -> None:
    fixed = VerifyWindow(WindowPolicy(mode="fixed", initial_window=3, min_window=1, max_window=6))
    fixed.update(3, 0)
    assert fixed.size == 3
    w = VerifyWindow(WindowPolicy(mode="adaptive", initial_window=4, min_window=2, max_window=6))
    w.update(4, 4)
    w.update(5, 5)
    w.update(6, 6)
    assert w.size == 6  # grew after full acceptances, capped at max_window
    w.update(6, 1)
    assert w.size == 3
    w.update(3, 2)
    assert w.size == 2  # halved after a partial acceptance, not below min_window
    w.update(4, 4)
    w.update(3, 0)
    assert w.size == 2  # nothing accepted: straight down to min_window
    w.update(0, 0)
    assert w.size == 2  # no draft: nothing learned


def test_a_verify_answer_must_continue_the_drafts() -> None:
    """What a final stage returns for a window is checked before it is committed: what
    accept_draft can return and nothing else."""
    assert answers([], [7]) and not answers([], [7, 8]) and not answers([], [])
    assert answers([1, 2, 3], [1, 2, 3, 4]) and answers([1, 2, 3], [1, 9]) and answers([1, 2], [5])
    assert not answers([1, 2, 3], [1, 2, 3, 4, 5]) and not answers([1, 2, 3], [2, 2])


def test_accept_draft_commits_the_agreeing_prefix_and_one_target_token() -> None:
    rows = np.eye(10, dtype=np.float32)[[4, 5, 6, 7]]  # the target's argmax per position
    calls: list[int] = []

    def greedy(row: np.ndarray) -> int:
        calls.append(1)
        return int(np.argmax(row))

    assert accept_draft(rows, [4, 5, 6], greedy) == [4, 5, 6, 7]  # all accepted + bonus
    assert accept_draft(rows, [4, 9, 6], greedy) == [4, 5]  # correction at the mismatch
    assert accept_draft(rows[:1], [], greedy) == [4]
    assert len(calls) == 4 + 2 + 1  # rows after a mismatch are never sampled
    with pytest.raises(ValueError, match="rows"):
        accept_draft(rows, [4], greedy)


# --- identity on the ggml stage runtime ----------------------------------------------------------
def _need_ggml() -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")


CHAINS = {
    "llama whole": ("llama", ["0..4"]),
    "gemma3 3 stages": ("gemma", ["0..1", "1..3", "3..4"]),
}


@pytest.fixture(scope="module")
def chains(synth_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, StageChain]]:
    _need_ggml()
    root = tmp_path_factory.mktemp("speculation")
    opened: dict[str, StageChain] = {}
    try:
        for name, (kind, ranges) in CHAINS.items():
            pkg = root / kind
            make_package(getattr(synth_dir, kind), pkg, model_id=f"acme/{kind}-GGUF:Q8_0")
            opened[name] = chain("ggml", pkg, ranges)
        yield opened
    finally:
        for ch in opened.values():
            ch.close()


requests = st.fixed_dictionaries(
    {
        "segment": st.lists(st.integers(1, 127), min_size=2, max_size=7),
        "repeats": st.integers(1, 4),
        "suffix": st.booleans(),
        "lo": st.integers(1, 4),
        "mpt": st.integers(1, 8),
        "window": st.integers(1, 8),
        "adaptive": st.booleans(),
        "seed": st.one_of(st.none(), st.integers(0, 1000)),
    }
)


@pytest.mark.llama
@pytest.mark.parametrize("name", list(CHAINS))
@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(req=requests)
def test_speculative_output_equals_plain_decoding(
    chains: dict[str, StageChain], name: str, req: dict
) -> None:
    ch = chains[name]
    lo = req["lo"] + 2 if req["suffix"] else req["lo"]
    src = suffix(lo, lo + 4, req["mpt"]) if req["suffix"] else cache(lo, 4, req["mpt"])
    mode = "adaptive" if req["adaptive"] else "fixed"
    window = WindowPolicy(mode=mode, initial_window=req["window"], max_window=req["window"])
    ids = req["segment"] * req["repeats"]
    sampling = None if req["seed"] is None else SamplingParams(temperature=0.9, seed=req["seed"])
    plain = ch.generate(ids, max_tokens=24, sampling=sampling)
    spec, stats = generate_speculative(
        ch, ids, max_tokens=24, plan=plan(src, window), sampling=sampling
    )  # exact verify: the same graphs as plain decoding, so identity must hold for any input
    assert spec.tokens == plain.tokens and spec.stop_reason == plain.stop_reason
    assert stats.accepted_tokens <= stats.proposed_tokens
    assert stats.max_window <= min(req["window"], req["mpt"])
    assert all(ch.stages[i].sessions == () for i in range(len(ch.stages)))  # freed


@pytest.mark.llama
def test_a_repetitive_prompt_gets_drafts_accepted(chains: dict[str, StageChain]) -> None:
    ch = chains["gemma3 3 stages"]
    ids = [3, 14, 15, 92, 65, 35] * 4
    window = WindowPolicy(mode="adaptive", initial_window=4, max_window=8)
    plain = ch.generate(ids, max_tokens=32)
    spec, stats = generate_speculative(ch, ids, max_tokens=32, plan=plan(suffix(3, 16), window))
    assert spec.tokens == plain.tokens
    assert stats.verify_passes > 0 and stats.accepted_tokens > 0
    # fewer passes through the chain than tokens (the prefill gives the first): the point
    assert 1 + stats.verify_passes + stats.decode_steps < len(spec.tokens)


@pytest.mark.llama
@pytest.mark.parametrize("seed", [None, 7])
def test_batched_verify_gives_the_same_tokens_where_the_engine_is_batch_invariant(
    chains: dict[str, StageChain], seed: int | None
) -> None:
    """Batched verify (one multi-row graph per stage) is exact only where ggml's multi-row
    logits equal its one-row logits; on the gemma3-like synthetic model they do bit for bit
    (measured for windows 1..16, whole and split; docs/generation.md), so the tokens match."""
    ch = chains["gemma3 3 stages"]
    ids = [3, 14, 15, 92, 65, 35] * 3
    first = ch.verify("probe", 0, ids, exact=True).logits
    ch.free("probe")
    again = ch.verify("probe", 0, ids, exact=False).logits
    ch.free("probe")
    assert first is not None and again is not None and np.array_equal(first, again)
    sampling = None if seed is None else SamplingParams(temperature=0.9, seed=seed)
    window = WindowPolicy(mode="adaptive", initial_window=4, max_window=8)
    plain = ch.generate(ids, max_tokens=32, sampling=sampling)
    spec, stats = generate_speculative(
        ch, ids, max_tokens=32, plan=plan(cache(1, 3), window), sampling=sampling, exact=False
    )
    assert spec.tokens == plain.tokens and stats.verify == "batched"


@pytest.mark.llama
def test_the_context_bounds_the_draft(synth_dir, tmp_path: Path) -> None:
    """A draft never runs past the context: the generation stops where plain decoding does."""
    _need_ggml()
    pkg = tmp_path / "pkg"
    make_package(synth_dir.llama, pkg)
    with chain("ggml", pkg, ["0..4"], StageConfig(n_ctx=20, n_threads=1)) as ch:
        ids = [5, 6, 7, 8] * 3
        plain = ch.generate(ids, max_tokens=50)
        window = WindowPolicy(mode="fixed", initial_window=8, max_window=8)
        spec, _ = generate_speculative(ch, ids, max_tokens=50, plan=plan(suffix(3, 4), window))
    assert spec.tokens == plain.tokens and spec.stop_reason == plain.stop_reason == "context"


def test_a_plan_the_runtime_cannot_execute_is_refused() -> None:
    draft_model = SpeculativePlan(
        mode="draft-model",
        requested="draft",
        requested_source="cli",
        draft_model="acme/draft",
        window=WindowPolicy(),
    )
    with pytest.raises(UsageError) as err:
        generate_speculative(None, [1], max_tokens=1, plan=draft_model)  # type: ignore[arg-type]
    assert err.value.code == "speculation_unsupported"


# --- packages declare it, run executes it --------------------------------------------------------
SUFFIX_DECL = (
    "ngram-suffix:ngram_min=3,ngram_max=16,max_proposal_tokens=8,window=adaptive,max_window=8"
)
CACHE_DECL = "ngram-cache:ngram_min=1,ngram_max=3,max_proposal_tokens=4"
PROMPT = "Ω"  # the synthetic vocabulary encodes little text (tests/skippy/commands/test_run_hub.py)


def _cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str]:
    from skippy.cli import main

    rc = main([str(a) for a in args])
    return rc, capsys.readouterr().out


def _write(
    capsys: pytest.CaptureFixture[str], src: Path, out: Path, *extra: str
) -> tuple[int, str]:
    return _cli(
        capsys,
        "write-package",
        src,
        "--out-dir",
        out,
        "--model-id",
        "acme/tiny-GGUF:Q8_0",
        "--source-revision",
        "0123abc",
        "--source-file",
        src.name,
        *extra,
    )


def test_write_package_declares_ngram_strategies(
    synth_dir, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from skippy.generation import parse_generation

    rc, _ = _write(
        capsys,
        synth_dir.llama,
        tmp_path / "p",
        "--speculative",
        SUFFIX_DECL,
        "--speculative",
        CACHE_DECL,
        "--speculative-default",
        "ngram-cache",
    )
    assert rc == 0
    gen = json.loads((tmp_path / "p" / "model-package.json").read_text())["generation"]
    sd = parse_generation(gen, layer_count=4).speculative
    assert sd is not None and sd.default == "ngram-cache"
    suffix_strategy = sd.strategies["ngram-suffix"]
    assert suffix_strategy.source == suffix(3, 16, 8)
    assert suffix_strategy.window == WindowPolicy(
        mode="adaptive", initial_window=8, min_window=1, max_window=8
    )
    assert sd.strategies["ngram-cache"].source == cache(1, 3, 4)


@pytest.mark.parametrize(
    "extra",
    [
        ["--speculative", "ngram-cache:ngram_min=1,ngram_max=5,max_proposal_tokens=4"],  # > 4
        ["--speculative", "ngram-suffix:ngram_min=2,ngram_max=8,max_proposal_tokens=4"],  # < 3
        ["--speculative", "ngram-suffix:ngram_min=3,ngram_max=8"],  # no max_proposal_tokens
        ["--speculative", "ngram-suffix:ngram_min=3,ngram_max=8,max_proposal_tokens=4,x=1"],
        ["--speculative", "native-mtp:layer_indices=3"],
        ["--speculative", SUFFIX_DECL],  # no default asked for: none is invented
        ["--speculative", SUFFIX_DECL, "--speculative-default", "ngram-cache"],  # undeclared
    ],
)
def test_write_package_refuses_a_bad_declaration_and_writes_nothing(
    synth_dir, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    import json

    rc, out = _write(capsys, synth_dir.llama, tmp_path / "p", *extra, "--json")
    assert rc == 2 and json.loads(out)["error"]["code"] == "invalid_speculative_declaration"
    assert not (tmp_path / "p" / "model-package.json").exists()


@pytest.mark.llama
def test_run_speculative_prints_the_same_text_with_acceptance(
    synth_dir, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """"Done when": run --stages 3 --speculative-strategy ngram-suffix prints the same
    text as without speculation, plus the drafts accepted."""
    import json

    _need_ggml()
    monkeypatch.setenv("SKIPPY_VERIFY_PACKAGE_SHA", "0")
    pkg = tmp_path / "p"
    decl = ["--speculative", SUFFIX_DECL, "--speculative", CACHE_DECL]
    assert (
        _write(capsys, synth_dir.llama, pkg, *decl, "--speculative-default", "ngram-suffix")[0] == 0
    )
    base = ["run", pkg, "--engine", "ggml", "--stages", 3, "--threads", 1, "--prompt", PROMPT]
    base += ["--max-tokens", 40]
    runs = {}
    for strategy in ("disabled", "ngram-suffix", "ngram-cache"):
        rc, out = _cli(capsys, *base, "--speculative-strategy", strategy, "--json")
        assert rc == 0
        runs[strategy] = json.loads(out)
    plain = runs["disabled"]
    assert "proposed_tokens" not in plain["speculative"]
    for strategy in ("ngram-suffix", "ngram-cache"):
        data = runs[strategy]
        assert (data["tokens"], data["completion"]) == (plain["tokens"], plain["completion"])
        s = data["speculative"]
        assert s["strategy"] == strategy and s["mode"] == strategy
        assert s["verify_passes"] > 0 and 0 < s["accepted_tokens"] <= s["proposed_tokens"]
    rc, text = _cli(capsys, *base)  # auto: the package default, ngram-suffix
    first, stats, summary = text.splitlines()[:3]
    assert rc == 0 and first == PROMPT + plain["completion"] and "3 stages" in stats
    assert (
        summary.startswith("[speculative ngram-suffix (exact verify): ")
        and "verify passes]" in summary
    )


def test_skippy_quantize_declares_ngram_strategies_too(hp_models, tmp_path: Path, capsys) -> None:
    import json

    from skippy.quantize_cli import main as quantize_main

    out = tmp_path / "q"
    prov = ["--model-id", "acme/tiny:Q8_0", "--source-revision", "0123abc", "--source-file", "m"]
    argv = ["quantize-layer-package", str(hp_models.f32), "--out-dir", str(out), "--type", "q8_0"]
    decl = ["--speculative", CACHE_DECL, "--speculative-default", "ngram-cache", "--json"]
    assert quantize_main([*argv, *prov, *decl]) == 0
    capsys.readouterr()
    sd = json.loads((out / "model-package.json").read_text())["generation"]["speculative_decoding"]
    assert sd["default"] == "ngram-cache" and sd["proposers"]["ngram-cache"]["ngram_max"] == 3
    bad = ["--speculative", "ngram-cache:ngram_min=1", "--json"]
    assert quantize_main([*argv, *prov, "--overwrite", *bad]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "invalid_speculative_declaration"
