"""The soak, short (the long one is `scripts/bench --only soak`): a 3-stage
split plus one spare of a synthetic model, real processes, two clients sending greedy
completions while a random worker is SIGKILLed and started again every few seconds. Every
request ends with exactly the undisturbed text or an error with a code; the split is serving
at the end; no node shows a ghost peer."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

import synth_gguf
from pkgtools import make_package
from soaktools import soak

pytestmark = pytest.mark.llama
IDS = [1, 5, 9, 17, 33, 65, 3, 100, 7, 12, 90, 44]


def test_a_short_soak_of_kills_and_restarts(tmp_path: Path) -> None:
    src = synth_gguf.llama_like(tmp_path / "llama.gguf", n_layers=6)
    make_package(src, tmp_path / "pkg", model_id="acme/tiny-GGUF:Q8_0")
    result = soak(
        tmp_path / "soak",
        tmp_path / "pkg",
        duration_s=8,
        kill_every_s=(2.0, 4.0),
        prompt=IDS,
        max_tokens=48,
        warmup_s=2.0,
        min_kills=2,  # what is asserted below: the soak goes on (bounded) until it is met
    )
    summary = result.summary()
    assert result.kills >= 2, summary
    assert result.wrong == [], result.wrong[:3]
    assert result.exact >= 1 and result.requests == result.exact + sum(
        result.clear_errors.values()
    ), summary
    assert result.ghosts == [], result.ghosts
