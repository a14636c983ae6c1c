"""What the cost-aware planner (``skippy.package.cost_plan``) knows on a
running coordinator, and the plan it makes for real.

- Compute: each capable node's calibration (``ComputeCost`` from its hello; this node's own
  from ``mesh_node.calibration``), seconds per layer per token measured on layers of
  ``layer_bytes`` bytes, scaled to the package's mean layer *active* bytes: decode is bound
  by reading the weights, so time per layer follows the bytes a token reads. For a dense
  model that is every byte; a mixture of experts reads its dense tensors and only
  ``expert_used_count`` of ``expert_count`` routed experts (``skippy.package.experts``), so
  its layers are predicted from those bytes, not from what they hold. The calibration model
  is dense: this assumes a routed expert's bytes cost what a dense matrix's bytes cost
  (ggml's ``mul_mat_id`` reads each selected expert's rows once, as ``mul_mat`` does).
  The output head is weighed the same way on the node holding the last stage.
- Links: the one-way latency of every link this node measured: half the least of its last
  heartbeat RTTs (``Link.rtt_min_s``; one sample can carry a loaded peer's delay). A
  link between two peers is measured only by them: it is taken as the median of this node's
  own links (the document says so). Bandwidth is not used: a decode step sends one
  activation row (kilobytes), so hops cost latency, not rate.

``cost_choice`` is the real planner's input: ``None`` unless every capable node is
calibrated (then ``TopologyService.propose`` falls back to the byte-balanced memory plan).
``mesh-node topology --dry-run`` prints the ranked candidates and sends nothing; uncalibrated
nodes are then assumed equally fast, and it says so.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from mesh_node.device_adverts import cpu_speed
from protocol.messages import ComputeCost, Devices
from skippy.package.cost_plan import (
    Candidate,
    LinkCosts,
    NodeCost,
    plan_by_cost,
    predict,
    why_behind,
)
from skippy.package.plan import ModelSizes
from skippy.package.topology import NodeCapacity, SplitTopology

if TYPE_CHECKING:
    from mesh_node.peers import PeerInfo

UNCALIBRATED_S_PER_LAYER: Final = 1e-3  # dry run only: equal speeds, only the order matters
MAX_CANDIDATES: Final = 20
WHY_CHOSEN: Final = "the lowest predicted decode time per token among the candidates that fit"


@dataclass(frozen=True)
class CostInputs:
    nodes: tuple[NodeCost, ...]  # every capable node, calibrated or assumed
    links: LinkCosts
    uncalibrated: tuple[str, ...]  # nodes with no calibration (assumed, dry run only)

    def assumptions(self) -> dict[str, str]:
        compute = (
            "calibrated: each node's hello (seconds per layer per token, scaled to the "
            "bytes a token reads of this package's layers: its active bytes)"
            if not self.uncalibrated
            else f"{len(self.uncalibrated)} node(s) uncalibrated: assumed "
            f"{UNCALIBRATED_S_PER_LAYER * 1000:g} ms per layer per token"
        )
        return {
            "compute": compute,
            "links": "one-way = half the heartbeat RTT of this node's links; a link between "
            f"two peers is taken as their median ({self.links.default_s * 1000:.2f} ms)",
        }


def per_layer_s(compute: ComputeCost, sizes: ModelSizes) -> float:
    """A node's decode seconds per layer per token for ``sizes``' layers: the calibrated
    figure scaled to the mean bytes a token reads of a layer (its active bytes)."""
    mean = sum(sizes.active_bytes) / max(1, sizes.layer_count)
    return compute.decode_s_per_layer * max(mean, 1.0) / compute.layer_bytes


def head_s(compute: ComputeCost, sizes: ModelSizes) -> float:
    """A node's seconds per token for the output head (the embedding matrix when tied),
    scaled by bytes like a layer: a matrix-vector product reads every weight once."""
    head = sizes.embeddings_bytes if sizes.tied_embeddings else sizes.output_bytes
    return compute.decode_s_per_layer * head / compute.layer_bytes


def gather(
    own_id: str,
    own_compute: ComputeCost | None,
    peers: Sequence[PeerInfo],
    capable: Sequence[NodeCapacity],
    sizes: ModelSizes,
    own_devices: Devices | None = None,
) -> CostInputs:
    """Pure: the planner's inputs from what this node knows (its peers' hellos and RTTs).
    A node's ``compute`` is its stage device's speed; with devices, its CPU's figure
    (``mesh_node.device_adverts.cpu_speed``) prices what a stage leaves in RAM."""
    compute = {p.node_id: p.compute for p in peers}
    compute[own_id] = own_compute
    cpu = {p.node_id: cpu_speed(p.devices) for p in peers}
    cpu[own_id] = cpu_speed(own_devices)
    nodes, uncalibrated = [], []
    for c in capable:
        cost = compute.get(c.node_id)
        if cost is None:
            uncalibrated.append(c.node_id)
        s = UNCALIBRATED_S_PER_LAYER if cost is None else per_layer_s(cost, sizes)
        head = 0.0 if cost is None else head_s(cost, sizes)
        on_cpu = cpu.get(c.node_id)
        cpu_s = None if cost is None or on_cpu is None else per_layer_s(on_cpu, sizes)
        nodes.append(NodeCost(c.node_id, c.memory_budget_bytes, s, head, c.memory, cpu_s))
    own = {
        (own_id, p.node_id): rtt / 2
        for p in peers
        if p.connected and (rtt := p.rtt_min_s if p.rtt_min_s is not None else p.rtt_s) is not None
    }
    default = statistics.median(own.values()) if own else 0.0
    return CostInputs(tuple(nodes), LinkCosts(own, default), tuple(uncalibrated))


@dataclass(frozen=True)
class CostChoice:
    """The chosen candidate, the runners-up and what was assumed: kept with the topology."""

    chosen: Candidate
    ranked: tuple[Candidate, ...]
    inputs: CostInputs

    def prediction(self, why: str = WHY_CHOSEN) -> dict[str, Any]:
        fitting = [c for c in self.ranked if c.fits]
        runner_up = next((c for c in fitting if c != self.chosen), None)
        return {
            "planner": "cost",
            "predicted_ms_per_token": round(self.chosen.predicted_s * 1000, 3),
            "chosen": self.chosen.to_dict(),
            "runner_up": None if runner_up is None else runner_up.to_dict(),
            "runner_up_why": (
                None if runner_up is None else why_behind(self.chosen, runner_up, self.ranked)
            ),
            "candidates_total": len(self.ranked),
            "candidates_fit": len(fitting),
            "why": why,
            "assumptions": self.inputs.assumptions(),
        }


def cost_choice(
    inputs: CostInputs, sizes: ModelSizes, *, stages: int | None, first_node: str | None
) -> CostChoice | None:
    """Pure: the cost plan when every node is calibrated and a candidate fits, else ``None``
    (the caller's memory plan then decides, and reports why)."""
    if inputs.uncalibrated or not inputs.nodes:
        return None
    ranked = plan_by_cost(
        sizes, inputs.nodes, inputs.links, first_node=first_node, stages=stages
    )
    if not ranked or not ranked[0].fits:
        return None
    return CostChoice(ranked[0], tuple(ranked), inputs)


def predict_topology(
    inputs: CostInputs, sizes: ModelSizes, topology: SplitTopology
) -> dict[str, Any] | None:
    """The prediction for a topology made otherwise (healed, restored): ``None`` when a
    stage node is uncalibrated or unknown."""
    by_id = {n.node_id: n for n in inputs.nodes}
    order = [by_id.get(s.node_id) for s in topology.stages]
    if inputs.uncalibrated and any(s.node_id in inputs.uncalibrated for s in topology.stages):
        return None
    if any(n is None for n in order):
        return None
    known = [n for n in order if n is not None]
    c = predict(sizes, known, [s.layers for s in topology.stages], inputs.links)
    return {
        "planner": "cost",
        "predicted_ms_per_token": round(c.predicted_s * 1000, 3),
        "chosen": c.to_dict(),
        "runner_up": None,
        "runner_up_why": None,
        "candidates_total": 1,
        "candidates_fit": int(c.fits),
        "why": "re-predicted for the stages this topology kept (healed or restored)",
        "assumptions": inputs.assumptions(),
    }


def memory_plan_reason(inputs: CostInputs) -> dict[str, Any]:
    """Why the byte-balanced memory plan was used (no prediction)."""
    why = (
        f"{len(inputs.uncalibrated)} capable node(s) sent no calibration: the byte-balanced "
        "memory plan is used"
        if inputs.uncalibrated
        else "no cost candidate fits the nodes' memory budgets: the memory plan is used"
    )
    return {"planner": "memory", "predicted_ms_per_token": None, "why": why}


def dry_run(
    own_id: str,
    own_compute: ComputeCost | None,
    peers: Sequence[PeerInfo],
    capable: Sequence[NodeCapacity],
    sizes: ModelSizes,
    *,
    include_self: bool,
    stages: int | None,
    own_devices: Devices | None = None,
) -> dict[str, Any]:
    """The ranked candidates for ``sizes`` over the capable nodes connected now."""
    inputs = gather(own_id, own_compute, peers, capable, sizes, own_devices)
    ranked = plan_by_cost(
        sizes,
        inputs.nodes,
        inputs.links,
        first_node=own_id if include_self else None,
        stages=stages,
    )
    best = ranked[0] if ranked and ranked[0].fits else None
    return {
        "dry_run": True,
        "candidates": [c.to_dict() for c in ranked[:MAX_CANDIDATES]],
        "candidates_total": len(ranked),
        "chosen": best.to_dict() if best is not None else None,
        "why": WHY_CHOSEN if best is not None else "no candidate fits the nodes' memory budgets",
        "assumptions": inputs.assumptions(),
    }
