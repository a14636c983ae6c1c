"""The node core and its services (``mesh_node.node_service``, ``mesh_node.composition``): a
service's stream kinds, feature bits, status sections and metrics reach peers, the status
document and ``/metrics`` through the one interface; the core imports no service; the
composed node advertises what ``mesh-node run`` always advertised."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from layering import graph, read_imports
from meshtools import identity, settings, wait_for, with_peers
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mesh_node.composition import compose
from mesh_node.metrics import SectionCollector, node_registry
from mesh_node.node import MeshNode
from mesh_node.node_service import FeatureBits, StreamKind, merge_features
from mesh_node.peers import InboundStream
from mesh_node.settings import NODE_KEYS
from protocol import constants as pc
from protocol.messages import Hello, decode_link_message
from skippy.config import read_environment
from skippy.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
ECHO = "echo-test"  # a subprotocol and feature of this test's own


class EchoService:
    """A service of this test: one stream kind (echoes what it reads), one feature bit, one
    status section, one metric, and a ``run`` that counts what it saw."""

    config_table: str | None = None

    def __init__(self) -> None:
        self.echoed = 0
        self.started_before_listening: bool | None = None
        self.node: MeshNode | None = None

    async def _echo(self, inbound: InboundStream) -> None:
        data = await inbound.stream.receive_some()
        self.echoed += 1
        await inbound.stream.send_all(data)
        await inbound.stream.send_eof()

    def streams(self) -> Sequence[StreamKind]:
        return [StreamKind(1, self._echo, name=ECHO, major=1)]

    def features(self, now_s: float) -> FeatureBits:
        return {ECHO: frozenset({"echo"}), pc.FEATURE_SKIPPY_STAGE: frozenset({pc.BIT_CONTROL})}

    def status_sections(self) -> Mapping[str, Any]:
        return {"echo": {"echoed": self.echoed}}

    def collectors(self) -> Sequence[Collector]:
        def families(section: Mapping[str, Any]) -> list[Metric]:
            return [GaugeMetricFamily("echo_echoed", "Streams echoed", value=section["echoed"])]

        return [SectionCollector(lambda: self.status_sections()["echo"], families)]

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        assert self.node is not None
        self.started_before_listening = self.node.listen_url is None
        task_status.started()


async def test_a_service_declares_its_stream_kinds_bits_status_and_metrics(tmp_path):
    owner = Ed25519PrivateKey.generate()
    service = EchoService()
    async with trio.open_nursery() as n:
        a = MeshNode(settings(tmp_path, "a"), identity(owner))
        service.node = a
        a.add_service(service)
        await n.start(a.run)
        b = MeshNode(with_peers(settings(tmp_path, "b"), a), identity(owner))
        await n.start(b.run)
        await wait_for(lambda: (p := b.peer(a.node_id)) is not None and p.connected)
        assert service.started_before_listening is True  # ready before any peer reaches it

        # its bits, in a's hello as b received it
        seen = b.peer(a.node_id)
        assert seen is not None and seen.features == {
            ECHO: ("echo",),
            pc.FEATURE_SKIPPY_STAGE: (pc.BIT_CONTROL,),
        }
        # its stream kind, served to a peer
        stream = await b.open_stream(a.node_id, 1, name=ECHO, major=1)
        async with stream:
            await stream.send_all(b"ping")
            await stream.send_eof()
            assert await stream.receive_some() == b"ping"
        assert service.echoed == 1
        # its status section and its metric
        assert a.status()["echo"] == {"echoed": 1}
        text = generate_latest(node_registry(a.status, a.collectors())).decode()
        assert "echo_echoed 1.0" in text
        assert "mesh_node_uptime_seconds" in text  # beside the core's families
        # a node without the service has none of it
        assert ECHO not in b.features and "echo" not in b.status()
        n.cancel_scope.cancel()


async def test_services_are_added_before_the_node_runs_and_looked_up_by_type(tmp_path):
    async with trio.open_nursery() as n:
        node = MeshNode(settings(tmp_path, "a"), identity())
        echo = EchoService()
        echo.node = node
        node.add_service(echo)
        with pytest.raises(UsageError) as missing:
            node.service(int)
        assert missing.value.code == "no_such_service"
        assert node.service(EchoService) is echo
        clash = EchoService()  # kind 2 is free, kind 1 is echo's: refused as a whole
        clash.streams = lambda: [  # type: ignore[method-assign]
            StreamKind(2, clash._echo, name=ECHO, major=1),
            StreamKind(1, clash._echo, name=ECHO, major=1),
        ]
        with pytest.raises(UsageError):  # one handler per (name, major, kind)
            node.add_service(clash)
        node.register_subprotocol(2, clash._echo, name=ECHO, major=1)  # nothing half-added
        await n.start(node.run)
        late = EchoService()
        with pytest.raises(UsageError) as running:
            node.add_service(late)
        assert running.value.code == "node_running"
        n.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("declared", "merged"),
    [
        ([], {}),
        ([{"f": frozenset({"b", "a"})}], {"f": ("a", "b")}),
        (
            [{"f": frozenset({"c"})}, {"f": frozenset({"a", "c"}), "e": frozenset()}],
            {"e": (), "f": ("a", "c")},
        ),
    ],
)
def test_merge_features_unites_and_sorts_whatever_the_order(declared, merged):
    assert merge_features(declared) == merged
    assert merge_features(reversed(declared)) == merged


# What `mesh-node run` advertised before services declared their bits, spelled out here
# independently of the services: the stage bundle, verify windows, sampling controls and the
# chunk chain always; artifact-transfer when the node serves artifacts, and the swarm bits
# with it unless swarm_transfer is off. Since relays, every node also reads relayed addresses
# (mesh-relay/1 "relayed", a new feature older peers ignore); "relay" only when it relays.
# Since native-mtp, every stage host also passes NextN drafts on ("nextn-drafts").
ALWAYS = {
    *pc.STAGE_BUNDLE,
    pc.BIT_VERIFY_WINDOW,
    pc.BIT_NEXTN_DRAFTS,
    pc.BIT_SAMPLING_CONTROLS,
    pc.BIT_CHUNK_CHAIN,
}
SWARM = {pc.BIT_SWARM_TRANSFER, pc.BIT_SIBLING_SERVE, pc.BIT_CHUNK_RUNS, pc.BIT_PARTIAL_SERVE}


@pytest.mark.parametrize(
    ("mode", "swarm", "bits"),
    [
        ("disabled", True, ALWAYS),
        ("open", False, ALWAYS | {pc.BIT_ARTIFACT_TRANSFER}),
        ("open", True, ALWAYS | {pc.BIT_ARTIFACT_TRANSFER} | SWARM),
    ],
)
def test_a_composed_node_advertises_the_bits_mesh_node_run_always_did(tmp_path, mode, swarm, bits):
    s = settings(tmp_path, "x", artifact_transfer=mode, swarm_transfer=swarm)
    node = compose(s, identity(), read_environment()).node
    expected = {
        pc.FEATURE_MESH_RELAY: (pc.BIT_RELAYED,),
        pc.FEATURE_SKIPPY_STAGE: tuple(sorted(bits)),
    }
    assert node.features == expected
    hello = Hello(listen=None, features=node.features, memory_budget_bytes=1)
    assert hello.encode() == Hello(None, expected, 1).encode()  # the same bytes on the wire
    assert decode_link_message(hello.encode()) == Hello(None, expected, 1)


def test_each_composed_services_config_table_is_a_table_of_the_node_toml(tmp_path):
    parts = compose(settings(tmp_path, "x"), identity(), read_environment())
    services = [parts.topology, parts.host, parts.artifacts, parts.serving, parts.relay]
    tables = {s.config_table for s in services} - {None}
    assert tables == {"serving", "http", "relay"}
    assert tables <= NODE_KEYS
    assert all(parts.node.service(type(s)) is s for s in services)


# The core: the node, its links, membership, and the interface services implement.
CORE = ["mesh_node.node", "mesh_node.node_service"]
SERVICES = (
    "mesh_node.topology",
    "mesh_node.transfer",
    "mesh_node.serving",
    "mesh_node.http",
    "mesh_node.lab",
    "mesh_node.metrics",
    "mesh_node.composition",
    "mesh_node.node_process",
    "mesh_node.relay",
)


def reachable(edges: Mapping[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += edges.get(module, ())
    return seen


@pytest.mark.parametrize("core", CORE)
def test_the_core_imports_no_service_even_indirectly(core):
    imports = read_imports(REPO, ("protocol", "skippy", "mesh_node"))
    edges = graph(imports)
    assert core in edges  # the reader saw it
    found = sorted(m for m in reachable(edges, core) if m.startswith(SERVICES))
    assert found == [], f"{core} reaches {found}"
