"""The mesh knows devices (mesh_node/device_adverts.py): what a node advertises about its
devices, what a coordinator makes of a peer's advertisement (the memory its device and RAM
give, the CPU's speed), how the planners place stages by it, and two nodes with different
devices in one process getting the placement their devices allow, shown in status and
/metrics."""

from __future__ import annotations

import pytest
import trio
from meshtools import identity, settings, topology_node, topology_of, wait_for, with_peers
from prometheus_client import generate_latest

from mesh_node.device_adverts import (
    advertise,
    capacity,
    cpu_speed,
    experts_on_cpu,
    node_memory,
    planned_placement,
    stage_device,
    usable_bytes,
)
from mesh_node.metrics import node_registry, stage_families
from mesh_node.peers import render_status, render_topology
from protocol import constants as pc
from protocol.messages import ComputeCost, DeviceReport, Devices
from skippy.config import parse_rule
from skippy.package.cost_plan import LinkCosts, NodeCost, plan_by_cost
from skippy.package.plan import ModelSizes
from skippy.package.ranges import LayerRange
from skippy.package.topology import NodeCapacity, plan_topology
from skippy.runtime.devices import FIT_MARGIN, DeviceInfo, placement_mode

GIB = 2**30
REF = "hf://lab/pkg@" + "0" * 40
# A mixture of experts: 8 layers of 1000 bytes, 800 of them routed experts; a token reads
# the 200 dense bytes and a quarter of the experts (400 bytes per layer).
MOE = ModelSizes(
    layer_bytes=(1000,) * 8,
    metadata_bytes=10,
    embeddings_bytes=100,
    output_bytes=100,
    layer_active_bytes=(400,) * 8,
    layer_expert_bytes=(800,) * 8,
)
TOTAL = 10 + 8000 + 200
DENSE = TOTAL - 6400


def _info(name: str, kind: str, free: int, total: int | None = None) -> DeviceInfo:
    return DeviceInfo(name, name, kind, free, free if total is None else total)


def _gpu_node(free: int, *, experts_in_ram: bool = True, speed: ComputeCost | None = None,
              cpu: ComputeCost | None = None) -> Devices:
    return Devices(
        (
            DeviceReport("CUDA0", "GPU", free, max(free, 1), speed),
            DeviceReport("CPU", "CPU", 60 * GIB, 64 * GIB, cpu),
        ),
        stage_device="CUDA0",
        experts_on_cpu=experts_in_ram,
    )


# --- what a node advertises ---------------------------------------------------------------------
def test_the_stage_device_is_resolved_as_auto_resolves_it() -> None:
    devices = [
        _info("Vulkan1", "IGPU", 40 * GIB),
        _info("CUDA0", "GPU", 8 * GIB),
        _info("CUDA1", "GPU", 20 * GIB),
        _info("CPU", "CPU", 64 * GIB),
    ]
    assert stage_device("auto", devices) == "CUDA1"  # a GPU first, then the most free memory
    assert stage_device("auto", devices[:1] + devices[3:]) == "Vulkan1"
    assert stage_device("auto", devices[3:]) == "CPU"
    assert stage_device("CUDA0", devices) == "CUDA0"
    assert stage_device("cpu", devices) == "CPU"


def test_experts_stay_in_ram_with_cpu_moe_or_a_rule_that_sends_them_to_the_cpu() -> None:
    assert experts_on_cpu(True, ())
    assert not experts_on_cpu(False, ())
    assert experts_on_cpu(False, (parse_rule("exps=CPU"),))
    assert not experts_on_cpu(False, (parse_rule("exps=CUDA0"), parse_rule("exps=CPU")))
    assert not experts_on_cpu(False, (parse_rule("attn=CPU"),))


def test_the_advertisement_carries_each_devices_memory_and_speed_within_the_bounds() -> None:
    fast, slow = ComputeCost(1e-4, 1e-5, 100), ComputeCost(1e-3, 1e-4, 100)
    devices = [_info("CUDA0", "GPU", 20 * GIB, 24 * GIB), _info("CPU", "CPU", 60 * GIB)]
    ad = advertise(devices, "CUDA0", experts_in_ram=True, speeds={"CUDA0": fast, "CPU": slow})
    assert ad is not None and ad.stage_device == "CUDA0" and ad.experts_on_cpu
    assert [(d.name, d.kind, d.free_bytes, d.total_bytes) for d in ad.devices] == [
        ("CUDA0", "GPU", 20 * GIB, 24 * GIB),
        ("CPU", "CPU", 60 * GIB, 60 * GIB),
    ]
    assert ad.get("CUDA0").compute == fast and cpu_speed(ad) == slow  # type: ignore[union-attr]
    # more devices than a hello may carry: the stage device and the CPU are kept
    many = [_info(f"Vulkan{i}", "GPU", GIB) for i in range(20)]
    many += [_info("CUDA0", "GPU", GIB), _info("CPU", "CPU", GIB)]
    ad = advertise(many, "CUDA0", experts_in_ram=False, speeds={})
    assert ad is not None and len(ad.devices) == pc.MAX_DEVICES
    assert {"CUDA0", "CPU"} <= {d.name for d in ad.devices}
    assert advertise([], "CPU", experts_in_ram=False, speeds={}) is None


# --- what a coordinator makes of it (pure) --------------------------------------------------------
def test_a_peers_device_memory_less_the_runtimes_margin_and_its_budget_for_ram() -> None:
    mem = node_memory("n", 5000, _gpu_node(2200))
    assert mem is not None
    assert (mem.device, mem.host_bytes, mem.experts_in_ram) == ("CUDA0", 5000, True)
    assert mem.device_bytes == usable_bytes(2200) == 2000
    for free in (0, 1, 11, 2200, 2201, 10**12 + 7, 24 * GIB):
        usable = usable_bytes(free)  # the most the runtime's check lets through
        assert int(usable * (1 + FIT_MARGIN)) <= free < int((usable + 1) * (1 + FIT_MARGIN)) + 1
    cpu_only = Devices((DeviceReport("CPU", "CPU", GIB, GIB),), "CPU")
    assert node_memory("n", 5000, cpu_only) is None  # the budget alone, as before
    assert node_memory("n", 5000, None) is None
    assert node_memory("n", 5000, _gpu_node(0)) is None  # no memory free: no device offer


def test_the_memory_plan_fits_stages_into_device_memory_and_ram() -> None:
    gpu = capacity("9" * 64, 7000, _gpu_node(2200))
    # Without its device the node's budget cannot hold the model; with it, the dense part
    # sits in its 2000 usable device bytes and the 6400 routed-expert bytes in RAM.
    assert not NodeCapacity("9" * 64, 7000).holds(MOE, LayerRange(0, 8, 8))
    assert gpu.holds(MOE, LayerRange(0, 8, 8))
    one = plan_topology(
        MOE, [gpu], topology_id="t", run_id="r", package_ref=REF, manifest_sha256="ab" * 32
    )
    assert [len(s.layers) for s in one.stages] == [8]
    where = planned_placement(one, [gpu], MOE)["9" * 64]
    assert where == {
        "mode": "experts on CPU",
        "device": "CUDA0",
        "device_bytes": DENSE,
        "host_bytes": 6400,
    }
    # A node that keeps experts on the device (no cpu_moe) must hold it all in one place.
    whole = capacity("9" * 64, 7000, _gpu_node(2200, experts_in_ram=False))
    assert not whole.holds(MOE, LayerRange(0, 8, 8))


def test_the_cost_model_prices_a_stage_at_the_speed_of_where_it_sits() -> None:
    ms = 1e-3
    mem = node_memory("g", 7000, _gpu_node(2200))
    gpu = NodeCost("g", 7000, 0.1 * ms, 0.0, mem, cpu_decode_s_per_layer=1 * ms)
    plain = NodeCost("c", 9000, 1 * ms)
    every = LayerRange(0, 8, 8)
    # experts in RAM: the routed bytes a token reads (200 of 400 per layer) at the CPU's
    # speed, the rest at the device's
    assert gpu.stage_s(MOE, every, last=False) == pytest.approx(8 * (0.5 * 0.1 + 0.5 * 1) * ms)
    # with cpu_moe even a small stage keeps its experts in RAM, as the runtime does
    assert gpu.stage_s(MOE, LayerRange(0, 1, 8), last=False) == pytest.approx(0.55 * ms)
    # without it, a stage the device holds runs at the device's speed, a larger one on the CPU
    on_device = node_memory("g", 7000, _gpu_node(2200, experts_in_ram=False))
    whole = NodeCost("g", 7000, 0.1 * ms, 0.0, on_device, cpu_decode_s_per_layer=1 * ms)
    assert whole.stage_s(MOE, LayerRange(0, 1, 8), last=False) == pytest.approx(0.1 * ms)
    assert whole.stage_s(MOE, LayerRange(0, 4, 8), last=False) == pytest.approx(4 * ms)
    # no device offer: the CPU-bound node at its one speed
    assert plain.stage_s(MOE, every, last=False) == pytest.approx(8 * ms)
    ranked = plan_by_cost(MOE, [gpu, plain], LinkCosts(default_s=5 * ms))
    best = ranked[0]
    assert best.nodes == ("g",) and best.compute_s == pytest.approx(4.4 * ms)
    assert best.stage_modes == ("experts on CPU",)  # what --dry-run prints beside each stage
    split = next(c for c in ranked if c.nodes == ("g", "c"))
    assert split.stage_modes == ("experts on CPU", "cpu")
    assert split.to_dict()["stage_modes"] == ["experts on CPU", "cpu"]
    # the same node without its device cannot hold the model at all
    bare = plan_by_cost(MOE, [NodeCost("g", 7000, 0.1 * ms)], LinkCosts())
    assert not bare[0].fits and "lacks" in (bare[0].problem or "")


def test_a_loaded_stages_placement_in_the_planners_words() -> None:
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_up_exps.weight"]
    on_gpu = dict.fromkeys(names, "CUDA0") | {"token_embd.weight": "CPU"}
    assert placement_mode(on_gpu, "CUDA0") == "device"
    assert placement_mode(on_gpu | {"blk.0.ffn_up_exps.weight": "CPU"}, "CUDA0") == (
        "experts on CPU"
    )
    assert placement_mode(on_gpu | {"blk.0.attn_q.weight": "CPU"}, "CUDA0") == "mixed"
    assert placement_mode(dict.fromkeys(names, "CPU"), "CPU") == "cpu"


def test_metrics_show_the_devices_and_the_stages_device_memory_and_placement() -> None:
    doc = {
        "node_id": "n",
        "owner_id": None,
        "owner_status": "none",
        "artifact_transfer": "disabled",
        "uptime_s": 1.0,
        "memory_budget": 5,
        "peers": [],
        "devices": _gpu_node(2200).to_wire(),
    }
    stage = {"device": "CUDA0", "placement": "experts on CPU", "device_memory_bytes": 1234}
    from mesh_node.metrics import SectionCollector

    registry = node_registry(lambda: doc, [SectionCollector(lambda: stage, stage_families)])
    text = generate_latest(registry).decode()
    assert 'mesh_node_device_free_bytes{device="CUDA0",type="GPU"} 2200.0' in text
    assert 'mesh_node_device_total_bytes{device="CPU",type="CPU"} ' in text
    assert "mesh_node_stage_device_memory_bytes 1234.0" in text
    assert 'mesh_node_stage_placement{device="CUDA0",placement="experts on CPU"} 1.0' in text
    none = [SectionCollector(lambda: None, stage_families)]
    empty = generate_latest(node_registry(lambda: doc, none))
    assert b"mesh_node_stage_device_memory_bytes 0.0" in empty


# --- two nodes in one process -------------------------------------------------------------------
async def test_two_nodes_with_different_devices_get_the_placement_their_devices_allow(tmp_path):
    """n0 has a CPU and a 4500-byte budget; n1 a GPU with 2200 bytes free (2000 usable),
    experts kept in RAM, and a 7000-byte budget. Split in two, each stage holds about 4110
    bytes: n0's in its RAM, n1's dense part on its GPU and its routed experts in RAM. The
    coordinator's status shows n1's devices and each stage's placement."""
    async with trio.open_nursery() as nursery:
        n0 = topology_node(settings(tmp_path, "n0", memory_budget_bytes=4500), identity())
        await nursery.start(n0.run)
        n1 = topology_node(
            with_peers(settings(tmp_path, "n1", memory_budget_bytes=7000), n0), identity()
        )
        n1.devices = _gpu_node(2200)
        await nursery.start(n1.run)
        await wait_for(lambda: any(p.devices for p in n0.peers(connected_only=True)))

        active = await topology_of(n0).propose(
            package_ref=REF, manifest_sha256="ab" * 32, sizes=MOE
        )
        stages = active.topology.stages
        assert len(stages) == 2, active.to_dict()
        where = active.placement
        assert where[n0.node_id]["mode"] == "cpu" and where[n0.node_id]["device"] == "CPU"
        assert where[n1.node_id]["mode"] == "experts on CPU"
        assert where[n1.node_id]["device"] == "CUDA0"
        n1_stage = active.topology.stage_of(n1.node_id)
        assert n1_stage is not None
        assert where[n1.node_id]["device_bytes"] <= 2000
        assert where[n1.node_id]["device_bytes"] + where[n1.node_id]["host_bytes"] == (
            MOE.stage_bytes(n1_stage.layers)
        )

        doc = n0.status()
        peer = next(p for p in doc["peers"] if p["node_id"] == n1.node_id)
        assert peer["devices"]["stage"] == "CUDA0"
        assert peer["devices"]["list"][0]["free_bytes"] == 2200
        status = {s["stage_index"]: s["placement"] for s in doc["topology"]["stage_status"]}
        assert status[n1_stage.stage_index]["mode"] == "experts on CPU"
        assert "(CUDA0: experts on CPU)" in render_status(doc)
        assert "CUDA0: experts on CPU" in render_topology(doc["topology"])
        assert "devices  CUDA0 GPU" in render_status(n1.status())
        nursery.cancel_scope.cancel()


async def test_the_coordinators_cost_plan_prices_a_gpu_node_at_its_devices_speed(tmp_path):
    """Both nodes calibrated: n0 a CPU (1 ms per layer), n1 a GPU (0.1 ms) whose experts stay
    in RAM (its CPU: 1 ms). The real coordinator's cost plan puts the whole model on n1,
    priced as it will run: per layer, the routed experts a token reads (half its bytes) at the
    CPU's speed and the rest at the GPU's."""
    # measured on layers of MOE's active bytes, so the figures apply unscaled
    cpu, gpu = ComputeCost(1e-3, 1e-4, 400), ComputeCost(1e-4, 1e-5, 400)
    async with trio.open_nursery() as nursery:
        n0 = topology_node(settings(tmp_path, "n0", memory_budget_bytes=9000), identity())
        n0.compute = cpu
        n0.devices = Devices((DeviceReport("CPU", "CPU", GIB, GIB, cpu),), "CPU")
        await nursery.start(n0.run)
        n1 = topology_node(
            with_peers(settings(tmp_path, "n1", memory_budget_bytes=7000), n0), identity()
        )
        n1.compute, n1.devices = gpu, _gpu_node(2200, speed=gpu, cpu=cpu)
        await nursery.start(n1.run)
        await wait_for(lambda: any(p.devices for p in n0.peers(connected_only=True)))

        active = await topology_of(n0).propose(
            package_ref=REF, manifest_sha256="ab" * 32, sizes=MOE
        )
        plan = active.prediction
        assert plan is not None and plan["planner"] == "cost", plan
        assert plan["chosen"]["nodes"] == [n1.node_id]
        assert plan["chosen"]["stage_modes"] == ["experts on CPU"]
        # 8 layers x (0.5 x 0.1 + 0.5 x 1) ms, and the 100-byte head (a quarter of a layer's
        # active bytes) on the GPU
        assert plan["chosen"]["compute_ms"] == pytest.approx(8 * 0.55 + 0.025)
        assert active.placement[n1.node_id]["mode"] == "experts on CPU"
        nursery.cancel_scope.cancel()
