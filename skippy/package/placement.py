"""Placing a model's layers on nodes by the memory each can give: device memory (VRAM) for
what must sit on a GPU, system memory for what may stay on the CPU (pure).

A node gives ``host_bytes`` of RAM and, with a GPU, ``device_bytes`` of its free device memory;
on a unified-memory machine (Apple silicon) the two are one pool, ``device_bytes``. A stage
(a contiguous layer range, plus the metadata, the embeddings on the first stage and the head on
the last) fits a node in the first of these ways that holds it:

1. ``device``: all of it in device memory;
2. ``experts on CPU``: everything but the routed experts in device memory, the routed experts
   (``ffn_*_exps``) in RAM, as llama.cpp's ``--override-tensor exps=CPU`` / ``--n-cpu-moe``
   keep them: attention, norms, the router and shared experts run on the GPU, each token reads
   only its ``expert_used_count`` experts from RAM;
3. ``cpu``: all of it in RAM (the node's device unused for this stage).

That is the order when nothing says where experts go (a plan on paper). A mesh node runs one
rule (``NodeMemory.experts_in_ram``, from its ``[runtime] cpu_moe``): with it, a stage with
experts is always ``experts on CPU`` (or ``cpu``); without it, never.

``place`` fills nodes with a device first (a GPU computes attention far faster than a CPU,
whatever holds the experts), then CPU-only ones, each group the node that can hold the most
first: as many layers as fit, then the next node, so the model crosses as few hops as those
nodes allow. A node gives memory to one stage; nodes left over are listed with why. When the
layers outrun the nodes it raises ``TopologyError(code="placement_does_not_fit")`` saying how
much is missing and what the mesh offers. Each stage's placement says why it sits where it
does (``why``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from skippy.errors import TopologyError
from skippy.package.plan import ModelSizes
from skippy.package.ranges import LayerRange
from skippy.progress import human_bytes

Mode = Literal["device", "experts on CPU", "cpu"]
CPU: Final = "CPU"


@dataclass(frozen=True)
class NodeMemory:
    """What a node offers to a stage."""

    node_id: str
    host_bytes: int  # system memory it gives to stages
    device_bytes: int = 0  # free memory of its device; 0 without one
    device: str = CPU  # the ggml device name ("CUDA0", "Metal", "Vulkan0"), CPU without one
    unified: bool = False  # device and host share one pool: only ``device_bytes`` counts
    # Where a stage's routed experts go when the rest sits on the device: None (a paper
    # plan) on the device when the stage fits there, else in RAM; a mesh node says what its
    # runtime does: True, always in RAM (``[runtime] cpu_moe``); False, never apart.
    experts_in_ram: bool | None = None

    def __post_init__(self) -> None:
        if self.host_bytes < 0 or self.device_bytes < 0:
            raise TopologyError(
                f"node {self.node_id}: memory must not be negative", code="invalid_node_memory"
            )
        if self.unified and self.device_bytes == 0:
            raise TopologyError(
                f"node {self.node_id}: a unified-memory node needs its pool's size",
                code="invalid_node_memory",
            )

    @property
    def offered(self) -> int:
        """The most bytes one stage can take here."""
        return self.device_bytes if self.unified else self.device_bytes + self.host_bytes

    def describe(self) -> str:
        if self.unified:
            return f"{human_bytes(self.device_bytes)} unified ({self.device})"
        if self.device_bytes:
            return (
                f"{human_bytes(self.device_bytes)} on {self.device} + "
                f"{human_bytes(self.host_bytes)} RAM"
            )
        return f"{human_bytes(self.host_bytes)} RAM"


@dataclass(frozen=True)
class StagePlacement:
    index: int
    node_id: str
    layers: LayerRange
    mode: Mode
    device: str
    device_bytes: int  # of this stage, in device memory
    host_bytes: int  # of this stage, in RAM
    why: str

    @property
    def bytes(self) -> int:
        return self.device_bytes + self.host_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "node_id": self.node_id,
            "layers": str(self.layers),
            "mode": self.mode,
            "device": self.device,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "why": self.why,
        }


@dataclass(frozen=True)
class Placement:
    stages: tuple[StagePlacement, ...]
    total_bytes: int
    offered_bytes: int
    unused: tuple[tuple[str, str], ...] = ()  # (node id, why no stage)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stages": [s.to_dict() for s in self.stages],
            "total_bytes": self.total_bytes,
            "offered_bytes": self.offered_bytes,
            "unused": [{"node_id": n, "why": why} for n, why in self.unused],
        }


def stage_split(sizes: ModelSizes, r: LayerRange, kv_bytes_per_layer: int = 0) -> tuple[int, int]:
    """(bytes that must be on the stage's compute device, routed-expert bytes that may stay in
    RAM) for range ``r``; the KV cache counts with the former."""
    experts = sum(sizes.expert_bytes[r.start : r.stop])
    total = sizes.stage_bytes(r) + kv_bytes_per_layer * len(r)
    return total - experts, experts


def fit(node: NodeMemory, dense: int, experts: int) -> tuple[Mode, int, int] | None:
    """How a stage of ``dense`` + ``experts`` bytes sits on ``node``: (mode, device bytes,
    host bytes), or None when it does not fit."""
    total = dense + experts
    if node.unified:
        return ("device", total, 0) if total <= node.device_bytes else None
    if node.device_bytes:
        if total <= node.device_bytes and not (experts and node.experts_in_ram):
            return "device", total, 0
        if (
            experts
            and node.experts_in_ram is not False
            and dense <= node.device_bytes
            and experts <= node.host_bytes
        ):
            return "experts on CPU", dense, experts
    return ("cpu", 0, total) if total <= node.host_bytes else None


def stage_fit(
    node: NodeMemory, sizes: ModelSizes, r: LayerRange, kv_bytes_per_layer: int = 0
) -> tuple[Mode, int, int] | None:
    """``fit`` for the stage of layers ``r``: how it sits on ``node``, or None."""
    return fit(node, *stage_split(sizes, r, kv_bytes_per_layer))


def _why(node: NodeMemory, mode: Mode, dense: int, experts: int) -> str:
    if mode == "device":
        where = "unified memory" if node.unified else node.device
        return f"all {human_bytes(dense + experts)} in {where} ({node.describe()})"
    if mode == "experts on CPU":
        return (
            f"{human_bytes(dense)} of attention, norms, router and shared tensors on "
            f"{node.device}; its {human_bytes(experts)} of routed experts do not fit there and "
            f"stay in RAM ({node.describe()})"
        )
    reason = "no device" if not node.device_bytes else f"too large for {node.device}"
    return f"all {human_bytes(dense + experts)} in RAM, {reason} ({node.describe()})"


def place(
    sizes: ModelSizes, nodes: Sequence[NodeMemory], *, kv_bytes_per_layer: int = 0
) -> Placement:
    """Cut ``sizes``' layers into stages over ``nodes`` (see the module doc)."""
    if not nodes:
        raise TopologyError("no node to place stages on", code="topology_no_nodes")
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        raise TopologyError("a node is listed twice", code="topology_coverage")
    order = sorted(nodes, key=lambda n: (n.device_bytes == 0, -n.offered, n.node_id))
    stages: list[StagePlacement] = []
    unused: list[tuple[str, str]] = []
    start, n = 0, sizes.layer_count
    for node in order:
        if start == n:
            unused.append((node.node_id, "not needed: the stages before it hold every layer"))
            continue
        best: tuple[int, Mode, int, int, int, int] | None = None
        for stop in range(start + 1, n + 1):
            if n - sizes.tail_layers <= stop < n:
                continue  # a cut there parts the NextN tail from the trunk's last layer
            r = LayerRange(start, stop, n)
            dense, experts = stage_split(sizes, r, kv_bytes_per_layer)
            how = fit(node, dense, experts)
            if how is None:
                break
            best = (stop, how[0], how[1], how[2], dense, experts)
        if best is None:
            unused.append((node.node_id, f"cannot hold layer {start} ({node.describe()})"))
            continue
        stop, mode, on_device, on_host, dense, experts = best
        stages.append(
            StagePlacement(
                index=len(stages),
                node_id=node.node_id,
                layers=LayerRange(start, stop, n),
                mode=mode,
                device=CPU if mode == "cpu" else node.device,
                device_bytes=on_device,
                host_bytes=on_host,
                why=_why(node, mode, dense, experts),
            )
        )
        start = stop
    whole = LayerRange(0, n, n)
    total = sum(stage_split(sizes, whole, kv_bytes_per_layer))
    offered = sum(node.offered for node in nodes)
    if start < n:
        rest = LayerRange(start, n, n)
        need = sum(stage_split(sizes, rest, kv_bytes_per_layer))
        raise TopologyError(
            f"the mesh cannot hold this model: layers {rest} ({human_bytes(need)}) have no node "
            f"left after {len(stages)} stage(s); the model needs about {human_bytes(total)} "
            f"across stages and the {len(nodes)} node(s) offer {human_bytes(offered)} "
            f"(largest: {order[0].describe()})",
            code="placement_does_not_fit",
            expected=need,
            actual=offered,
            remediation="add nodes, or nodes with more memory; a GPU node also gives its RAM "
            "to the routed experts of a mixture-of-experts model",
        )
    return Placement(tuple(stages), total, offered, tuple(unused))




NODE_KEYS: Final = frozenset({"id", "memory", "device", "device_memory", "unified"})


def nodes_from_toml(raw: dict[str, Any]) -> list[NodeMemory]:
    """``[[node]]`` tables (``id``, ``memory``, and with a device ``device`` and
    ``device_memory``; ``unified = true`` for one pool) as ``NodeMemory``; sizes as in the
    node config (``120GiB``, ``64GB``, bytes)."""
    from skippy.config import parse_size
    from skippy.errors import UsageError

    tables = raw.get("node")
    if set(raw) - {"node"} or not isinstance(tables, list) or not tables:
        raise UsageError(
            "a nodes file holds [[node]] tables and nothing else",
            code="invalid_nodes_file",
            remediation='e.g. [[node]] id = "gpu0"  memory = "120GiB"  device = "CUDA0"  '
            'device_memory = "22GiB"',
        )
    out = []
    for i, t in enumerate(tables):
        where = f"node[{i}]"
        if not isinstance(t, dict):
            raise UsageError(f"{where} is not a table", code="invalid_nodes_file")
        unknown = sorted(set(t) - NODE_KEYS)
        if unknown:
            raise UsageError(
                f"unknown key {where}.{unknown[0]}",
                code="unknown_config_key",
                remediation="known keys: " + ", ".join(sorted(NODE_KEYS)),
            )
        node_id, unified = t.get("id"), t.get("unified", False)
        if not isinstance(node_id, str) or not node_id:
            raise UsageError(f"{where}.id must be a non-empty string", code="invalid_nodes_file")
        if not isinstance(unified, bool):
            raise UsageError(f"{where}.unified must be true or false", code="invalid_nodes_file")
        device_bytes = parse_size(t.get("device_memory", 0), f"{where}.device_memory")
        device = t.get("device", CPU if not device_bytes else "GPU")
        if not isinstance(device, str):
            raise UsageError(f"{where}.device must be a string", code="invalid_nodes_file")
        out.append(
            NodeMemory(
                node_id=node_id,
                host_bytes=parse_size(t.get("memory", 0), f"{where}.memory"),
                device_bytes=device_bytes,
                device=device,
                unified=unified,
            )
        )
    return out


__all__ = [
    "CPU",
    "NODE_KEYS",
    "Mode",
    "NodeMemory",
    "Placement",
    "StagePlacement",
    "fit",
    "nodes_from_toml",
    "place",
    "stage_fit",
    "stage_split",
]
