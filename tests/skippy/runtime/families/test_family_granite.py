"""granite and granitemoe: what the certification matrix does not show. The matrix runs the
synthetic models with all four multipliers set; here a model with only the (required) logit
scale equals llama.cpp too (an absent multiplier leaves its step out, as llama.cpp does), the
numpy reference applies the multipliers, and granite's metadata errors have their codes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from stagetools import chain

from skippy.errors import ModelError
from skippy.runtime.boundary import StageUnsupported
from skippy.runtime.canary import check, synth
from skippy.runtime.families import spec_from_metadata
from skippy.runtime.stage import StageConfig

K = gguf.Keys
IDS = synth.long_prompt(40)


@pytest.mark.parametrize("name", ["granite", "granitemoe"])
def test_only_the_logit_scale_equals_llama_cpp(name: str, tmp_path: Path) -> None:
    """Without embedding, residual and attention multipliers (0 in llama.cpp: skipped),
    every position's logits equal llama.cpp's one batch bit for bit, in 7-row chunks over
    two stages."""
    spec = synth.family(name)
    spec = replace(spec, name=f"{name}-logit-only", kv={K.LLM.LOGIT_SCALE: 8.0})
    model, pkg = check.package_model(spec, "F16", tmp_path)
    ours = check.stage_logits(pkg, IDS, check.Case(("0..1", "1..4"), 7))
    assert check.max_difference(ours, check.oracle(model, IDS)) == 0.0


@pytest.mark.parametrize("name", ["granite", "granitemoe"])
def test_the_numpy_reference_applies_granite_s_multipliers(name: str, tmp_path: Path) -> None:
    """The f32 reference (embedding, residual, attention and logit multipliers) splits as
    it runs whole, and picks llama.cpp's next token at every position."""
    model, pkg = check.package_model(synth.family(name), "F16", tmp_path)
    whole = numpy_logits(pkg, ["0..4"], IDS)
    split = numpy_logits(pkg, ["0..1", "1..4"], IDS)
    assert np.array_equal(split, whole)
    ref = check.oracle(model, IDS)
    assert (whole.argmax(axis=1) == ref.argmax(axis=1)).all()
    assert check.max_difference(whole, ref) < 1e-3


def numpy_logits(pkg: Path, ranges: list[str], ids: list[int]) -> np.ndarray[Any, Any]:
    with chain("numpy", pkg, ranges, StageConfig(n_ctx=64, n_threads=1)) as ch:
        return ch.logits(ids, all_positions=True)


def family_kv(name: str, **changes: Any) -> dict[str, Any]:
    spec = synth.family(name)
    kv: dict[str, Any] = dict(synth.model_metadata(spec, spec.dims(), "F16"))
    kv["general.architecture"] = spec.arch_name
    for key, value in changes.items():
        full = f"{spec.arch_name}.{key}"
        if value is None:
            kv.pop(full)
        else:
            kv[full] = value
    return kv


BAD: dict[str, tuple[str, dict[str, Any], type[Exception], str]] = {
    "no logit scale": ("granite", {"logit_scale": None}, ModelError, "missing_hyperparameter"),
    "logit scale 0": ("granitemoe", {"logit_scale": 0.0}, ModelError, "invalid_hyperparameters"),
    "logit scale not a number": (
        "granite",
        {"logit_scale": "8"},
        ModelError,
        "invalid_hyperparameters",
    ),
    "no RoPE": (
        "granite",
        {"rope.scaling.finetuned": False},
        StageUnsupported,
        "unsupported_hyperparameter",
    ),
    "a shared expert": (
        "granitemoe",
        {"expert_shared_feed_forward_length": 512},
        StageUnsupported,
        "unsupported_hyperparameter",
    ),
    "more experts used than there are": (
        "granitemoe",
        {"expert_used_count": 9},
        ModelError,
        "invalid_hyperparameters",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_granite_metadata_has_a_code(case: str) -> None:
    name, changes, error, code = BAD[case]
    with pytest.raises(error) as err:
        spec_from_metadata(family_kv(name, **changes))
    assert err.value.code == code  # type: ignore[attr-defined]


def test_the_multipliers_reach_the_spec() -> None:
    """The logit scale is llama.cpp's single-precision 1 / logit_scale; absent multipliers
    are None (no step), not 1.0 or 0.0."""
    spec = spec_from_metadata(family_kv("granite"))
    assert (spec.logit_scale, spec.embed_scale, spec.residual_scale) == (0.125, 12.0, 0.22)
    assert spec.attn_scale == 1.0 / 64.0
    bare = spec_from_metadata(
        family_kv("granite", embedding_scale=None, residual_scale=None, **{"attention.scale": None})
    )
    assert (bare.embed_scale, bare.residual_scale, bare.attn_scale) == (None, None, 1 / 8)
