"""Helpers shared by the stage-runtime tests (plain functions, not fixtures).

Tests run ggml on one thread: other suites share this 2-core machine, and two spinning ggml
threads on an oversubscribed CPU run ~30x slower (measured: 0.65 s per gemma token at load
7). Results do not depend on the thread count (each output row is one thread's dot products).

``llama_logits`` is the independent reference: llama.cpp through llama-cpp-python's low-level
API (the canary's oracle, ``skippy.runtime.canary.oracle``), every position's logits from one
batch. ``repack=False`` loads the model without ggml's CPU weight repacking
(``use_extra_bufts = false``): llama.cpp then runs the same kernels on the same bytes as our
ggml engine, so the two must agree bit for bit; with repacking (llama.cpp's default)
Q4_0/Q4_K weights are re-laid-out for other kernels and logits differ slightly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from skippy.config import read_environment
from skippy.constants import ENV_VERIFY_PACKAGE_SHA
from skippy.consume.resolve import resolve_stage
from skippy.runtime.boundary import StageLoad
from skippy.runtime.canary.oracle import llama_logits as oracle_logits
from skippy.runtime.chain import StageChain, open_stage
from skippy.runtime.stage import StageConfig

# A 232-token SmolLM2 prompt (longer than serving's 128-row prefill chunk). Before the engine's
# prefill followed llama.cpp's shapes, its greedy continuation here was ". He brought it to the
# fire, ..." through the stage runtime and ". It was a great fire, ..." through llama.cpp.
SMOL_LONG_PROMPT = (
    "Long ago, in a valley between two rivers, there was a small city built of wood and stone. "
    "Its people were farmers, weavers and traders, and every autumn they carried their grain to "
    "the market square to sell it to merchants who came from the coast. The winters were cold "
    "and long, so each family kept a stack of dry logs beside the door and a clay pot of embers "
    "that never went out. The elders told the children that the first fire had been a gift, "
    "carried down from the mountains by a shepherd who had seen lightning strike an old oak "
    "tree. He brought a burning branch home in a bowl of wet clay, and from that branch every "
    "hearth in the valley was lit. For many generations the people guarded the flame carefully, "
    "and they made laws about how it could be shared. A family that let its embers die had to "
    "ask a neighbour for a coal, and in return it owed that neighbour a day of work at harvest "
    "time. The children learned the rules before they learned to read. Then one dry summer, "
    "when the rivers ran low and the wind blew hard from the east, a spark escaped from the "
    "baker's oven"
)
SMOL_LONG_GREEDY_16 = ". It was a great fire, and it burned for many days, but it"


def stage_loads(pkg: Path, ranges: Sequence[str], *, verify: bool = False) -> list[StageLoad]:
    """The consumer path: resolve, select, check (and verify) each range's parts."""
    env = read_environment({} if verify else {ENV_VERIFY_PACKAGE_SHA: "0"})
    out = []
    for r in ranges:
        resolved = resolve_stage(str(pkg), env, layers_text=r, text_only=True)
        out.append(
            StageLoad.from_selection(
                resolved.stage.selection,
                resolved.files(),
                manifest_sha256=resolved.stage.package.manifest_sha256,
            )
        )
    return out


def chain(
    engine: str, pkg: Path, ranges: Sequence[str], config: StageConfig | None = None
) -> StageChain:
    loads = stage_loads(pkg, ranges)
    cfg = config or StageConfig(n_ctx=128, n_threads=1)
    stages = [
        open_stage(engine, load, cfg, stage_index=i, stage_count=len(loads))
        for i, load in enumerate(loads)
    ]
    return StageChain(stages, None)


def all_logits(engine: str, pkg: Path, ranges: Sequence[str], ids: Sequence[int]) -> np.ndarray:
    with chain(engine, pkg, ranges) as ch:
        return ch.logits(ids, all_positions=True)


def split_ranges(layer_count: int) -> list[list[str]]:
    """Two-stage splits at 1, L/2 and L-1, and a three-stage split."""
    n, half = layer_count, layer_count // 2
    third = max(1, n // 3)
    return [
        ["0..1", f"1..{n}"],
        [f"0..{half}", f"{half}..{n}"],
        [f"0..{n - 1}", f"{n - 1}..{n}"],
        [f"0..{third}", f"{third}..{2 * third}", f"{2 * third}..{n}"],
    ]


def llama_logits(
    model: Path,
    ids: Sequence[int],
    *,
    repack: bool = True,
    n_ctx: int = 512,
    threads: int = 1,
    prefill: int | None = None,
) -> np.ndarray:
    """llama.cpp's logits at every position of ``ids`` (one batch), shape (n, vocab); with
    ``prefill`` k, the first k positions as one batch and the rest one token per
    ``llama_decode`` (as a generation decodes), shape (n - k + 1, vocab): the prefill's last
    row, then each decoded position's. The canary's oracle, with repacking on by default."""
    return oracle_logits(
        model,
        ids,
        n_batch=max(len(ids), 1),
        n_threads=threads,
        repack=repack,
        n_ctx=n_ctx,
        prefill=prefill,
    )


def numpy_reference_agrees(family: str, root: Path, *, n: int = 64) -> tuple[float, float]:
    """A canary family's synthetic F16 model run by the numpy reference (the f32 oracle):
    asserts that two stages give one stage's logits bit for bit and returns (the share of
    positions whose next token is llama.cpp's, the largest logit difference from it)."""
    from skippy.runtime.canary import check, synth

    spec = synth.family(family)
    model, pkg = check.package_model(spec, "F16", root)
    ids = synth.long_prompt(n, vocab=spec.dims().vocab)
    cfg = StageConfig(n_ctx=check.N_CTX, n_threads=1)
    with chain("numpy", pkg, ["0..4"], cfg) as ch:
        whole = ch.logits(ids, all_positions=True)
    with chain("numpy", pkg, ["0..1", "1..4"], cfg) as ch:
        split = ch.logits(ids, all_positions=True)
    assert np.array_equal(split, whole)
    ref = check.oracle(model, ids)
    agree = float((whole.argmax(axis=1) == ref.argmax(axis=1)).mean())
    return agree, check.max_difference(whole, ref)


def llama_decode_reference(model: Path, ids: Sequence[int], n_ctx: int) -> np.ndarray:
    """llama.cpp decoding ``ids`` one token at a time after a one-token prefill (repacking
    off): one row of logits per position."""
    return oracle_logits(model, ids, n_batch=len(ids), n_ctx=n_ctx, repack=False, prefill=1)


def decode_rows(
    pkg: Path, ranges: Sequence[str], ids: Sequence[int], config: StageConfig
) -> np.ndarray:
    """The stage runtime's logits for ``ids`` decoded one token at a time (the reused decode
    graph) after a one-token prefill, over ``ranges``."""
    rows = []
    with chain("ggml", pkg, ranges, config) as ch:
        first = ch.prefill("s", list(ids[:1])).logits
        assert first is not None
        rows.append(first[-1])
        for pos in range(1, len(ids)):
            step = ch.decode("s", pos, ids[pos]).logits
            assert step is not None
            rows.append(step[-1])
    return np.stack(rows)


def batched_decode_rows(
    pkg: Path, layers: str, prompts: Sequence[Sequence[int]], config: StageConfig
) -> list[np.ndarray]:
    """Each prompt's logits when every session's step runs in one batched graph per
    position (one whole-range stage ``layers``), after one-token prefills."""
    from skippy.runtime.stage import DecodeStep

    rows: list[list[np.ndarray]] = [[] for _ in prompts]
    with chain("ggml", pkg, [layers], config) as ch:
        stage = ch.stages[0]
        for i, p in enumerate(prompts):
            first = stage.prefill(f"s{i}", 0, np.asarray(p[:1])).logits
            assert first is not None
            rows[i].append(first[-1])
        for pos in range(1, len(prompts[0])):
            steps = [DecodeStep(f"s{i}", pos, np.asarray([p[pos]])) for i, p in enumerate(prompts)]
            for i, out in enumerate(stage.decode_batch(steps)):
                assert out.logits is not None
                rows[i].append(out.logits[-1])
    return [np.stack(r) for r in rows]
