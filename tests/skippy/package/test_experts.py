"""Mixture of experts around the runtime: size accounting (all bytes held, active bytes read per
token), the cost planner predicting MoE stages from active bytes, ``plan`` and ``inspect``
showing both, and malformed MoE metadata refused with a code by inspect, write-package, the
engine choice and the stage loader. The bytes are recounted here from gguf-py's own reader
(``gguf.GGUFReader``), independently of ``skippy.package.experts``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest
import synth_gguf
from pkgtools import make_package

from protocol.messages import ComputeCost
from skippy import constants as c
from skippy.cli import main
from skippy.errors import ModelError
from skippy.package.cost_plan import LinkCosts, NodeCost, predict
from skippy.package.plan import ModelSizes
from skippy.package.ranges import LayerRange
from skippy.produce.sizes import sizes_from_source
from skippy.produce.write_package import WriteOptions, local_provenance, write_package
from skippy.produce.write_package_v2 import WriteOptionsV2, write_package_v2
from skippy.runtime.boundary import StageLoad
from skippy.runtime.canary import synth
from skippy.runtime.weights import StageWeights
from skippy.serving.engine_choice import stage_runtime_problem

EXPERTS, USED = 4, 2
ROUTED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def run_text(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 layers: layer 0 dense (leading dense block), layers 1-2 routed experts plus shared
    experts (which count as dense)."""
    root = tmp_path_factory.mktemp("moe")
    return synth_gguf.moe_like(
        root / "moe.gguf", experts=EXPERTS, used=USED, n_layers=3, dense_layers=1, shared_ff=32
    )


@pytest.fixture(scope="module")
def moe_pkg(moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe-pkg") / "pkg"
    make_package(moe, out)
    return out


def reference(path: Path) -> dict[str, Any]:
    """Per layer: bytes, routed expert bytes; the model's parameters: total, active."""
    r = gguf.GGUFReader(path)
    layer_bytes: dict[int, int] = {}
    routed: dict[int, int] = {}
    total = active = 0
    for t in r.tensors:
        n = int(t.n_elements)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        expert = kind in ROUTED
        total += n
        active += n * USED // EXPERTS if expert else n
        if t.name.startswith("blk."):
            i = int(t.name.split(".")[1])
            layer_bytes[i] = layer_bytes.get(i, 0) + int(t.n_bytes)
            routed[i] = routed.get(i, 0) + (int(t.n_bytes) if expert else 0)
    inactive = {i: routed[i] - routed[i] * USED // EXPERTS for i in routed}
    return {"inactive": inactive, "routed": routed, "total": total, "active": active}


# --- vocabulary --------------------------------------------------------------------------------
def test_moe_vocabulary_is_gguf_pys() -> None:
    names = gguf.TENSOR_NAMES
    t = gguf.MODEL_TENSOR
    exps = (t.FFN_GATE_EXP, t.FFN_UP_EXP, t.FFN_DOWN_EXP, t.FFN_GATE_UP_EXP)
    assert tuple(names[k].removeprefix("blk.{bid}.") for k in exps) == c.EXPERT_TENSOR_KINDS
    assert names[t.FFN_GATE_INP].removeprefix("blk.{bid}.") == c.ROUTER_TENSOR_KIND
    llm = gguf.Keys.LLM
    for key, ours in (
        (llm.EXPERT_COUNT, c.EXPERT_COUNT_KEY),
        (llm.EXPERT_USED_COUNT, c.EXPERT_USED_COUNT_KEY),
        (llm.EXPERT_FEED_FORWARD_LENGTH, c.EXPERT_FF_LENGTH_KEY),
        (llm.EMBEDDING_LENGTH, c.EMBEDDING_LENGTH_KEY),
    ):
        assert key.format(arch="a") == c.arch_key("a", ours)


# --- accounting ---------------------------------------------------------------------------------
def test_plan_json_shows_every_stage_s_bytes_and_the_bytes_a_token_reads(moe, capsys) -> None:
    ref = reference(moe)
    assert ref["inactive"][0] == 0 and ref["inactive"][1] > 0  # the fixture is what it says
    code, doc = run_json(capsys, "plan", str(moe), "--stages", "2")
    assert code == 0
    for s in doc["stages"]:
        unread = sum(ref["inactive"][i] for i in range(s["layer_start"], s["layer_end"]))
        assert s["active_bytes"] == s["total_bytes"] - unread
        assert s["active_bytes"] < s["total_bytes"]


def test_plan_of_a_moe_package_equals_plan_of_its_gguf(moe, moe_pkg, capsys) -> None:
    for balance in ("layers", "bytes"):
        _, raw = run_json(capsys, "plan", str(moe), "--stages", "3", "--balance", balance)
        _, pkg = run_json(capsys, "plan", str(moe_pkg), "--stages", "3", "--balance", balance)
        assert raw["stages"] == pkg["stages"]
    code, text = run_text(capsys, "plan", str(moe_pkg), "--stages", "2")
    assert code == 0 and "active" in text and "mixture of experts" in text


def test_a_dense_plan_reads_every_byte(synth_dir, capsys) -> None:
    _, doc = run_json(capsys, "plan", str(synth_dir.llama), "--stages", "2")
    assert all(s["active_bytes"] == s["total_bytes"] for s in doc["stages"])
    _, text = run_text(capsys, "plan", str(synth_dir.llama), "--stages", "2")
    assert "active" not in text


# --- the cost planner ---------------------------------------------------------------------------
def _cost(sizes: ModelSizes, compute: ComputeCost) -> float:
    from mesh_node.cost_inputs import per_layer_s

    node = NodeCost("n" * 64, 1 << 40, per_layer_s(compute, sizes))
    whole = [LayerRange(0, sizes.layer_count, sizes.layer_count)]
    return predict(sizes, [node], whole, LinkCosts()).compute_s


def test_a_moe_stage_is_predicted_faster_than_a_dense_stage_of_equal_bytes() -> None:
    compute = ComputeCost(1e-3, 1e-4, 1000)  # 1 ms per 1000-byte layer: 1 us per byte
    dense = ModelSizes((1000,) * 4, 10, 50, 50)
    moe = ModelSizes((1000,) * 4, 10, 50, 50, layer_active_bytes=(400,) * 4)
    assert dense.stage_bytes(LayerRange(0, 4, 4)) == moe.stage_bytes(LayerRange(0, 4, 4))
    assert _cost(dense, compute) == pytest.approx(4 * 1000 * 1e-6)
    assert _cost(moe, compute) == pytest.approx(4 * 400 * 1e-6)


def test_within_a_model_each_stage_is_predicted_from_the_bytes_a_token_reads(moe) -> None:
    """Two equally fast nodes, a dense layer and two MoE layers: each stage's time is its
    active bytes at the node's seconds per byte (a MoE layer's less than its bytes), and the
    candidate shows both byte counts."""
    from mesh_node.cost_inputs import per_layer_s

    sizes = sizes_from_source(moe)
    ref = reference(moe)
    compute = ComputeCost(1e-3, 1e-4, 10_000)  # 0.1 us per byte
    s = per_layer_s(compute, sizes)
    nodes = [NodeCost("a" * 64, 1 << 40, s), NodeCost("b" * 64, 1 << 40, s)]
    one = predict(sizes, nodes[:1], [LayerRange(0, 1, 3)], LinkCosts())
    two = predict(sizes, nodes[1:], [LayerRange(1, 2, 3)], LinkCosts())
    read = [sizes.layer_bytes[i] - ref["inactive"][i] for i in range(3)]
    assert one.compute_s == pytest.approx(read[0] * 1e-7)
    assert two.compute_s == pytest.approx(read[1] * 1e-7)
    assert two.compute_s < sizes.layer_bytes[1] * 1e-7
    both = predict(sizes, nodes, [LayerRange(0, 1, 3), LayerRange(1, 3, 3)], LinkCosts())
    d = both.to_dict()
    assert d["stage_bytes"] == [sizes.stage_bytes(r) for r in both.layers]
    assert d["stage_active_bytes"] == [
        d["stage_bytes"][0] - ref["inactive"][0],
        d["stage_bytes"][1] - ref["inactive"][1] - ref["inactive"][2],
    ]


# --- inspect ------------------------------------------------------------------------------------
def test_inspect_of_a_moe_gguf_and_its_package_says_experts_parameters_and_runtime(
    moe, moe_pkg, capsys
) -> None:
    ref = reference(moe)
    for path in (moe, moe_pkg):
        code, doc = run_json(capsys, "inspect", str(path))
        assert code == 0, doc
        assert doc["experts"]["expert_count"] == EXPERTS
        assert doc["experts"]["expert_used_count"] == USED
        assert doc["parameters"] == {"total": ref["total"], "active_per_token": ref["active"]}
        rt = doc["stage_runtime"]
        assert rt["runs"] is True and rt["code"] is None  # qwen3moe is a stage-runtime family
        code, text = run_text(capsys, "inspect", str(path))
        assert code == 0
        assert f"experts: {EXPERTS} ({USED} used per token)" in text
        assert f"parameters: total {ref['total']:,}, active per token {ref['active']:,}" in text
        assert "stage runtime: yes" in text


def test_inspect_of_a_dense_model_says_experts_none_and_the_runtime_runs_it(
    synth_dir, tmp_path, capsys
) -> None:
    qwen3 = synth_gguf.qwen3_like(tmp_path / "qwen3.gguf")
    total = sum(int(t.n_elements) for t in gguf.GGUFReader(qwen3).tensors)
    code, doc = run_json(capsys, "inspect", str(qwen3))
    assert code == 0
    assert doc["stage_runtime"]["runs"] is True and doc["experts"]["moe"] is False
    assert doc["parameters"] == {"total": total, "active_per_token": total}
    _, text = run_text(capsys, "inspect", str(qwen3))
    assert "stage runtime: yes" in text and "experts: none" in text


def test_inspect_of_a_v2_moe_package(moe, tmp_path, capsys) -> None:
    prov = local_provenance(
        model_id="acme/moe-GGUF:Q8_0", source_repo=None, source_revision="0", source_file="m"
    )
    write_package_v2(moe, WriteOptionsV2(out_dir=tmp_path / "v2", provenance=prov))
    ref = reference(moe)
    code, doc = run_json(capsys, "inspect", str(tmp_path / "v2"))
    assert code == 0, doc
    assert doc["parameters"] == {"total": ref["total"], "active_per_token": ref["active"]}
    assert doc["experts"]["expert_count"] == EXPERTS


# --- malformed MoE metadata ---------------------------------------------------------------------
BAD = [
    ({"omit_expert_count": True}, "moe_expert_count_missing"),
    ({"meta_experts": 0}, "moe_expert_count_missing"),
    ({"used": 5}, "moe_expert_used_count_invalid"),
    ({"used": 0}, "moe_expert_used_count_invalid"),
    ({"expert_dim": 8}, "moe_expert_shape_mismatch"),
    ({"router_shape": (32, EXPERTS)}, "moe_router_shape_mismatch"),
    ({"router_shape": (64, 8)}, "moe_router_shape_mismatch"),
    ({"meta_expert_ff": 96}, "moe_expert_ff_mismatch"),
    ({"dense_layers": 2}, "moe_experts_missing"),
]


@pytest.mark.parametrize(("variant", "code"), BAD, ids=[c for _, c in BAD])
def test_malformed_moe_is_refused_with_a_code_by_inspect_plan_and_write_package(
    tmp_path, capsys, variant, code
) -> None:
    bad = synth_gguf.moe_like(tmp_path / "bad.gguf", n_layers=2, **variant)
    for command in ("inspect", "plan"):
        extra = ("--stages", "2") if command == "plan" else ()
        exit_code, doc = run_json(capsys, command, str(bad), *extra)
        assert exit_code == 1 and doc["error"]["code"] == code, (command, doc)
    exit_code, text = run_text(capsys, "inspect", str(bad))
    assert exit_code == 1 and "Traceback" not in text
    prov = local_provenance(
        model_id="acme/bad-GGUF:Q8_0", source_repo=None, source_revision="0", source_file="b"
    )
    with pytest.raises(ModelError) as v1:
        write_package(bad, WriteOptions(out_dir=tmp_path / "v1", provenance=prov))
    with pytest.raises(ModelError) as v2:
        write_package_v2(bad, WriteOptionsV2(out_dir=tmp_path / "v2", provenance=prov))
    assert v1.value.code == v2.value.code == code
    assert not (tmp_path / "v1" / "model-package.json").exists()
    assert not (tmp_path / "v2" / "model-package.json").exists()


@pytest.mark.parametrize(
    ("extra", "code"),
    [
        ({"expert_count": 4, "expert_used_count": 5}, "moe_expert_used_count_invalid"),
        ({"expert_count": 4}, "moe_expert_used_count_invalid"),
        ({"expert_used_count": 2}, "moe_expert_count_missing"),
        ({"expert_count": [4, 4]}, "moe_expert_count_invalid"),
    ],
)
@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_the_engine_choice_refuses_malformed_moe_keys_with_a_code(arch, extra, code) -> None:
    """Before the family check: a split is never planned for such metadata."""
    kv = {c.KEY_ARCHITECTURE: arch, **{f"{arch}.{k}": v for k, v in extra.items()}}
    with pytest.raises(ModelError) as err:
        stage_runtime_problem(kv)
    assert err.value.code == code


def test_the_stage_loader_refuses_experts_that_disagree_with_the_metadata(tmp_path) -> None:
    """A stage whose metadata part says 4 experts and whose layer part holds 8 (two valid
    packages mixed): a coded error before ggml sees a tensor."""
    four = tmp_path / "four"
    eight = tmp_path / "eight"
    make_package(synth_gguf.moe_like(tmp_path / "4.gguf", experts=4), four)
    make_package(synth_gguf.moe_like(tmp_path / "8.gguf", experts=8), eight)
    load = StageLoad(
        model_id="acme/moe-GGUF:Q8_0",
        source_sha256="0" * 64,
        layers=LayerRange(1, 2, 2),
        part_paths=(four / "shared" / "metadata.gguf", eight / c.layer_path(1)),
        part_roles=(c.ROLE_METADATA, c.ROLE_LAYER),
    )
    with pytest.raises(ModelError) as err:
        StageWeights.open(load)
    assert err.value.code == "moe_expert_shape_mismatch"


# --- the support table inspect shows ------------------------------------------------------------
def test_inspect_s_support_table_answers_as_the_stage_runtime_does(synth_dir, tmp_path) -> None:
    """``skippy.runtime.support`` (no numpy, for inspect) against ``spec_from_metadata``
    (through ``stage_runtime_problem``) on a file of every family, dense and MoE."""
    from skippy.gguf.reader import open_gguf
    from skippy.runtime.support import STAGE_FAMILIES, support_verdict
    from skippy.runtime.weights import read_model_kv

    files = [
        synth_dir.llama,
        synth_dir.gemma,
        # llama-like under GLM's sparse-attention architecture, with a NextN layer (the
        # canary's glm4moe below is the family's real shape)
        synth_gguf.nextn_like(tmp_path / "glm-dsa.gguf", arch="glm-dsa"),
        synth_gguf.qwen2_like(tmp_path / "qwen2.gguf"),
        synth_gguf.qwen3_like(tmp_path / "qwen3.gguf"),
        synth_gguf.uncovered_like(tmp_path / "exaone.gguf"),
        synth_gguf.llama_like(tmp_path / "baichuan.gguf", arch="baichuan"),
        synth_gguf.moe_like(tmp_path / "qwen3moe.gguf"),
        synth_gguf.high_precision(tmp_path / "mixtral.gguf", n_layers=2, n_experts=4),
        # the canary's model of every family llama.cpp runs (those the runtime has and not)
        *(
            synth.write_model(f, tmp_path / f"canary-{f.name}.gguf", dtype="F16")
            for f in synth.FAMILIES
        ),
    ]
    for name in ("olmo2", "smollm3"):  # the canary's models of the newer families
        files.append(synth.write_model(synth.family(name), tmp_path / f"{name}.gguf", dtype="F32"))
    runs = set()
    for path in files:
        with open_gguf(path) as g:
            kv = read_model_kv(g)
        problem = stage_runtime_problem(kv)
        verdict = support_verdict(kv)
        assert verdict["runs"] == (problem is None), path.name
        assert verdict["code"] == (None if problem is None else problem.code), path.name
        if problem is None:
            runs.add(kv[c.KEY_ARCHITECTURE])
        else:  # the same words, up to the list of what it runs instead
            assert verdict["reason"].startswith(problem.message.split(" (it runs")[0])
    assert runs == set(STAGE_FAMILIES)


# --- the pure rules on a tensor directory --------------------------------------------------------
def _dir(*entries: tuple[str, tuple[int, ...], int]) -> list[Any]:
    from skippy.gguf.reader import TensorInfo

    return [TensorInfo(n, s, 0, 0, 0, b) for n, s, b in entries]


MOE_KV = {
    c.KEY_ARCHITECTURE: "qwen3moe",
    "qwen3moe.expert_count": 8,
    "qwen3moe.expert_used_count": 2,
    "qwen3moe.embedding_length": 64,
}


def test_a_fused_gate_up_and_expert_biases_count_as_routed_experts() -> None:
    from skippy.package.experts import summarize

    s = summarize(
        MOE_KV,
        _dir(
            ("blk.0.attn_q.weight", (64, 64), 1000),
            ("blk.0.ffn_gate_inp.weight", (64, 8), 2048),
            ("blk.0.ffn_gate_up_exps.weight", (64, 64, 8), 8000),
            ("blk.0.ffn_gate_up_exps.bias", (64, 8), 800),
            ("blk.0.ffn_down_exps.weight", (32, 64, 8), 4000),
            ("blk.0.ffn_up_shexp.weight", (64, 32), 500),
        ),
    )
    assert s.expert_bytes == 8000 + 800 + 4000
    assert s.active_bytes == 1000 + 2048 + 500 + (8000 + 800 + 4000) * 2 // 8
    assert s.inactive_bytes(0) == (8000 + 800 + 4000) * 6 // 8


@pytest.mark.parametrize(
    "entries",
    [
        (("blk.0.ffn_gate_inp.weight", (64, 8), 2048),),
        (("blk.0.ffn_gate_exps.weight", (64, 32, 8), 100),),
    ],
    ids=["router-only", "experts-only"],
)
def test_a_layer_needs_both_its_router_and_its_experts(entries) -> None:
    from skippy.package.experts import summarize

    with pytest.raises(ModelError) as err:
        summarize(MOE_KV, _dir(*entries))
    assert err.value.code == "moe_layer_incomplete"
