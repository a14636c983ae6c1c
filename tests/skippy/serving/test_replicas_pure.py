"""Replicas of a split: the pure decisions. Planning R replicas over
disjoint peers, the least-outstanding-tokens chooser, the replica count's usage errors."""

from __future__ import annotations

import dataclasses

import pytest

from mesh_node.settings import serving_settings
from skippy.errors import TopologyError, UsageError
from skippy.package.heal import heal_topology
from skippy.package.plan import ModelSizes
from skippy.package.ranges import LayerRange
from skippy.package.topology import (
    NodeCapacity,
    SplitTopology,
    pin_first_stage,
    plan_like,
    plan_topology,
)
from skippy.serving.replicas import (
    ReplicaLoad,
    check_replicas,
    choose_replica,
    free_for,
    peers_needed,
)

SIZES = ModelSizes(layer_bytes=(100,) * 6, metadata_bytes=10, embeddings_bytes=50, output_bytes=50)
COORD = "c" * 64


def node(i: int, budget: int = 10_000) -> NodeCapacity:
    return NodeCapacity(f"{i:064x}", budget)


def plan_replicas(capable: list[NodeCapacity], replicas: int, stages: int) -> list[SplitTopology]:
    """What the coordinator's replicas do, one after another: each plans over the capable
    nodes the others do not hold (``free_for``), stage 0 on the coordinator."""
    topologies: list[SplitTopology] = []
    for k in range(replicas):
        held = {s.node_id for t in topologies for s in t.stages}
        topologies.append(
            plan_topology(
                SIZES,
                free_for(capable, held, COORD),
                topology_id=f"topo-{k}",
                run_id=f"run-{k}",
                package_ref="pkg",
                manifest_sha256="0" * 64,
                stages=stages,
                first_node=COORD,
            )
        )
    return topologies


def test_replicas_are_planned_over_disjoint_peers_with_stage_0_on_the_coordinator() -> None:
    capable = [NodeCapacity(COORD, 10_000), *(node(i) for i in range(4))]
    a, b = plan_replicas(capable, 2, 3)
    workers_a = {s.node_id for s in a.stages[1:]}
    workers_b = {s.node_id for s in b.stages[1:]}
    assert a.stages[0].node_id == b.stages[0].node_id == COORD
    assert len(workers_a) == len(workers_b) == 2
    assert not workers_a & workers_b
    # Equal budgets: the same layer ranges, so both replicas share the coordinator's stage 0.
    assert [s.layers for s in a.stages] == [s.layers for s in b.stages]


def test_a_replica_planned_with_other_cuts_is_pinned_to_the_shared_stage_0() -> None:
    """The cost planner can cut a replica's stage 0 elsewhere (its workers' speeds): seen in
    ``mesh-node lab --nodes 7 --replicas 2`` (0..4 against replica 0's 0..3, never ready)."""
    capable = [NodeCapacity(COORD, 10_000), *(node(i) for i in range(4))]
    a, _ = plan_replicas(capable, 2, 3)
    first = a.stages[0].layers
    other = a.stages[0].layers.stop + 1
    b = SplitTopology(
        topology_id="topo-b", run_id="run-b", package_ref="pkg", manifest_sha256="0" * 64,
        layer_count=6,
        stages=tuple(
            dataclasses.replace(s, layers=LayerRange(r[0], r[1], 6))
            for s, r in zip(a.stages, [(0, other), (other, 5), (5, 6)], strict=True)
        ),
    )
    pinned = pin_first_stage(b, first)
    assert pinned.stages[0].layers == first and pinned.stages[1].layers == LayerRange(
        first.stop, 5, 6
    )
    assert [s.node_id for s in pinned.stages] == [s.node_id for s in b.stages]
    assert pinned.stages[2] == b.stages[2] and pin_first_stage(pinned, first) is pinned
    with pytest.raises(TopologyError):  # stage 1 would be empty
        pin_first_stage(b, LayerRange(0, 5, 6))


def test_a_replica_takes_replica_0s_layer_ranges_when_its_nodes_can_hold_them() -> None:
    capable = [NodeCapacity(COORD, 10_000), *(node(i) for i in range(4))]
    a, b = plan_replicas(capable, 2, 3)
    shifted = SplitTopology(
        topology_id="topo-b", run_id="run-b", package_ref="pkg", manifest_sha256="0" * 64,
        layer_count=6,
        stages=tuple(
            dataclasses.replace(s, layers=LayerRange(r[0], r[1], 6))
            for s, r in zip(b.stages, [(0, 1), (1, 4), (4, 6)], strict=True)
        ),
    )
    same = plan_like(shifted, a, capable, SIZES)
    assert [s.layers for s in same.stages] == [s.layers for s in a.stages]
    assert [s.node_id for s in same.stages] == [s.node_id for s in shifted.stages]
    # a node too small for its copied range: only stage 0 is shared
    small = [c if c.node_id != shifted.stages[2].node_id else NodeCapacity(c.node_id, 1)
             for c in capable]
    only_first = plan_like(shifted, a, small, SIZES)
    assert only_first.stages[0].layers == a.stages[0].layers
    assert only_first.stages[2].layers == shifted.stages[2].layers


def test_a_replica_cannot_take_another_replicas_peers() -> None:
    capable = [NodeCapacity(COORD, 10_000), *(node(i) for i in range(3))]  # 2 x 2 need 4
    with pytest.raises(Exception) as info:
        plan_replicas(capable, 2, 3)
    assert getattr(info.value, "code", "") == "topology_stage_count"


def test_free_for_keeps_the_coordinator_and_drops_the_other_replicas_nodes() -> None:
    capable = [NodeCapacity(COORD, 1), node(1), node(2)]
    free = free_for(capable, {COORD, node(1).node_id}, COORD)
    assert [c.node_id for c in free] == [COORD, node(2).node_id]


def test_a_replica_heals_with_a_spare_and_never_with_another_replicas_node() -> None:
    capable = [NodeCapacity(COORD, 10_000), *(node(i) for i in range(5))]  # one spare
    a, b = plan_replicas(capable, 2, 3)
    lost = a.stages[1].node_id
    held_by_b = {s.node_id for s in b.stages}
    linked = [c for c in capable if c.node_id != lost]
    healed = heal_topology(a, free_for(linked, held_by_b, COORD), SIZES, topology_id="topo-h")
    new = healed.stages[1].node_id
    assert new != lost and new not in held_by_b
    assert [s.node_id for s in healed.stages[2:]] == [s.node_id for s in a.stages[2:]]


def test_peers_needed() -> None:
    assert peers_needed(1, 3) == 2
    assert peers_needed(2, 3) == 4
    assert peers_needed(3, 2) == 3


def test_the_chooser_takes_the_ready_replica_with_the_fewest_outstanding_tokens() -> None:
    loads = [ReplicaLoad(0, True, 300, 2), ReplicaLoad(1, True, 120, 3), ReplicaLoad(2, True, 500)]
    assert choose_replica(loads) == 1


def test_the_chooser_never_takes_a_replica_that_is_not_ready() -> None:
    loads = [ReplicaLoad(0, False, 0), ReplicaLoad(1, True, 10_000)]
    assert choose_replica(loads) == 1
    assert choose_replica([ReplicaLoad(0, False, 0), ReplicaLoad(1, False, 0)]) is None
    assert choose_replica([]) is None


def test_the_chooser_breaks_ties_by_requests_in_flight_then_index() -> None:
    assert choose_replica([ReplicaLoad(0, True, 50, 2), ReplicaLoad(1, True, 50, 1)]) == 1
    assert choose_replica([ReplicaLoad(0, True, 50, 1), ReplicaLoad(1, True, 50, 1)]) == 0


def test_requests_alternate_when_each_choice_adds_its_tokens() -> None:
    """What the leases do under concurrent arrivals: each chosen request adds its tokens."""
    outstanding = [0, 0]
    picks = []
    for _ in range(8):
        k = choose_replica([ReplicaLoad(i, True, outstanding[i]) for i in range(2)])
        assert k is not None
        outstanding[k] += 40
        picks.append(k)
    assert picks.count(0) == picks.count(1) == 4


def test_replicas_need_a_stage_count_of_at_least_two() -> None:
    check_replicas(1, None)
    check_replicas(2, 3)
    for stages in (None, 1):
        with pytest.raises(UsageError) as info:
            check_replicas(2, stages)
        assert info.value.code == "usage" and "--stages" in info.value.message
    with pytest.raises(UsageError):
        check_replicas(0, 3)


def test_serving_replicas_setting_is_validated() -> None:
    assert serving_settings(None).replicas == 1
    assert serving_settings({"replicas": 3}).replicas == 3
    for bad in (0, -1, 65, "2", True, 1.5):
        with pytest.raises(UsageError) as info:
            serving_settings({"replicas": bad})
        assert "serving.replicas" in info.value.message


SERVING = {
    "model": "tiny",
    "state": "ready",
    "stages": 2,
    "topology_id": "topo-a",
    "replicas": [
        {
            "replica": 0,
            "state": "ready",
            "reason": None,
            "code": None,
            "nodes": [COORD, "a" * 64],
            "requests_in_flight": 1,
            "outstanding_tokens": 120,
            "requests_total": 7,
        },
        {
            "replica": 1,
            "state": "waiting",
            "reason": "no capable peer for stage 1",
            "code": "no_capable_peer",
            "nodes": [COORD, "b" * 64],
            "requests_in_flight": 0,
            "outstanding_tokens": 0,
            "requests_total": 3,
        },
    ],
}


def test_status_text_shows_each_replica() -> None:
    from mesh_node.peers import render_serving

    lines = render_serving(SERVING)
    assert any(line.startswith("  replica 0 ready;") and "total 7" in line for line in lines)
    assert any(
        line.startswith("  replica 1 waiting [no_capable_peer]: no capable peer") for line in lines
    )


def test_metrics_label_each_replica() -> None:
    from mesh_node.metrics import replica_families

    families = {f.name: f for f in replica_families(SERVING)}
    ready = {s.labels["replica"]: s.value for s in families["mesh_node_replica_ready"].samples}
    assert ready == {"0": 1, "1": 0}
    total = {
        s.labels["replica"]: s.value
        for s in families["mesh_node_replica_requests"].samples
        if s.name.endswith("_total")
    }
    assert total == {"0": 7, "1": 3}
    assert replica_families({"state": "ready"}) == []


def test_the_lab_checks_its_replicas_against_its_nodes() -> None:
    from mesh_node.lab.run import LabOptions

    ok = LabOptions(nodes=5, package="pkg", serve=True, replicas=2)
    assert ok.serve_stages == 3  # an equal share of the 4 workers per replica, plus stage 0
    assert LabOptions(nodes=4, package="pkg", serve=True).serve_stages == 4
    with pytest.raises(UsageError) as info:
        LabOptions(nodes=4, package="pkg", serve=True, replicas=2, stages=3)
    assert "need 4 workers" in info.value.message and info.value.code == "usage"
    with pytest.raises(UsageError) as info:
        LabOptions(nodes=5, package="pkg", replicas=2)  # neither --serve nor --prompt
    assert "--replicas needs" in info.value.message
