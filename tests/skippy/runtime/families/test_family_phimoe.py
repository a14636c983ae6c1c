"""phimoe: what the certification matrix does not show. The numpy reference applies its
norm biases and output bias (split equals whole, llama.cpp's next token everywhere), and its
metadata and tensor plan say what llama.cpp's loader requires."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_family_granite import family_kv, numpy_logits

from skippy.errors import ModelError
from skippy.package.ranges import LayerRange
from skippy.runtime.canary import check, synth
from skippy.runtime.families import spec_from_metadata, stage_tensors

IDS = synth.long_prompt(40)


def test_the_numpy_reference_applies_the_biases(tmp_path: Path) -> None:
    model, pkg = check.package_model(synth.family("phimoe"), "F16", tmp_path)
    whole = numpy_logits(pkg, ["0..4"], IDS)
    split = numpy_logits(pkg, ["0..3", "3..4"], IDS)
    assert np.array_equal(split, whole)
    ref = check.oracle(model, IDS)
    assert (whole.argmax(axis=1) == ref.argmax(axis=1)).all()
    assert check.max_difference(whole, ref) < 1e-2


def test_only_the_last_stage_holds_the_output_biases() -> None:
    """The output norm's and head's biases are required (llama.cpp refuses a phimoe file
    without them) and belong to the stage that owns the output."""
    spec = spec_from_metadata(family_kv("phimoe"))
    names = {t.name: t for t in stage_tensors(spec, LayerRange(3, 4, 4), vocab=512, tied=False)}
    assert names["output_norm.bias"].required and names["output_norm.bias"].shape == (256,)
    assert names["output.bias"].required and names["output.bias"].shape == (512,)
    first = stage_tensors(spec, LayerRange(0, 3, 4), vocab=512, tied=False)
    assert not any(t.name.startswith("output") for t in first)


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"expert_count": None}, "missing_hyperparameter"),
        ({"expert_used_count": 0}, "invalid_hyperparameters"),
        ({"expert_used_count": 17}, "invalid_hyperparameters"),
    ],
)
def test_bad_phimoe_experts_have_a_code(changes: dict[str, object], code: str) -> None:
    with pytest.raises(ModelError) as err:
        spec_from_metadata(family_kv("phimoe", **changes))
    assert err.value.code == code
