"""The MoE giants' stage rows, called by scripts/bench.py (``--only families``).

For each family of ``FAMILIES`` the stage runtime claims (``skippy.runtime.families``), a
mid-sized synthetic model written by ``skippy.runtime.canary.synth`` (8 layers, width 1024, 32
experts of 512, top-4 where the family routes to experts, Q4_K; cached under the bench's work
folder with its package): greedy decode (32 tokens) and a 512-token prefill of the ggml engine
as one whole-range stage against llama.cpp through its C API on the same GGUF, with its default
weight repacking (what users get) and with repacking off (the same kernels on the same bytes),
and the ggml stage with repacking too (``StageConfig(repack=True)``, off by default), 2 threads,
alternating round by round in one child process so machine noise hits every engine
alike. The target: decode >= 0.9x llama.cpp's default. The load average and the other
processes' CPU are reported beside the figures (the machine may be shared).

The llama.cpp driver, the stage loader and the alternating rounds are bench_moe's (one of each).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench_moe import (  # type: ignore[import-not-found]
    DECODE_TOKENS,
    N_CTX,
    PREFILL,
    QUIET_CORES,
    THREADS,
    _Llama,
    _rate,
    _ratio,
    _stage_loads,
    _verdict,
    alternate,
)
from benchlib import (  # type: ignore[import-not-found]
    ROOT,
    BenchContext,
    Row,
    run_child,
    spread,
)

FAMILIES = ("gpt-oss", "deepseek2-lite", "deepseek2", "glm4moe", "llama4")  # the canary's names
LAYERS = 8
N_EXPERT, N_EXPERT_USED = 32, 4
DIMS = {
    "embd": 1024,
    "n_head": 16,
    "n_head_kv": 4,
    "head_dim": 64,
    "ff": 2048,
    "ff_exp": 512,
    "ff_shexp": 1024,
}
ENGINES = ("ggml", "ggml_repack", "llama_repack", "llama_norepack")
DECODE_TARGET = 0.9


def _claimed() -> list[str]:
    """The families of ``FAMILIES`` that have a synthetic model and that the runtime runs."""
    from skippy.runtime.canary import synth
    from skippy.runtime.support import STAGE_FAMILIES

    return [
        name
        for name in FAMILIES
        if name in synth.FAMILY_NAMES and synth.family(name).arch_name in STAGE_FAMILIES
    ]


def _is_moe(name: str) -> bool:
    from skippy.runtime.canary import synth

    return synth.family(name).moe is not None


def _model(ctx: BenchContext, name: str) -> tuple[Path, Path]:
    """The family's synthetic GGUF and its package (written once, reused when present: the
    canary's ``package_model``, in a folder named by the bench's shape)."""
    from skippy.runtime.canary import synth
    from skippy.runtime.canary.check import package_model

    spec = synth.family(name)
    spec = replace(spec, n_layers=LAYERS)
    if spec.moe is not None:
        spec = replace(spec, moe=synth.MoE(N_EXPERT, N_EXPERT_USED))
    root = ctx.work / "families" / f"{LAYERS}L-{DIMS['embd']}w-{N_EXPERT}x{N_EXPERT_USED}"
    root.mkdir(parents=True, exist_ok=True)
    return package_model(spec, "Q4_K", root, dims=synth.Dims(**DIMS))


def _child(*args: str) -> dict[str, Any]:
    return run_child(__file__, *args)


def _whole(pkg: Path) -> str:
    """The package's whole range: its NextN/MTP layers too, where the family has them
    (glm4moe's and deepseek2's follow the 8 trunk layers and go with the final stage)."""
    from skippy.package.manifest import parse_manifest, read_manifest_bytes

    return f"0..{parse_manifest(read_manifest_bytes(pkg)).layer_count}"


def rows(ctx: BenchContext) -> list[Row]:
    out: list[Row] = []
    for name in _claimed():
        model, pkg = _model(ctx, name)
        whole = _whole(pkg)
        res = _child(str(pkg), str(model), str(ctx.runs))
        moe = f" {N_EXPERT}x top-{N_EXPERT_USED}" if _is_moe(name) else ""
        m = f"{name} synth {LAYERS}L w{DIMS['embd']}{moe} Q4_K"
        load = spread(res["loadavg"], fmt="{:.2f}")
        for key, n, label in (
            ("decode", DECODE_TOKENS, "decode"),
            (f"prefill{PREFILL}", PREFILL, f"prefill {PREFILL}"),
        ):
            g, gr, on, off = (res[e][key] for e in ENGINES)
            r_on, med_on = _ratio(g, on)
            verdict = f" ({_verdict(med_on, DECODE_TARGET)})" if key == "decode" else ""
            out.append(
                (m, f"{label}: llama.cpp, {THREADS} threads, default repacking", _rate(on, n), "")
            )
            out.append(
                (
                    m,
                    f"{label}: ggml stage {whole}",
                    _rate(g, n),
                    f"{r_on} x llama.cpp default{verdict}; {_ratio(g, off)[0]} x llama.cpp "
                    f"repacking off; load avg {load}",
                )
            )
            r_rep, med_rep = _ratio(gr, on)
            verdict = f" ({_verdict(med_rep, DECODE_TARGET)})" if key == "decode" else ""
            out.append(
                (
                    m,
                    f"{label}: ggml stage {whole}, repack = true",
                    _rate(gr, n),
                    f"{r_rep} x llama.cpp default{verdict}; {_ratio(gr, g)[0]} x the stage "
                    "unrepacked",
                )
            )
            others = res["others"][key]
            quiet = [i for i, c in enumerate(others) if c < QUIET_CORES]
            if quiet:
                pick = [[res[e][key][i] for i in quiet] for e in ENGINES]
                out.append(
                    (
                        m,
                        f"{label}: rounds with others < {QUIET_CORES} cores busy",
                        f"{len(quiet)} of {len(others)} rounds",
                        f"in them: ggml {_ratio(pick[0], pick[2])[0]}, repack = true "
                        f"{_ratio(pick[1], pick[2])[0]} x llama.cpp default",
                    )
                )
    return out


# --- the child -----------------------------------------------------------------------------------
def child_speed(pkg: str, gguf: str, runs: str) -> dict[str, Any]:
    from skippy.gguf.ggml import configure_openmp

    configure_openmp()  # as the runtime runs (libgomp reads it once, as llama_cpp loads it)
    from skippy.runtime.chain import StageChain
    from skippy.runtime.ggml_engine import GgmlStage
    from skippy.runtime.stage import StageConfig

    whole = _whole(Path(pkg))
    cfg = StageConfig(n_ctx=N_CTX, n_threads=THREADS, n_batch=PREFILL)
    chains = {
        "ggml": StageChain([GgmlStage(_stage_loads(pkg, (whole,))[0], cfg)], None),
        "ggml_repack": StageChain(
            [GgmlStage(_stage_loads(pkg, (whole,))[0], replace(cfg, repack=True))], None
        ),
    }
    llamas = {
        "llama_repack": _Llama(gguf, repack=True),
        "llama_norepack": _Llama(gguf, repack=False),
    }
    return alternate(ENGINES, chains, llamas, int(runs))  # it closes them


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[0] != "child":
        print("usage: bench_families.py child PKG GGUF RUNS (via scripts/bench)")
        return 2
    print(json.dumps(child_speed(*argv[1:])))
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests" / "support")]
    raise SystemExit(main(sys.argv[1:]))
