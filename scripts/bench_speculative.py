"""Speculative-decoding rows (issue #22), called by scripts/bench.py.

On gemma3-270m, 2 threads, in one child process with ``OPENBLAS_NUM_THREADS=1``: decode tok/s
of plain decoding vs ngram-suffix speculation with exact verify (one-position steps per
stage, plain decoding's tokens bit for bit) and with batched verify (one multi-row graph
per stage), as one whole-range stage and as a 3-stage chain in one process (loopback only:
no link between the stages, so the round trips that speculation saves across a real split
are not in these figures), on a repetitive prompt and a non-repetitive one. Runs are
interleaved mode by mode so machine noise hits all of them; each row also gives the
acceptance (accepted / proposed drafted tokens) and whether the tokens equal plain decoding's.

Then serving: a 3-node lab split (``mesh-node lab``'s processes, every link through the lab's
userspace relay) of a gemma3 package declaring ngram-suffix as its default, served once with
``[speculative] strategy = "disabled"`` and once with ``auto`` (the package's ngram-suffix, as
verify windows), at 0 and 20 ms RTT: decode tok/s on the repetitive prompt, and the
coordinator's speculative counters.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchlib import (  # type: ignore[import-not-found]
    ROOT,
    BenchContext,
    Row,
    gemma_package,
    spread,
)

THREADS = 2
N_CTX = 512
TOKENS = 48
SPLITS = {"whole 0..18": ("0..18",), "3 stages": ("0..6", "6..12", "12..18")}
PROMPTS = {
    "repetitive": "Repeat this paragraph exactly.\nThe quick brown fox jumps over the lazy dog. "
    'The dog sleeps in the sun.\n{"name": "fox", "colour": "brown", "speed": "quick"}\n'
    "Repeat:\nThe quick brown fox jumps over the lazy dog. The dog sleeps in the sun.\n"
    '{"name": "fox", "colour": "brown", "speed": "quick"}\nRepeat:\n',
    "non-repetitive": "Write a short story about a lighthouse keeper who finds a message",
}
MODES = ("plain", "exact", "batched")
SUFFIX_DECLARATION = (
    "ngram-suffix:ngram_min=3,ngram_max=16,max_proposal_tokens=8,window=adaptive,"
    "initial_window=4,min_window=1,max_window=8"
)
WAN_RTTS_MS = (0, 20)
WAN_TOKENS = 48


def _child(*args: str) -> dict[str, Any]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__)), "child", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise SystemExit(f"bench_speculative child failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _spec_package(ctx: BenchContext) -> Path:
    """gemma3-270m as a package declaring ngram-suffix (adaptive window) as its default."""
    from skippy.constants import MANIFEST_NAME
    from skippy.produce.write_package import WriteOptions, local_provenance, write_package

    pkg = ctx.work / "pkg-gemma3-ngram-suffix"
    if not (pkg / MANIFEST_NAME).exists():
        prov = local_provenance(
            model_id="bench/model-GGUF:Q",
            source_repo=None,
            source_revision="r",
            source_file=ctx.gemma.name,
        )
        opts = WriteOptions(
            out_dir=pkg,
            provenance=prov,
            overwrite=True,
            speculative=(SUFFIX_DECLARATION,),
            speculative_default="ngram-suffix",
        )
        write_package(ctx.gemma, opts)
    return pkg


async def _wan_lab(ctx: BenchContext, pkg: Path, strategy: str) -> dict[int, Any]:
    """Decode tok/s through a 3-node lab split at each RTT, serving with ``strategy``."""
    import shutil

    import trio
    from bench_serve import _complete  # type: ignore[import-not-found]
    from servetools import wait_ready  # type: ignore[import-not-found]

    from mesh_node.lab.netem import LinkSpec, LinkTable
    from mesh_node.lab.run import LAB_NODE_CONFIG, LabOptions, open_lab

    root = ctx.work / f"spec-wan-{strategy}"
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
    out: dict[int, Any] = {}
    async with open_lab(options) as lab:
        api, _, _ = await lab.start_serving()
        assert lab.netem is not None
        await trio.to_thread.run_sync(wait_ready, api, 600)
        for rtt_ms in WAN_RTTS_MS:
            lab.netem.set_links(LinkTable(LinkSpec(rtt_s=rtt_ms / 1000)))
            await trio.sleep(2 * rtt_ms / 1000 + 0.5)
            rates = []
            for _ in range(ctx.runs):
                d = await trio.to_thread.run_sync(_complete, api, PROMPTS["repetitive"], WAN_TOKENS)
                n = d["usage"]["completion_tokens"]
                rates.append((n - 1) / d["timings"]["decode_s"])
            docs = await lab.cluster.statuses()
            serving = next((doc.get("serving") for doc in docs if doc and doc.get("serving")), {})
            out[rtt_ms] = {"rates": rates, "speculative": (serving or {}).get("speculative")}
    return out


def wan_rows(ctx: BenchContext) -> list[Row]:
    """Serve across a 3-node lab split at emulated RTTs: plain vs ngram-suffix windows."""
    import trio

    pkg = _spec_package(ctx)
    plain = trio.run(_wan_lab, ctx, pkg, "disabled")
    spec = trio.run(_wan_lab, ctx, pkg, "auto")
    out: list[Row] = []
    for rtt_ms in WAN_RTTS_MS:
        p, s = plain[rtt_ms]["rates"], spec[rtt_ms]["rates"]
        c = spec[rtt_ms]["speculative"] or {}
        ratio = statistics.median(s) / statistics.median(p)
        out.append(
            (
                "gemma3",
                f"serve 3-node lab split, {rtt_ms} ms RTT, repetitive: decode plain / "
                "ngram-suffix windows",
                f"{spread(p, fmt='{:.1f}')} / {spread(s, fmt='{:.1f}')} tok/s",
                f"{ratio:.2f}x (goal >= 1.5 at 20 ms); accepted {c.get('accepted')} of "
                f"{c.get('proposed')} in {c.get('verify_passes')} windows (all runs, cumulative)",
            )
        )
    return out


def rows(ctx: BenchContext) -> list[Row]:
    return local_rows(ctx) + wan_rows(ctx)


def local_rows(ctx: BenchContext) -> list[Row]:
    pkg = gemma_package(ctx)
    data = _child(str(pkg), str(ctx.runs))
    out: list[Row] = []
    for split in SPLITS:
        for prompt in PROMPTS:
            cell = data[split][prompt]
            plain = cell["plain"]["rates"]
            for mode in MODES:
                c = cell[mode]
                label = f"decode {prompt}, {split}: " + (
                    "plain" if mode == "plain" else f"ngram-suffix, {mode} verify"
                )
                note = ""
                if mode != "plain":
                    ratios = [s / p for s, p in zip(c["rates"], plain, strict=True)]
                    acc = c["accepted"] / c["proposed"] if c["proposed"] else 0.0
                    note = (
                        f"{spread(ratios, fmt='{:.2f}')} x plain; accepted {c['accepted']}/"
                        f"{c['proposed']} ({acc:.0%}) in {c['passes']} verify passes; "
                        f"tokens {'identical' if c['identical'] else 'DIFFER'}"
                    )
                out.append(("gemma3", label, spread(c["rates"], fmt="{:.1f}") + " tok/s", note))
    return out


# --- the child: measurements ---------------------------------------------------------------------
def _measure(pkg: Path, runs: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from stagetools import chain  # type: ignore[import-not-found]

    from skippy.generation import SpeculativePlan
    from skippy.generation.schema import NgramSource, WindowPolicy
    from skippy.runtime.speculation import generate_speculative
    from skippy.runtime.stage import StageConfig
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
    for split, ranges in SPLITS.items():
        config = StageConfig(n_ctx=N_CTX, n_threads=THREADS)
        with chain("ggml", pkg, list(ranges), config) as ch:
            ch.tokenizer = LlamaTokenizer(pkg / "shared" / "metadata.gguf")
            out[split] = {}
            for prompt, text in PROMPTS.items():
                ids = ch.tokenize(text)
                cell: dict[str, Any] = {
                    m: {"rates": [], "accepted": 0, "proposed": 0, "passes": 0, "identical": True}
                    for m in MODES
                }
                reference = None
                for _ in range(runs):
                    for mode in MODES:
                        if mode == "plain":
                            gen = ch.generate(ids, max_tokens=TOKENS)
                            stats = None
                        else:
                            gen, stats = generate_speculative(
                                ch, ids, max_tokens=TOKENS, plan=plan, exact=mode == "exact"
                            )
                        c = cell[mode]
                        c["rates"].append(gen.decode_tokens_per_s or 0.0)
                        if reference is None:
                            reference = gen.tokens
                        c["identical"] = c["identical"] and gen.tokens == reference
                        if stats is not None:  # the same each run: keep the last
                            c["accepted"], c["proposed"] = (
                                stats.accepted_tokens,
                                stats.proposed_tokens,
                            )
                            c["passes"] = stats.verify_passes
                out[split][prompt] = cell
    return out


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "child":
        print(json.dumps(_measure(Path(sys.argv[2]), int(sys.argv[3]))))
    else:
        raise SystemExit("run through scripts/bench --only speculative")
