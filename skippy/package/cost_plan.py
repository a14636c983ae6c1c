"""A split planner that knows what links and nodes cost (pure).

``plan_topology`` (``skippy.package.topology``) places byte-balanced stages by memory budget
and stays the default; this module ranks alternatives by predicted decode time per token:

    t_token = sum over stages (layers x the node's seconds per layer per token)
            + the last stage's node's time for the output head
            + sum over hops of the one-way latency (stage i -> i+1, and the last stage back
              to stage 0, which holds the sampler)

subject to memory (each stage's bytes within its node's budget). A stage's "layers" are
counted by the bytes a token reads (``ModelSizes.layer_weight``: its active bytes over the
mean layer's): its layer count for a dense model of equal layers; for a mixture of experts
only the share of the routed experts a token uses counts, so a MoE stage is predicted faster
than a dense stage of the same bytes, while its memory is still all of its bytes. Every
stage count, node choice and order is a candidate (exhaustively up to
``MAX_EXHAUSTIVE_NODES`` nodes); each stage's layer count is proportional to its node's
speed, so a faster node takes a heavier range. ``plan_by_cost`` returns every candidate, best
first, each with its prediction and, when it does not fit, why: what ``mesh-node topology
--dry-run --json`` is meant to print.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from skippy.errors import TopologyError
from skippy.package.placement import NodeMemory, stage_fit
from skippy.package.plan import ModelSizes
from skippy.package.ranges import LayerRange
from skippy.package.topology import SplitTopology, StageAssignment

MAX_EXHAUSTIVE_NODES: Final = 7  # 7! orders x 7 counts: ~35k candidates, milliseconds each


@dataclass(frozen=True)
class NodeCost:
    """A node that may hold a stage: its budget and its calibrated decode speed."""

    node_id: str
    memory_budget_bytes: int
    decode_s_per_layer: float  # seconds per layer per token (a calibration run)
    # Seconds per token for the output head (logits) when this node holds the last stage:
    # on gemma3-270m the 262144-row head costs more than all 18 layers (docs/runtime-facts.md).
    head_s: float = 0.0
    # With devices: what its device and RAM give (a stage must fit them, not just the
    # budget), and the CPU's own speed, for the part of a stage that does not sit on the
    # device (``decode_s_per_layer`` is then the device's). None: the budget and one speed.
    memory: NodeMemory | None = None
    cpu_decode_s_per_layer: float | None = None

    def __post_init__(self) -> None:
        if not self.decode_s_per_layer > 0:
            raise TopologyError("decode_s_per_layer must be positive", path=self.node_id)
        if not self.head_s >= 0:
            raise TopologyError("head_s must not be negative", path=self.node_id)
        if self.cpu_decode_s_per_layer is not None and not self.cpu_decode_s_per_layer > 0:
            raise TopologyError("cpu_decode_s_per_layer must be positive", path=self.node_id)

    @property
    def offer(self) -> NodeMemory:
        return self.memory or NodeMemory(self.node_id, self.memory_budget_bytes)

    def stage_s(self, sizes: ModelSizes, r: LayerRange, *, last: bool) -> float:
        """Seconds per token for layers ``r`` here (and the head when ``last``), at the
        speed of where the stage sits: the device's, the CPU's for a stage in RAM, and for
        a stage whose routed experts stay in RAM, the experts a token reads at the CPU's
        and the rest at the device's."""
        dev = self.decode_s_per_layer
        cpu = self.cpu_decode_s_per_layer
        how = stage_fit(self.offer, sizes, r) if self.memory is not None else None
        mode = how[0] if how is not None else "device"
        weight = sizes.layer_weight(r)
        if cpu is None or mode == "device":
            return weight * dev + (self.head_s if last else 0.0)
        if mode == "cpu":
            return weight * cpu + (self.head_s * cpu / dev if last else 0.0)
        active = sum(sizes.active_bytes[r.start : r.stop])
        routed = sum(
            a - (b - e)
            for a, b, e in zip(
                sizes.active_bytes[r.start : r.stop],
                sizes.layer_bytes[r.start : r.stop],
                sizes.expert_bytes[r.start : r.stop],
                strict=True,
            )
        )
        share = max(0, routed) / active if active > 0 else 0.0
        return weight * ((1 - share) * dev + share * cpu) + (self.head_s if last else 0.0)


@dataclass(frozen=True)
class LinkCosts:
    """One-way latency between nodes (half the RTT heartbeats measure); symmetric unless both
    directions are given; ``default_s`` for pairs nobody measured."""

    one_way_s: Mapping[tuple[str, str], float] = field(default_factory=dict)
    default_s: float = 0.0

    def between(self, a: str, b: str) -> float:
        return self.one_way_s.get((a, b), self.one_way_s.get((b, a), self.default_s))


@dataclass(frozen=True)
class Candidate:
    nodes: tuple[str, ...]  # in stage order
    layers: tuple[LayerRange, ...]
    compute_s: float
    hops_s: float
    problem: str | None = None  # why it does not fit (None: it fits)
    stage_bytes: tuple[int, ...] = ()  # what each stage holds (its memory)
    stage_active_bytes: tuple[int, ...] = ()  # what each stage reads per token (its time)
    # Where each stage sits on its node (``skippy.package.placement`` modes: device, experts
    # on CPU, cpu); empty when no node of the candidate advertised a device.
    stage_modes: tuple[str, ...] = ()

    @property
    def predicted_s(self) -> float:
        return self.compute_s + self.hops_s

    @property
    def fits(self) -> bool:
        return self.problem is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": list(self.nodes),
            "layers": [[r.start, r.stop] for r in self.layers],
            "predicted_ms_per_token": round(self.predicted_s * 1000, 3),
            "compute_ms": round(self.compute_s * 1000, 3),
            "hops_ms": round(self.hops_s * 1000, 3),
            "fits": self.fits,
            "problem": self.problem,
            "stage_bytes": list(self.stage_bytes),
            "stage_active_bytes": list(self.stage_active_bytes),
            "stage_modes": list(self.stage_modes),
        }


def speed_weighted_counts(layer_count: int, speeds: Sequence[float]) -> list[int]:
    """Contiguous layer counts proportional to ``speeds`` (layers per second), each >= 1,
    summing to ``layer_count`` (largest remainder)."""
    k = len(speeds)
    if not 1 <= k <= layer_count:
        raise TopologyError(f"{k} stages cannot share {layer_count} layers")
    total = sum(speeds)
    shares = [layer_count * s / total for s in speeds]
    counts = [max(1, int(x)) for x in shares]
    while sum(counts) > layer_count:  # the minimum of one layer overshot: trim the largest
        i = max(range(k), key=lambda j: (counts[j], -j))
        counts[i] -= 1
    order = sorted(range(k), key=lambda i: (-(shares[i] - int(shares[i])), i))
    for i in order[: layer_count - sum(counts)]:
        counts[i] += 1
    return counts


def evaluate(
    sizes: ModelSizes, order: Sequence[NodeCost], links: LinkCosts
) -> Candidate:
    """One candidate: ``order``'s nodes as stages 0.. with speed-weighted ranges (the trunk's
    layers shared out, the NextN tail with the last stage)."""
    tail = sizes.tail_layers
    speeds = [1 / n.decode_s_per_layer for n in order]
    counts = speed_weighted_counts(sizes.layer_count - tail, speeds)
    counts[-1] += tail
    ranges, start = [], 0
    for c in counts:
        ranges.append(LayerRange(start, start + c, sizes.layer_count))
        start += c
    return predict(sizes, order, ranges, links)


def predict(
    sizes: ModelSizes,
    order: Sequence[NodeCost],
    ranges: Sequence[LayerRange],
    links: LinkCosts,
) -> Candidate:
    """The prediction for a given assignment (``order[i]`` runs ``ranges[i]``): what a
    planned candidate gets, and what a healed or restored topology is re-predicted with."""
    last = len(order) - 1
    compute = sum(
        n.stage_s(sizes, r, last=i == last)
        for i, (r, n) in enumerate(zip(ranges, order, strict=True))
    )
    ids = [n.node_id for n in order]
    hops = 0.0
    if len(ids) > 1:
        hops = sum(links.between(a, b) for a, b in itertools.pairwise(ids))
        hops += links.between(ids[-1], ids[0])  # the last stage's logits or token go home
    problem = None
    modes: list[str] = []
    for n, r in zip(order, ranges, strict=True):
        need = sizes.stage_bytes(r)
        offer = n.offer
        how = stage_fit(offer, sizes, r)
        modes.append("-" if how is None else how[0])
        if how is None and problem is None:  # the first stage that does not fit says why
            where = f"budget {n.memory_budget_bytes}"
            if n.memory is not None:
                where += f", {offer.describe()}"
            problem = (
                f"node {n.node_id[:12]} lacks {max(1, need - offer.offered)} bytes for layers "
                f"{r} ({need} bytes, {where})"
            )
    return Candidate(
        tuple(ids),
        tuple(ranges),
        compute,
        hops,
        problem,
        tuple(sizes.stage_bytes(r) for r in ranges),
        tuple(sizes.stage_active_bytes(r) for r in ranges),
        tuple(modes) if any(n.memory is not None for n in order) else (),
    )


def topology_from_candidate(
    candidate: Candidate,
    sizes: ModelSizes,
    *,
    topology_id: str,
    run_id: str,
    package_ref: str,
    manifest_sha256: str,
) -> SplitTopology:
    """The split a fitting candidate describes (stage ``i`` on ``candidate.nodes[i]``)."""
    if not candidate.fits:
        raise TopologyError(
            f"the candidate does not fit: {candidate.problem}", code="topology_does_not_fit"
        )
    return SplitTopology(
        topology_id=topology_id,
        run_id=run_id,
        package_ref=package_ref,
        manifest_sha256=manifest_sha256,
        layer_count=sizes.layer_count,
        stages=tuple(
            StageAssignment(node, f"stage-{i}", i, layers)
            for i, (node, layers) in enumerate(zip(candidate.nodes, candidate.layers, strict=True))
        ),
    )


def rank_key(c: Candidate) -> tuple[bool, float, int, tuple[str, ...]]:
    """The candidates' order: fitting first, then by predicted time per token; a tie goes
    to fewer stages, then to the node ids in stage order."""
    return (not c.fits, round(c.predicted_s, 9), len(c.nodes), c.nodes)


def why_behind(chosen: Candidate, other: Candidate, ranked: Sequence[Candidate]) -> str:
    """Why ``other`` ranks after ``chosen`` (pure): how much slower it is predicted to be,
    or, for a tie, how many candidates tie and which rule broke it."""
    a, b = rank_key(chosen), rank_key(other)
    if b[1] > a[1]:
        return f"{(other.predicted_s - chosen.predicted_s) * 1000:.3g} ms/token slower"
    tied = sum(1 for c in ranked if c.fits and rank_key(c)[1] == a[1])
    what = (
        "the same nodes in another order"
        if set(other.nodes) == set(chosen.nodes)
        else "other nodes"
    )
    rule = (
        "a tie goes to fewer stages"
        if b[2] > a[2]
        else "a tie goes to the node ids in stage order"
    )
    return f"{what}, as fast as the chosen split ({tied} candidates tie): {rule}"


def plan_by_cost(
    sizes: ModelSizes,
    nodes: Sequence[NodeCost],
    links: LinkCosts,
    *,
    first_node: str | None = None,
    stages: int | None = None,
) -> list[Candidate]:
    """Every candidate split, the fitting ones first, each group by predicted time per
    token (ties: fewer stages, then node ids). ``first_node`` pins stage 0 (a serving
    coordinator); ``stages`` fixes the count. The first candidate is the plan when it fits."""
    if not nodes:
        raise TopologyError("no capable node to place stages on", code="topology_no_nodes")
    by_id = {n.node_id: n for n in nodes}
    if len(by_id) != len(nodes):
        raise TopologyError("a node is listed twice", code="topology_coverage")
    if len(nodes) > MAX_EXHAUSTIVE_NODES:
        # Keep the search bounded: the fastest nodes (and the pinned one) are considered.
        keep = sorted(nodes, key=lambda n: (n.decode_s_per_layer, n.node_id))
        keep = keep[:MAX_EXHAUSTIVE_NODES]
        if first_node in by_id and by_id[first_node] not in keep:
            keep = [by_id[first_node], *keep[:-1]]
        nodes = keep
    pinned = by_id.get(first_node) if first_node is not None else None
    if first_node is not None and pinned is None:
        raise TopologyError(
            "the node asked to hold stage 0 is not among the capable nodes",
            code="topology_no_nodes",
            path=first_node,
        )
    top = min(len(nodes), sizes.layer_count - sizes.tail_layers)  # a trunk layer per stage
    counts = [stages] if stages is not None else list(range(1, top + 1))
    out: list[Candidate] = []
    for k in counts:
        if not 1 <= k <= top:
            raise TopologyError(f"{k} stages need 1..{top}", code="topology_stage_count")
        orders: Iterable[tuple[NodeCost, ...]]
        if pinned is not None:
            rest = [n for n in nodes if n is not pinned]
            orders = ((pinned, *p) for p in itertools.permutations(rest, k - 1))
        else:
            orders = itertools.permutations(nodes, k)
        out += [evaluate(sizes, order, links) for order in orders]
    out.sort(key=rank_key)
    return out


__all__ = [
    "Candidate",
    "LinkCosts",
    "NodeCost",
    "evaluate",
    "plan_by_cost",
    "predict",
    "rank_key",
    "speed_weighted_counts",
    "topology_from_candidate",
    "why_behind",
]
