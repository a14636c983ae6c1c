"""What the cost-aware planner (``skippy.package.cost_plan``, issue #21 section 3) knows on a
running coordinator: the capable nodes and their budgets, and the one-way latency of every
link it measured (half the heartbeat RTT). ``mesh-node topology --dry-run`` prints the ranked
candidates beside the plan ``plan_topology`` would send, and sends nothing.

Not yet known here: per-node compute speed (a calibration advertised in Hello is future
work), so every node is assumed equally fast (``UNCALIBRATED_S_PER_LAYER``), and the latency
of a link between two peers, which only they measure: it is taken as the median of this
node's own links (the document says both).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any, Final

from skippy.package.cost_plan import LinkCosts, NodeCost, plan_by_cost
from skippy.package.plan import ModelSizes

if TYPE_CHECKING:
    from mesh_node.node import MeshNode

UNCALIBRATED_S_PER_LAYER: Final = 1e-3  # equal speeds: only the ordering of candidates matters
MAX_CANDIDATES: Final = 20


def dry_run(
    node: MeshNode, sizes: ModelSizes, *, include_self: bool, stages: int | None
) -> dict[str, Any]:
    """The ranked candidates for ``sizes`` over the capable nodes connected now."""
    capable = node.topology.capable_nodes(include_self)
    costs = [NodeCost(c.node_id, c.memory_budget_bytes, UNCALIBRATED_S_PER_LAYER) for c in capable]
    own = {
        (node.node_id, p.node_id): p.rtt_s / 2
        for p in node.peers(connected_only=True)
        if p.rtt_s is not None
    }
    default = statistics.median(own.values()) if own else 0.0
    ranked = plan_by_cost(
        sizes,
        costs,
        LinkCosts(own, default),
        first_node=node.node_id if include_self else None,
        stages=stages,
    )
    best = ranked[0] if ranked and ranked[0].fits else None
    return {
        "dry_run": True,
        "candidates": [c.to_dict() for c in ranked[:MAX_CANDIDATES]],
        "candidates_total": len(ranked),
        "chosen": best.to_dict() if best is not None else None,
        "why": (
            "the lowest predicted decode time per token among the candidates that fit"
            if best is not None
            else "no candidate fits the nodes' memory budgets"
        ),
        "assumptions": {
            "compute": "uncalibrated: every node assumed equally fast "
            f"({UNCALIBRATED_S_PER_LAYER * 1000:g} ms per layer per token)",
            "links": "one-way = half the heartbeat RTT of this node's links; a link between "
            f"two peers is taken as their median ({default * 1000:.2f} ms)",
        },
    }
