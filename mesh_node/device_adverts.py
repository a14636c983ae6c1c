"""A node's devices in the mesh: what its hello advertises about them (``Devices``), and
what a coordinator makes of a peer's advertisement when it places stages.

Advertising (this node): ggml's device list (``skippy.runtime.devices.list_devices``: the
CPU, whose memory is the machine's RAM, and any GPU), the device its stages run on
(``[runtime] device`` resolved as ``choose_device`` resolves ``auto`` for a stage that fits:
the GPU with the most free memory, else the CPU), whether it keeps routed experts in RAM
(``[runtime] cpu_moe``, or a placement rule sending them to the CPU), and the calibrated
speed measured on its stage device and on the CPU (``mesh_node.calibration``).

Planning (a peer's advertisement, pure): ``node_memory`` turns it into the
``skippy.package.placement.NodeMemory`` that the planners fit stages into: the stage
device's free memory less the margin the runtime keeps (``FIT_MARGIN``) for what must sit
on it, the node's memory budget for RAM; ``cpu_speed`` is the CPU's calibrated figure for a
stage (or its experts) left in RAM. A peer's advertisement is input: the protocol bounds
and checks it on receipt; a claim the planner cannot use (no device memory) counts as none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from protocol import constants as pc
from protocol.messages import ComputeCost, DeviceReport, Devices
from skippy.config import PlacementRule
from skippy.package.placement import NodeMemory, stage_fit
from skippy.package.plan import ModelSizes
from skippy.package.topology import NodeCapacity, SplitTopology
from skippy.runtime.devices import AUTO, CPU, FIT_MARGIN, DeviceInfo

# A tensor name the routed-experts rule matches (llama.cpp's --cpu-moe pattern): a placement
# rule that sends it to the CPU keeps the experts in RAM as cpu_moe does.
_EXPERT_PROBE: Final = "blk.0.ffn_up_exps.weight"
# "auto"'s preference among device types, best first (``skippy.runtime.devices``)
_AUTO_KINDS: Final = ("GPU", "IGPU")


def stage_device(requested: str, devices: Sequence[DeviceInfo]) -> str:
    """The device this node's stages run on: ``CPU``, a named device (start-up checked that
    it exists), or for ``auto`` the GPU (then integrated GPU) with the most free memory."""
    if requested.upper() == CPU:
        return CPU
    if requested != AUTO:
        named = next((d for d in devices if d.name == requested), None)
        return CPU if named is None or named.kind == CPU else named.name
    fits = [d for d in devices if d.kind in _AUTO_KINDS]
    if not fits:
        return CPU
    return min(fits, key=lambda d: (_AUTO_KINDS.index(d.kind), -d.free_bytes, d.name)).name


def experts_on_cpu(cpu_moe: bool, rules: Sequence[PlacementRule]) -> bool:
    """Whether this node keeps a MoE's routed experts in RAM: ``cpu_moe``, or a rule whose
    first match for an expert tensor is the CPU (first match wins, as ``place_tensors``)."""
    if cpu_moe:
        return True
    rule = next((r for r in rules if r.matches(_EXPERT_PROBE)), None)
    return rule is not None and rule.device.upper() == CPU


def advertise(
    devices: Sequence[DeviceInfo],
    stage: str,
    *,
    experts_in_ram: bool,
    speeds: Mapping[str, ComputeCost | None],
) -> Devices | None:
    """This node's hello ``devices`` (``None`` without a device list): at most
    ``MAX_DEVICES``, the stage device and the CPU kept first when there are more."""
    if not devices:
        return None
    keep = sorted(devices, key=lambda d: (d.name not in (stage, CPU),))[: pc.MAX_DEVICES]
    order = [d for d in devices if d in keep]  # the registry's order
    reports = tuple(
        DeviceReport(
            name=d.name[: pc.MAX_DEVICE_NAME_CHARS],
            kind=d.kind if d.kind in pc.DEVICE_TYPES else "OTHER",
            free_bytes=min(d.free_bytes, d.total_bytes),
            total_bytes=d.total_bytes,
            compute=speeds.get(d.name),
        )
        for d in order
    )
    names = {r.name for r in reports}
    runs_on = stage if stage in names else CPU
    if runs_on not in names:  # a list without the CPU or the stage device: nothing to name
        return None
    return Devices(reports, runs_on, experts_in_ram)


def usable_bytes(free_bytes: int) -> int:
    """The most bytes a stage may need on a device with ``free_bytes`` free: the runtime
    (``choose_device``) asks for ``int(need * (1 + FIT_MARGIN))`` free bytes."""
    usable = math.floor(free_bytes / (1 + FIT_MARGIN) + 1e-6)
    while usable > 0 and int(usable * (1 + FIT_MARGIN)) > free_bytes:
        usable -= 1
    return max(0, usable)


def node_memory(node_id: str, budget_bytes: int, devices: Devices | None) -> NodeMemory | None:
    """What a node gives a stage, from its advertisement (pure): its stage device's usable
    memory (free, less the runtime's margin) for what must sit there, its budget for RAM.
    ``None`` (the budget alone) when it advertised no devices or its stages run on the CPU."""
    if devices is None or devices.stage_device == CPU:
        return None
    dev = devices.get(devices.stage_device)
    if dev is None or dev.kind == CPU:
        return None
    usable = usable_bytes(dev.free_bytes)
    if usable <= 0:
        return None
    return NodeMemory(
        node_id=node_id,
        host_bytes=budget_bytes,
        device_bytes=usable,
        device=dev.name,
        experts_in_ram=devices.experts_on_cpu,
    )


def capacity(node_id: str, budget_bytes: int, devices: Devices | None) -> NodeCapacity:
    """A node as the planners see it: its budget, and what its devices give (pure)."""
    return NodeCapacity(node_id, budget_bytes, node_memory(node_id, budget_bytes, devices))


def planned_placement(
    topology: SplitTopology, nodes: Sequence[NodeCapacity], sizes: ModelSizes
) -> dict[str, dict[str, Any]]:
    """Where each stage of ``topology`` sits on its node, by node id (pure): ``mode``
    (``device``, ``experts on CPU``, ``cpu``), ``device``, and the bytes on the device and in
    RAM, as ``skippy.package.placement.fit`` places it in what the node offers; a stage node
    the coordinator knows nothing of now is left out."""
    by_id = {n.node_id: n for n in nodes}
    out: dict[str, dict[str, Any]] = {}
    for s in topology.stages:
        node = by_id.get(s.node_id)
        how = None if node is None else stage_fit(node.offer, sizes, s.layers)
        if node is None or how is None:
            continue
        mode, on_device, on_host = how
        out[s.node_id] = {
            "mode": mode,
            "device": CPU if mode == "cpu" else node.offer.device,
            "device_bytes": on_device,
            "host_bytes": on_host,
        }
    return out


def cpu_speed(devices: Devices | None) -> ComputeCost | None:
    """The CPU's calibrated speed from an advertisement, if it carries one."""
    cpu = None if devices is None else devices.get(CPU)
    return None if cpu is None else cpu.compute


__all__ = [
    "advertise",
    "capacity",
    "cpu_speed",
    "experts_on_cpu",
    "node_memory",
    "planned_placement",
    "stage_device",
    "usable_bytes",
]
