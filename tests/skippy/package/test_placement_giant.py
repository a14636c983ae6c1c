"""Placing a DeepSeek-V3-shaped model (61 layers, ~435 GB at Q4_K/Q6_K) on a mixed mesh by
the memory each node can give: GPUs hold attention and shared tensors, their RAM the routed
experts; unified-memory Macs and CPU boxes take whole stages; a mesh that is too small is
refused with what is missing.

The model's sizes are computed from its real shapes (hidden 7168, 3 dense then 58 MoE layers of
256 experts x 2048, MLA with q_lora 1536 and kv_lora 512, vocabulary 129280) and ggml's block
sizes, tensor by tensor as its GGUF would hold them (fragment headers left out): no weights."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from skippy.cli import main
from skippy.errors import TopologyError
from skippy.gguf.constants import GGML_TYPES
from skippy.package.placement import NodeMemory, fit, place, stage_split
from skippy.package.plan import ModelSizes
from skippy.package.ranges import LayerRange

GB = 10**9
GIB = 2**30
HIDDEN, VOCAB, LAYERS, DENSE_LEAD = 7168, 129280, 61, 3
EXPERTS, EXPERT_FF, DENSE_FF, HEADS = 256, 2048, 18432, 128
Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD = 1536, 512, 128, 64, 128


def _bytes(kind: str, *shape: int) -> int:
    """A tensor's bytes in ggml's type ``kind`` (``F32``, ``Q4_K``, ``Q6_K``)."""
    if kind == "F32":
        n = 1
        for d in shape:
            n *= d
        return 4 * n
    _, block, size = next(v for v in GGML_TYPES.values() if v[0] == kind)
    rows = 1
    for d in shape[1:]:
        rows *= d
    assert shape[0] % block == 0
    return shape[0] // block * size * rows


def deepseek_v3_sizes() -> ModelSizes:
    layers, experts = [], []
    for i in range(LAYERS):
        attn = (
            _bytes("F32", HIDDEN) * 2  # attn_norm, ffn_norm
            + _bytes("Q4_K", HIDDEN, Q_LORA)
            + _bytes("F32", Q_LORA)
            + _bytes("Q4_K", Q_LORA, HEADS * (NOPE + ROPE))
            + _bytes("Q4_K", HIDDEN, KV_LORA + ROPE)
            + _bytes("F32", KV_LORA)
            + _bytes("Q6_K", KV_LORA, HEADS * (NOPE + V_HEAD))
            + _bytes("Q4_K", HEADS * V_HEAD, HIDDEN)
        )
        if i < DENSE_LEAD:
            ffn = 2 * _bytes("Q4_K", HIDDEN, DENSE_FF) + _bytes("Q6_K", DENSE_FF, HIDDEN)
            routed = 0
        else:
            ffn = (
                _bytes("F32", HIDDEN, EXPERTS)  # router
                + _bytes("F32", EXPERTS)  # selection bias
                + 2 * _bytes("Q4_K", HIDDEN, EXPERT_FF)  # shared expert
                + _bytes("Q6_K", EXPERT_FF, HIDDEN)
            )
            routed = 2 * _bytes("Q4_K", HIDDEN, EXPERT_FF, EXPERTS) + _bytes(
                "Q6_K", EXPERT_FF, HIDDEN, EXPERTS
            )
        layers.append(attn + ffn + routed)
        experts.append(routed)
    active = tuple(b - r + r * 8 // EXPERTS for b, r in zip(layers, experts, strict=True))
    return ModelSizes(
        layer_bytes=tuple(layers),
        metadata_bytes=6 * 10**6,
        embeddings_bytes=_bytes("Q4_K", HIDDEN, VOCAB),
        output_bytes=_bytes("F32", HIDDEN) + _bytes("Q6_K", HIDDEN, VOCAB),
        layer_active_bytes=active,
        layer_expert_bytes=tuple(experts),
    )


def gpu(name: str) -> NodeMemory:  # a 24 GB consumer GPU in a 128 GB box
    return NodeMemory(name, host_bytes=120 * GIB, device_bytes=22 * GIB, device="CUDA0")


def mac(name: str) -> NodeMemory:  # a 64 GB Mac: one pool, ~48 GB for the model
    return NodeMemory(name, host_bytes=0, device_bytes=48 * GIB, device="MTL0", unified=True)


def cpu_box(name: str) -> NodeMemory:
    return NodeMemory(name, host_bytes=240 * GIB)


SIZES = deepseek_v3_sizes()


def _check(placement_sizes: ModelSizes, nodes: list[NodeMemory]) -> None:
    """Every layer once, in order; each stage fits its node the way it says."""
    p = place(placement_sizes, nodes)
    by_id = {n.node_id: n for n in nodes}
    assert p.stages[0].layers.start == 0 and p.stages[-1].layers.stop == LAYERS
    for a, b in zip(p.stages, p.stages[1:], strict=False):
        assert a.layers.stop == b.layers.start
    assert len({s.node_id for s in p.stages}) == len(p.stages)
    for s in p.stages:
        node = by_id[s.node_id]
        dense, routed = stage_split(placement_sizes, s.layers)
        assert s.device_bytes + s.host_bytes == dense + routed
        assert fit(node, dense, routed) == (s.mode, s.device_bytes, s.host_bytes)


def test_the_model_is_deepseek_v3_sized() -> None:
    total = sum(stage_split(SIZES, LayerRange(0, LAYERS, LAYERS)))
    assert 380 * GB < total < 450 * GB  # ~435 GB: Q4_K, down projections Q6_K
    assert sum(SIZES.expert_bytes) > 0.9 * total  # routed experts are nearly all of it


def test_a_mixed_mesh_holds_it_with_experts_in_gpu_nodes_ram() -> None:
    nodes = [gpu(f"gpu{i}") for i in range(4)] + [mac("mac0"), mac("mac1"), cpu_box("cpu0")]
    _check(SIZES, nodes)
    p = place(SIZES, nodes)
    modes = {s.node_id: s.mode for s in p.stages}
    # GPU nodes keep attention on the device and the experts in RAM, never all on the CPU
    assert all(m == "experts on CPU" for n, m in modes.items() if n.startswith("gpu"))
    assert "CUDA0" in p.stages[[s.node_id for s in p.stages].index("gpu0")].why
    # each GPU node's device holds less than its VRAM, its RAM the experts
    for s in p.stages:
        if s.node_id.startswith("gpu"):
            assert 0 < s.device_bytes <= 22 * GIB and s.host_bytes <= 120 * GIB
    assert p.total_bytes == sum(stage_split(SIZES, LayerRange(0, LAYERS, LAYERS)))
    # devices first: the GPU nodes hold it all; the others are listed as not needed
    assert [s.node_id for s in p.stages] == ["gpu0", "gpu1", "gpu2", "gpu3"]
    assert {n for n, why in p.unused if why.startswith("not needed")} == {"mac0", "mac1", "cpu0"}


def test_gpu_only_nodes_are_refused_without_their_ram() -> None:
    """The same GPUs counted by VRAM alone hold nothing of a 6 GB MoE layer: refused."""
    vram_only = [
        NodeMemory(f"g{i}", host_bytes=0, device_bytes=22 * GIB, device="CUDA0") for i in range(8)
    ]
    with pytest.raises(TopologyError) as e:
        place(SIZES, vram_only)
    assert e.value.code == "placement_does_not_fit"


def test_a_mesh_too_small_is_refused_saying_what_is_missing() -> None:
    nodes = [gpu("gpu0"), gpu("gpu1"), mac("mac0")]
    with pytest.raises(TopologyError) as e:
        place(SIZES, nodes)
    err = e.value
    assert err.code == "placement_does_not_fit"
    assert "cannot hold this model" in err.message and "layers " in err.message
    assert err.expected > 0 and err.actual == sum(n.offered for n in nodes)


def test_cpu_boxes_and_macs_take_whole_stages() -> None:
    nodes = [cpu_box("cpu0"), cpu_box("cpu1"), mac("mac0")]
    _check(SIZES, nodes)
    p = place(SIZES, nodes)
    assert {s.mode for s in p.stages} <= {"cpu", "device"}


@pytest.mark.parametrize(
    ("node", "dense", "routed", "want"),
    [
        (NodeMemory("u", 0, 10, "MTL0", unified=True), 6, 4, ("device", 10, 0)),
        (NodeMemory("u", 0, 9, "MTL0", unified=True), 6, 4, None),
        (NodeMemory("g", 8, 10, "CUDA0"), 6, 4, ("device", 10, 0)),
        (NodeMemory("g", 8, 7, "CUDA0"), 6, 4, ("experts on CPU", 6, 4)),
        (NodeMemory("g", 12, 5, "CUDA0"), 6, 4, ("cpu", 0, 10)),  # dense too big for VRAM
        (NodeMemory("g", 3, 5, "CUDA0"), 6, 4, None),
        (NodeMemory("c", 10), 6, 4, ("cpu", 0, 10)),
        (NodeMemory("c", 9), 6, 4, None),
    ],
)
def test_fit_rules(
    node: NodeMemory, dense: int, routed: int, want: tuple[str, int, int] | None
) -> None:
    assert fit(node, dense, routed) == want


def test_bad_node_memory_is_refused() -> None:
    with pytest.raises(TopologyError) as e:
        NodeMemory("x", host_bytes=-1)
    assert e.value.code == "invalid_node_memory"
    with pytest.raises(TopologyError):
        NodeMemory("m", host_bytes=0, unified=True)


# --- the command: plan --nodes ---------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from skippy.runtime.canary import synth

    path = tmp_path_factory.mktemp("place") / "qwen3moe.gguf"
    synth.write_model(synth.family("qwen3moe"), path, dtype="Q8_0")
    return path


def _plan(capsys: pytest.CaptureFixture[str], gguf: Path, nodes: Path) -> tuple[int, Any]:
    rc = main(["plan", str(gguf), "--nodes", str(nodes), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_plan_nodes_places_a_real_moe_file(
    moe_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes = tmp_path / "nodes.toml"
    nodes.write_text(
        '[[node]]\nid = "gpu0"\nmemory = "4MiB"\ndevice = "Vulkan0"\ndevice_memory = "1MiB"\n'
        '[[node]]\nid = "box"\nmemory = "1GiB"\n'
    )
    rc, out = _plan(capsys, moe_gguf, nodes)
    assert rc == 0, out
    first, second = out["stages"]
    assert (first["node_id"], first["mode"], first["device"]) == (
        "gpu0",
        "experts on CPU",
        "Vulkan0",
    )
    assert first["host_bytes"] > 0 and first["device_bytes"] <= 2**20
    assert (second["node_id"], second["mode"], second["layers"].split("..")[1]) == (
        "box",
        "cpu",
        "4",
    )


@pytest.mark.parametrize(
    ("text", "rc", "code"),
    [
        ('[[node]]\nid = "tiny"\nmemory = "1MiB"\n', 1, "placement_does_not_fit"),
        ("x = 1\n", 2, "invalid_nodes_file"),
        ('[[node]]\nid = "a"\nmemroy = "1GiB"\n', 2, "unknown_config_key"),
        ('[[node]]\nid = "a"\nmemory = "lots"\n', 2, "invalid_config"),
        ("[[node]\n", 2, "invalid_config"),
    ],
)
def test_plan_nodes_refusals(
    moe_gguf: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    text: str,
    rc: int,
    code: str,
) -> None:
    nodes = tmp_path / "nodes.toml"
    nodes.write_text(text)
    got, out = _plan(capsys, moe_gguf, nodes)
    assert (got, out["error"]["code"]) == (rc, code)


def test_a_nodes_experts_rule_decides_where_its_experts_go() -> None:
    """A paper plan keeps experts on the device while the stage fits there; a mesh node with
    cpu_moe always keeps them in RAM, one without it never splits a stage."""
    paper = NodeMemory("g", host_bytes=100, device_bytes=50, device="CUDA0")
    moe = replace(paper, experts_in_ram=True)
    whole = replace(paper, experts_in_ram=False)
    assert fit(paper, 10, 30) == ("device", 40, 0)
    assert fit(moe, 10, 30) == ("experts on CPU", 10, 30)
    assert fit(whole, 10, 30) == ("device", 40, 0)
    assert fit(paper, 20, 60) == ("experts on CPU", 20, 60)  # too large for the device
    assert fit(whole, 20, 60) == ("cpu", 0, 80)
    assert fit(moe, 60, 30) == ("cpu", 0, 90)  # its dense part does not fit the device
    assert fit(moe, 40, 0) == ("device", 40, 0)  # a dense stage: nothing to keep in RAM
    assert fit(whole, 60, 60) is None
