"""The ready report: the stage descriptor's strict parse, the
coordinator's check against the topology (pure), and how the coordinator records reports."""

from __future__ import annotations

import dataclasses

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshtools import identity, settings

from mesh_node.node import MeshNode
from mesh_node.topology import ActiveTopology, TopologyService
from protocol.messages import StageReady, decode_control_message
from skippy.errors import TopologyError
from skippy.package.ranges import LayerRange
from skippy.package.topology import SplitTopology, StageAssignment
from skippy.stage.descriptor import StageDescriptor, admission_problem

A, B = "a" * 64, "b" * 64
REF = "hf://lab/pkg@" + "1" * 40
SHA = "ab" * 32
TOPOLOGY = SplitTopology(
    "topo-1",
    "run-1",
    REF,
    SHA,
    6,
    (
        StageAssignment(A, "stage-0", 0, LayerRange(0, 3, 6)),
        StageAssignment(B, "stage-1", 1, LayerRange(3, 6, 6)),
    ),
)
GOOD = StageDescriptor(REF, SHA, 1, LayerRange(3, 6, 6), artifact_count=5, artifact_bytes=1234)


def test_descriptor_round_trips_and_parses_strictly() -> None:
    assert StageDescriptor.from_dict(GOOD.to_dict()) == GOOD
    for broken in (
        {**GOOD.to_dict(), "extra": 1},
        {k: v for k, v in GOOD.to_dict().items() if k != "layer_count"},
        {**GOOD.to_dict(), "stage_index": True},
        {**GOOD.to_dict(), "layer_start": 6},
        {**GOOD.to_dict(), "manifest_sha256": "AB" * 32},
        {**GOOD.to_dict(), "artifact_bytes": -1},
        [GOOD.to_dict()],
    ):
        with pytest.raises(TopologyError) as err:
            StageDescriptor.from_dict(broken)
        assert err.value.code == "invalid_stage_descriptor"


@pytest.mark.parametrize(
    ("node", "change", "reason"),
    [
        (B, {}, None),
        ("c" * 64, {}, "not_in_topology"),
        (B, {"package_ref": "hf://lab/other@" + "1" * 40}, "package_mismatch"),
        (B, {"manifest_sha256": "cd" * 32}, "manifest_mismatch"),
        (B, {"stage_index": 0}, "stage_mismatch"),
        (B, {"layers": LayerRange(2, 6, 6)}, "layers_mismatch"),
        (A, {}, "stage_mismatch"),
    ],
)
def test_admission_problem(node: str, change: dict[str, object], reason: str | None) -> None:
    descriptor = dataclasses.replace(GOOD, **change)  # type: ignore[arg-type]
    problem = admission_problem(descriptor, TOPOLOGY, node)
    assert (problem[0] if problem else None) == reason


def test_the_coordinator_records_reports_of_its_own_topology_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    node = MeshNode(settings(tmp_path, "coord"), identity(Ed25519PrivateKey.generate()))
    service = TopologyService(node)

    def report(node_id: str, message: StageReady) -> tuple[bool, str | None]:
        # the message as it crosses the wire, decoded strictly
        decoded = decode_control_message(message.encode())
        assert isinstance(decoded, StageReady)
        ack = service.record_stage(node_id, decoded)
        return ack.accepted, ack.code

    ready = StageReady("topo-1", "stage-1", True, GOOD.to_dict())
    assert report(B, ready) == (False, "stale_topology")  # no topology yet
    service.active = ActiveTopology(TOPOLOGY, b"s" * 64, node.node_id, "coordinator", "active")
    assert report(B, dataclasses.replace(ready, topology_id="topo-0")) == (False, "stale_topology")
    assert report(B, dataclasses.replace(ready, stage_id="stage-0")) == (False, "not_in_topology")
    bad = dataclasses.replace(ready, descriptor={"layers": "all"})
    assert report(B, bad) == (False, "invalid_stage_descriptor")
    wrong = dataclasses.replace(GOOD, layers=LayerRange(4, 6, 6)).to_dict()
    assert report(B, dataclasses.replace(ready, descriptor=wrong)) == (False, "layers_mismatch")
    assert service.active.reports[B].state == "rejected" and not service.active.all_ready
    failed = StageReady("topo-1", "stage-0", False, None, "not_in_offline_cache", "it failed")
    assert report(A, failed) == (True, None)
    assert service.active.reports[A].state == "failed"
    assert service.active.reports[A].message == "it failed"  # why, as the node said it
    assert report(B, ready) == (True, None)
    assert report(A, StageReady("topo-1", "stage-0", True, dataclasses.replace(
        GOOD, stage_index=0, layers=LayerRange(0, 3, 6)).to_dict())) == (True, None)
    assert service.active.all_ready
    doc = service.status()
    assert doc is not None and doc["all_ready"]
    assert doc["ready"][B] == {
        "state": "ready", "code": None, "message": None, "artifact_bytes": 1234
    }
