"""The pure parts of self-healing serving: the replay schedule, healing a topology
over the nodes linked now, and the persisted run state (tables and round trips, no I/O but a
temp folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh_node.serving.state import SplitState, load_state, save_state, state_path
from skippy.errors import TopologyError
from skippy.package.heal import heal_topology, missing_nodes
from skippy.package.plan import ModelSizes
from skippy.package.topology import NodeCapacity, SplitTopology, plan_topology
from skippy.serving.replay import Step, schedule

A, B, C, D = ("a" * 64, "b" * 64, "c" * 64, "d" * 64)
SIZES = ModelSizes(layer_bytes=(100,) * 6, metadata_bytes=10, embeddings_bytes=50, output_bytes=50)


@pytest.mark.parametrize(
    ("prompt", "generated", "chunk", "want"),
    [
        # the first attempt: the prompt in chunks, the last one samples
        ([1, 2, 3], [], 2, [Step("prefill", 0, (1, 2), False), Step("prefill", 2, (3,), True)]),
        # a replay after 2 tokens: the same chunks, then each token as its own decode step
        (
            [1, 2, 3],
            [7, 8],
            2,
            [
                Step("prefill", 0, (1, 2), False),
                Step("prefill", 2, (3,), False),
                Step("decode", 3, (7,), False),
                Step("decode", 4, (8,), True),
            ],
        ),
        ([4], [5], 128, [Step("prefill", 0, (4,), False), Step("decode", 1, (5,), True)]),
    ],
)
def test_the_replay_schedule_repeats_the_calls_that_ran(
    prompt: list[int], generated: list[int], chunk: int, want: list[Step]
) -> None:
    assert schedule(prompt, generated, chunk) == want
    # the steps cover every committed position once, in order; the last one samples
    steps = schedule(prompt, generated, chunk)
    assert [p for s in steps for p in range(s.start, s.end)] == list(
        range(len(prompt) + len(generated))
    )
    assert [s.sample for s in steps] == [False] * (len(steps) - 1) + [True]


def test_the_replay_schedule_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        schedule([], [], 4)
    with pytest.raises(ValueError):
        schedule([1], [], 0)


def _topology(nodes: list[NodeCapacity]) -> SplitTopology:
    return plan_topology(
        SIZES,
        nodes,
        topology_id="topo-1",
        run_id="run-1",
        package_ref="hf://ns/repo@" + "0" * 40,
        manifest_sha256="e" * 64,
        stages=3,
        first_node=A,
    )


def test_healing_keeps_linked_nodes_and_moves_only_the_missing() -> None:
    nodes = [NodeCapacity(A, 1000), NodeCapacity(B, 1000), NodeCapacity(C, 1000)]
    topo = _topology(nodes)
    # every node linked again (a node came back with its id): the same stages, a new id
    same = heal_topology(topo, nodes, SIZES, topology_id="topo-2")
    assert same.topology_id == "topo-2" and same.run_id == "run-1"
    assert [s.node_id for s in same.stages] == [s.node_id for s in topo.stages]
    # C gone, D linked: only C's stage moves to D
    linked = [nodes[0], nodes[1], NodeCapacity(D, 1000)]
    assert missing_nodes(topo, {A, B, D}) == [C]
    moved = heal_topology(topo, linked, SIZES, topology_id="topo-3")
    want = [D if s.node_id == C else s.node_id for s in topo.stages]
    assert [s.node_id for s in moved.stages] == want
    # C gone and nobody to take it: no_capable_peer
    with pytest.raises(TopologyError) as err:
        heal_topology(topo, nodes[:2], SIZES, topology_id="topo-4")
    assert err.value.code == "no_capable_peer"


def test_the_run_state_round_trips_and_a_bad_file_is_ignored(tmp_path: Path) -> None:
    topo = _topology([NodeCapacity(A, 1000), NodeCapacity(B, 1000), NodeCapacity(C, 1000)])
    state = SplitState(A, topo.package_ref, topo.manifest_sha256, 3, topo, b"\x01" * 64)
    assert load_state(tmp_path) is None
    save_state(tmp_path, state)
    back = load_state(tmp_path)
    assert back is not None and back == state
    assert back.matches(A, topo.package_ref, topo.manifest_sha256, 3)
    assert not back.matches(B, topo.package_ref, topo.manifest_sha256, 3)
    assert not back.matches(A, topo.package_ref, topo.manifest_sha256, 2)
    # no partial left beside it; a corrupt file is reported and ignored (a fresh plan)
    assert [p.name for p in state_path(tmp_path).parent.iterdir()] == ["split.json"]
    state_path(tmp_path).write_text("{not json")
    assert load_state(tmp_path) is None


@pytest.mark.parametrize(
    ("configured", "cores", "co_located", "want"),
    [
        (None, 2, 3, 1),  # three stages on a 2-core host: one thread each, not 2 x 3
        (None, 8, 3, 2),
        (None, 2, 1, 2),  # alone on the host: every core
        (None, 1, 4, 1),  # never below one
        (4, 2, 3, 4),  # threads = N is honoured as given
    ],
)
def test_auto_threads_divide_the_cores_among_co_located_stages(
    configured: int | None, cores: int, co_located: int, want: int
) -> None:
    from skippy.runtime.contention import stage_threads

    assert stage_threads(configured, cores, co_located) == want


def test_threads_setting_is_auto_by_default_or_a_count() -> None:
    from mesh_node.settings import serving_settings
    from skippy.errors import UsageError

    assert serving_settings(None).threads is None
    assert serving_settings({"threads": "auto"}).threads is None
    assert serving_settings({"threads": 3}).threads == 3
    for bad in ("many", 0, True, 2.5):
        with pytest.raises(UsageError):
            serving_settings({"threads": bad})


def test_hello_carries_an_optional_host_fingerprint() -> None:
    from protocol import constants as pc
    from protocol.errors import ProtocolError
    from protocol.messages import Hello, decode_link_message

    limits = pc.Limits()
    with_host = Hello("ws://127.0.0.1:1", {}, 5, host="ab12" * 8)
    assert decode_link_message(with_host.encode(), limits) == with_host
    without = Hello("ws://127.0.0.1:1", {}, 5)  # an older node's hello is still valid
    assert decode_link_message(without.encode(), limits) == without
    for bad in ("", "x" * 65, "not/hex!"):
        with pytest.raises(ProtocolError):
            decode_link_message(Hello(None, {}, 0, host=bad).encode(), limits)
