"""Split serving over real mesh links between nodes in this process (synthetic models).

- split == whole: through a 3-node split of tiny llama and qwen3 models, the activations that
  cross each boundary are bit-identical to the in-process chain's, and the final stage's logits
  at every generated position are bit-identical to the whole model's (one stage) for the same
  tokens;
- concurrent requests each get their own session through every stage and the same tokens as
  alone; the queue bound answers ServerBusy beyond it;
- a malformed, oversized or foreign frame on a transport stream is refused (that stream is
  reset with a code) while a request running through the same nodes is undisturbed.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

import synth_gguf
from meshtools import identity, settings, topology_of, wait_for, with_peers
from pkgtools import make_package
from stagetools import chain

from mesh_node.composition import compose
from mesh_node.errors import StreamReset
from mesh_node.node import MeshNode
from mesh_node.node_process import _package_facts
from mesh_node.serving.host import StageHost, accept_window
from mesh_node.serving.pipeline import GenerationParams, ServerBusy, SplitServer
from mesh_node.serving.split import SplitSpec
from mesh_node.settings import ServingSettings
from protocol import constants as pc
from skippy.config import read_environment
from skippy.errors import SkippyError
from skippy.runtime.canary import synth
from skippy.runtime.compute_thread import compute_thread
from skippy.runtime.stage import StageConfig
from skippy.runtime.tokenizer import LlamaTokenizer
from skippy.stage import stage_frames as t

pytestmark = pytest.mark.llama
IDS = [1, 5, 9, 17, 33, 65, 3, 100, 7, 12, 90, 44]
SERVING = ServingSettings(
    n_ctx=128, threads=1, prefill_chunk=5, max_sessions=3, max_queue=1, max_frame_bytes=64 * 1024
)
SERVING_CONFIG = StageConfig(n_ctx=128, n_threads=1, n_batch=5)


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve_split")
    out = {}
    for arch, make in (("llama", synth_gguf.llama_like), ("qwen3", synth_gguf.qwen3_like)):
        src = make(root / f"{arch}.gguf", n_layers=6)
        make_package(src, root / arch, model_id=f"acme/{arch}-GGUF:Q8_0")
        out[arch] = root / arch
    # the canary's glm4moe: four trunk layers and a NextN layer (its writer declares mtp)
    glm = synth.write_model(synth.family("glm4moe"), root / "glm4moe.gguf", dtype="Q8_0")
    make_package(glm, root / "glm4moe", model_id="acme/glm-GGUF:Q8_0")
    out["glm4moe"] = root / "glm4moe"
    return out


class Recorder:
    """A stage that records what crosses it (inputs and outputs), delegating to the real one."""

    def __init__(self, stage: Any) -> None:
        self.stage = stage
        self.descriptor = stage.descriptor
        self.calls: list[tuple[str, int, np.ndarray, Any]] = []
        self.decodes = 0
        self.threads: set[tuple[str, str]] = set()  # (call, thread) of the stage's calls

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stage, name)

    def prefill(self, session: str, start: int, inputs: Any, **kw: Any) -> Any:
        out = self.stage.prefill(session, start, inputs, **kw)
        self.threads.add(("prefill", threading.current_thread().name))
        self.calls.append((session, start, np.array(inputs), out))
        return out

    def decode(self, session: str, position: int, inputs: Any, **kw: Any) -> Any:
        out = self.stage.decode(session, position, inputs, **kw)
        self.threads.add(("decode", threading.current_thread().name))
        self.calls.append((session, position, np.array(inputs), out))
        self.decodes += 1
        return out


@dataclass
class Split:
    nodes: list[MeshNode]
    hosts: list[StageHost]
    server: SplitServer
    recorders: list[Recorder] = field(default_factory=list)


@asynccontextmanager
async def split(tmp: Path, pkg: Path, stages: int = 3) -> AsyncIterator[Split]:
    async with trio.open_nursery() as nursery:
        nodes: list[MeshNode] = []
        hosts = []
        for i in range(stages):
            s = settings(tmp, f"n{i}", serving=SERVING)
            parts = compose(with_peers(s, nodes[0]) if nodes else s, identity(), read_environment())
            node, host = parts.node, parts.host
            await nursery.start(node.run)
            nodes.append(node)
            hosts.append(host)
        await wait_for(lambda: len(nodes[0].peers(connected_only=True)) == stages - 1)
        ref, sha, sizes = _package_facts(nodes[0].settings, str(pkg))
        spec = SplitSpec(ref, sha, sizes, stages, settings=SERVING)
        server = SplitServer(
            nodes[0], hosts[0], topology_of(nodes[0]), spec, model_name="tiny"
        )
        await nursery.start(server.run)
        await wait_for(lambda: server.route is not None, 30)
        yield Split(nodes, hosts, server)
        nursery.cancel_scope.cancel()


async def generate(server: SplitServer, ids: list[int], n: int) -> list[int]:
    out: list[int] = []

    async def emit(token: int) -> bool:
        out.append(token)
        return False

    await server.generate(ids, GenerationParams(max_tokens=n), emit)
    return out


def _index(host: StageHost) -> int:
    return host.loaded.assignment.stage_index if host.loaded else 0


def _record(sp: Split) -> list[Recorder]:
    """Wrap each node's loaded stage, in stage order (the route's stage 0 is the same
    object)."""
    recs = []
    for host in sorted(sp.hosts, key=lambda h: h.loaded.assignment.stage_index if h.loaded else 0):
        assert host.loaded is not None
        rec = Recorder(host.loaded.stage)
        host.loaded.stage = rec
        recs.append(rec)
    return recs


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
async def test_split_equals_whole_at_every_boundary_and_position(
    arch: str, packages: dict[str, Path], tmp_path: Path
) -> None:
    pkg = packages[arch]
    async with split(tmp_path, pkg) as sp:
        for host in sp.hosts:  # where each stage runs, in its node's status: the CPU here
            where = host.status()
            assert where is not None and where["device_fallback"] is None
            assert (where["device"], where["placement"], where["device_memory_bytes"]) == (
                "CPU",
                "cpu",
                0,
            )
        recs = _record(sp)
        got = await generate(sp.server, IDS, 12)
        # prefills ran on the one compute thread, and these single-threaded stages' small
        # decode steps on the event loop (no hand-off; no OpenMP pool can form at 1 thread)
        loop = threading.current_thread().name
        calls = {c for rec in recs for c in rec.threads}
        assert calls == {("prefill", compute_thread().name), ("decode", loop)}
        # the decode-step counters (the WAN bench's per-token compute) count exactly them
        for host, rec in zip(sorted(sp.hosts, key=_index), recs, strict=True):
            assert host.steps == rec.decodes > 0
            assert 0 < host.step_busy_s <= host.busy_s
    # every activation row that crossed a boundary arrived bit for bit as the upstream stage
    # produced it, call by call (prefill chunks, then one-token decodes)
    for up, down in itertools.pairwise(recs):
        assert len(up.calls) == len(down.calls)
        for (_, p_up, _, out), (_, p_down, received, _) in zip(up.calls, down.calls, strict=True):
            assert p_up == p_down and np.array_equal(out.activations, received)
    # the whole model as one stage, driven with the same calls, gives the same logits at
    # every position where the split sampled a token, bit for bit, and the same tokens
    with chain("ggml", pkg, ["0..6"], SERVING_CONFIG) as whole:
        stage = whole.stages[0]
        want_logits = []
        for _, position, inputs, _ in recs[0].calls:
            call = stage.decode if len(inputs) == 1 and position >= len(IDS) else stage.prefill
            want_logits.append(call("w", position, inputs).logits[-1])
    outs = [c[3] for c in recs[-1].calls]
    assert len(outs) == len(want_logits) == len(recs[0].calls)
    for out, want in zip(outs, want_logits, strict=True):
        if out.logits is None:  # a greedy decode: the head's argmax on ggml, no logits
            assert out.token == int(np.argmax(want))
        else:
            assert np.array_equal(out.logits[-1], want)
    assert any(out.logits is None for out in outs)
    sampled = [int(np.argmax(r)) for r in want_logits[-12:]]
    assert got == sampled


@pytest.mark.parametrize("stages", [3, 1])
async def test_concurrent_requests_have_their_own_sessions(
    packages: dict[str, Path], tmp_path: Path, stages: int
) -> None:
    """Each request gets its own session and the tokens it gets alone, while its decode steps
    run batched with the others' (one graph per step), split and whole."""
    pkg = packages["llama"]
    prompts = [IDS, IDS[:7], [3, 1, 4, 1, 5, 9, 2, 6]]
    with chain("ggml", pkg, ["0..6"], SERVING_CONFIG) as whole:
        whole.tokenizer = LlamaTokenizer(pkg / "shared" / "metadata.gguf")  # stops at EOS
        want = [list(whole.generate(p, max_tokens=10).tokens) for p in prompts]
    async with split(tmp_path, pkg, stages) as sp:
        # Whether steps meet in a stage is up to timing: up to 3 rounds, each checked, until
        # every stage ran batched steps (one round under load once left a stage without).
        for _ in range(3):
            got: list[list[int]] = [[], [], []]

            async def one(i: int, got: list[list[int]] = got) -> None:
                got[i] = await generate(sp.server, prompts[i], 10)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
            assert got == want
            if all(h.batches > 0 for h in sp.hosts):
                break
        assert all(h.batches > 0 for h in sp.hosts)  # every stage ran batched steps
        # every stage frees every session (FREE travels down the chain after the answer)
        await wait_for(
            lambda: all(h.loaded is not None and not h.loaded.stage.sessions for h in sp.hosts)
        )
        # 3 slots + 1 queue place: the fifth concurrent request is refused with ServerBusy
        outcomes: list[str] = []

        async def busy(i: int) -> None:
            try:
                await generate(sp.server, IDS, 30)
                outcomes.append("ok")
            except ServerBusy:
                outcomes.append("busy")

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(busy, i)
        assert sorted(outcomes) == ["busy", "ok", "ok", "ok", "ok"]


class BatchCounter:
    """A stage that counts decode_batch calls (and their refusals), delegating to the real one."""

    def __init__(self, stage: Any) -> None:
        self.stage = stage
        self.descriptor = stage.descriptor
        self.batches: list[tuple[int, str | None]] = []  # (steps, refusal code)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stage, name)

    def decode_batch(self, steps: Any) -> Any:
        try:
            out = self.stage.decode_batch(steps)
        except SkippyError as exc:
            self.batches.append((len(steps), exc.code))
            raise
        self.batches.append((len(steps), None))
        return out


async def test_a_refused_step_in_a_batch_fails_only_its_own_session(
    packages: dict[str, Path], tmp_path: Path
) -> None:
    """Two sessions' decode steps queued together: one at a wrong position refuses the batch,
    which then runs its steps alone; the good session gets the output of its own decode."""
    host = StageHost(MeshNode(settings(tmp_path, "n0", serving=SERVING), identity()), SERVING)
    with chain("ggml", packages["llama"], ["0..6"], SERVING_CONFIG) as ch:
        stage = BatchCounter(ch.stages[0])
        stage.prefill("a", 0, np.array(IDS[:4]))
        stage.prefill("b", 0, np.array(IDS[:3]))
        results: dict[str, Any] = {}

        async def step(name: str, position: int) -> None:
            try:
                results[name] = await host.decode(stage, name, position, np.array([5]), None)
            except SkippyError as exc:
                results[name] = exc.code

        async with trio.open_nursery() as nursery:
            nursery.start_soon(step, "a", 4)
            nursery.start_soon(step, "b", 7)  # b holds 3 positions
        stage.truncate("a", 4)
        alone = stage.decode("a", 4, np.array([5]))
    assert stage.batches == [(2, "position_mismatch")]
    assert results["b"] == "position_mismatch"
    assert np.array_equal(results["a"].logits, alone.logits)
    assert host.batches == 0


async def test_a_verify_window_joins_the_decode_batches_position_by_position(
    packages: dict[str, Path], tmp_path: Path
) -> None:
    """Session a's 3-position verify window and session b's decode step, queued together:
    a's first position runs in one graph with b's step, its other two alone; every output
    equals the session's own steps run alone (a's window by ``decode_steps``)."""
    host = StageHost(MeshNode(settings(tmp_path, "n0", serving=SERVING), identity()), SERVING)
    with chain("ggml", packages["llama"], ["0..6"], SERVING_CONFIG) as ch:
        stage = BatchCounter(ch.stages[0])
        stage.prefill("a", 0, np.array(IDS[:4]))
        stage.prefill("b", 0, np.array(IDS[:3]))
        window = [7, 9, 11]
        results: dict[str, Any] = {}

        async def verify() -> None:
            results["a"] = await host.verify(stage, "a", t.Sampling(), 4, np.array(window), window)

        async def decode() -> None:
            results["b"] = await host.decode(stage, "b", 3, np.array([5]), None)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(verify)
            nursery.start_soon(decode)
        assert stage.batches == [(2, None)]
        assert (host.batches, host.batched_steps, host.batched_window_steps) == (1, 2, 1)
        stage.truncate("a", 4)
        stage.truncate("b", 3)
        alone_a = stage.decode_steps("a", 4, np.array(window)).logits
        alone_b = stage.decode("b", 3, np.array([5])).logits
    _, committed = results["a"]
    assert committed == accept_window(t.Sampling(), 4, alone_a, window)
    assert np.array_equal(results["b"].logits, alone_b)


async def test_a_verify_window_past_the_context_is_refused_before_it_runs(
    packages: dict[str, Path], tmp_path: Path
) -> None:
    host = StageHost(MeshNode(settings(tmp_path, "n0", serving=SERVING), identity()), SERVING)
    with chain("ggml", packages["llama"], ["0..6"], SERVING_CONFIG) as ch:
        stage = ch.stages[0]
        n_ctx = SERVING_CONFIG.n_ctx
        stage.prefill("a", 0, np.array([IDS[i % len(IDS)] for i in range(n_ctx - 2)]))
        with pytest.raises(SkippyError) as err:
            await host.verify(stage, "a", t.Sampling(), n_ctx - 2, np.array([1, 2, 3]), [1, 2, 3])
        assert err.value.code == "context_full"
        assert stage.session_length("a") == n_ctx - 2  # no position of the window ran


async def test_bad_frames_are_refused_without_disturbing_other_sessions(
    packages: dict[str, Path], tmp_path: Path
) -> None:
    pkg = packages["llama"]
    with chain("ggml", pkg, ["0..6"], SERVING_CONFIG) as whole:
        whole.tokenizer = LlamaTokenizer(pkg / "shared" / "metadata.gguf")  # stops at EOS
        want = list(whole.generate(IDS, max_tokens=40).tokens)
    async with split(tmp_path, pkg) as sp:
        coord = sp.nodes[0]
        route = sp.server.route
        assert route is not None
        stage1 = route.node_ids[1]
        width = route.stage0.facts.width
        tid = route.topology_id
        begin = t.encode_begin(1, 77, width=width, sampling=t.Sampling(), topology_id=tid)
        good_rows = np.zeros((2, width), np.float32)
        cases = {
            # a malformed header (unknown version)
            "transport_version": begin + b"\x09" + bytes(t.HEADER_BYTES - 1),
            # activations of another width
            "transport_width_mismatch": begin
            + t.encode_activations(
                1, 77, phase=t.Phase.PREFILL, start=0, activations=np.zeros((2, width + 1), "f4")
            ),
            # more bytes than the frame cap (refused from the header alone)
            "transport_frame_too_large": begin
            + t.HEADER.pack(t.VERSION, t.Kind.ACTIVATIONS, 0, 0, 1, 77, 0, 1000, width, 0),
            # a frame for a session this stream did not begin
            "unknown_session": begin
            + t.encode_activations(
                1, 78, phase=t.Phase.PREFILL, start=0, activations=good_rows
            ),
            # activations before any BEGIN
            "unknown_session ": t.encode_activations(
                1, 79, phase=t.Phase.PREFILL, start=0, activations=good_rows
            ),
            # a BEGIN for another topology
            "stale_topology": t.encode_begin(
                1, 80, width=width, sampling=t.Sampling(), topology_id="topo-other"
            ),
        }
        got: list[int] = []
        refusals: dict[str, str] = {}

        async def legit() -> None:
            got.extend(await generate(sp.server, IDS, 40))

        async def rogue() -> None:
            for expected, data in cases.items():
                stream = await coord.open_stream(stage1, pc.KIND_TRANSPORT)
                await stream.send_all(data)
                with trio.fail_after(5):
                    try:
                        while await stream.receive_some():
                            pass
                        refusals[expected.strip()] = "not reset"
                    except StreamReset as exc:
                        refusals[expected.strip()] = str(exc.actual)
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(legit)
            nursery.start_soon(rogue)
        assert refusals == {k.strip(): k.strip() for k in cases}
        assert got == want
        # a transport stream from a node that is not the upstream stage is refused too
        stage2 = next(n for n in sp.nodes if n.node_id == route.node_ids[2])
        stream = await stage2.open_stream(stage1, pc.KIND_TRANSPORT)
        await stream.send_all(begin)
        with pytest.raises(StreamReset) as err, trio.fail_after(5):
            while await stream.receive_some():
                pass
        assert err.value.actual == "not_upstream"


async def test_a_one_stage_route_samples_on_the_coordinator(
    packages: dict[str, Path], tmp_path: Path
) -> None:
    """The whole model on the coordinator (no transport): chunked prefill, then decode."""
    pkg = packages["llama"]
    with chain("ggml", pkg, ["0..6"], SERVING_CONFIG) as whole:
        whole.tokenizer = LlamaTokenizer(pkg / "shared" / "metadata.gguf")
        want = list(whole.generate(IDS, max_tokens=10).tokens)
    async with split(tmp_path, pkg, stages=1) as sp:
        assert sp.server.route is not None and sp.server.route.single
        assert await generate(sp.server, IDS, 10) == want


# greedy with penalties and a bias (they move the argmax: the final stage needs the logits),
# and seeded sampling with every control
CONTROLLED = (
    t.Sampling(
        repeat_penalty=1.6,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repeat_last_n=8,
        logit_bias=((3, 1.5), (44, -100.0)),
    ),
    t.Sampling(
        temperature=0.9,
        top_k=30,
        top_p=0.95,
        min_p=0.02,
        typical_p=0.97,
        repeat_penalty=1.3,
        frequency_penalty=0.3,
        repeat_last_n=128,  # the whole context
        logit_bias=((9, -100.0), (17, 2.0)),
        seed=5,
    ),
)


def _without_bit(node: MeshNode, node_id: str, bit: str) -> Any:
    """``node.peer`` as if ``node_id`` did not advertise ``bit`` (an older version)."""
    from dataclasses import replace

    real_peer = node.peer

    def peer(other: str) -> Any:
        info = real_peer(other)
        if info is None or other != node_id:
            return info
        kept = tuple(b for b in info.features[pc.FEATURE_SKIPPY_STAGE] if b != bit)
        return replace(info, features={pc.FEATURE_SKIPPY_STAGE: kept})

    return peer


async def test_sampling_controls_give_the_same_tokens_on_one_stage_and_on_a_split(
    packages: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Penalties, logit bias, min-p and typical-p: the same tokens through a 3-stage split
    (the final stage reads the tokens before each position from the frames' ids) as on one
    stage (the coordinator samples), and greedy ones equal the in-process chain's (one
    sampler that accepts each token), which differ from plain greedy. A node without the
    sampling-controls bit gets no such session: the request is refused, naming it."""
    from mesh_node.serving.generator import BadGenerationRequest
    from skippy.runtime.sampling import Sampler

    pkg = packages["llama"]
    n = 16
    with chain("ggml", pkg, ["0..6"], SERVING_CONFIG) as whole:
        whole.tokenizer = LlamaTokenizer(pkg / "shared" / "metadata.gguf")
        plain = list(whole.generate(IDS, max_tokens=n).tokens)
        want = list(whole.generate(IDS, max_tokens=n, sampling=CONTROLLED[0]).tokens)
        first = whole.logits(IDS)
    assert want != plain and 44 not in want
    assert want[0] == Sampler(CONTROLLED[0], IDS).sample(first)

    async def run(sp: Split, sampling: t.Sampling) -> list[int]:
        out: list[int] = []

        async def emit(token: int) -> bool:
            out.append(token)
            return False

        await sp.server.generate(IDS, GenerationParams(max_tokens=n, sampling=sampling), emit)
        return out

    got: dict[int, list[list[int]]] = {}
    for stages in (3, 1):
        async with split(tmp_path / f"s{stages}", pkg, stages=stages) as sp:
            got[stages] = [await run(sp, sampling) for sampling in CONTROLLED]
            assert await run(sp, CONTROLLED[1]) == got[stages][1]  # seeded: reproducible
            if stages == 3:
                last = sp.server.route.node_ids[-1] if sp.server.route else ""
                monkeypatch.setattr(
                    sp.nodes[0], "peer", _without_bit(sp.nodes[0], last, pc.BIT_SAMPLING_CONTROLS)
                )
                with pytest.raises(BadGenerationRequest) as err:
                    await run(sp, CONTROLLED[0])
                assert err.value.code == "unsupported_parameter"
                assert last[:12] in err.value.message
                assert await run(sp, t.Sampling()) == plain  # plain requests still run there
                monkeypatch.undo()
            await wait_for(
                lambda sp=sp: all(
                    h.loaded is not None and not h.loaded.stage.sessions for h in sp.hosts
                )
            )
    assert got[3] == got[1]
    assert got[3][0] == want
    assert 9 not in got[3][1] and len(got[3][1]) == n


async def test_a_cancelled_request_frees_its_session_along_the_chain(
    packages: dict[str, Path], tmp_path: Path
) -> None:
    """A client that goes away cancels its request: every stage frees the session's KV."""
    async with split(tmp_path, packages["llama"]) as sp:
        seen: list[int] = []
        with trio.move_on_after(30) as scope:

            async def emit(token: int) -> bool:
                seen.append(token)
                if len(seen) == 3:
                    scope.cancel()  # as the HTTP layer does when the client disconnects
                return False

            await sp.server.generate(IDS, GenerationParams(max_tokens=100), emit)
        assert scope.cancelled_caught and len(seen) == 3
        await wait_for(
            lambda: all(h.loaded is not None and not h.loaded.stage.sessions for h in sp.hosts)
        )
        assert sp.server.stats.in_flight == 0


async def test_a_begin_to_a_node_without_a_stage_is_refused_as_stage_not_ready(
    packages: dict[str, Path], tmp_path: Path
) -> None:
    # e.g. a worker restarted within peer_loss_timeout_s: its route must be seen as broken
    # (stage_not_ready waits for a new route), not as a width the request got wrong
    async with split(tmp_path, packages["llama"], stages=2) as sp, trio.open_nursery() as n:
        coord = sp.nodes[0]
        s = with_peers(settings(tmp_path, "bare", serving=SERVING), coord)
        bare = compose(s, identity(), read_environment()).node
        await n.start(bare.run)
        await wait_for(lambda: coord.peer(bare.node_id) is not None, 10)
        route = sp.server.route
        assert route is not None
        begin = t.encode_begin(
            1, 5, width=route.stage0.facts.width, sampling=t.Sampling(),
            topology_id=route.topology_id,
        )
        stream = await coord.open_stream(bare.node_id, pc.KIND_TRANSPORT)
        await stream.send_all(begin)
        with pytest.raises(StreamReset) as err, trio.fail_after(5):
            while await stream.receive_some():
                pass
        assert err.value.actual == "stage_not_ready"
        n.cancel_scope.cancel()


# --- speculative decoding across the split ----------------------------------------
def _ngram_plan() -> Any:
    from skippy.generation import SpeculativePlan
    from skippy.generation.schema import NgramSource, WindowPolicy

    return SpeculativePlan(
        mode="ngram-cache",
        requested="ngram-cache",
        requested_source="cli",
        strategy_id="ngram-cache",
        ngram=NgramSource("ngram-cache", ngram_min=1, ngram_max=3, max_proposal_tokens=6),
        window=WindowPolicy(mode="adaptive", initial_window=4, min_window=1, max_window=6),
    )


@pytest.mark.parametrize("stages", [3, 1])
async def test_speculative_windows_across_the_split_give_plain_decodings_tokens(
    packages: dict[str, Path], tmp_path: Path, stages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verify windows cross every link as one frame (exact one-position steps per stage); the
    final stage accepts and returns the committed tokens; greedy and seeded sampling give the
    tokens of plain decoding, with greedy drafts accepted, and every stage
    frees the session."""
    pkg = packages["llama"]
    prompt = [5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17]
    async with split(tmp_path, pkg, stages=stages) as sp:
        gen = sp.server.generator
        accepted: list[int] = []
        greedy_plain: list[int] = []

        async def emit_none(token: int) -> bool:
            return False

        for sampling in (
            t.Sampling(),
            t.Sampling(temperature=0.9, top_k=20, seed=11),
            *CONTROLLED,  # the penalties read each window's drafts before their position
        ):
            params = GenerationParams(max_tokens=24, sampling=sampling)
            runs = []
            for plan in (None, _ngram_plan()):
                gen.speculative = plan
                out: list[int] = []

                async def emit(token: int, out: list[int] = out) -> bool:
                    out.append(token)
                    return False

                result = await sp.server.generate(prompt, params, emit)
                assert result.tokens == out
                runs.append(result)
            plain, spec = runs
            if sampling == t.Sampling():
                greedy_plain = plain.tokens
            assert spec.tokens == plain.tokens and spec.stop_reason == plain.stop_reason
            assert plain.verify_passes == 0 and spec.verify_passes > 0
            assert spec.accepted_tokens <= spec.proposed_tokens
            accepted.append(spec.accepted_tokens)
        assert accepted[0] > 0  # greedy (sampling this random model rarely repeats itself)
        # counted in serving's metrics and shown on the status page (text form here)
        from mesh_node.peers import render_serving

        counters = sp.server.metrics.speculative
        assert counters["accepted"] == sum(accepted) and counters["verify_passes"] > 0
        status = sp.server.status()
        assert status["speculative_strategy"] == "ngram-cache"
        assert status["speculative"] == counters
        assert any(
            line.startswith("  speculative ngram-cache: accepted")
            for line in render_serving(status)
        )
        if stages > 1:  # a stage that does not advertise verify-window: plain decoding
            from dataclasses import replace

            real_peer = sp.nodes[0].peer
            last = sp.server.route.node_ids[-1] if sp.server.route else ""

            def without_bit(node_id: str) -> Any:
                info = real_peer(node_id)
                if info is None or node_id != last:
                    return info
                bits = info.features[pc.FEATURE_SKIPPY_STAGE]
                kept = tuple(b for b in bits if b != pc.BIT_VERIFY_WINDOW)
                return replace(info, features={pc.FEATURE_SKIPPY_STAGE: kept})

            monkeypatch.setattr(sp.nodes[0], "peer", without_bit)
            result = await sp.server.generate(prompt, GenerationParams(max_tokens=24), emit_none)
            assert result.verify_passes == 0 and result.tokens == greedy_plain
        await wait_for(
            lambda: all(h.loaded is not None and not h.loaded.stage.sessions for h in sp.hosts)
        )


async def test_concurrent_speculating_requests_batch_their_windows_and_keep_their_tokens(
    packages: dict[str, Path], tmp_path: Path
) -> None:
    """Three speculating requests at once over the split: each gets plain decoding's tokens,
    and verify-window positions ran in batched graphs with other sessions' steps (whether a
    window meets another session's step is up to timing: up to 3 rounds, each checked)."""
    pkg = packages["llama"]
    prompts = [[5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17], [3, 1, 3, 1, 3, 1, 3], IDS]
    async with split(tmp_path, pkg, stages=3) as sp:

        async def run_all() -> list[list[int]]:
            got: list[list[int]] = [[], [], []]

            async def one(i: int) -> None:
                got[i] = await generate(sp.server, prompts[i], 16)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
            return got

        plain = await run_all()
        sp.server.generator.speculative = _ngram_plan()
        for _ in range(3):
            assert await run_all() == plain
            if sum(h.batched_window_steps for h in sp.hosts) > 0:
                break
        assert sum(h.batched_window_steps for h in sp.hosts) > 0


@pytest.mark.parametrize("stages", [1, 3])
async def test_native_mtp_across_the_split_drafts_as_the_chain_does(
    packages: dict[str, Path], tmp_path: Path, stages: int
) -> None:
    """native-mtp: the final stage's NextN head drafts after each pass (the prompt's tokens
    reach it with every frame's ids), stage 0 verifies each draft in a window; the tokens
    are plain decoding's, and the drafts and their fate are exactly those of the in-process
    chain (on this prompt, whose 48 tokens hold no end-of-generation token, one of them is
    accepted)."""
    from skippy.generation import parse_generation, resolve_speculative_plan
    from skippy.package.manifest import parse_manifest
    from skippy.runtime.token_loop import generate_speculative

    pkg, prompt, n = packages["glm4moe"], [1, 499, 248, 187, 302, 460, 468, 115], 48
    m = parse_manifest((pkg / "model-package.json").read_bytes())
    plan = resolve_speculative_plan(package=parse_generation(m.generation, layer_count=5))
    assert plan.mode == "native-mtp"
    with chain("ggml", pkg, ["0..5"]) as ch:
        want, stats = generate_speculative(ch, prompt, max_tokens=n, plan=plan)
    assert stats.accepted_tokens > 0
    async with split(tmp_path, pkg, stages=stages) as sp:
        route = sp.server.route
        assert route is not None and len(route.node_ids) == stages
        plain = await generate(sp.server, prompt, n)
        sp.server.generator.speculative = plan

        async def emit_none(token: int) -> bool:
            return False

        result = await sp.server.generate(prompt, GenerationParams(max_tokens=n), emit_none)
        assert result.tokens == plain == list(want.tokens)
        assert (result.proposed_tokens, result.accepted_tokens, result.verify_passes) == (
            stats.proposed_tokens,
            stats.accepted_tokens,
            stats.verify_passes,
        )
        (final,) = [h.loaded for h in sp.hosts if h.loaded is not None and h.loaded.is_final]
        assert final.load.layers.stop == 5 and final.load.layers.start < 4 and final.stage.drafts


def test_serve_resolves_the_packages_declared_strategy(synth_dir, tmp_path: Path) -> None:
    """mesh-node serve's plan: --speculative-strategy, then the config, against the package's
    declared strategies (skippy's resolver); an undeclared one is refused, except an N-gram
    strategy, which needs nothing from the package."""
    from mesh_node.packages import package_speculation
    from skippy.errors import UsageError
    from skippy.generation import load_speculative_overrides

    pkg = tmp_path / "pkg"
    decl = "ngram-suffix:ngram_min=3,ngram_max=8,max_proposal_tokens=4,window=fixed,max_window=4"
    make_package(synth_dir.llama, pkg, speculative=(decl,), speculative_default="ngram-suffix")
    node = settings(tmp_path, "n0", serving=SERVING)
    plan = package_speculation(node, str(pkg), None, None)
    assert (plan.mode, plan.window.max_window if plan.window else None) == ("ngram-suffix", 4)
    overrides = load_speculative_overrides({"speculative": {"strategy": "disabled"}})
    assert package_speculation(node, str(pkg), overrides, None).mode == "disabled"
    assert package_speculation(node, str(pkg), overrides, "auto").mode == "ngram-suffix"
    with pytest.raises(UsageError) as err:
        package_speculation(node, str(pkg), None, "mtp-cache")
    assert err.value.code == "undeclared_speculative_strategy"
    # an N-gram strategy it does not declare: the request-local proposer, runtime bounds
    plan = package_speculation(node, str(pkg), None, "ngram-cache")
    assert plan.mode == "ngram-cache" and plan.ngram is not None
    assert (plan.ngram.ngram_min, plan.ngram.ngram_max) == (2, 4)
