"""Growing a served split when capable peers join: the pure decision (``skippy.package.grow``)
over topologies the real planner makes (tables, no I/O)."""

from __future__ import annotations

import pytest

from skippy.package.grow import GROW_INTERVAL_S, grow_check, grows, growth_summary
from skippy.package.plan import ModelSizes
from skippy.package.topology import NodeCapacity, SplitTopology, plan_topology

A, B, C = ("a" * 64, "b" * 64, "c" * 64)
SIZES = ModelSizes(layer_bytes=(100,) * 6, metadata_bytes=10, embeddings_bytes=50, output_bytes=50)


def _plan(nodes: list[str], *, tid: str = "topo-1", sizes: ModelSizes = SIZES) -> SplitTopology:
    return plan_topology(
        sizes,
        [NodeCapacity(n, 10_000) for n in nodes],
        topology_id=tid,
        run_id="run-1",
        package_ref="hf://ns/repo@" + "0" * 40,
        manifest_sha256="e" * 64,
        first_node=A,
    )


ONE = _plan([A])  # served on the coordinator alone
FREE: dict[str, object] = {
    "stages": None,
    "replicas": 1,
    "serving": True,
    "last_members": None,
    "since_last_s": None,
}


@pytest.mark.parametrize(
    ("capable", "changes", "plan", "why"),
    [
        # a capable peer joined a split of no fixed stage count that serves: plan again
        ({A, B}, {}, True, "outside the split: bbbbbbbbbbbb"),
        # --stages N: a peer that joins is a spare
        ({A, B}, {"stages": 1}, False, "fixed (1): peers that join are spares"),
        # replicas keep their stage count
        ({A, B}, {"replicas": 2}, False, "2 replicas keep their stage count"),
        # never while the active topology is still loading (a grow or a heal)
        ({A, B}, {"serving": False}, False, "not serving yet"),
        # nobody new: every capable node already holds a stage
        ({A}, {}, False, "no capable node outside the split"),
        # the same members as the last plan (which kept 1 stage): no plan on every tick
        ({A, B}, {"last_members": {A, B}, "since_last_s": 60.0}, False, "joined or left"),
        # a membership change, but the last plan was made just now: at most one per interval
        ({A, B, C}, {"last_members": {A, B}, "since_last_s": 1.0}, False, "1.0 s ago"),
        ({A, B, C}, {"last_members": {A, B}, "since_last_s": GROW_INTERVAL_S}, True, "b, cccc"),
    ],
)
def test_grow_check_plans_again_only_when_a_capable_peer_joined_a_free_split(
    capable: set[str], changes: dict[str, object], plan: bool, why: str
) -> None:
    check = grow_check(ONE, capable, **{**FREE, **changes})  # type: ignore[arg-type]
    assert check.plan is plan
    assert why in check.reason


def test_a_split_with_a_stage_per_layer_does_not_grow() -> None:
    two_layers = ModelSizes(
        layer_bytes=(100, 100), metadata_bytes=10, embeddings_bytes=50, output_bytes=50
    )
    full = _plan([A, B], sizes=two_layers)
    assert len(full.stages) == 2
    check = grow_check(full, {A, B, C}, **FREE)  # type: ignore[arg-type]
    assert not check.plan and "every layer" in check.reason


def test_a_plan_with_more_stages_grows_and_says_who_took_which_layers() -> None:
    planned = _plan([A, B], tid="topo-2")
    assert [s.node_id for s in planned.stages] == [A, B]
    assert grows(ONE, planned)
    assert growth_summary(ONE, planned) == (
        f"1 -> 2 stages, node {B[:12]} took layers {planned.stages[1].layers}"
    )
    three = _plan([A, B, C], tid="topo-3")
    assert grows(planned, three)
    taken = three.stage_of(C)
    assert taken is not None
    want = f"2 -> 3 stages, node {C[:12]} took layers {taken.layers}"
    assert growth_summary(planned, three) == want
    # the same count (a planner that kept the split) or fewer stages: no grow
    assert not grows(planned, _plan([A, C], tid="topo-4"))
    assert not grows(three, planned)


def test_a_plan_that_moves_stage_0_or_serves_another_package_is_no_grow() -> None:
    moved = plan_topology(
        SIZES,
        [NodeCapacity(A, 10_000), NodeCapacity(B, 10_000)],
        topology_id="topo-5",
        run_id="run-1",
        package_ref=ONE.package_ref,
        manifest_sha256=ONE.manifest_sha256,
        first_node=B,
    )
    assert not grows(ONE, moved)
    other = _plan([A, B], tid="topo-6")
    other = SplitTopology(
        topology_id=other.topology_id,
        run_id=other.run_id,
        package_ref=other.package_ref,
        manifest_sha256="f" * 64,
        layer_count=other.layer_count,
        stages=other.stages,
    )
    assert not grows(ONE, other)
