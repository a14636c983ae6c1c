"""The sampler chain's pieces (skippy/runtime/sampling.py), each against an expectation
computed here independently (plain Python over the listed logits), and the chain's order:
logit bias, penalties, top-k, typical-p, top-p, min-p, temperature (llama.cpp's)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from skippy.errors import UsageError
from skippy.runtime import sampling as s
from skippy.runtime.sampling import Sampler, SamplingParams

ROW = [2.0, -1.0, 0.5, 3.0, 0.0, -2.5, 1.25, 3.0]


def _cands(row: list[float]) -> s.Candidates:
    return np.arange(len(row)), np.asarray(row, dtype=np.float64)


def _softmax(values: list[float]) -> list[float]:
    top = max(values)
    z = [math.exp(v - top) for v in values]
    return [x / sum(z) for x in z]


def _sorted_ids(row: list[float]) -> list[int]:
    return sorted(range(len(row)), key=lambda i: (-row[i], i))


@pytest.mark.parametrize(
    ("bias", "want"),
    [
        ((), ROW),
        (((1, 5.0),), [2.0, 4.0, 0.5, 3.0, 0.0, -2.5, 1.25, 3.0]),
        (((0, -100.0), (7, 0.5)), [-98.0, -1.0, 0.5, 3.0, 0.0, -2.5, 1.25, 3.5]),
    ],
)
def test_logit_bias_is_added_to_the_named_tokens(bias, want) -> None:
    row = np.asarray(ROW)
    assert s.apply_logit_bias(row, bias).tolist() == want
    assert row.tolist() == ROW  # pure: the input is not changed


def test_a_logit_bias_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(UsageError) as err:
        s.apply_logit_bias(np.asarray(ROW), ((8, 1.0),))
    assert err.value.code == "token_out_of_range"


@pytest.mark.parametrize(
    ("history", "repeat", "frequency", "presence"),
    [
        ([0, 1, 1, 4], 2.0, 0.0, 0.0),
        ([0, 1, 1, 4], 1.0, 0.5, 0.25),
        ([0, 1, 1, 4, 3, 3, 3], 1.3, 0.2, -0.4),
        ([], 1.5, 1.0, 1.0),
    ],
)
def test_penalties_as_llama_cpp_applies_them(history, repeat, frequency, presence) -> None:
    want = list(ROW)
    for token in set(history):
        count = history.count(token)
        v = want[token]
        v = v * repeat if v <= 0 else v / repeat  # a non-positive logit is multiplied
        want[token] = v - (count * frequency + presence)
    got = s.apply_penalties(
        np.asarray(ROW), history, repeat=repeat, frequency=frequency, presence=presence
    )
    assert got.tolist() == pytest.approx(want, abs=1e-12)


def test_the_penalties_read_only_the_last_repeat_last_n_tokens() -> None:
    params = SamplingParams(repeat_penalty=2.0, repeat_last_n=2)
    history = [3, 3, 3, 0, 6]  # the window: [0, 6]
    got = s.shaped_logits(np.asarray(ROW, dtype=np.float32), params, history)
    want = list(ROW)
    want[0], want[6] = ROW[0] / 2, ROW[6] / 2
    assert got.tolist() == want
    # the sampler keeps only that window, and accept() moves it on
    sampler = Sampler(params, history)
    assert sampler.history == [0, 6]
    sampler.accept(3)
    assert sampler.history == [6, 3]
    assert Sampler(SamplingParams(), history).history == []  # no penalties: nothing kept


@pytest.mark.parametrize("k", [0, 1, 3, 8, 20])
def test_top_k_keeps_the_k_largest(k: int) -> None:
    ids, values = s.top_k(_cands(ROW), k)
    want = _sorted_ids(ROW)[: k if 0 < k < len(ROW) else len(ROW)]
    got = sorted(zip(ids.tolist(), values.tolist(), strict=True), key=lambda x: (-x[1], x[0]))
    assert [i for i, _ in got] == want or (k == 1 and ids.tolist() in ([3], [7]))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.7, 0.9, 0.999, 1.0])
def test_top_p_keeps_the_smallest_prefix_reaching_p(p: float) -> None:
    ids, _ = s.top_p(s.by_logit(_cands(ROW)), p)
    order = _sorted_ids(ROW)
    probs = _softmax([ROW[i] for i in order])
    if p >= 1.0:
        assert ids.tolist() == order
        return
    mass, cut = 0.0, len(order)
    for i, q in enumerate(probs):
        mass += q
        if mass >= p:
            cut = i + 1
            break
    assert ids.tolist() == order[:cut]


@pytest.mark.parametrize("p", [0.0, 0.05, 0.3, 0.5, 1.0])
def test_min_p_keeps_probabilities_at_least_p_times_the_largest(p: float) -> None:
    ids, _ = s.min_p(s.by_logit(_cands(ROW)), p)
    probs = _softmax(ROW)
    want = [i for i in _sorted_ids(ROW) if p <= 0 or probs[i] >= p * max(probs) - 1e-12]
    assert ids.tolist() == want


@pytest.mark.parametrize("p", [0.2, 0.5, 0.8, 0.95, 1.0])
def test_typical_keeps_the_tokens_nearest_the_entropy(p: float) -> None:
    ids, _ = s.typical(s.by_logit(_cands(ROW)), p)
    probs = _softmax(ROW)
    entropy = -sum(q * math.log(q) for q in probs)
    order = sorted(range(len(ROW)), key=lambda i: abs(-math.log(probs[i]) - entropy))
    if p >= 1.0:
        assert sorted(ids.tolist()) == list(range(len(ROW)))
        return
    mass, cut = 0.0, len(order)
    for i, token in enumerate(order):
        mass += probs[token]
        if mass > p:  # llama.cpp: strictly more than p
            cut = i + 1
            break
    assert sorted(ids.tolist()) == sorted(order[:cut])


def test_greedy_with_penalties_or_a_bias_takes_the_shaped_argmax() -> None:
    row = np.asarray(ROW, dtype=np.float32)
    assert Sampler().sample(row) == 3  # the first maximum (3 and 7 tie)
    # token 3 was just seen: its logit 3.0 / 1.5 = 2.0; 7 is now the largest
    penalized = SamplingParams(repeat_penalty=1.5)
    assert not penalized.plain_greedy and penalized.greedy
    assert Sampler(penalized, [3]).sample(row) == 7
    # presence penalty on both: 2.0 (token 0) wins
    assert Sampler(SamplingParams(presence_penalty=1.5), [3, 7]).sample(row) == 0
    # a bias lifts token 5 above everything
    assert Sampler(SamplingParams(logit_bias=((5, 6.0),))).sample(row) == 5
    # after: tokens that follow the history, not accepted yet
    assert Sampler(penalized).sample(row, after=[3]) == 7


def test_greedy_with_typical_p_takes_the_largest_typical_logit() -> None:
    """Typical-p may drop the most likely token (here it is atypically likely): greedy then
    takes the largest logit that is left, as llama.cpp's chain does."""
    probs = [0.4, 0.15, 0.15, 0.15, 0.15]
    row = np.log(np.asarray(probs, dtype=np.float32))
    params = SamplingParams(typical_p=0.5)
    assert not params.plain_greedy
    ids, _ = s.candidates(s.shaped_logits(row, params, ()), params)
    assert 0 not in ids.tolist()
    assert Sampler(params).sample(row) == 1  # the first of the equal largest left


def test_draws_come_only_from_the_survivors() -> None:
    """min-p at 0.3 keeps tokens 3, 7 and 0 (probability >= 0.3 x the largest); top-p 0.6 at
    temperature 1 keeps 3 and 7 whatever the temperature (llama.cpp computes top-p before the
    temperature); every seed's draw is among the survivors and repeats with its seed."""
    row = np.asarray(ROW, dtype=np.float32)
    for params, survivors in (
        (SamplingParams(temperature=1.0, min_p=0.3), {0, 3, 7}),
        (SamplingParams(temperature=2.0, top_p=0.6), {3, 7}),
        (SamplingParams(temperature=1.0, top_k=5, typical_p=0.5), None),
        (SamplingParams(temperature=0.8, logit_bias=((1, 100.0),)), {1}),
    ):
        if survivors is None:
            ids, _ = s.candidates(s.shaped_logits(row, params, ()), params)
            survivors = set(ids.tolist())
        drawn = set()
        for seed in range(60):
            seeded = SamplingParams(**{**params.__dict__, "seed": seed})
            token = Sampler(seeded).sample(row)
            assert token == Sampler(seeded).sample(row)
            drawn.add(token)
        assert drawn <= survivors and (len(survivors) == 1 or len(drawn) > 1), params


@pytest.mark.parametrize(
    "kw",
    [
        {"min_p": 1.5},
        {"typical_p": -0.1},
        {"repeat_penalty": 0.0},
        {"repeat_penalty": 11.0},
        {"presence_penalty": 2.5},
        {"frequency_penalty": float("nan")},
        {"repeat_last_n": -1},
        {"logit_bias": ((3, 1.0), (2, 1.0))},  # not ascending
        {"logit_bias": ((3, 101.0),)},
        {"logit_bias": tuple((i, 1.0) for i in range(1025))},
    ],
)
def test_bad_controls_are_refused(kw: dict[str, object]) -> None:
    with pytest.raises(UsageError) as err:
        SamplingParams(**kw)  # type: ignore[arg-type]
    assert err.value.code == "invalid_sampling"


def test_controls_and_what_needs_the_logits() -> None:
    assert not SamplingParams(temperature=0.7, top_k=3, top_p=0.5).controls
    assert SamplingParams().plain_greedy and SamplingParams(min_p=0.1, top_k=3).plain_greedy
    for kw in ({"min_p": 0.1}, {"typical_p": 0.9}, {"frequency_penalty": 0.1}):
        assert SamplingParams(**kw).controls  # type: ignore[arg-type]
    # penalties over no tokens change nothing
    assert not SamplingParams(repeat_penalty=1.3, repeat_last_n=0).penalized
    assert SamplingParams(repeat_penalty=1.3, repeat_last_n=0).plain_greedy
