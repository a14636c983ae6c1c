"""A split growing from 2 to 3 stages over real mesh links between nodes in this process
(synthetic model): while the third node is still loading, the worker whose layers changed has
its new stage loaded, yet the old route keeps serving through its replaced stage (no
failover, the same tokens); once every stage is ready the route switches and the replaced
stage closes. The third node's load waits on an event of the test (its real ready hook runs
after it), so "still loading" is a state, not a race."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

import synth_gguf
from meshtools import identity, settings, topology_of, wait_for, with_peers
from pkgtools import make_package

from mesh_node.composition import compose
from mesh_node.node import MeshNode
from mesh_node.node_process import _package_facts
from mesh_node.serving.pipeline import GenerationParams, GenerationResult, SplitServer
from mesh_node.serving.split import SplitSpec
from mesh_node.settings import ServingSettings
from mesh_node.transfer.fetch import StageResult
from skippy.config import read_environment
from skippy.stage.descriptor import StageDescriptor

pytestmark = pytest.mark.llama
IDS = [1, 5, 9, 17, 33, 65, 3, 100, 7, 12, 90, 44]
SERVING = ServingSettings(n_ctx=128, threads=1, prefill_chunk=5, max_sessions=3, max_queue=4)


@pytest.fixture(scope="module")
def tiny_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grow_links")
    src = synth_gguf.llama_like(root / "llama.gguf", n_layers=6)
    make_package(src, root / "pkg", model_id="acme/tiny-GGUF:Q8_0")
    return root / "pkg"


async def _generate(server: SplitServer, n: int = 12) -> tuple[list[int], GenerationResult]:
    out: list[int] = []

    async def emit(token: int) -> bool:
        out.append(token)
        return False

    result = await server.generate(IDS, GenerationParams(max_tokens=n), emit)
    return out, result


async def test_the_old_route_serves_while_a_grown_topology_loads(
    tiny_pkg: Path, tmp_path: Path
) -> None:
    async with trio.open_nursery() as nursery:
        nodes: list[MeshNode] = []
        hosts = []
        services = []
        gate = trio.Event()
        for i in range(3):
            s = settings(tmp_path, f"n{i}", serving=SERVING)
            # each node dials every earlier one: a worker counts only the nodes it verified
            # (certificate-less nodes here: the coordinator's word does not count)
            parts = compose(with_peers(s, *nodes), identity(), read_environment())
            node = parts.node
            nodes.append(node)
            hosts.append(parts.host)
            services.append(parts.artifacts)
            if i < 2:  # the third node joins later
                await nursery.start(node.run)
        # the third node loads its stage only when the test says so (its real hook then runs)
        real = services[2].ready_hook
        assert real is not None

        async def gated(result: StageResult) -> StageDescriptor:
            await gate.wait()
            assert real is not None
            return await real(result)

        services[2].ready_hook = gated
        await wait_for(lambda: len(nodes[0].peers(connected_only=True)) == 1)
        coord, w1, w2 = nodes
        ref, sha, sizes = _package_facts(coord.settings, str(tiny_pkg))
        spec = SplitSpec(ref, sha, sizes, None, settings=SERVING)
        server = SplitServer(coord, hosts[0], topology_of(coord), spec, model_name="tiny")
        await nursery.start(server.run)
        await wait_for(lambda: server.route is not None and len(server.route.node_ids) == 2, 30)
        want, _ = await _generate(server)
        old = server.route
        assert old is not None and old.node_ids == (coord.node_id, w1.node_id)
        w1_old = hosts[1].loaded
        assert w1_old is not None

        # the third node joins: the split grows; it holds its stage back
        await nursery.start(w2.run)  # and its services
        await wait_for(
            lambda: (a := topology_of(coord).active) is not None and len(a.topology.stages) == 3, 30
        )
        grown = topology_of(coord).active
        assert grown is not None
        tid = grown.topology.topology_id
        # w1 has its new layers loaded; the coordinator too; the route is still the old one
        await wait_for(
            lambda: (h := hosts[1].loaded) is not None and h.topology.topology_id == tid, 30
        )
        await wait_for(
            lambda: (h := hosts[0].loaded) is not None and h.topology.topology_id == tid, 30
        )
        assert hosts[1].loaded is not w1_old and hosts[1].retired == [w1_old]
        assert server.route is old
        with trio.fail_after(30):
            during, result = await _generate(server)
        assert during == want and result.failovers == 0
        assert server.route is old

        gate.set()  # the third stage loads; the route switches
        await wait_for(lambda: server.route is not None and server.route.topology_id == tid, 30)
        after, result = await _generate(server)
        assert after == want and result.failovers == 0
        # the replaced stages closed once the route moved on and their holders ended
        await wait_for(lambda: not hosts[0].retired and not hosts[1].retired, 10)
        assert w1_old.stage.weights is None  # closed
        nursery.cancel_scope.cancel()
