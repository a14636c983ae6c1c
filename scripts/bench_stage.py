"""Stage-runtime rows, called by scripts/bench.py.

On gemma3-270m, 2 threads, side by side in one child process per comparison (interleaved run
by run, so machine noise hits both): decode and prefill (128 and 512 tokens) tok/s of the
ggml engine as one whole-range stage vs llama.cpp through llama-cpp-python, and of a 3-stage
chain in one process vs the single stage; load time of the whole stage vs llama.cpp's load of
the same parts. Peak RSS per stage (each in its own child, the rise over the process just
before loading) vs its artifact bytes + KV cache. The prompt guard's options: the pure
predicate per prompt vs tokenizing in a child process.

The contention rows: ggml (adaptive, 2, 1 threads) and llama.cpp (2, 1 threads), each decode
and a 128-token prefill, as the machine is and beside one bounded busy-loop child pinned to
core 0; and the CLI (`run --engine ggml`, its default threads) the same way, its own figure.

Every measurement runs in a child with ``OPENBLAS_NUM_THREADS=1`` (runtime-facts.md: numpy's BLAS
threads and ggml's OpenMP threads fight in one process).
"""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
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
PREFILLS = (128, 512)
SPLIT = ("0..6", "6..12", "12..18")
PROMPT = "The capital of France is"


# --- the parent: rows ----------------------------------------------------------------------------
def _package(ctx: BenchContext) -> Path:
    from skippy.produce.write_package import WriteOptions, local_provenance, write_package

    pkg = ctx.work / "stage-gemma3"
    if not (pkg / "model-package.json").is_file():
        prov = local_provenance(
            model_id="google/gemma-3-270m-GGUF:Q4_K_M",
            source_repo=None,
            source_revision="bench",
            source_file=ctx.gemma.name,
        )
        write_package(ctx.gemma, WriteOptions(out_dir=pkg, provenance=prov, overwrite=True))
    return pkg


def _child(*args: str) -> dict[str, Any]:
    return run_child(__file__, *args)


def _rate(times: list[float], n: int) -> str:
    return spread([n / t for t in times], fmt="{:.1f}") + " tok/s"


def _ratio(a: list[float], b: list[float]) -> tuple[str, float]:
    """Per-run speed ratios b_time / a_time (a faster -> > 1): 'median (min..max)'."""
    ratios = [tb / ta for ta, tb in zip(a, b, strict=True)]
    return spread(ratios, fmt="{:.2f}"), statistics.median(ratios)


def rows(ctx: BenchContext) -> list[Row]:
    pkg = _package(ctx)
    out: list[Row] = []
    speed = _child("speed", str(pkg), str(ctx.gemma), str(ctx.runs))
    m = "gemma3"
    for key, n, label in [("decode", DECODE_TOKENS, "decode")] + [
        (f"prefill{p}", p, f"prefill {p}") for p in PREFILLS
    ]:
        g1, g3, ll = speed["ggml1"][key], speed["ggml3"][key], speed["llama"][key]
        r1, med1 = _ratio(g1, ll)
        r3, med3 = _ratio(g3, g1)  # chain / single speed: time single / time chain
        target = 0.9 if key == "decode" else 0.7
        out.append((m, f"{label}: llama.cpp, 2 threads", _rate(ll, n), ""))
        out.append(
            (
                m,
                f"{label}: ggml stage 0..18",
                _rate(g1, n),
                f"{r1} x llama.cpp (target >= {target}; {'met' if med1 >= target else 'NOT met'})",
            )
        )
        out.append(
            (
                m,
                f"{label}: ggml 3-stage chain {'/'.join(SPLIT)}",
                _rate(g3, n),
                f"{r3} x single stage (target >= 0.95; {'met' if med3 >= 0.95 else 'NOT met'})",
            )
        )
    out.append(_quiet_decode_row(m, speed))
    lg, ll = speed["load"]["ggml"], speed["load"]["llama"]
    out.append((m, "load: llama.cpp, the same 21 parts", spread(ll) + " s", ""))
    out.append((m, "load: ggml stage 0..18", spread(lg) + " s", f"{_ratio(lg, ll)[0]} x faster"))
    for r in ("0..18", *SPLIT):
        rss = _child("rss", str(pkg), r, "ggml")
        budget = rss["artifact_bytes"] + rss["kv_bytes"]
        mib = 1 / 2**20
        out.append(
            (
                m,
                f"peak RSS rise, ggml stage {r} (n_ctx 512)",
                f"{rss['rise'] * mib:.0f} MiB",
                f"{rss['rise'] / budget:.2f} x (artifacts {rss['artifact_bytes'] * mib:.0f} MiB "
                f"+ KV {rss['kv_bytes'] * mib:.1f} MiB; target <= 1.2); process peak "
                f"{rss['peak'] * mib:.0f} MiB",
            )
        )
    rss = _child("rss", str(pkg), "0..18", "llama")
    out.append(
        (
            m,
            "peak RSS rise, llama.cpp 0..18 (n_ctx 512)",
            f"{rss['rise'] / 2**20:.0f} MiB",
            f"process peak {rss['peak'] / 2**20:.0f} MiB",
        )
    )
    out += _contention_rows(_child("contend", str(pkg), str(ctx.gemma), str(ctx.runs)))
    out.append(_cli_row(_child("cli", str(pkg), str(ctx.runs))))
    guard = _child("guard", str(pkg), str(ctx.runs))
    for name, value in guard.items():
        out.append(("prompt guard", name, value, ""))
    return out


QUIET_CORES = 0.2  # the other processes' CPU, in cores, under which a run counts as quiet


def _quiet_decode_row(m: str, speed: dict[str, Any]) -> Row:
    """Decode ratios over the rounds in which both runs compared had the machine to
    themselves (the other processes under ``QUIET_CORES``): a neighbour taking one of the 2
    cores stalls every OpenMP barrier, so a loaded run measures the neighbour."""
    others = speed["others"]
    n = len(others["ggml1"])

    def quiet(a: str, b: str) -> list[int]:
        return [i for i in range(n) if max(others[a][i], others[b][i]) < QUIET_CORES]

    def ratio(a: str, b: str) -> str:
        idx = quiet(a, b)
        if not idx:
            return "no quiet rounds"
        pick = [speed[a]["decode"][i] for i in idx], [speed[b]["decode"][i] for i in idx]
        return f"{_ratio(*pick)[0]} x in {len(idx)} of {n} rounds"

    return (
        m,
        f"decode: rounds with others < {QUIET_CORES} cores busy",
        spread([max(v) for v in zip(*others.values(), strict=True)], fmt="{:.2f}") + " cores",
        f"ggml stage vs llama.cpp: {ratio('ggml1', 'llama')}; 3-stage chain vs single stage: "
        f"{ratio('ggml3', 'ggml1')}",
    )


# Each setup decodes and prefills as is and beside one busy neighbour.
CONTEND_SETUPS = (
    "ggml adaptive (cap 2)",
    "ggml 2 threads",
    "ggml 1 thread",
    "llama.cpp 2 threads",
    "llama.cpp 1 thread",
)
CONTEND_PREFILL = 128


def _contention_rows(res: dict[str, Any]) -> list[Row]:
    """Quiet (as the machine is) vs one busy neighbour, per setup; the engine's default
    (adaptive) against its own quiet speed and against llama.cpp (2 threads) side by side."""
    out: list[Row] = []
    m = "gemma3"
    for key, n, label in (
        ("decode", DECODE_TOKENS, "decode"),
        ("prefill", CONTEND_PREFILL, f"prefill {CONTEND_PREFILL}"),
    ):
        for setup in CONTEND_SETUPS:
            quiet, busy = res[setup]["quiet"][key], res[setup]["busy"][key]
            keep, keep_med = _ratio(busy, quiet)  # quiet time / busy time: speed kept
            note = f"busy neighbour: {_rate(busy, n)} = {keep} x quiet"
            if setup.startswith("ggml adaptive"):
                ll = res["llama.cpp 2 threads"]
                vs_q, med_q = _ratio(quiet, ll["quiet"][key])
                vs_b, med_b = _ratio(busy, ll["busy"][key])
                ok = keep_med >= 0.6 and med_q >= 0.9 and med_b >= 0.9
                note += (
                    f"; vs llama.cpp 2 threads: quiet {vs_q} x, busy {vs_b} x (targets: "
                    f">= 0.6 x quiet, >= 0.9 x llama.cpp; {'met' if ok else 'NOT met'})"
                    if key == "decode"
                    else f"; vs llama.cpp 2 threads: quiet {vs_q} x, busy {vs_b} x"
                )
            out.append((m, f"contention, {label}: {setup}, quiet", _rate(quiet, n), note))
    return out


def _cli_row(res: dict[str, Any]) -> Row:
    """`skippy-model-package run --engine ggml` with its default threads, as a user runs it:
    its own decode rate quiet and beside one busy neighbour, run by run."""
    quiet, busy = res["quiet"], res["busy"]
    keep = [b / q for q, b in zip(quiet, busy, strict=True)]
    ok = statistics.median(keep) >= 0.6
    return (
        "gemma3",
        "contention, decode: CLI run --engine ggml (default threads), quiet",
        spread(quiet, fmt="{:.1f}") + " tok/s",
        f"busy neighbour: {spread(busy, fmt='{:.1f}')} tok/s = {spread(keep, fmt='{:.2f}')} x "
        f"quiet (target >= 0.6; {'met' if ok else 'NOT met'})",
    )


# --- the children --------------------------------------------------------------------------------
def _busy_neighbour(core: int | None) -> subprocess.Popen[bytes]:
    """One bounded busy-loop process (at most 600 s), pinned to ``core`` where given; the
    caller stops it by its PID."""
    code = (
        "import os, sys, time\n"
        "core = int(sys.argv[1])\n"
        "if core >= 0: os.sched_setaffinity(0, {core})\n"
        "end = time.monotonic() + 600\n"
        "while time.monotonic() < end: pass\n"
    )
    return subprocess.Popen([sys.executable, "-c", code, str(-1 if core is None else core)])


def child_contend(pkg: str, gguf: str, runs: str) -> dict[str, Any]:
    """Decode (greedy, 32 tokens) and a 128-token prefill per setup, each run quiet and then
    beside one busy neighbour pinned to core 0 (started and stopped by PID here)."""
    from skippy.gguf.ggml import configure_openmp

    configure_openmp()
    import llama_cpp
    import numpy as np

    from skippy.runtime.chain import StageChain
    from skippy.runtime.ggml_engine import GgmlStage
    from skippy.runtime.sampling import Sampler
    from skippy.runtime.stage import StageConfig

    load = _stage_loads(pkg, ("0..18",))[0]
    configs = {
        "ggml adaptive (cap 2)": StageConfig(n_ctx=N_CTX, n_threads=2, adaptive_threads=True),
        "ggml 2 threads": StageConfig(n_ctx=N_CTX, n_threads=2),
        "ggml 1 thread": StageConfig(n_ctx=N_CTX, n_threads=1),
    }
    chains = {name: StageChain([GgmlStage(load, c)], None) for name, c in configs.items()}
    llms = {
        f"llama.cpp {n} thread{'s' if n > 1 else ''}": llama_cpp.Llama(
            model_path=gguf,
            n_ctx=N_CTX,
            n_batch=512,
            n_threads=n,
            n_threads_batch=n,
            verbose=False,
        )
        for n in (2, 1)
    }
    start = [2, 818, 5279, 529, 7001, 563]
    ids = [int(x) for x in np.random.default_rng(0).integers(300, 200_000, size=CONTEND_PREFILL)]
    res: dict[str, Any] = {s: {"quiet": {}, "busy": {}} for s in CONTEND_SETUPS}

    def ggml_run(ch: StageChain) -> tuple[float, float]:
        ch.free("b")
        tok = int(np.argmax(ch.prefill("b", start).logits[-1]))  # type: ignore[index]
        t = time.perf_counter()
        for i in range(DECODE_TOKENS):
            tok = ch.decode("b", len(start) + i, tok, sampler=Sampler()).token  # type: ignore[assignment]
        dec = time.perf_counter() - t
        ch.free("b")
        t = time.perf_counter()
        ch.prefill("b", ids)
        pre = time.perf_counter() - t
        ch.free("b")
        return dec, pre

    def llama_run(llm: Any) -> tuple[float, float]:
        llm.reset()
        llm.eval(start)
        tok = _llama_greedy(llm)
        t = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            llm.eval([tok])
            tok = _llama_greedy(llm)
        dec = time.perf_counter() - t
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        return dec, time.perf_counter() - t

    for _ in range(int(runs)):
        for condition in ("quiet", "busy"):
            neighbour = _busy_neighbour(0) if condition == "busy" else None
            try:
                time.sleep(1.0)  # a steady neighbour: the adaptive stage's window has seen it
                for name in CONTEND_SETUPS:
                    ch = chains.get(name)
                    dec, pre = ggml_run(ch) if ch is not None else llama_run(llms[name])
                    res[name][condition].setdefault("decode", []).append(dec)
                    res[name][condition].setdefault("prefill", []).append(pre)
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
    for ch in chains.values():
        ch.close()
    for llm in llms.values():
        llm.close()
    return res


def _llama_greedy(llm: Any) -> int:
    """The argmax of llama.cpp's last logits row (``Llama.eval`` no longer fills ``scores``
    unless every position's logits are kept)."""
    import ctypes

    import llama_cpp
    import numpy as np

    row = np.ctypeslib.as_array(
        ctypes.cast(llama_cpp.llama_get_logits_ith(llm.ctx, -1), ctypes.POINTER(ctypes.c_float)),
        shape=(llm.n_vocab(),),
    )
    return int(np.argmax(row))


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


def child_speed(pkg: str, gguf: str, runs: str) -> dict[str, Any]:
    from skippy.gguf.ggml import configure_openmp

    configure_openmp()  # as the runtime runs (libgomp reads it once, as llama_cpp loads it)
    import llama_cpp
    import numpy as np

    from skippy.runtime.chain import StageChain
    from skippy.runtime.ggml_engine import GgmlStage
    from skippy.runtime.llama_cpp import LlamaRuntimeConfig, LlamaStageRuntime
    from skippy.runtime.sampling import Sampler
    from skippy.runtime.stage import StageConfig

    cfg = StageConfig(n_ctx=N_CTX, n_threads=THREADS)
    whole_load = _stage_loads(pkg, ("0..18",))[0]
    chains = {
        "ggml1": StageChain([GgmlStage(whole_load, cfg)], None),
        "ggml3": StageChain([GgmlStage(load, cfg) for load in _stage_loads(pkg, SPLIT)], None),
    }
    llm = llama_cpp.Llama(
        model_path=gguf,
        n_ctx=N_CTX,
        n_batch=512,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        verbose=False,
    )
    rng = np.random.default_rng(0)
    prompts = {p: [int(x) for x in rng.integers(300, 200_000, size=p)] for p in PREFILLS}
    start = [2, 818, 5279, 529, 7001, 563]
    result: dict[str, Any] = {k: {} for k in (*chains, "llama")}
    others: dict[str, list[float]] = {}  # per decode run: the other processes' CPU, in cores
    result["others"] = others

    def record(engine: str, key: str, seconds: float) -> None:
        result[engine].setdefault(key, []).append(seconds)

    def decode_run(ch: StageChain) -> float:
        ch.free("b")
        out = ch.prefill("b", start)
        tok = int(np.argmax(out.logits[-1]))  # type: ignore[index]
        t = time.perf_counter()
        for i in range(DECODE_TOKENS):  # as generation runs: the head's argmax on ggml
            tok = ch.decode("b", len(start) + i, tok, sampler=Sampler()).token  # type: ignore[assignment]
        seconds = time.perf_counter() - t
        ch.free("b")
        return seconds

    def llama_decode() -> float:
        llm.reset()
        llm.eval(start)
        tok = _llama_greedy(llm)
        t = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            llm.eval([tok])
            tok = _llama_greedy(llm)
        return time.perf_counter() - t

    def prefill_run(name: str, ids: list[int]) -> float:
        if name == "llama":
            llm.reset()
            t = time.perf_counter()
            llm.eval(ids)
            return time.perf_counter() - t
        ch = chains[name]
        t = time.perf_counter()
        ch.prefill("b", ids)
        seconds = time.perf_counter() - t
        ch.free("b")
        return seconds

    decoders: dict[str, Callable[[], float]] = {
        **{name: functools.partial(decode_run, ch) for name, ch in chains.items()},
        "llama": llama_decode,
    }
    for r in range(int(runs)):
        # Each kind's runs follow each other (load swings within seconds on a shared machine),
        # the engines' order turning each round so none always goes first.
        names = list(decoders)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            before = cpu_ticks()
            record(name, "decode", decoders[name]())
            others.setdefault(name, []).append(others_cores(before, cpu_ticks()))
        names = [*chains, "llama"]
        for p, ids in prompts.items():
            for name in names[r % len(names) :] + names[: r % len(names)]:
                record(name, f"prefill{p}", prefill_run(name, ids))
    for ch in chains.values():
        ch.close()
    llm.close()
    # load time: the whole stage vs llama.cpp's load of the same parts (split-set links)
    loads: dict[str, list[float]] = {"ggml": [], "llama": []}
    for _ in range(int(runs)):
        t = time.perf_counter()
        GgmlStage(whole_load, cfg).close()
        loads["ggml"].append(time.perf_counter() - t)
        rt = LlamaStageRuntime(LlamaRuntimeConfig(n_ctx=N_CTX, n_threads=THREADS))
        t = time.perf_counter()
        rt.load(whole_load)
        loads["llama"].append(time.perf_counter() - t)
        rt.close()
    result["load"] = loads
    return result


def _rss_bytes(field: str = "VmRSS:") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def child_rss(pkg: str, layers: str, engine: str) -> dict[str, Any]:
    """One stage alone: RSS just before loading (libraries imported, ggml loaded), then the
    peak after loading it and running a 128-token prefill and 16 decodes."""
    import numpy as np

    from skippy.gguf import ggml
    from skippy.runtime.llama_cpp import LlamaRuntimeConfig, LlamaStageRuntime, import_llama
    from skippy.runtime.stage import StageConfig

    load = _stage_loads(pkg, (layers,))[0]
    import_llama()
    ggml.load()
    artifact_bytes = sum(p.stat().st_size for p in load.part_paths)
    ids = [int(x) for x in np.random.default_rng(0).integers(300, 200_000, size=128)]
    # ru_maxrss survives fork + exec (it would report the bench parent's peak); reset this
    # process's high-water mark and read VmHWM so the figure is the stage's alone (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_bytes()
    if engine == "llama":
        rt = LlamaStageRuntime(LlamaRuntimeConfig(n_ctx=512, n_threads=THREADS))
        rt.load(load)
        rt.generate(ids, max_tokens=16)
        kv = 0
    else:
        from skippy.runtime.ggml_engine import GgmlStage

        stage = GgmlStage(load, StageConfig(n_ctx=512, n_threads=THREADS))
        x: Any = (
            np.asarray(ids)
            if load.layers.owns_input
            else (
                np.random.default_rng(1).standard_normal((128, stage.spec.width)).astype(np.float32)
            )
        )
        stage.prefill("r", 0, x)
        for i in range(16):
            step = x[i : i + 1]
            stage.decode("r", 128 + i, step)
        kv = stage.kv_bytes_per_session()
    peak = _rss_bytes("VmHWM:")
    return {
        "before": before,
        "peak": peak,
        "rise": peak - before,
        "artifact_bytes": artifact_bytes,
        "kv_bytes": kv,
    }


def child_guard(pkg: str, runs: str) -> dict[str, str]:
    """What each way of keeping a prompt from aborting llama.cpp costs."""
    import tempfile

    import synth_gguf  # type: ignore[import-not-found]

    from skippy.produce.write_package import WriteOptions, local_provenance, write_package
    from skippy.runtime.prompt_guard import Vocabulary, probe_in_child, spm_verdict

    n = int(runs)
    meta = Path(pkg) / "shared" / "metadata.gguf"
    out: dict[str, str] = {}

    def timed(fn: Any, reps: int) -> list[float]:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return times

    vocab_times = timed(lambda: Vocabulary.read(meta), n)
    out["gemma3: read the vocabulary once (262,144 tokens)"] = (
        spread(vocab_times, 1e3, "{:.0f}") + " ms"
    )
    vocab = Vocabulary.read(meta)
    out["gemma3: SentencePiece predicate, 1 KiB prompt (all 256 byte tokens)"] = (
        spread(timed(lambda: spm_verdict(vocab, PROMPT * 40), 100), 1e6, "{:.1f}") + " us"
    )
    with tempfile.TemporaryDirectory() as tmp:
        src = synth_gguf.llama_like(Path(tmp) / "llama.gguf")
        prov = local_provenance(
            model_id="acme/tiny-GGUF:Q8_0",
            source_repo=None,
            source_revision="r",
            source_file=src.name,
        )
        write_package(src, WriteOptions(out_dir=Path(tmp) / "pkg", provenance=prov))
        tiny = Vocabulary.read(Path(tmp) / "pkg" / "shared" / "metadata.gguf")
        text = "Ω " * 512
        out["synthetic (no byte tokens): predicate with merge replay, 1 KiB prompt"] = (
            spread(timed(lambda: spm_verdict(tiny, text), 20), 1e3, "{:.2f}") + " ms"
        )
    out["gemma3: tokenize once in a child process (the fallback)"] = (
        spread(timed(lambda: probe_in_child(meta, PROMPT), n), fmt="{:.2f}") + " s"
    )
    return out


def child_cli(pkg: str, runs: str) -> dict[str, list[float]]:
    """The CLI's decode tok/s (its own --json figure), each run quiet then beside one busy
    neighbour pinned to core 0 (started and stopped by PID here)."""
    argv = [sys.executable, "-m", "skippy.cli", "run", pkg, "--engine", "ggml"]
    argv += ["--prompt", PROMPT, "--max-tokens", str(DECODE_TOKENS), "--json"]
    res: dict[str, list[float]] = {"quiet": [], "busy": []}
    for _ in range(int(runs)):
        for condition in ("quiet", "busy"):
            neighbour = _busy_neighbour(0) if condition == "busy" else None
            try:
                time.sleep(1.0)
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
                if proc.returncode != 0:
                    raise SystemExit(f"run failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
                res[condition].append(float(json.loads(proc.stdout)["decode_tokens_per_s"]))
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
    return res


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "child":
        print("usage: bench_stage.py child {speed|rss|guard|contend|cli} ARGS (via scripts/bench)")
        return 2
    kind, args = argv[1], argv[2:]
    children = {
        "speed": child_speed,
        "rss": child_rss,
        "guard": child_guard,
        "contend": child_contend,
        "cli": child_cli,
    }
    print(json.dumps(children[kind](*args)))
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests" / "support")]
    raise SystemExit(main(sys.argv[1:]))
