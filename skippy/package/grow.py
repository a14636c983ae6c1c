"""Growing a served split when capable peers join (pure).

A split served with no fixed stage count ("default: all connected") is planned over the nodes
linked at bring-up; a capable node that joins later is no spare but room to grow. The
coordinator asks ``grow_check`` on every look at the split: it says whether to plan again now,
and why not otherwise. Churn is bounded here:

- only with no fixed stage count and one replica (``--stages N`` keeps extra peers as spares;
  replicas keep their fixed stage count);
- only while the route serves the active topology (never while a grow or a heal is loading);
- only when the capable nodes differ from those of the last plan and some hold no stage (a
  membership change, not every tick);
- at most once per ``interval_s``.

The new plan is the planner's own (memory plan, or the cost plan when every node is
calibrated); ``grows`` says whether it is a grow: more stages, stage 0 still on the
coordinator. ``growth_summary`` is the log and status line.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from typing import Final

from skippy.package.topology import SplitTopology

GROW_INTERVAL_S: Final = 10.0  # the least time between two plans made for a grow


@dataclass(frozen=True)
class GrowCheck:
    plan: bool  # plan again now over the capable nodes
    reason: str  # why (or why not), for the debug log


def grow_check(
    active: SplitTopology,
    capable: Set[str],
    *,
    stages: int | None,
    replicas: int,
    serving: bool,
    last_members: Set[str] | None,
    since_last_s: float | None,
    interval_s: float = GROW_INTERVAL_S,
) -> GrowCheck:
    """Whether the coordinator of ``active`` plans again now. ``capable``: the capable nodes
    linked now (the coordinator included); ``serving``: the route serves ``active``;
    ``last_members``: ``capable`` when the last grow plan was made (``None``: never), and
    ``since_last_s`` how long ago."""
    if stages is not None:
        return GrowCheck(False, f"the stage count is fixed ({stages}): peers that join are spares")
    if replicas > 1:
        return GrowCheck(False, f"{replicas} replicas keep their stage count")
    if not serving:
        return GrowCheck(False, "the active topology is not serving yet")
    held = {s.node_id for s in active.stages}
    new = sorted(set(capable) - held)
    if not new:
        return GrowCheck(False, "no capable node outside the split")
    if len(active.stages) >= active.layer_count:
        return GrowCheck(False, "every layer is a stage of its own")
    if last_members is not None and set(capable) == set(last_members):
        return GrowCheck(False, "no capable node joined or left since the last plan")
    if since_last_s is not None and since_last_s < interval_s:
        return GrowCheck(
            False, f"the last grow plan was {since_last_s:.1f} s ago (one per {interval_s:g} s)"
        )
    return GrowCheck(True, "capable node(s) outside the split: " + ", ".join(n[:12] for n in new))


def grows(active: SplitTopology, planned: SplitTopology) -> bool:
    """Whether ``planned`` grows ``active``: more stages, the same package and stage 0 node."""
    return (
        len(planned.stages) > len(active.stages)
        and planned.manifest_sha256 == active.manifest_sha256
        and planned.stages[0].node_id == active.stages[0].node_id
    )


def growth_summary(active: SplitTopology, planned: SplitTopology) -> str:
    """``1 -> 2 stages, node 0123456789ab took layers 3..6``: the stage counts, then each node
    that had no stage and what it takes."""
    held = {s.node_id for s in active.stages}
    added = [
        f"node {s.node_id[:12]} took layers {s.layers}"
        for s in planned.stages
        if s.node_id not in held
    ]
    head = f"{len(active.stages)} -> {len(planned.stages)} stages"
    return ", ".join([head, *added])
