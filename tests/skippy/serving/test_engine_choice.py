"""Which engine serves a package, and whether it may be split (skippy.serving.engine_choice):
the decisions, on real synthetic GGUF metadata."""

from __future__ import annotations

from pathlib import Path

import pytest
import synth_gguf

from skippy.errors import ModelError, UsageError
from skippy.gguf.reader import open_gguf
from skippy.runtime.weights import read_model_kv
from skippy.serving.engine_choice import (
    check_split,
    choose_engine,
    family_of,
    stage_runtime_problem,
)


def _choice(path: Path, configured: str = "ggml"):
    with open_gguf(path) as g:
        kv = read_model_kv(g)
    return choose_engine(configured, family_of(kv), stage_runtime_problem(kv))


def test_a_covered_family_keeps_the_configured_engine_and_may_be_split(synth_dir):
    choice = _choice(synth_dir.llama)
    assert (choice.engine, choice.family, choice.one_node) == ("ggml", "llama", False)
    assert choice.label == "engine: ggml"
    check_split(choice, 3)  # no refusal


def test_an_uncovered_family_is_served_whole_by_llama_cpp(tmp_path):
    choice = _choice(synth_gguf.uncovered_like(tmp_path / "exaone.gguf"))
    assert (choice.engine, choice.family, choice.code) == ("llama", "exaone", "family_unsupported")
    assert choice.label == (
        "engine: llama.cpp (one node; split placement refused: exaone is not supported by the "
        "stage runtime)"
    )
    check_split(choice, None)
    check_split(choice, 1)
    with pytest.raises(ModelError) as err:  # the model cannot be split: exit 1
        check_split(choice, 2)
    assert err.value.code == "unsupported_architecture" and err.value.actual == 2
    assert "'exaone' is not supported" in err.value.message
    assert "without --stages" in (err.value.remediation or "")


def test_a_refusal_other_than_the_architecture_is_named(tmp_path, synth_dir):
    with open_gguf(synth_dir.llama) as g:
        kv = {**read_model_kv(g), "llama.rope.scaling.type": "yarn"}
    choice = choose_engine("ggml", family_of(kv), stage_runtime_problem(kv))
    assert choice.engine == "llama" and choice.code == "family_unsupported"
    assert "RoPE scaling 'yarn'" in (choice.split_refused or "")


def test_engine_llama_serves_any_model_whole(synth_dir):
    choice = _choice(synth_dir.llama, "llama")
    assert (choice.engine, choice.code) == ("llama", "engine_whole_model")
    with pytest.raises(UsageError) as err:
        check_split(choice, 2)
    assert "engine = \"ggml\"" in (err.value.remediation or "")
