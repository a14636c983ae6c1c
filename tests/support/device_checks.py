"""The device checks ``test_stage_device.py`` runs, each in a fresh process.

A Vulkan device on Mesa's lavapipe appears only when ``GGML_VK_VISIBLE_DEVICES`` is set before
ggml first reads its registry, so each check runs as ``python tests/support/device_checks.py CHECK
DIR [ARGS]`` with it set, and prints one JSON document: the measured differences, tokens and
devices, which the test asserts on. ``DIR`` holds the synthetic models and packages (made once,
reused). Small models, short prompts: lavapipe is 40-100x slower than the CPU backend.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from skippy.gguf import ggml
from skippy.runtime.canary import check, synth
from skippy.runtime.canary.oracle import LlamaOracle
from skippy.runtime.chain import StageChain
from skippy.runtime.devices import CPU_MOE_PATTERN, list_devices
from skippy.runtime.ggml_engine import GgmlStage
from skippy.runtime.stage import DecodeStep, StageConfig

PROMPT = 24  # tokens: past a chunk of 16, so prefill runs two graphs
N_NEW = 6
CHUNK = 16


def device_name() -> str:
    found = [d for d in list_devices(ggml.load()) if d.kind != "CPU"]
    if not found:
        raise SystemExit(json.dumps({"error": "no_device", "devices": []}))
    return found[0].name


def _stages(pkg: Path, ranges: tuple[str, ...], cfg: StageConfig) -> list[GgmlStage]:
    loads = check.stage_loads(pkg, ranges)
    return [GgmlStage(x, cfg, stage_index=i, stage_count=len(loads)) for i, x in enumerate(loads)]


def _greedy_rows(ch: StageChain, ids: list[int]) -> tuple[list[int], np.ndarray]:
    """Greedy tokens from a prefill and one-token decodes, with each step's logits."""
    tokens, rows = check.plain_run(ch, "g", ids, N_NEW)
    return tokens, np.stack(rows)


def parity(root: Path, family: str, dtype: str, cpu_moe: bool) -> dict[str, Any]:
    """One stage and a two-stage split on the device against llama.cpp on the same device
    (all layers offloaded; with ``cpu_moe`` the experts in CPU memory on both sides): every
    position's logits of a chunked prefill, then greedy decode steps through the reused
    decode graph; a batch of two sessions against each alone."""
    dev = device_name()
    spec = synth.family(family)
    model, pkg = check.package_model(spec, dtype, root)
    n = spec.layer_count()  # NextN layers included: they stay with the final stage
    ids = synth.long_prompt(PROMPT, vocab=spec.dims().vocab)
    cfg = StageConfig(n_ctx=256, n_batch=CHUNK, n_threads=1, device=dev, cpu_moe=cpu_moe)
    patterns = [CPU_MOE_PATTERN] if cpu_moe else []
    with LlamaOracle(model, n_gpu_layers=-1, cpu_patterns=patterns) as o:
        ref = o.logits(ids, n_batch=CHUNK, n_ctx=256)
        ref_tokens = o.greedy(ids, N_NEW, n_batch=CHUNK)
    out: dict[str, Any] = {"device": dev, "oracle_tokens": ref_tokens}
    for name, ranges in (("whole", (f"0..{n}",)), ("split", ("0..1", f"1..{n}"))):
        stages = _stages(pkg, ranges, cfg)
        placed = {k: v for s in stages for k, v in s.placement.items()}
        with StageChain(stages, None) as ch:  # type: ignore[arg-type]
            logits = ch.logits(list(ids), all_positions=True)
            tokens, _ = _greedy_rows(ch, list(ids))
            out[name] = {
                "on": sorted({s.device for s in stages}),
                "max_diff": float(np.max(np.abs(logits - ref))),
                "tokens": tokens,
                "experts_on_cpu": sorted(
                    k for k, v in placed.items() if "exps" in k and v == "CPU"
                ),
                "weights_on_device": sorted(k for k, v in placed.items() if v != "CPU"),
            }
    # speculative verify windows of 3 over the greedy tokens, the prompt in one chunk
    one_chunk = StageConfig(n_ctx=256, n_batch=32, n_threads=1, device=dev, cpu_moe=cpu_moe)
    with StageChain(_stages(pkg, (f"0..{n}",), one_chunk), None) as ch:  # type: ignore[arg-type]
        tokens = out["whole"]["tokens"]
        rows: list[np.ndarray] = []
        ch.prefill("v", list(ids))
        while len(rows) + 1 < len(tokens):
            window = tokens[len(rows) : min(len(rows) + 3, len(tokens) - 1)]
            logits = ch.verify("v", len(ids) + len(rows), window, exact=False).logits
            assert logits is not None  # a final stage's (typing)
            rows.extend(logits[-len(window) :])
        got = np.stack(rows)
    with LlamaOracle(model, n_gpu_layers=-1, cpu_patterns=patterns) as o:
        want = o.logits(
            [*ids, *tokens[:-1]], n_batch=len(ids), n_ctx=256, prefill=len(ids), steps=(3,)
        )[1:]
    out["verify_max_diff"] = float(np.max(np.abs(got - want)))
    stages = _stages(pkg, (f"0..{n}",), cfg)
    with StageChain(stages, None) as ch:  # type: ignore[arg-type]
        st = stages[0]
        alone, batched = [], []
        for s, cut in (("a", 20), ("b", 12)):
            ch.prefill(s, list(ids[:cut]))
        for s, pos in (("a", 20), ("b", 12)):
            alone.append(st.decode(s, pos, np.array([5])).logits)
            st.truncate(s, pos)
        batched = [o.logits for o in st.decode_batch(
            [DecodeStep("a", 20, np.array([5])), DecodeStep("b", 12, np.array([5]))]
        )]
        out["batch_max_diff"] = max(
            float(np.max(np.abs(a - b))) for a, b in zip(alone, batched, strict=True)
        )
        out["batch_same_argmax"] = all(
            int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(alone, batched, strict=True)
        )
        out["logit_scale"] = float(max(np.max(np.abs(a)) for a in alone))
    return out


def across(root: Path, family: str, dtype: str) -> dict[str, Any]:
    """The same split with stage 0 on the CPU and the rest on the device, against the whole
    model on the CPU: greedy tokens and the logits' largest difference."""
    dev = device_name()
    _, pkg = check.package_model(synth.family(family), dtype, root)
    n = synth.Dims().n_layers
    ids = synth.long_prompt(PROMPT, vocab=synth.Dims().vocab)
    base = {"n_ctx": 256, "n_batch": CHUNK, "n_threads": 1}
    loads = check.stage_loads(pkg, ("0..1", f"1..{n}"))
    mixed = [
        GgmlStage(loads[0], StageConfig(**base, device="CPU"), stage_index=0, stage_count=2),
        GgmlStage(loads[1], StageConfig(**base, device=dev), stage_index=1, stage_count=2),
    ]
    cpu = _stages(pkg, (f"0..{n}",), StageConfig(**base, device="CPU"))
    with StageChain(mixed, None) as a, StageChain(cpu, None) as b:  # type: ignore[arg-type]
        on = [s.device for s in mixed]
        la, lb = a.logits(list(ids), all_positions=True), b.logits(list(ids), all_positions=True)
        ta, ra = _greedy_rows(a, list(ids))
        tb, rb = _greedy_rows(b, list(ids))
    return {
        "on": on,
        "tokens_mixed": ta,
        "tokens_cpu": tb,
        "max_diff": float(max(np.max(np.abs(la - lb)), np.max(np.abs(ra - rb)))),
        "logit_scale": float(np.max(np.abs(lb))),
    }


def fallback() -> dict[str, Any]:
    """An op the device lacks runs on the CPU through the stage runtime's scheduler: ggml's
    Vulkan backend cannot convert F32 to Q4_K (``ggml_cpy``), so a graph of a device matmul
    (its weight in device memory) feeding that conversion is split, the conversion runs on
    the CPU, and its bytes equal ggml's Q4_K quantization of the matmul's output."""
    from skippy.gguf.ggml import GgmlInitParams, GgmlType
    from skippy.runtime.device_backend import DeviceBackend

    dev = device_name()
    g = ggml.load()
    handle = backend_device(g, dev)
    backend = DeviceBackend(g, dev, 1)
    q4_k, k, n = 12, 32, 4 * 256
    params = GgmlInitParams(mem_size=1 << 20, mem_buffer=None, no_alloc=True)
    wctx, ctx = g.ggml_init(params), g.ggml_init(params)
    runner = backend.runner(64)
    wbuf = None
    try:
        w = g.ggml_new_tensor_2d(wctx, GgmlType.F32, k, n)
        buft = g.ggml_backend_dev_buffer_type(handle)
        wbuf = g.ggml_backend_alloc_ctx_tensors_from_buft(wctx, buft)
        g.ggml_backend_buffer_set_usage(wbuf, ggml.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        rng = np.random.default_rng(0)
        weights = rng.standard_normal((n, k)).astype(np.float32)
        g.ggml_backend_tensor_set(w, weights.ctypes.data, 0, weights.nbytes)
        x = g.ggml_new_tensor_2d(ctx, GgmlType.F32, k, 1)
        g.ggml_set_input(x)
        y = g.ggml_mul_mat(ctx, w, x)  # [n, 1]
        g.ggml_set_output(y)
        out = g.ggml_cpy(ctx, y, g.ggml_new_tensor_1d(ctx, q4_k, n))
        g.ggml_set_output(out)
        gf = g.ggml_new_graph_custom(ctx, 64, False)
        g.ggml_build_forward_expand(gf, out)
        device_lacks = not g.ggml_backend_dev_supports_op(handle, out)
        runner.alloc(gf)
        values = rng.standard_normal(k).astype(np.float32)
        g.ggml_backend_tensor_set(x, values.ctypes.data, 0, values.nbytes)
        runner.compute(gf)
        got = np.empty(g.ggml_nbytes(out), dtype=np.uint8)
        g.ggml_backend_tensor_get(out, got.ctypes.data, 0, got.nbytes)
        ys = np.empty(n, dtype=np.float32)
        g.ggml_backend_tensor_get(y, ys.ctypes.data, 0, ys.nbytes)
        want = np.empty_like(got)
        g.ggml_quantize_chunk(q4_k, ys.ctypes.data, want.ctypes.data, 0, 1, n, None)

        def on(t: int) -> str:
            b = runner.backend_of(t)
            return g.ggml_backend_dev_name(g.ggml_backend_get_device(b)).decode() if b else "?"

        return {
            "device": dev,
            "device_lacks_op": device_lacks,
            "splits": runner.splits(),
            "on": {"mul_mat": on(y), "cpy": on(out)},
            "equal": bool(np.array_equal(got, want)),
            "matmul_close": float(np.max(np.abs(ys - weights @ values))),
        }
    finally:
        runner.free()
        if wbuf:
            g.ggml_backend_buffer_free(wbuf)
        g.ggml_free(ctx)
        g.ggml_free(wctx)
        backend.close()


def backend_device(g: ggml.Ggml, name: str) -> int:
    from skippy.runtime.devices import device_handles

    return device_handles(g)[name]


def short(root: Path, fallback_to_cpu: bool) -> dict[str, Any]:
    """A stage whose KV caches alone exceed the device's free memory."""
    dev = device_name()
    _, pkg = check.package_model(synth.family("qwen3"), "F16", root)
    n = synth.Dims().n_layers
    cfg = StageConfig(
        n_ctx=4096, max_sessions=4096, device=dev, device_fallback=fallback_to_cpu
    )
    try:
        (stage,) = _stages(pkg, (f"0..{n}",), cfg)
    except Exception as exc:  # the coded error is the result
        return {"error": getattr(exc, "code", type(exc).__name__), "message": str(exc)}
    with stage:
        return {"device": stage.device, "fallback": stage.device_fallback}


def alloc_fails(root: Path) -> dict[str, Any]:
    """The device refuses an allocation while the stage loads (run with the Vulkan driver's
    allocation limit lowered below one weight's size, ``GGML_VK_FORCE_MAX_ALLOCATION_SIZE``):
    a coded error, no stage, and the process goes on to run a CPU stage."""
    dev = device_name()
    _, pkg = check.package_model(synth.family("qwen3"), "F16", root)
    n = synth.Dims().n_layers
    out: dict[str, Any] = {}
    try:
        _stages(pkg, (f"0..{n}",), StageConfig(n_ctx=256, device=dev))
        out["error"] = None
    except Exception as exc:
        out.update(error=getattr(exc, "code", type(exc).__name__), message=str(exc))
    (cpu,) = _stages(pkg, (f"0..{n}",), StageConfig(n_ctx=256, device="CPU"))
    with StageChain([cpu], None) as ch:
        out["cpu_tokens"] = list(ch.generate([1, 2, 3], max_tokens=3).tokens)
    return out


def cpu_greedy(root: Path, family: str, dtype: str, n_prompt: int, n_new: int) -> dict[str, Any]:
    """llama.cpp's greedy continuation on the CPU (run without a device visible) and its
    text, as a served split should answer it."""
    from skippy.runtime.tokenizer import LlamaTokenizer

    model, pkg = check.package_model(synth.family(family), dtype, root)
    prompt = synth.long_prompt(n_prompt)
    with LlamaTokenizer(pkg / "shared" / "metadata.gguf") as tok:
        greedy = check.oracle_greedy(model, prompt, n_new, n_batch=len(prompt))
        ends = [i for i, t in enumerate(greedy) if tok.is_eog(t)]
        return {"prompt": prompt, "text": tok.detokenize(greedy[: ends[0]] if ends else greedy)}


def main(argv: list[str]) -> int:
    check_name, root = argv[0], Path(argv[1])
    root.mkdir(parents=True, exist_ok=True)
    if check_name == "parity":
        result = parity(root, argv[2], argv[3], argv[4:] == ["cpu_moe"])
    elif check_name == "across":
        result = across(root, argv[2], argv[3])
    elif check_name == "fallback":
        result = fallback()
    elif check_name == "short":
        result = short(root, argv[2:] == ["fallback"])
    elif check_name == "alloc_fails":
        result = alloc_fails(root)
    elif check_name == "cpu_greedy":
        result = cpu_greedy(root, argv[2], argv[3], int(argv[4]), int(argv[5]))
    elif check_name == "devices":
        result = {"devices": [d.to_dict() for d in list_devices(ggml.load())]}
    else:
        raise SystemExit(f"unknown check {check_name}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
