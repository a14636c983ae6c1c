"""The cost-aware planner (skippy/package/cost_plan.py, issue #21 section 3): pure cases from
the issue, and one with link latencies measured by real heartbeats through the emulated-link
relay (4 nodes, one pair 50 ms RTT, the others 5 ms)."""

from __future__ import annotations

import pytest
import trio
from test_wan_links import relayed_mesh

from mesh_node.lab.netem import LinkSpec, LinkTable
from skippy.errors import TopologyError
from skippy.package.cost_plan import LinkCosts, NodeCost, plan_by_cost, speed_weighted_counts
from skippy.package.plan import ModelSizes

SIZES = ModelSizes(layer_bytes=(100,) * 12, metadata_bytes=10, embeddings_bytes=50, output_bytes=50)
WHOLE = SIZES.metadata_bytes + sum(SIZES.layer_bytes) + 100
MS = 1e-3


def ids(n: int) -> list[str]:
    return [f"{i:x}" * 64 for i in range(1, n + 1)]


def test_one_node_that_holds_the_model_beats_any_split_when_hops_cost() -> None:
    a, b = ids(2)
    nodes = [NodeCost(a, WHOLE, 1 * MS), NodeCost(b, WHOLE, 1 * MS)]
    best = plan_by_cost(SIZES, nodes, LinkCosts(default_s=5 * MS))[0]
    assert best.nodes in ((a,), (b,)) and best.hops_s == 0.0


def test_two_nodes_that_hold_the_model_between_them_beat_four() -> None:
    four = ids(4)
    half = WHOLE // 2 + 200  # no node holds it alone; any two do
    nodes = [NodeCost(n, half, 1 * MS) for n in four]
    ranked = plan_by_cost(SIZES, nodes, LinkCosts(default_s=5 * MS))
    best = ranked[0]
    assert best.fits and len(best.nodes) == 2
    four_stage = min(
        (c for c in ranked if c.fits and len(c.nodes) == 4), key=lambda c: c.predicted_s
    )
    assert best.predicted_s < four_stage.predicted_s  # the same compute, two more hops
    assert not any(c.fits for c in ranked if len(c.nodes) == 1)


def test_a_node_three_times_slower_gets_fewer_layers() -> None:
    fast, slow = ids(2)
    nodes = [NodeCost(fast, WHOLE, 1 * MS), NodeCost(slow, WHOLE, 3 * MS)]
    two = plan_by_cost(SIZES, nodes, LinkCosts(), stages=2)[0]
    layers = {n: r.stop - r.start for n, r in zip(two.nodes, two.layers, strict=True)}
    assert layers[fast] == 9 and layers[slow] == 3  # 3:1, as their speeds
    assert speed_weighted_counts(10, [1.0, 1.0, 2.0]) == [3, 2, 5]


def test_a_pinned_first_node_holds_stage_zero_and_nothing_fits_says_why() -> None:
    a, b, c = ids(3)
    nodes = [NodeCost(a, WHOLE, 1 * MS), NodeCost(b, WHOLE, 1 * MS), NodeCost(c, 10, 1 * MS)]
    ranked = plan_by_cost(SIZES, nodes, LinkCosts(default_s=1 * MS), first_node=b)
    assert all(cand.nodes[0] == b for cand in ranked)
    unfit = [cand for cand in ranked if not cand.fits]
    assert unfit and all("lacks" in (cand.problem or "") for cand in unfit)
    with pytest.raises(TopologyError):
        plan_by_cost(SIZES, nodes, LinkCosts(), first_node="f" * 64)


async def test_measured_rtts_steer_the_plan_away_from_the_slow_pair(tmp_path) -> None:
    slow = LinkSpec(rtt_s=0.05)
    table = LinkTable(LinkSpec(rtt_s=0.005), {("n0", "n2"): slow, ("n2", "n0"): slow})
    async with relayed_mesh(tmp_path, 4, table) as mesh:
        await trio.sleep(0.5)  # a few heartbeats: every link has an RTT
        one_way = {}
        for node in mesh.nodes:
            for peer in node.peers(connected_only=True):
                assert peer.rtt_s is not None
                one_way[(node.node_id, peer.node_id)] = peer.rtt_s / 2
        n0, n2 = mesh.nodes[0].node_id, mesh.nodes[2].node_id
        assert one_way[(n0, n2)] > one_way[(n0, mesh.nodes[1].node_id)]  # measured, not told
        # Each node holds half the model: two stages, on a pair that is not n0-n2.
        budget = WHOLE // 2 + 200
        costs = [NodeCost(n.node_id, budget, 1 * MS) for n in mesh.nodes]
        best = plan_by_cost(SIZES, costs, LinkCosts(one_way), stages=2)[0]
        assert set(best.nodes) != {n0, n2}
        # And with stage 0 pinned on n0 (a serving coordinator), its partner is not n2.
        pinned = plan_by_cost(SIZES, costs, LinkCosts(one_way), first_node=n0, stages=2)[0]
        assert pinned.nodes[0] == n0 and pinned.nodes[1] != n2
