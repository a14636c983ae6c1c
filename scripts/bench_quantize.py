"""Quantize rows: skippy-quantize quantize-layer-package vs llama.cpp's quantizer.

On gemma3-270m dequantized to F32 (tests/support/f32_source.py, cached next to the Q4_K_M file),
for Q8_0 and Q4_K (llama-quantize's alias of Q4_K_M), in one run, interleaved so both sides
meet the same noise: ``llama_model_quantize`` alone (llama-cpp-python, all cores), llama.cpp
then write-package of its output (today's two-step path), and quantize-layer-package (one
streaming pass: quantize, split, hash). Target: ours <= 1.0x llama.cpp's quantize alone;
peak RSS of the skippy-quantize CLI <= 300 MiB (a child process, as a user runs it).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchlib import BenchContext, Row, child_peak_rss_mib, spread  # type: ignore[import-not-found]
from f32_source import gemma_f32  # type: ignore[import-not-found]
from quant_reference import llama_quantize  # type: ignore[import-not-found]

from skippy.produce.quant_rules import parse_file_type
from skippy.produce.quantize_package import QuantizeOptions, quantize_layer_package
from skippy.produce.write_package import WriteOptions, local_provenance, write_package

TYPES = ("Q8_0", "Q4_K")


def _prov(source: Path, type_name: str) -> object:
    return local_provenance(
        model_id=f"bench/gemma-3-270m:{type_name}",
        source_repo=None,
        source_revision="r",
        source_file=source.name,
    )


def bench_type(source: Path, work: Path, type_name: str, runs: int) -> list[Row]:
    ref = work / f"llama-{type_name}.gguf"
    ref_pkg, ours_pkg = work / f"llama-{type_name}-pkg", work / f"ours-{type_name}"
    prov = _prov(source, type_name)
    ours_opts = QuantizeOptions(
        out_dir=ours_pkg,
        provenance=prov,  # type: ignore[arg-type]
        file_type=parse_file_type(type_name),
        overwrite=True,
    )
    split_opts = WriteOptions(out_dir=ref_pkg, provenance=_prov(ref, type_name), overwrite=True)  # type: ignore[arg-type]

    def clean() -> None:
        for p in (ref, ref_pkg, ours_pkg):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
        os.sync()

    llama, split, ours = [], [], []
    for _ in range(runs):  # interleaved: each pair meets the same background load
        clean()
        t = time.perf_counter()
        llama_quantize(source, ref, type_name, nthread=os.cpu_count() or 1)
        llama.append(time.perf_counter() - t)
        t = time.perf_counter()
        write_package(ref, split_opts)
        split.append(time.perf_counter() - t)
        clean()
        t = time.perf_counter()
        quantize_layer_package(source, ours_opts)
        ours.append(time.perf_counter() - t)
    two_step = [a + b for a, b in zip(llama, split, strict=True)]
    ratios = [o / a for o, a in zip(ours, llama, strict=True)]
    rss_out = work / f"rss-{type_name}"
    shutil.rmtree(rss_out, ignore_errors=True)
    rss = child_peak_rss_mib(
        [
            sys.executable, "-m", "skippy.quantize_cli", "quantize-layer-package", str(source),
            "--out-dir", str(rss_out), "--type", type_name, "--model-id",
            f"bench/gemma-3-270m:{type_name}", "--source-revision", "r", "--source-file",
            source.name, "--json",
        ]
    )  # fmt: skip
    shutil.rmtree(rss_out, ignore_errors=True)
    clean()
    t_llama, t_ours = statistics.median(llama), statistics.median(ours)
    label = f"gemma3 F32 -> {type_name}"
    return [
        (label, "llama_model_quantize alone (s)", spread(llama), "reference"),
        (
            label,
            "llama.cpp quantize + write-package (s)",
            spread(two_step),
            f"ratio {statistics.median(two_step) / t_llama:.2f}",
        ),
        (
            label,
            "quantize-layer-package (s)",
            spread(ours),
            f"ratio {t_ours / t_llama:.2f}, per run {spread(ratios, fmt='{:.2f}')} "
            "(target <= 1.0)",
        ),
        (label, "quantize-layer-package peak RSS", f"{rss:.0f} MiB", "target <= 300 MiB"),
    ]


def rows(ctx: BenchContext) -> list[Row]:
    source = gemma_f32(ctx.gemma, ctx.gemma.parent)
    work = ctx.work / "quantize"
    work.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as f:  # warm the page cache for both sides
        while f.read(1 << 24):
            pass
    out: list[Row] = []
    for type_name in TYPES:
        out += bench_type(source, work, type_name, ctx.runs)
    return out
