"""skippy.package.topology: a split topology covers 0..layer_count exactly once, one stage per
node, and survives a round trip through its dict form; untrusted dicts are parsed strictly."""

from __future__ import annotations

import json
from typing import Any

import pytest

from skippy.errors import TopologyError
from skippy.package.ranges import LayerRange
from skippy.package.topology import SplitTopology, StageAssignment

NODES = [f"{i:x}" * 64 for i in range(1, 5)]
SHA = "ab" * 32


def topo(ranges: list[tuple[int, int]], layer_count: int = 6, **kw: Any) -> SplitTopology:
    stages = tuple(
        StageAssignment(NODES[i], f"stage-{i}", i, LayerRange(a, b, layer_count))
        for i, (a, b) in enumerate(ranges)
    )
    args: dict[str, Any] = {
        "topology_id": "t1",
        "run_id": "r1",
        "package_ref": "hf://lab/pkg@" + "0" * 40,
        "manifest_sha256": SHA,
        "layer_count": layer_count,
        "stages": stages,
    }
    args.update(kw)
    return SplitTopology(**args)


def test_exact_cover_round_trips_through_dict_and_canonical_bytes():
    t = topo([(0, 2), (2, 5), (5, 6)])
    assert SplitTopology.from_dict(t.to_dict()) == t
    assert SplitTopology.from_dict(json.loads(t.canonical_bytes())) == t
    assert t.stage_of(NODES[1]) == t.stages[1]
    assert t.stage_of("f" * 64) is None
    assert t.final_stage.layers.owns_output


@pytest.mark.parametrize(
    "ranges",
    [
        [(0, 2), (3, 6)],  # gap
        [(0, 3), (3, 5)],  # ends short
        [(1, 3), (3, 6)],  # does not start at 0
    ],
)
def test_coverage_gaps_and_short_ends_are_refused(ranges):
    with pytest.raises(TopologyError) as exc:
        topo(ranges)
    assert exc.value.code == "topology_coverage"


def test_overlap_is_refused():
    data = topo([(0, 3), (3, 6)]).to_dict()
    data["stages"][1]["layer_start"] = 2
    with pytest.raises(TopologyError) as exc:
        SplitTopology.from_dict(data)
    assert exc.value.code == "topology_coverage"


def test_one_stage_per_node_and_stage_order():
    data = topo([(0, 3), (3, 6)]).to_dict()
    data["stages"][1]["node_id"] = NODES[0]
    with pytest.raises(TopologyError, match="node_id appears"):
        SplitTopology.from_dict(data)
    data = topo([(0, 3), (3, 6)]).to_dict()
    data["stages"][1]["stage_index"] = 5
    with pytest.raises(TopologyError, match="order"):
        SplitTopology.from_dict(data)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("manifest_sha256", "AB" * 32),
        ("manifest_sha256", "ab" * 31),
        ("topology_id", ""),
        ("topology_id", "x" * 200),
        ("run_id", "a b"),
        ("layer_count", True),
        ("layer_count", "6"),
        ("package_ref", ""),
        ("stages", "nope"),
    ],
)
def test_hostile_fields_are_refused(key, value):
    data = topo([(0, 6)]).to_dict()
    data[key] = value
    with pytest.raises(TopologyError):
        SplitTopology.from_dict(data)


@pytest.mark.parametrize("node_id", ["A" * 64, "a" * 63, "g" * 64, 7, None])
def test_node_ids_are_64_lowercase_hex(node_id):
    data = topo([(0, 6)]).to_dict()
    data["stages"][0]["node_id"] = node_id
    with pytest.raises(TopologyError):
        SplitTopology.from_dict(data)


def test_extra_or_missing_keys_are_refused():
    data = topo([(0, 6)]).to_dict()
    data["extra"] = 1
    with pytest.raises(TopologyError):
        SplitTopology.from_dict(data)
    data = topo([(0, 6)]).to_dict()
    del data["stages"][0]["stage_id"]
    with pytest.raises(TopologyError):
        SplitTopology.from_dict(data)


# --- planning ----------------------------------------------------------------------------------
def _sizes():
    from skippy.package.plan import ModelSizes

    return ModelSizes(layer_bytes=(100,) * 6, metadata_bytes=10, embeddings_bytes=50,
                      output_bytes=50)


def _plan(nodes, **kw):
    from skippy.package.topology import NodeCapacity, plan_topology

    args = {"topology_id": "t", "run_id": "r", "package_ref": "hf://a/b@" + "0" * 40,
            "manifest_sha256": SHA}
    args.update(kw)
    return plan_topology(_sizes(), [NodeCapacity(n, b) for n, b in nodes], **args)


def test_plan_puts_the_largest_stage_on_the_largest_budget():
    t = _plan([(NODES[0], 500), (NODES[1], 10**6), (NODES[2], 300)])
    assert len(t.stages) == 3 and t.layer_count == 6
    big = max(t.stages, key=lambda s: len(s.layers) * 100 + (50 if s.layers.owns_input else 0)
              + (50 if s.layers.owns_output else 0))
    assert big.node_id == NODES[1]
    assert SplitTopology.from_dict(t.to_dict()) == t


def test_plan_drops_nodes_that_cannot_hold_a_stage():
    t = _plan([(NODES[0], 10**6), (NODES[1], 10**6), (NODES[2], 5)])
    assert {s.node_id for s in t.stages} == {NODES[0], NODES[1]}


def test_plan_that_cannot_fit_names_the_node_and_the_missing_bytes():
    with pytest.raises(TopologyError) as exc:
        _plan([(NODES[0], 300), (NODES[1], 200)])
    assert exc.value.code == "topology_does_not_fit"
    # Two stages of 3 layers: 10 + 300 + 50 = 360 bytes each; the 200-byte node lacks 160.
    assert NODES[1][:12] in exc.value.message and "lacks 160 bytes" in exc.value.message


def test_plan_stage_count_and_empty_input():
    assert len(_plan([(NODES[0], 10**6), (NODES[1], 10**6)], stages=1).stages) == 1
    with pytest.raises(TopologyError):
        _plan([(NODES[0], 10**6)], stages=2)
    with pytest.raises(TopologyError):
        _plan([])
