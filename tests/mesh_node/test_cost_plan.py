"""The cost-aware planner (skippy/package/cost_plan.py): pure cases from
the issue, and one with link latencies measured by real heartbeats through the emulated-link
relay (4 nodes, one pair 50 ms RTT, the others 5 ms)."""

from __future__ import annotations

import pytest
import trio
from meshtools import topology_of, wait_for
from test_wan_links import relayed_mesh

from mesh_node.lab.netem import LinkSpec, LinkTable
from protocol.messages import ComputeCost
from skippy.errors import TopologyError
from skippy.package.cost_plan import (
    LinkCosts,
    NodeCost,
    plan_by_cost,
    speed_weighted_counts,
    why_behind,
)
from skippy.package.plan import ModelSizes

SIZES = ModelSizes(layer_bytes=(100,) * 12, metadata_bytes=10, embeddings_bytes=50, output_bytes=50)
WHOLE = SIZES.metadata_bytes + sum(SIZES.layer_bytes) + 100
MS = 1e-3
REF = "hf://lab/pkg@" + "0" * 40


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


def test_the_output_head_is_counted_on_the_last_stages_node() -> None:
    a, b = ids(2)
    nodes = [NodeCost(a, WHOLE, 1 * MS, head_s=9 * MS), NodeCost(b, WHOLE, 1 * MS, head_s=1 * MS)]
    best = plan_by_cost(SIZES, nodes, LinkCosts(), stages=2)[0]
    assert best.nodes[-1] == b  # the node with the cheaper head ends the pipeline
    assert best.compute_s == pytest.approx(13 * MS)


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


# --- the real coordinator plans by cost (mesh_node.topology.TopologyService.propose) ---------
def _calibrated(ms_per_layer: float) -> ComputeCost:
    # Measured on layers of SIZES' bytes, so the figure applies unscaled.
    return ComputeCost(ms_per_layer * MS, ms_per_layer * MS / 4, SIZES.layer_bytes[0])


async def test_the_coordinator_plans_by_cost_over_measured_links_and_calibrations(tmp_path):
    """4 calibrated nodes, n0-n2 at 50 ms RTT and the rest at 5 ms, n3 three times slower:
    the coordinator's own plan avoids the slow pair and the slow node, prefers 2 stages to 4
    when each node holds half the model, and gives n3 fewer layers when 4 are asked for."""
    slow = LinkSpec(rtt_s=0.05)
    table = LinkTable(LinkSpec(rtt_s=0.005), {("n0", "n2"): slow, ("n2", "n0"): slow})
    compute = [_calibrated(1.0), _calibrated(1.0), _calibrated(1.0), _calibrated(3.0)]
    budget = WHOLE // 2 + 200  # no node holds the model alone; any two do
    node_settings = {"memory_budget_bytes": budget}
    async with relayed_mesh(tmp_path, 4, table, compute, **node_settings) as mesh:
        coordinator = mesh.nodes[0]
        n0, n1, n2, n3 = (n.node_id for n in mesh.nodes)

        def slow_pair_measured() -> bool:
            # What the planner reads: the least of each link's recent heartbeat RTTs.
            rtt = {p.node_id: p.rtt_min_s for p in coordinator.peers(connected_only=True)}
            if len(rtt) < 3 or any(v is None for v in rtt.values()):
                return False
            return rtt[n2] > max(rtt[n1], rtt[n3]) + 0.02  # type: ignore[operator]

        await wait_for(slow_pair_measured, timeout_s=20)
        free = await topology_of(coordinator).propose(
            package_ref=REF, manifest_sha256="ab" * 32, sizes=SIZES
        )
        chosen = [s.node_id for s in free.topology.stages]
        assert len(chosen) == 2 and set(chosen) != {n0, n2} and n3 not in chosen
        assert free.prediction is not None and free.prediction["planner"] == "cost"
        assert free.prediction["chosen"]["nodes"] == chosen
        # 12 layers x 1 ms, and the head (50 bytes: half a 100-byte layer) on the last stage
        assert free.prediction["chosen"]["compute_ms"] == pytest.approx(12.5)

        four = await topology_of(coordinator).propose(
            package_ref=REF, manifest_sha256="ab" * 32, sizes=SIZES, stages=4, first_node=n0
        )
        stages = four.topology.stages
        assert stages[0].node_id == n0 and stages[2].node_id == n2, four.prediction
        layers = {s.node_id: len(s.layers) for s in stages}
        assert layers[n3] < min(layers[n] for n in (n0, n1, n2))
        assert four.state == "active"  # the workers accepted the cost plan's ranges
        assert four.to_dict()["prediction"]["planner"] == "cost"
        from mesh_node.peers import render_topology

        assert "planner cost, predicted " in render_topology(four.to_dict())


async def test_an_uncalibrated_node_falls_back_to_the_memory_plan_and_says_why(tmp_path):
    async with relayed_mesh(tmp_path, 2, LinkTable(), [_calibrated(1.0)]) as mesh:
        active = await topology_of(mesh.nodes[0]).propose(
            package_ref=REF, manifest_sha256="ab" * 32, sizes=SIZES
        )
        assert active.prediction is not None and active.prediction["planner"] == "memory"
        assert "1 capable node(s) sent no calibration" in active.prediction["why"]
        assert len(active.topology.stages) == 2  # the memory plan: one stage per node


# --- the lab report: the plan, and predicted beside measured (mesh_node.lab.report) ----------
def test_the_report_shows_the_plan_and_predicted_beside_measured_decode() -> None:
    from mesh_node.lab.report import predicted_vs_measured, render_plan

    a, b = ids(2)
    nodes = [NodeCost(a, WHOLE, 1 * MS), NodeCost(b, WHOLE, 1 * MS)]
    ranked = plan_by_cost(SIZES, nodes, LinkCosts(default_s=5 * MS), stages=2)
    plan = {
        "planner": "cost",
        "predicted_ms_per_token": round(ranked[0].predicted_s * 1000, 3),
        "chosen": ranked[0].to_dict(),
        "runner_up": ranked[1].to_dict(),
        "candidates_total": len(ranked),
        "candidates_fit": len(ranked),
        "why": "the lowest predicted decode time per token among the candidates that fit",
        "assumptions": {"compute": "calibrated"},
    }
    pvm = predicted_vs_measured(plan, {"decode_tokens_per_s": 25.0})
    assert pvm == {
        "predicted_ms_per_token": 22.0,  # 12 layers x 1 ms + two 5 ms hops
        "measured_decode_ms_per_token": 40.0,
        "measured_over_predicted": 1.82,
        "planner": "cost",
    }
    text = "\n".join(render_plan({"plan": plan, "predicted_vs_measured": pvm}))
    assert "plan: cost planner, predicted 22.00 ms/token (compute 12.00 + hops 10.00)" in text
    assert "decode per token: predicted 22.00 ms, measured 40.00 ms (1.82x" in text
    assert predicted_vs_measured(plan, None) is None  # no prompt: nothing measured
    memory = {"planner": "memory", "predicted_ms_per_token": None, "why": "2 uncalibrated"}
    assert predicted_vs_measured(memory, {"decode_tokens_per_s": 25.0}) == {
        "predicted_ms_per_token": None,
        "measured_decode_ms_per_token": 40.0,
        "measured_over_predicted": None,
        "planner": "memory",
    }
    assert render_plan({"plan": memory}) == ["plan: memory planner; 2 uncalibrated"]


def test_the_runner_up_says_why_it_lost_even_when_it_predicts_the_same() -> None:
    """Equal nodes and links (a lab): the runner-up is the same split in another order and
    predicts exactly the winner's time; the plan and the lab's line say it is a tie and
    which rule broke it. A slower runner-up says by how much."""
    from mesh_node.cost_inputs import CostChoice, CostInputs
    from mesh_node.lab.report import render_plan

    a, b, c = ids(3)
    nodes = tuple(NodeCost(n, WHOLE, 1 * MS) for n in (a, b, c))
    links = LinkCosts(default_s=5 * MS)
    ranked = plan_by_cost(SIZES, nodes, links, stages=3)
    plan = CostChoice(ranked[0], tuple(ranked), CostInputs(nodes, links, ())).prediction()
    assert plan["runner_up"]["predicted_ms_per_token"] == plan["predicted_ms_per_token"]
    assert plan["runner_up_why"] == (
        "the same nodes in another order, as fast as the chosen split (6 candidates tie): "
        "a tie goes to the node ids in stage order"
    )
    line = next(x for x in render_plan({"plan": plan}) if "runner-up" in x)
    assert line == f"  runner-up: 27.00 ms/token over 3 stage(s) ({plan['runner_up_why']})"
    # no hop costs anything: one stage and two stages tie; fewer stages win the tie
    ranked = plan_by_cost(SIZES, nodes[:2], LinkCosts(), stages=None)
    assert [len(x.nodes) for x in ranked[:3]] == [1, 1, 2]
    assert why_behind(ranked[0], ranked[2], ranked).endswith("a tie goes to fewer stages")
    assert why_behind(ranked[0], ranked[1], ranked).startswith("other nodes, as fast")
    # a slower runner-up: by how much
    slow = (NodeCost(a, WHOLE, 1 * MS), NodeCost(b, WHOLE, 1.5 * MS))
    ranked = plan_by_cost(SIZES, slow, LinkCosts(), stages=1)
    assert why_behind(ranked[0], ranked[1], ranked) == "6 ms/token slower"  # 12 x 0.5 ms


def test_inputs_scale_calibrations_to_the_package_and_a_healed_split_is_re_predicted() -> None:
    from mesh_node.cost_inputs import cost_choice, gather, predict_topology
    from mesh_node.peers import AuthenticatedPeer, PeerInfo
    from skippy.package.topology import NodeCapacity, SplitTopology, StageAssignment

    own, fast, spare = ids(3)

    def peer(node_id: str, rtt_s: float, compute: ComputeCost | None) -> PeerInfo:
        auth = AuthenticatedPeer(node_id, None, "verified", True)
        return PeerInfo(auth, None, {}, WHOLE, True, 0.0, rtt_s=rtt_s, compute=compute)

    # Calibrated on 50-byte layers: SIZES' 100-byte layers take twice as long.
    cost = ComputeCost(1 * MS, 0.5 * MS, 50)
    peers = [peer(fast, 0.010, cost), peer(spare, 0.030, cost)]
    capable = [NodeCapacity(n, WHOLE) for n in (own, fast, spare)]
    inputs = gather(own, cost, peers, capable, SIZES)
    assert [n.decode_s_per_layer for n in inputs.nodes] == pytest.approx([2 * MS] * 3)
    assert inputs.links.between(own, fast) == pytest.approx(0.005)  # half the RTT
    assert inputs.links.between(fast, spare) == pytest.approx(0.010)  # the median of own links
    choice = cost_choice(inputs, SIZES, stages=2, first_node=own)
    assert choice is not None and choice.chosen.nodes == (own, fast)  # the nearer peer
    # A heal moved stage 1 to the spare: same ranges, predicted over the slower link.
    healed = SplitTopology(
        "topo-h", "run-1", REF, "ab" * 32, SIZES.layer_count,
        tuple(
            StageAssignment(n, f"stage-{i}", i, r)
            for i, (n, r) in enumerate(zip((own, spare), choice.chosen.layers, strict=True))
        ),
    )
    again = predict_topology(inputs, SIZES, healed)
    assert again is not None and again["chosen"]["nodes"] == [own, spare]
    assert again["predicted_ms_per_token"] > choice.prediction()["predicted_ms_per_token"]
    # One node without a calibration: no cost plan, no prediction.
    blind = gather(own, cost, [peer(fast, 0.01, None)], capable[:2], SIZES)
    assert cost_choice(blind, SIZES, stages=None, first_node=own) is None
    assert predict_topology(blind, SIZES, healed) is None
