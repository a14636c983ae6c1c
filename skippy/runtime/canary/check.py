"""One family's parity with llama.cpp: the certification canary's core check.

A synthetic model of the family (``skippy.runtime.canary.synth``) is written as a layer
package, run by the stage runtime over a stage layout (one stage, several, one per layer) with
its prompt prefilled in chunks of a given size, and every position's logits are compared with
llama.cpp's on the original GGUF, evaluated in one batch (``skippy.runtime.canary.oracle``,
weight repacking off: the same kernels on the same bytes).

``python -m skippy.runtime.canary.check FAMILY [--dtype D ...]`` prints the largest difference
for each case: what a developer runs while writing a family's builder.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from skippy.runtime.canary import synth
from skippy.runtime.canary.oracle import llama_logits

N_CTX: Final = 1024
LONG_PROMPT: Final = 320  # past the synthetic models' sliding window (128)
SHORT_PROMPT: Final = 12
CHUNKS: Final = (512, 128, 7)


@dataclass(frozen=True)
class Case:
    """A stage layout (layer ranges, ``"a..b"``) and the prefill's chunk size."""

    ranges: tuple[str, ...]
    n_batch: int

    @property
    def name(self) -> str:
        return f"{len(self.ranges)} stage(s) {'|'.join(self.ranges)}, chunks of {self.n_batch}"


def layouts(layer_count: int) -> list[tuple[str, ...]]:
    """One stage, three stages (as even as the layers allow), one stage per layer."""
    n = layer_count
    one = (f"0..{n}",)
    cuts = sorted({0, max(1, n // 3), max(2, 2 * n // 3), n})
    three = tuple(f"{a}..{b}" for a, b in itertools.pairwise(cuts) if a < b)
    per_layer = tuple(f"{i}..{i + 1}" for i in range(n))
    return [one, three, per_layer]


def default_cases(layer_count: int) -> list[Case]:
    """Every layout with every chunk size of ``CHUNKS``, once each."""
    out = []
    for i, ranges in enumerate(layouts(layer_count)):
        for j, chunk in enumerate(CHUNKS):
            if (i + j) % len(CHUNKS) == 0 or len(ranges) == 1:
                out.append(Case(ranges, chunk))
    return out


def package_model(spec: synth.FamilySpec, dtype: str, root: Path) -> tuple[Path, Path]:
    """The family's synthetic GGUF at ``dtype`` and its layer package, made once under
    ``root`` (both reused when present)."""
    from skippy.produce.write_package import WriteOptions, local_provenance, write_package

    model = root / synth.model_file_name(spec, dtype)
    if not model.exists():
        synth.write_model(spec, model, dtype=dtype)
    pkg = root / f"{model.stem}-pkg"
    if not (pkg / "model-package.json").exists():
        prov = local_provenance(
            model_id=f"canary/{spec.name}-GGUF:{dtype}",
            source_repo=None,
            source_revision="0123abc",
            source_file=model.name,
        )
        write_package(model, WriteOptions(out_dir=pkg, provenance=prov))
    return model, pkg


def stage_logits(
    pkg: Path, ids: Sequence[int], case: Case, *, n_ctx: int = N_CTX, n_threads: int = 1
) -> npt.NDArray[np.float32]:
    """The stage runtime's logits at every position of ``ids`` over ``case``'s layout."""
    from skippy.config import read_environment
    from skippy.constants import ENV_VERIFY_PACKAGE_SHA
    from skippy.consume.resolve import resolve_stage
    from skippy.runtime.boundary import StageLoad
    from skippy.runtime.chain import StageChain, open_stage
    from skippy.runtime.stage import StageConfig

    env = read_environment({ENV_VERIFY_PACKAGE_SHA: "0"})
    loads = []
    for r in case.ranges:
        resolved = resolve_stage(str(pkg), env, layers_text=r, text_only=True)
        loads.append(
            StageLoad.from_selection(
                resolved.stage.selection,
                resolved.files(),
                manifest_sha256=resolved.stage.package.manifest_sha256,
            )
        )
    cfg = StageConfig(n_ctx=n_ctx, n_batch=case.n_batch, n_threads=n_threads)
    stages = [
        open_stage("ggml", load, cfg, stage_index=i, stage_count=len(loads))
        for i, load in enumerate(loads)
    ]
    with StageChain(stages, None) as ch:
        return ch.logits(list(ids), all_positions=True)


def oracle(model: Path, ids: Sequence[int], *, n_ctx: int = N_CTX) -> npt.NDArray[np.float32]:
    """llama.cpp's logits at every position of ``ids``, one batch, repacking off."""
    return llama_logits(model, ids, n_batch=max(len(ids), 1), n_ctx=n_ctx, repack=False)


def max_difference(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> float:
    """The largest absolute difference (``inf`` for shapes that differ or non-finite rows)."""
    if a.shape != b.shape or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max(initial=0.0))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m skippy.runtime.canary.check",
        description="one family's logits: the stage runtime against llama.cpp",
    )
    p.add_argument("family", choices=synth.FAMILY_NAMES)
    p.add_argument("--dtype", action="append", choices=synth.DTYPES)
    p.add_argument("--dir", type=Path, default=Path(".work") / "canary")
    args = p.parse_args(argv)
    spec = synth.family(args.family)
    worst = 0.0
    for dtype in args.dtype or list(synth.DTYPES):
        model, pkg = package_model(spec, dtype, args.dir)
        layers = spec.dims().n_layers
        for n in (SHORT_PROMPT, LONG_PROMPT):
            ids = synth.long_prompt(n, vocab=spec.dims().vocab)
            ref = oracle(model, ids)
            for case in default_cases(layers):
                diff = max_difference(stage_logits(pkg, ids, case), ref)
                worst = max(worst, diff)
                print(f"{spec.name} {dtype} {n} ids, {case.name}: max |diff| {diff:.3g}")
    print(f"worst: {worst:.3g}")
    return 0 if worst == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
