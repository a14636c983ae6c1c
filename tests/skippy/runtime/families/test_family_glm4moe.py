"""glm4moe's own behaviour beyond the certification matrix: its NextN/MTP layer held by the
final stage (its tensors checked and mapped, never run, no KV cache) and a cut between it
and the trunk refused before ggml; a GLM-4.5-Air-like file (no Q/K norms, no biases, no
leading dense layer, no NextN layer, weights not normalised, no routed scale) and a file
with a RoPE factor but no scaling type (llama.cpp scales it linearly) equal to llama.cpp bit
for bit; and the metadata's defaults and refusals."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from stagetools import stage_loads

from skippy.errors import SkippyError
from skippy.runtime.boundary import StageUnsupported
from skippy.runtime.canary import synth
from skippy.runtime.canary.check import Case, oracle, package_model, stage_logits
from skippy.runtime.chain import open_stage
from skippy.runtime.families import spec_from_metadata
from skippy.runtime.stage import StageConfig
from skippy.runtime.weights import StageWeights

pytestmark = pytest.mark.llama

SPEC = synth.family("glm4moe")
TRUNK = SPEC.dims().n_layers  # 4; the NextN layer is layer 4 of 5
K = gguf.Keys
N = 40  # F16 weights: the engine equals llama.cpp at any row count
CFG = StageConfig(n_ctx=64, n_threads=1)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return package_model(SPEC, "F16", tmp_path_factory.mktemp("glm4moe"))


def test_the_final_stage_holds_the_nextn_layer_without_running_it(
    model: tuple[Path, Path],
) -> None:
    _, pkg = model
    (load,) = stage_loads(pkg, [f"{TRUNK - 1}..{TRUNK + 1}"])
    with StageWeights.open(load) as w:
        names = set(w.tensors)
    assert {f"blk.{TRUNK}.nextn.{p}.weight" for p in ("eh_proj", "enorm", "hnorm")} <= names
    assert f"blk.{TRUNK}.ffn_gate_inp.weight" in names  # its block, for the MTP helper
    (middle,) = stage_loads(pkg, ["1..2"])  # one trunk layer, no NextN layer
    final, plain = open_stage("ggml", load, CFG), open_stage("ggml", middle, CFG)
    try:
        spec = final.spec
        assert (spec.n_layer, spec.n_trunk, spec.n_layer_nextn) == (TRUNK + 1, TRUNK, 1)
        # one trunk layer's K and V, and the NextN layer's: the draft head's own cache (the
        # trunk's graphs never run or write it: skippy/runtime/nextn.py)
        assert final.kv_bytes_per_session() == 2 * plain.kv_bytes_per_session() > 0
        assert final.drafts and not plain.drafts
    finally:
        final.close()
        plain.close()


def test_a_cut_between_the_trunk_and_its_nextn_layer_is_refused(
    model: tuple[Path, Path],
) -> None:
    _, pkg = model
    for load in stage_loads(pkg, [f"0..{TRUNK}", f"{TRUNK}..{TRUNK + 1}"]):
        with pytest.raises(StageUnsupported) as exc:
            StageWeights.open(load)
        assert exc.value.code == "nextn_stage_cut"


def test_a_file_without_the_optional_parts_equals_llama_cpp(tmp_path: Path) -> None:
    """GLM-4.5-Air's shape: no per-head Q/K norms, no Q/K/V biases; and no leading dense
    layer, no NextN layer, the picked experts' sigmoid weights neither normalised nor
    scaled."""
    optional = {*synth.HEAD_QK_NORM, *synth.QKV_BIAS}
    kv = {
        k: v
        for k, v in SPEC.kv.items()
        if k not in (K.LLM.EXPERT_WEIGHTS_NORM, K.LLM.EXPERT_WEIGHTS_SCALE)
    }
    air = replace(
        SPEC,
        layer=tuple(t for t in SPEC.layer if t not in optional),
        kv=kv,
        dense_lead=0,
        dense_layer=(),
        nextn=(),
    )
    gguf_path, pkg = package_model(air, "F16", tmp_path)
    ids = synth.long_prompt(N, vocab=SPEC.dims().vocab)
    got = stage_logits(pkg, ids, Case(("0..2", "2..4"), 512))
    assert np.array_equal(got, oracle(gguf_path, ids))


def test_a_rope_factor_without_a_scaling_type_scales_linearly_as_llama_cpp(
    tmp_path: Path,
) -> None:
    """llama.cpp's loader reads a missing ``rope.scaling.type`` as linear and applies the
    factor; reading it as unscaled would rotate 4 times too fast."""
    kv = {k: v for k, v in SPEC.kv.items() if k != K.Rope.SCALING_TYPE}
    linear = replace(SPEC, kv={**kv, K.Rope.SCALING_FACTOR: 4.0})
    gguf_path, pkg = package_model(linear, "F16", tmp_path)
    meta: dict[str, Any] = dict(synth.model_metadata(linear, linear.dims(), "F16"))
    spec = spec_from_metadata({**meta, "general.architecture": "glm4moe"})
    assert spec.rope_scale == 0.25 and spec.yarn is None
    ids = synth.long_prompt(N, vocab=SPEC.dims().vocab)
    got = stage_logits(pkg, ids, Case((f"0..{TRUNK + 1}",), 512))
    assert np.array_equal(got, oracle(gguf_path, ids))


def _kv(**changes: Any) -> dict[str, Any]:
    kv: dict[str, Any] = dict(synth.model_metadata(SPEC, SPEC.dims(), "F32"))
    kv["general.architecture"] = "glm4moe"
    for key, value in changes.items():
        full = f"glm4moe.{key}"
        if value is None:
            kv.pop(full, None)
        else:
            kv[full] = value
    return kv


def test_the_metadata_reads_as_llama_cpps_loader_does() -> None:
    spec = spec_from_metadata(_kv())
    assert spec.n_rot == spec.head_dim // 2 and spec.rope_dims == 32
    assert (spec.dense_layers, spec.n_layer_nextn, spec.n_trunk) == ({0}, 1, TRUNK)
    assert (spec.expert_gating, spec.expert_weights_norm) == ("sigmoid", True)
    assert spec.expert_weights_scale == 2.5
    assert spec.n_ff_shexp == 2 * spec.n_ff_exp
    # absent keys: sigmoid gating (this family's default), no normalisation, no scale
    bare = spec_from_metadata(
        _kv(expert_gating_func=None, expert_weights_norm=None, expert_weights_scale=None)
    )
    assert (bare.expert_gating, bare.expert_weights_norm) == ("sigmoid", False)
    assert bare.expert_weights_scale == 0.0


@pytest.mark.parametrize(
    ("rope", "scale"),
    [
        ({"rope.scaling.factor": 4.0}, 0.25),  # no type: linear, as llama.cpp's default
        ({"rope.scale_linear": 2.0}, 0.5),  # the older spelling of the factor
        ({"rope.scaling.type": "linear", "rope.scaling.factor": 8.0}, 0.125),
        ({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}, 1.0),  # none never scales
        ({"rope.scaling.type": "linear"}, 1.0),  # no factor: unscaled
        ({"rope.scaling.factor": 0.0}, 1.0),
    ],
)
def test_the_rope_scale_is_llama_cpps(rope: dict[str, Any], scale: float) -> None:
    plain = _kv(**{"rope.scaling.type": None, "rope.scaling.factor": None})
    plain.pop("glm4moe.rope.scaling.original_context_length")
    spec = spec_from_metadata({**plain, **{f"glm4moe.{k}": v for k, v in rope.items()}})
    assert spec.rope_scale == scale and spec.yarn is None


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"expert_gating_func": 4}, "unsupported_hyperparameter"),  # sqrt(softplus)
        ({"rope.dimension_sections": [8, 8, 8, 0]}, "unsupported_hyperparameter"),
        ({"expert_shared_count": None}, "missing_hyperparameter"),
        ({"expert_feed_forward_length": None}, "missing_hyperparameter"),
        ({"nextn_predict_layers": TRUNK + 1}, "invalid_hyperparameters"),
        ({"rope.dimension_count": 31}, "unsupported_hyperparameter"),
        ({"rope.dimension_count": 128}, "unsupported_hyperparameter"),
    ],
)
def test_metadata_the_runtime_cannot_run_is_refused_with_a_code(
    changes: dict[str, Any], code: str
) -> None:
    with pytest.raises(SkippyError) as exc:
        spec_from_metadata(_kv(**changes))
    assert exc.value.code == code
