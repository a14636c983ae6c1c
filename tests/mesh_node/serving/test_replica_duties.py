"""Replicas as equal splits, in one process with real nodes and the real stage runtime: every
replica is built from one ``SplitSpec``; what only one may do is a duty it was given (the
node's own topology service, the loaded stage 0, the run file), and the set reports a ready
replica's route whichever replica it is."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import trio

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

import synth_gguf
from meshtools import address_of, identity, settings, topology_of, wait_for
from pkgtools import make_package

from mesh_node.composition import compose
from mesh_node.node import MeshNode
from mesh_node.node_process import _package_facts
from mesh_node.serving.host import StageHost
from mesh_node.serving.pipeline import SplitServer
from mesh_node.serving.split import LoadsStage0, SharesStage0, SplitSpec
from mesh_node.serving.state import load_state
from mesh_node.settings import ServingSettings
from skippy.config import read_environment
from skippy.errors import UsageError
from skippy.package.plan import ModelSizes

pytestmark = pytest.mark.llama
SERVING = ServingSettings(engine="ggml", token_timeout_s=20.0, failover_timeout_s=20.0)


@pytest.fixture(scope="module")
def tiny_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("replica_duties")
    src = synth_gguf.llama_like(root / "llama.gguf", n_layers=6)
    make_package(src, root / "pkg", model_id="acme/llama-GGUF:Q8_0")
    return root / "pkg"


@dataclass
class Member:
    node: MeshNode
    host: StageHost
    scope: trio.CancelScope


@asynccontextmanager
async def mesh(tmp: Path, n: int) -> AsyncIterator[list[Member]]:
    """``n`` running nodes on loopback, each in its own cancel scope; the first is the
    coordinator, the others its peers."""
    async with trio.open_nursery() as nursery:
        members: list[Member] = []
        for i in range(n):
            s = settings(tmp, f"n{i}", serving=SERVING, peer_loss_timeout_s=2.0)
            if members:
                s = replace(s, peers=(address_of(members[0].node),))

            async def run(s=s, task_status=trio.TASK_STATUS_IGNORED):  # type: ignore[no-untyped-def]
                with trio.CancelScope() as scope:
                    parts = compose(s, identity(), read_environment())
                    async with trio.open_nursery() as inner:
                        await inner.start(parts.node.run)
                        task_status.started(Member(parts.node, parts.host, scope))
                        await trio.sleep_forever()

            members.append(await nursery.start(run))
        await wait_for(lambda: len(members[0].node.peers(connected_only=True)) == n - 1)
        yield members
        nursery.cancel_scope.cancel()


def test_a_spec_refuses_replicas_its_stage_count_cannot_carry() -> None:
    package = ("hf://acme/x@" + "0" * 40, "0" * 64)
    sizes = ModelSizes(layer_bytes=(1,) * 4, metadata_bytes=1, embeddings_bytes=1, output_bytes=1)
    with pytest.raises(UsageError) as info:
        SplitSpec(*package, sizes, stages=None, replicas=2)
    assert info.value.code == "usage" and "--stages" in info.value.message
    with pytest.raises(UsageError):
        SplitSpec(*package, sizes, stages=2, replicas=0)
    assert SplitSpec(*package, sizes, stages=2, replicas=2).replicas == 2


async def test_replicas_are_equal_splits_with_named_duties(tiny_pkg: Path, tmp_path: Path) -> None:
    async with mesh(tmp_path, 3) as (coord, w0, w1):
        ref, sha, sizes = _package_facts(coord.node.settings, str(tiny_pkg))
        spec = SplitSpec(ref, sha, sizes, stages=2, replicas=2, settings=SERVING)
        node_topology = topology_of(coord.node)
        server = SplitServer(coord.node, coord.host, node_topology, spec, model_name="tiny")
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            managers = server.replicas.managers
            await wait_for(lambda: all(m.route is not None for m in managers), 60)
            first, other = managers
            # one spec; each its own topology service: the node's, and a sibling of it
            assert first.spec is other.spec is spec
            assert first.topology is node_topology
            assert node_topology.siblings == (other.topology,)
            # the duties: stage 0 loaded for the first, shared by the other; one run file
            assert isinstance(first.duties.stage0, LoadsStage0)
            assert isinstance(other.duties.stage0, SharesStage0)
            assert first.duties.run_file is not None and other.duties.run_file is None
            assert other.duties.layout is not None and first.duties.layout is None
            assert first.route is not None and other.route is not None
            assert first.route.stage0 is other.route.stage0 is coord.host.loaded
            state = load_state(coord.node.settings.data_dir)
            assert state is not None and state.topology.topology_id == first.route.topology_id
            # disjoint workers
            nodes = [set(m.route.node_ids) for m in managers if m.route is not None]
            assert nodes[0] & nodes[1] == {coord.node.node_id}

            # the first replica's worker goes: the set serves on the other replica, and its
            # status names that replica's route
            lost = w0 if w0.node.node_id in first.route.node_ids else w1
            kept_route = other.route
            lost.scope.cancel()
            await wait_for(lambda: first.route is None, 20)
            status = server.status()
            assert status["state"] == "ready" and status["code"] is None
            assert status["topology_id"] == kept_route.topology_id
            assert status["stages"] == 2
            assert [r["state"] == "ready" for r in status["replicas"]] == [False, True]
            nursery.cancel_scope.cancel()
