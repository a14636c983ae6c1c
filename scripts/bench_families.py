"""The newer model families' decode speed against llama.cpp, called by scripts/bench.py
(``--only families``).

Each family of ``FAMILIES`` as a mid-sized synthetic model (``skippy.runtime.canary.synth``
at the MoE bench's size: width 1024, 16 heads of 64 over 4 KV heads, 8 layers of 32 experts
of 512, top-4, Q4_K; the family's own extras as its canary model has them, e.g. glm4moe's
leading dense layer, shared expert and NextN layer), cached under the bench's work folder
with its package. In one child with ``OPENBLAS_NUM_THREADS=1``, alternating round by round
so machine noise hits every engine alike: greedy decode of 32 tokens by the ggml engine as
one whole-range stage, as shipped and with ``repack = true``, and by llama.cpp through its C
API with weight repacking off (the same kernels on the same bytes) and with its default
repacking (what users get). The target: decode >= 0.9x llama.cpp. The tokens are compared
too: the rows say when they differ.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchlib import ROOT, BenchContext, Row, spread  # type: ignore[import-not-found]

FAMILIES = ("glm4moe",)  # one name per family added after the MoE bench's qwen3moe
THREADS = 2
DECODE_TOKENS = 32
LAYERS = 8
N_EXPERT, N_EXPERT_USED = 32, 4
DIMS = {
    "embd": 1024,
    "n_head": 16,
    "n_head_kv": 4,
    "head_dim": 64,
    "ff": 2048,
    "ff_exp": 512,
    "ff_shexp": 1024,  # glm4moe: two shared experts' width
}
ENGINES = ("ggml", "ggml_repack", "llama_norepack", "llama_repack")
TARGET = 0.9


def _model(ctx: BenchContext, name: str) -> tuple[Path, Path]:
    """The family's synthetic GGUF and its package (written once, reused when present)."""
    from skippy.produce.write_package import WriteOptions, local_provenance, write_package
    from skippy.runtime.canary import synth

    spec = replace(synth.family(name), n_layers=LAYERS, moe=synth.MoE(N_EXPERT, N_EXPERT_USED))
    root = ctx.work / "families"
    model = root / f"{name}-{LAYERS}L-{DIMS['embd']}w-{N_EXPERT}x{N_EXPERT_USED}-Q4_K.gguf"
    if not model.exists():
        synth.write_model(spec, model, dtype="Q4_K", dims=synth.Dims(**DIMS))
    pkg = root / f"{model.stem}-pkg"
    if not (pkg / "model-package.json").is_file():
        prov = local_provenance(
            model_id=f"bench/{name}-synth-GGUF:Q4_K",
            source_repo=None,
            source_revision="bench",
            source_file=model.name,
        )
        write_package(model, WriteOptions(out_dir=pkg, provenance=prov, overwrite=True))
    return model, pkg


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
        raise SystemExit(f"bench_families child {args} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _rate(times: list[float]) -> str:
    return spread([DECODE_TOKENS / s for s in times], fmt="{:.1f}") + " tok/s"


def _ratio(ours: list[float], theirs: list[float]) -> tuple[str, float]:
    """Per-round speed ratios (ours faster -> > 1): 'median (min..max)', and the median."""
    r = [b / a for a, b in zip(ours, theirs, strict=True)]
    return spread(r, fmt="{:.2f}"), statistics.median(r)


def rows(ctx: BenchContext) -> list[Row]:
    out: list[Row] = []
    for name in FAMILIES:
        model, pkg = _model(ctx, name)
        res = _child(str(pkg), str(model), str(ctx.runs))
        m = f"{name} synth {LAYERS}L w{DIMS['embd']} {N_EXPERT}x top-{N_EXPERT_USED} Q4_K"
        load = spread(res["loadavg"], fmt="{:.2f}")
        t: dict[str, list[float]] = res["times"]
        same = "" if res["same_tokens"] else "; TOKENS DIFFER from llama.cpp's"
        for engine, label in (("llama_norepack", "repacking off"), ("llama_repack", "default")):
            out.append((m, f"decode: llama.cpp, {THREADS} threads, {label}", _rate(t[engine]), ""))
        for ours, label in (("ggml", "as shipped"), ("ggml_repack", "repack = true")):
            r_on, med = _ratio(t[ours], t["llama_repack"])
            r_off = _ratio(t[ours], t["llama_norepack"])[0]
            verdict = f"target >= {TARGET}; {'met' if med >= TARGET else 'NOT met'}"
            out.append(
                (
                    m,
                    f"decode: ggml stage, {label}",
                    _rate(t[ours]),
                    f"{r_on} x llama.cpp default ({verdict}); {r_off} x llama.cpp repacking "
                    f"off; load avg {load}{same}",
                )
            )
    return out


# --- the child -----------------------------------------------------------------------------------
def child(pkg: str, gguf: str, runs: str) -> dict[str, Any]:
    from skippy.gguf.ggml import configure_openmp

    configure_openmp()  # as the runtime runs (libgomp reads it once, as llama_cpp loads it)
    import numpy as np
    from bench_moe import _Llama, _stage_loads  # type: ignore[import-not-found]

    from skippy.package.manifest import parse_manifest, read_manifest_bytes
    from skippy.runtime.canary.synth import long_prompt
    from skippy.runtime.chain import StageChain
    from skippy.runtime.ggml_engine import GgmlStage
    from skippy.runtime.sampling import Sampler
    from skippy.runtime.stage import StageConfig

    n = parse_manifest(read_manifest_bytes(Path(pkg))).layer_count
    whole = f"0..{n}"  # NextN layers included
    cfg = StageConfig(n_ctx=1024, n_threads=THREADS, n_batch=512)
    chains = {
        "ggml": StageChain([GgmlStage(_stage_loads(pkg, (whole,))[0], cfg)], None),
        "ggml_repack": StageChain(
            [GgmlStage(_stage_loads(pkg, (whole,))[0], replace(cfg, repack=True))], None
        ),
    }
    llamas = {
        "llama_norepack": _Llama(gguf, repack=False),
        "llama_repack": _Llama(gguf, repack=True),
    }
    start = long_prompt(6)

    def ggml_decode(ch: StageChain) -> tuple[float, list[int]]:
        ch.free("b")
        tok = int(np.argmax(ch.prefill("b", start).logits[-1]))  # type: ignore[index]
        toks, t = [], time.perf_counter()
        for i in range(DECODE_TOKENS):
            tok = ch.decode("b", len(start) + i, tok, sampler=Sampler()).token  # type: ignore[assignment]
            toks.append(tok)
        seconds = time.perf_counter() - t
        ch.free("b")
        return seconds, toks

    def llama_decode(llm: Any) -> tuple[float, list[int]]:
        llm.reset()
        tok = llm.eval(start, 0)
        toks, t = [], time.perf_counter()
        for i in range(DECODE_TOKENS):
            tok = llm.eval([tok], len(start) + i)
            toks.append(tok)
        seconds = time.perf_counter() - t
        llm.reset()
        return seconds, toks

    def measure(name: str) -> tuple[float, list[int]]:
        ch = chains.get(name)
        return ggml_decode(ch) if ch is not None else llama_decode(llamas[name])

    tokens = {name: measure(name)[1] for name in ENGINES}  # warm-up: first touches, repacking
    times: dict[str, list[float]] = {name: [] for name in ENGINES}
    loadavg: list[float] = []
    for r in range(int(runs)):
        loadavg.append(os.getloadavg()[0])
        for name in ENGINES[r % len(ENGINES) :] + ENGINES[: r % len(ENGINES)]:
            times[name].append(measure(name)[0])
    for ch in chains.values():
        ch.close()
    for llm in llamas.values():
        llm.close()
    # the same kernels on the same bytes: each ggml stage's tokens are its llama.cpp's
    same = (
        tokens["ggml"] == tokens["llama_norepack"]
        and tokens["ggml_repack"] == tokens["llama_repack"]
    )
    return {"times": times, "loadavg": loadavg, "same_tokens": same}


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[0] != "child":
        print("usage: bench_families.py child PKG GGUF RUNS (via scripts/bench)")
        return 2
    print(json.dumps(child(*argv[1:])))
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests" / "support")]
    raise SystemExit(main(sys.argv[1:]))
