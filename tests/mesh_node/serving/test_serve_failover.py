"""Failover with exact replay, over real mesh links between nodes in this process (synthetic
model): for every kill point of an n-token generation (during the prefill, and after each
generated token but the last), a stage node (stage 1 or the final stage, in turn) is stopped
mid-request; a spare takes its stage, the request replays its committed tokens through the
new route and finishes with exactly the undisturbed run's tokens, greedy and seeded. Stage 0's
calls on every attempt have the undisturbed run's shapes (the prompt in the same chunks, then
one-token decodes): a replay recomputes exactly what ran. The stopped node then comes back
with the same id and is the next kill's spare (its verified parts are still in its cache).

The route manager heals on its own (no operator): a returning node with no spare in the
mesh is planned back into its own stage, and the 503 in between says what the split waits for.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

import synth_gguf
from meshtools import address_of, identity, settings, topology_of, wait_for
from pkgtools import make_package

from mesh_node.composition import compose
from mesh_node.identity import LocalIdentity
from mesh_node.node import MeshNode
from mesh_node.node_process import _package_facts
from mesh_node.serving.host import StageHost
from mesh_node.serving.pipeline import GenerationParams, SplitNotReady, SplitServer
from mesh_node.serving.split import SplitSpec
from mesh_node.settings import ServingSettings
from protocol import constants as pc
from skippy.config import read_environment
from skippy.serving.replay import schedule
from skippy.stage import stage_frames as t

pytestmark = pytest.mark.llama
IDS = [1, 5, 9, 17, 33, 65, 3, 100, 7, 12, 90, 44]  # 12 tokens: chunks 5 + 5 + 2
N = 8
SERVING = ServingSettings(
    n_ctx=128,
    threads=1,
    prefill_chunk=5,
    max_sessions=2,
    max_queue=1,
    max_frame_bytes=64 * 1024,
    failover_timeout_s=30,
    token_timeout_s=10,
)


@pytest.fixture(scope="module")
def tiny_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serve_failover")
    src = synth_gguf.llama_like(root / "llama.gguf", n_layers=6)
    make_package(src, root / "pkg", model_id="acme/llama-GGUF:Q8_0")
    return root / "pkg"


@dataclass
class Member:
    name: str
    ident: LocalIdentity
    node: MeshNode
    host: StageHost
    scope: trio.CancelScope


class Recorder:
    """Stage 0's stage, recording each call's shape per session (delegates to the real one);
    ``hook`` runs on the compute thread after each call."""

    def __init__(self, stage: Any) -> None:
        self.stage = stage
        self.descriptor = stage.descriptor
        self.calls: dict[str, list[tuple[str, int, int]]] = {}
        self.hook: Callable[[], None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stage, name)

    def _record(self, session: str, kind: str, start: int, inputs: Any) -> None:
        self.calls.setdefault(session, []).append((kind, start, len(inputs)))
        if self.hook is not None:
            hook, self.hook = self.hook, None
            hook()

    def prefill(self, session: str, start: int, inputs: Any, **kw: Any) -> Any:
        out = self.stage.prefill(session, start, inputs, **kw)
        self._record(session, "prefill", start, inputs)
        return out

    def decode(self, session: str, position: int, inputs: Any, **kw: Any) -> Any:
        out = self.stage.decode(session, position, inputs, **kw)
        self._record(session, "decode", position, inputs)
        return out


class Mesh:
    def __init__(self, nursery: trio.Nursery, tmp: Path) -> None:
        self.nursery = nursery
        self.tmp = tmp
        self.members: dict[str, Member] = {}
        self.coordinator: MeshNode | None = None

    async def start(self, name: str, ident: LocalIdentity | None = None) -> Member:
        ident = ident or identity()
        # Every node of this mesh shares the test's one process and loop: a stall of the
        # process (a loaded CI machine) reaches them all at once, and 0.6 s (``FAST``) made
        # three live nodes "lost" together, once. A kill closes its links, so the loss is seen
        # at once; the timeout only judges silent links.
        s = settings(self.tmp, name, serving=SERVING, peer_loss_timeout_s=2.0)
        if self.coordinator is not None:
            from dataclasses import replace

            s = replace(s, peers=(address_of(self.coordinator),))

        async def run(task_status: trio.TaskStatus[Member]) -> None:
            with trio.CancelScope() as scope:
                parts = compose(s, ident, read_environment())
                node, host = parts.node, parts.host
                async with trio.open_nursery() as n:
                    await n.start(node.run)
                    task_status.started(Member(name, ident, node, host, scope))
                    await trio.sleep_forever()

        member: Member = await self.nursery.start(run)
        self.members[name] = member
        return member

    def of(self, node_id: str) -> Member:
        return next(m for m in self.members.values() if m.node.node_id == node_id)

    def capable(self, node_id: str) -> bool:
        assert self.coordinator is not None
        peer = self.coordinator.peer(node_id)
        return (
            peer is not None
            and peer.connected
            and peer.has_features(pc.FEATURE_SKIPPY_STAGE, pc.STAGE_BUNDLE)
        )


@asynccontextmanager
async def split(tmp: Path, pkg: Path, *, spares: int) -> AsyncIterator[tuple[Mesh, SplitServer]]:
    async with trio.open_nursery() as nursery:
        mesh = Mesh(nursery, tmp)
        coord = await mesh.start("coord")
        mesh.coordinator = coord.node
        for i in range(2):
            await mesh.start(f"w{i}")
        await wait_for(lambda: len(coord.node.peers(connected_only=True)) == 2)
        ref, sha, sizes = _package_facts(coord.node.settings, str(pkg))
        spec = SplitSpec(ref, sha, sizes, 3, settings=SERVING)
        server = SplitServer(
            coord.node, coord.host, topology_of(coord.node), spec, model_name="tiny"
        )
        await nursery.start(server.run)
        await wait_for(lambda: server.route is not None, 30)
        for i in range(spares):
            spare = await mesh.start(f"s{i}")
            await wait_for(lambda s=spare: mesh.capable(s.node.node_id), 10)
        yield mesh, server
        nursery.cancel_scope.cancel()


async def _generate(server: SplitServer, params: GenerationParams, on_token: Any) -> Any:
    out: list[int] = []

    async def emit(token: int) -> bool:
        out.append(token)
        await on_token(len(out))
        return False

    result = await server.generate(IDS, params, emit)
    assert result.tokens == out
    return result


async def _nothing(_: int) -> None:
    return None


def _shapes(n_tokens: int) -> list[tuple[str, int, int]]:
    """Stage 0's calls in the undisturbed run of ``n_tokens`` tokens (it feeds each token
    but the last)."""
    steps = schedule(IDS, [0] * (n_tokens - 1), 5)
    return [(s.phase, s.start, len(s.tokens)) for s in steps]


@pytest.mark.parametrize(
    ("sampling", "kill_points"),
    [
        (t.Sampling(), range(N)),  # greedy: every kill point
        (t.Sampling(temperature=0.9, top_k=20, seed=7), (0, N // 2)),  # seeded: two of them
        # every sampling control: the penalties read the replayed tokens before each position
        (
            t.Sampling(
                temperature=0.9,
                top_k=20,
                min_p=0.02,
                typical_p=0.97,
                repeat_penalty=1.4,
                presence_penalty=0.3,
                frequency_penalty=0.2,
                repeat_last_n=6,
                logit_bias=((5, 1.0), (9, -100.0)),
                seed=7,
            ),
            (0, N // 2),
        ),
        (t.Sampling(repeat_penalty=1.8, repeat_last_n=4, logit_bias=((3, 2.0),)), (N - 2,)),
    ],
    ids=["greedy", "seeded", "controls", "greedy-controls"],
)
async def test_every_kill_point_continues_exactly(
    sampling: t.Sampling, kill_points: range | tuple[int, ...], tiny_pkg: Path, tmp_path: Path
) -> None:
    params = GenerationParams(max_tokens=N, sampling=sampling)
    async with split(tmp_path, tiny_pkg, spares=1) as (mesh, server):
        coord_host = mesh.members["coord"].host
        assert coord_host.loaded is not None
        rec = Recorder(coord_host.loaded.stage)
        coord_host.loaded.stage = rec
        want = (await _generate(server, params, _nothing)).tokens
        assert len(want) == N
        assert list(rec.calls.values()) == [_shapes(N)]
        for k in kill_points:
            route = server.route
            assert route is not None
            victim = mesh.of(route.node_ids[1 + k % 2])
            rec.calls.clear()

            def kill(v: Member = victim) -> None:
                v.scope.cancel()

            if k == 0:  # during the prefill: after stage 0's first chunk
                token = trio.lowlevel.current_trio_token()  # the hook runs on the compute thread
                rec.hook = lambda t=token: trio.from_thread.run_sync(kill, trio_token=t)

            async def on_token(count: int, k: int = k, kill: Any = kill) -> None:
                if count == k:
                    kill()

            result = await _generate(server, params, on_token)
            assert result.tokens == want, f"kill point {k}"
            assert result.failovers >= 1, f"kill point {k}: no failover happened"
            # every attempt made the undisturbed run's calls, in the same shapes
            attempts = list(rec.calls.values())
            assert len(attempts) >= 2 and attempts[-1] == _shapes(N)
            for calls in attempts[:-1]:
                assert calls == _shapes(N)[: len(calls)], f"kill point {k}"
            new = server.route
            assert new is not None and victim.node.node_id not in new.node_ids
            # the stopped node comes back with the same id: the next kill's spare
            await mesh.start(victim.name, victim.ident)
            await wait_for(lambda v=victim: mesh.capable(v.node.node_id), 10)


async def test_a_returning_node_is_planned_in_without_an_operator(
    tiny_pkg: Path, tmp_path: Path
) -> None:
    """No spare: a stopped stage node leaves the split waiting (503 naming the node); the
    same node started again is planned back into its own stage and the split serves again,
    with the same tokens."""
    params = GenerationParams(max_tokens=N)
    async with split(tmp_path, tiny_pkg, spares=0) as (mesh, server):
        want = (await _generate(server, params, _nothing)).tokens
        route = server.route
        assert route is not None
        # the three nodes share this machine (one host fingerprint in their hellos): with
        # threads = "auto" each stage would take a third of the cores
        topology = route.stage0.topology
        assert [mesh.of(n).host.co_located(topology) for n in route.node_ids] == [3, 3, 3]
        victim = mesh.of(route.node_ids[2])
        victim.scope.cancel()
        await wait_for(lambda: server.replicas.waiting is not None, 10)
        with pytest.raises(SplitNotReady) as err:
            await _generate(server, params, _nothing)
        assert err.value.code == "no_capable_peer"
        assert f"node {victim.node.node_id[:12]} to come back" in err.value.message
        await mesh.start(victim.name, victim.ident)
        await wait_for(lambda: server.route is not None, 20)
        healed = server.route
        assert healed is not None and healed.node_ids == route.node_ids
        assert healed.topology_id != route.topology_id
        assert (await _generate(server, params, _nothing)).tokens == want
        assert np.array_equal(healed.node_ids, route.node_ids)


async def test_a_failover_under_verify_windows_continues_exactly(
    tiny_pkg: Path, tmp_path: Path
) -> None:
    """With speculative verify windows, a stage lost mid-request is replaced and the
    replay (one-token steps: the graphs every window step ran) ends with the tokens of plain
    decoding."""
    from skippy.generation import SpeculativePlan
    from skippy.generation.schema import NgramSource, WindowPolicy

    plan = SpeculativePlan(
        mode="ngram-cache",
        requested="ngram-cache",
        requested_source="cli",
        strategy_id="ngram-cache",
        ngram=NgramSource("ngram-cache", ngram_min=1, ngram_max=3, max_proposal_tokens=4),
        window=WindowPolicy(mode="adaptive", initial_window=3, min_window=1, max_window=4),
    )
    params = GenerationParams(max_tokens=3 * N)
    async with split(tmp_path, tiny_pkg, spares=1) as (mesh, server):
        want = (await _generate(server, params, _nothing)).tokens
        server.generator.speculative = plan
        undisturbed = await _generate(server, params, _nothing)
        assert undisturbed.tokens == want and undisturbed.verify_passes > 0
        route = server.route
        assert route is not None
        victim = mesh.of(route.node_ids[2])

        async def on_token(count: int) -> None:
            if count == 2 * N:
                victim.scope.cancel()

        result = await _generate(server, params, on_token)
        assert result.tokens == want and result.failovers >= 1
