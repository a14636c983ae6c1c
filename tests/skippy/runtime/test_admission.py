"""The stage-admission vocabulary (``skippy.runtime.admission``): a loaded stage's descriptor,
the facts peers agree on, and the one rule that a chain (``check_follows``) and a serving
coordinator (``runtime_problem``) both apply."""

from __future__ import annotations

from dataclasses import replace

import pytest

from skippy.errors import UsageError
from skippy.package.ranges import LayerRange
from skippy.runtime.admission import AdmissionDescriptor, RuntimeFacts, runtime_problem

STAGE0 = AdmissionDescriptor(
    package_ref="acme/m",
    model_id="acme/m",
    manifest_sha256="a" * 64,
    stage_index=0,
    stage_count=2,
    layers=LayerRange(0, 2, 4),
    width=64,
    vocab=1000,
    activation_dtype="f32",
    engine="ggml",
    runtime_version="skippy-stage/1 ggml/0.25.3",
    n_ctx=128,
)
STAGE1 = replace(STAGE0, stage_index=1, layers=LayerRange(2, 4, 4))


def test_the_facts_are_the_descriptor_reduced_to_what_peers_agree_on() -> None:
    facts = STAGE0.facts
    assert facts == RuntimeFacts(
        "acme/m", 64, "f32", "skippy-stage/1 ggml/0.25.3", "ggml", 128, 1000
    )
    assert RuntimeFacts.from_dict(facts.to_dict()) == facts
    assert replace(STAGE0, vocab=None).facts.vocab == 0  # a middle stage has no vocabulary


def test_adjacent_stages_of_one_manifest_and_runtime_follow() -> None:
    STAGE1.check_follows(STAGE0)
    assert runtime_problem(STAGE1.facts, STAGE0.facts) is None


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"width": 32}, "activation_mismatch"),
        ({"activation_dtype": "f16"}, "activation_mismatch"),
        ({"runtime_version": "skippy-stage/1 numpy-reference"}, "runtime_mismatch"),
    ],
)
def test_a_chain_and_a_route_refuse_a_runtime_for_the_same_reason(
    change: dict[str, object], code: str
) -> None:
    other = replace(STAGE1, **change)  # type: ignore[arg-type]
    problem = runtime_problem(other.facts, STAGE0.facts)
    assert problem is not None and problem[0] == code
    with pytest.raises(UsageError) as err:
        other.check_follows(STAGE0)
    assert err.value.code == "stage_mismatch" and problem[1] in err.value.message


def test_a_chain_also_needs_one_manifest_and_adjacent_layers() -> None:
    with pytest.raises(UsageError, match="different package manifests"):
        replace(STAGE1, manifest_sha256="b" * 64).check_follows(STAGE0)
    with pytest.raises(UsageError, match="not followed by"):
        replace(STAGE1, layers=LayerRange(3, 4, 4)).check_follows(STAGE0)


def test_a_route_also_needs_a_loaded_stage_with_its_context() -> None:
    assert runtime_problem(None, STAGE0.facts) == (
        "stage_not_loaded",
        "the stage is fetched but not loaded in a runtime",
    )
    small = replace(STAGE1, n_ctx=64).facts
    problem = runtime_problem(small, STAGE0.facts)
    assert problem is not None and problem[0] == "context_too_small"
    replace(STAGE1, n_ctx=64).check_follows(STAGE0)  # in one process each stage has its own
