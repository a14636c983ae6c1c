"""Mixture-of-experts stage rows, called by scripts/bench.py (``--only moe``).

A mid-sized synthetic qwen3moe (8 layers, width 1024, 32 experts of 512, top-4, Q4_K:
``skippy.runtime.canary.synth`` writes it, cached under the bench's work folder with its
package), 2 threads, all in one child process, alternating round by round so machine noise
hits every engine alike: decode (greedy, 32 tokens) and a 512-token prefill of the ggml
engine as one whole-range stage, of a 3-stage chain in the same process, and of llama.cpp
through its C API with weight repacking off (the same kernels on the same bytes) and with its
default repacking (what users get), and the ggml whole-range stage with repacking too
(``StageConfig(repack=True)``: bit-identical to llama.cpp's default). The load average is
read around every round and reported beside the figures: the machine may be shared.

Every measurement runs in a child with ``OPENBLAS_NUM_THREADS=1`` (runtime-facts.md: numpy's
BLAS threads and ggml's OpenMP threads fight in one process).
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchlib import (  # type: ignore[import-not-found]
    ROOT,
    BenchContext,
    Row,
    cpu_ticks,
    others_cores,
    run_child,
    spread,
)

THREADS = 2
N_CTX = 1024
DECODE_TOKENS = 32
PREFILL = 512
LAYERS = 8
WHOLE = f"0..{LAYERS}"
SPLIT = ("0..3", "3..6", "6..8")
N_EXPERT, N_EXPERT_USED = 32, 4
# width 1024 = 16 heads of 64 over 4 KV heads; experts of 512 (a multiple of Q4_K's 256)
DIMS = {"embd": 1024, "n_head": 16, "n_head_kv": 4, "head_dim": 64, "ff_exp": 512}
ENGINES = ("ggml1", "ggml1_repack", "ggml3", "llama_norepack", "llama_repack")
DECODE_TARGET, PREFILL_TARGET, CHAIN_TARGET = 0.95, 0.9, 0.9
QUIET_CORES = 0.2  # the other processes' CPU, in cores, under which a round counts as quiet


# --- the parent: rows ----------------------------------------------------------------------------
def _model(ctx: BenchContext) -> tuple[Path, Path]:
    """The synthetic MoE GGUF and its package (written once, reused when present)."""
    from skippy.produce.write_package import WriteOptions, local_provenance, write_package
    from skippy.runtime.canary import synth

    spec = replace(
        synth.family("qwen3moe"), n_layers=LAYERS, moe=synth.MoE(N_EXPERT, N_EXPERT_USED)
    )
    root = ctx.work / "moe"
    model = root / f"qwen3moe-{LAYERS}L-{DIMS['embd']}w-{N_EXPERT}x{N_EXPERT_USED}-Q4_K.gguf"
    if not model.exists():
        synth.write_model(spec, model, dtype="Q4_K", dims=synth.Dims(**DIMS))
    pkg = root / f"{model.stem}-pkg"
    if not (pkg / "model-package.json").is_file():
        prov = local_provenance(
            model_id="bench/qwen3moe-synth-GGUF:Q4_K",
            source_repo=None,
            source_revision="bench",
            source_file=model.name,
        )
        write_package(model, WriteOptions(out_dir=pkg, provenance=prov, overwrite=True))
    return model, pkg


def _child(*args: str) -> dict[str, Any]:
    return run_child(__file__, *args)


def _rate(times: list[float], n: int) -> str:
    return spread([n / t for t in times], fmt="{:.1f}") + " tok/s"


def _ratio(a: list[float], b: list[float]) -> tuple[str, float]:
    """Per-round speed ratios b_time / a_time (a faster -> > 1): 'median (min..max)'."""
    ratios = [tb / ta for ta, tb in zip(a, b, strict=True)]
    return spread(ratios, fmt="{:.2f}"), statistics.median(ratios)


def _verdict(med: float, target: float) -> str:
    return f"target >= {target}; {'met' if med >= target else 'NOT met'}"


def rows(ctx: BenchContext) -> list[Row]:
    model, pkg = _model(ctx)
    res = _child("speed", str(pkg), str(model), str(ctx.runs))
    m = f"qwen3moe synth {LAYERS}L w{DIMS['embd']} {N_EXPERT}x top-{N_EXPERT_USED} Q4_K"
    load = spread(res["loadavg"], fmt="{:.2f}")
    out: list[Row] = []
    for key, n, label, target in (
        ("decode", DECODE_TOKENS, "decode", DECODE_TARGET),
        (f"prefill{PREFILL}", PREFILL, f"prefill {PREFILL}", PREFILL_TARGET),
    ):
        g1, g3 = res["ggml1"][key], res["ggml3"][key]
        off, on = res["llama_norepack"][key], res["llama_repack"][key]
        out.append((m, f"{label}: llama.cpp, 2 threads, repacking off", _rate(off, n), ""))
        out.append((m, f"{label}: llama.cpp, 2 threads, default repacking", _rate(on, n), ""))
        r_off = _ratio(g1, off)[0]
        r_on, med_on = _ratio(g1, on)
        out.append(
            (
                m,
                f"{label}: ggml stage {WHOLE}",
                _rate(g1, n),
                f"{r_on} x llama.cpp default ({_verdict(med_on, target)}); "
                f"{r_off} x llama.cpp repacking off; load avg {load}",
            )
        )
        gr = res["ggml1_repack"][key]
        r_rep, med_rep = _ratio(gr, on)
        out.append(
            (
                m,
                f"{label}: ggml stage {WHOLE}, repack = true",
                _rate(gr, n),
                f"{r_rep} x llama.cpp default ({_verdict(med_rep, target)}); "
                f"{_ratio(gr, g1)[0]} x the stage unrepacked; load avg {load}",
            )
        )
        r3, med3 = _ratio(g3, g1)  # chain / single speed: time single / time chain
        out.append(
            (
                m,
                f"{label}: ggml 3-stage chain {'/'.join(SPLIT)}",
                _rate(g3, n),
                f"{r3} x single stage ({_verdict(med3, CHAIN_TARGET)})",
            )
        )
        out.append(_quiet_row(m, label, res, key))
    return out


def _quiet_row(m: str, label: str, res: dict[str, Any], key: str) -> Row:
    """The rounds in which the machine's other processes stayed under ``QUIET_CORES`` busy,
    and the ratios within them: with 2 OpenMP threads on 2 cores, a neighbour that takes a
    core stalls every barrier of the graph, so loaded rounds measure the neighbour."""
    others = res["others"][key]
    quiet = [i for i, c in enumerate(others) if c < QUIET_CORES]
    busy = spread(others, fmt="{:.2f}")
    value = f"{len(quiet)} of {len(others)} rounds"
    if not quiet:
        return (m, f"{label}: rounds with others < {QUIET_CORES} cores busy", value, busy)

    def pick(engine: str) -> list[float]:
        return [res[engine][key][i] for i in quiet]

    g1 = pick("ggml1")
    return (
        m,
        f"{label}: rounds with others < {QUIET_CORES} cores busy",
        value,
        f"in them: ggml {_ratio(g1, pick('llama_repack'))[0]} x llama.cpp default, "
        f"ggml repack = true {_ratio(pick('ggml1_repack'), pick('llama_repack'))[0]} x "
        "llama.cpp default, "
        f"{_ratio(g1, pick('llama_norepack'))[0]} x repacking off; 3-stage chain "
        f"{_ratio(pick('ggml3'), g1)[0]} x single stage (others busy per round, all rounds: "
        f"{busy} cores)",
    )


# --- the child -----------------------------------------------------------------------------------
def _stage_loads(pkg: str, ranges: tuple[str, ...]) -> list[Any]:
    from skippy.config import read_environment
    from skippy.consume.resolve import resolve_stage
    from skippy.runtime.boundary import StageLoad

    env = read_environment({"SKIPPY_VERIFY_PACKAGE_SHA": "0"})
    loads = []
    for r in ranges:
        resolved = resolve_stage(pkg, env, layers_text=r, text_only=True)
        loads.append(StageLoad.from_selection(resolved.stage.selection, resolved.files()))
    return loads


class _Llama:
    """llama.cpp through its C API (llama-cpp-python's binding): one model, one context; the
    high-level ``Llama`` cannot switch weight repacking off."""

    def __init__(self, gguf: str, *, repack: bool) -> None:
        from skippy.runtime.llama_cpp import import_llama

        lib = self.lib = import_llama()
        mparams = lib.llama_model_default_params()
        mparams.use_extra_bufts = repack
        self.model = lib.llama_model_load_from_file(gguf.encode(), mparams)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {gguf}")
        self.n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model)))
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = N_CTX
        cparams.n_batch = cparams.n_ubatch = PREFILL
        cparams.n_threads = cparams.n_threads_batch = THREADS
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as llama-cpp-python does
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise SystemExit(f"llama.cpp could not create a context for {gguf}")
        self.batch = lib.llama_batch_init(PREFILL, 0, 1)

    def reset(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def eval(self, ids: list[int], pos: int) -> int:
        """Decode ``ids`` at ``pos..``; the greedy next token of the last row."""
        import numpy as np

        lib, b = self.lib, self.batch
        b.n_tokens = len(ids)
        for j, tok in enumerate(ids):
            b.token[j] = tok
            b.pos[j] = pos + j
            b.n_seq_id[j] = 1
            b.seq_id[j][0] = 0
            b.logits[j] = j == len(ids) - 1
        if lib.llama_decode(self.ctx, b) != 0:
            raise SystemExit("llama_decode failed")
        row = np.ctypeslib.as_array(
            ctypes.cast(lib.llama_get_logits_ith(self.ctx, -1), ctypes.POINTER(ctypes.c_float)),
            shape=(self.n_vocab,),
        )
        return int(np.argmax(row))

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def alternate(
    engines: tuple[str, ...],
    chains: dict[str, Any],
    llamas: dict[str, _Llama],
    runs: int,
) -> dict[str, Any]:
    """Greedy decode (``DECODE_TOKENS`` after a 6-token start) and a ``PREFILL``-token
    prefill of each engine (a ``StageChain`` in ``chains`` or a llama.cpp in ``llamas``), one
    unrecorded warm-up each, then ``runs`` rounds: per engine and kind the seconds, per round
    the load average and the other processes' busy cores; every engine is closed afterwards,
    however it ends. Also bench_families'."""
    try:
        return _alternate(engines, chains, llamas, runs)
    finally:
        for ch in chains.values():
            ch.close()
        for llm in llamas.values():
            llm.close()


def _alternate(
    engines: tuple[str, ...],
    chains: dict[str, Any],
    llamas: dict[str, _Llama],
    runs: int,
) -> dict[str, Any]:
    import numpy as np

    from skippy.runtime.canary.synth import long_prompt
    from skippy.runtime.sampling import Sampler

    prompt = long_prompt(PREFILL)
    start = prompt[:6]

    def ggml(ch: Any, key: str) -> float:
        ch.free("b")
        if key != "decode":
            t = time.perf_counter()
            ch.prefill("b", prompt)
            seconds = time.perf_counter() - t
        else:
            tok = int(np.argmax(ch.prefill("b", start).logits[-1]))
            t = time.perf_counter()
            for i in range(DECODE_TOKENS):
                tok = ch.decode("b", len(start) + i, tok, sampler=Sampler()).token
            seconds = time.perf_counter() - t
        ch.free("b")
        return seconds

    def llama(llm: _Llama, key: str) -> float:
        llm.reset()
        if key != "decode":
            t = time.perf_counter()
            llm.eval(prompt, 0)
            seconds = time.perf_counter() - t
        else:
            tok = llm.eval(start, 0)
            t = time.perf_counter()
            for i in range(DECODE_TOKENS):
                tok = llm.eval([tok], len(start) + i)
            seconds = time.perf_counter() - t
        llm.reset()
        return seconds

    def measure(name: str, key: str) -> float:
        return ggml(chains[name], key) if name in chains else llama(llamas[name], key)

    keys = ("decode", f"prefill{PREFILL}")
    result: dict[str, Any] = {e: {} for e in engines}
    loadavg: list[float] = []
    others: dict[str, list[float]] = {}
    for name in engines:  # one unrecorded warm-up each: first-touch pages, repacking
        for key in keys:
            measure(name, key)
    for r in range(runs):
        loadavg.append(os.getloadavg()[0])
        # The engines' runs of one kind follow each other (load swings within seconds on a
        # shared machine), and the order turns each round so no engine always goes first.
        order = engines[r % len(engines) :] + engines[: r % len(engines)]
        for key in keys:
            before = cpu_ticks()
            for name in order:
                result[name].setdefault(key, []).append(measure(name, key))
            others.setdefault(key, []).append(others_cores(before, cpu_ticks()))
    loadavg.append(os.getloadavg()[0])
    result["loadavg"] = loadavg
    result["others"] = others
    return result


def child_speed(pkg: str, gguf: str, runs: str) -> dict[str, Any]:
    from skippy.gguf.ggml import configure_openmp

    configure_openmp()  # as the runtime runs (libgomp reads it once, as llama_cpp loads it)
    from skippy.runtime.chain import StageChain
    from skippy.runtime.ggml_engine import GgmlStage
    from skippy.runtime.stage import StageConfig

    cfg = StageConfig(n_ctx=N_CTX, n_threads=THREADS, n_batch=PREFILL)
    packed = replace(cfg, repack=True)
    chains = {
        "ggml1": StageChain([GgmlStage(_stage_loads(pkg, (WHOLE,))[0], cfg)], None),
        "ggml1_repack": StageChain([GgmlStage(_stage_loads(pkg, (WHOLE,))[0], packed)], None),
        "ggml3": StageChain([GgmlStage(load, cfg) for load in _stage_loads(pkg, SPLIT)], None),
    }
    llamas = {
        "llama_norepack": _Llama(gguf, repack=False),
        "llama_repack": _Llama(gguf, repack=True),
    }
    return alternate(ENGINES, chains, llamas, int(runs))


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "child" or argv[1] != "speed":
        print("usage: bench_moe.py child speed PKG GGUF RUNS (via scripts/bench)")
        return 2
    print(json.dumps(child_speed(*argv[2:])))
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests" / "support")]
    raise SystemExit(main(sys.argv[1:]))
