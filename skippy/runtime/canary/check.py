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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

import numpy as np
import numpy.typing as npt

from skippy.errors import UsageError
from skippy.runtime.canary import synth
from skippy.runtime.canary.oracle import LlamaOracle, llama_logits

if TYPE_CHECKING:
    from skippy.runtime.boundary import StageLoad
    from skippy.runtime.chain import StageChain

RowArray = npt.NDArray[np.float32]

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


def layouts(layer_count: int, trunk: int | None = None) -> list[tuple[str, ...]]:
    """One stage, three stages (as even as the layers allow), one stage per layer. Where
    the model has NextN layers after a ``trunk`` of fewer layers, the cuts fall in the
    trunk and the final stage holds the NextN layers too (where the runtime wants them)."""
    n = layer_count if trunk is None else trunk
    cuts = sorted({0, max(1, n // 3), max(2, 2 * n // 3), n})
    three = [(a, b) for a, b in itertools.pairwise(cuts) if a < b]
    per_layer = [(i, i + 1) for i in range(n)]
    out = []
    for ranges in ([(0, n)], three, per_layer):
        ranges[-1] = (ranges[-1][0], layer_count)
        out.append(tuple(f"{a}..{b}" for a, b in ranges))
    return out


def default_cases(layer_count: int, trunk: int | None = None) -> list[Case]:
    """Every layout with every chunk size of ``CHUNKS``, once each."""
    out = []
    for i, ranges in enumerate(layouts(layer_count, trunk)):
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


def stage_loads(pkg: Path, ranges: Sequence[str]) -> list[StageLoad]:
    """One ``StageLoad`` per layer range of the package (hashes not re-checked: the canary
    wrote the package itself)."""
    from skippy.config import read_environment
    from skippy.constants import ENV_VERIFY_PACKAGE_SHA
    from skippy.consume.resolve import resolve_stage
    from skippy.runtime.boundary import StageLoad

    env = read_environment({ENV_VERIFY_PACKAGE_SHA: "0"})
    loads = []
    for r in ranges:
        resolved = resolve_stage(str(pkg), env, layers_text=r, text_only=True)
        loads.append(
            StageLoad.from_selection(
                resolved.stage.selection,
                resolved.files(),
                manifest_sha256=resolved.stage.package.manifest_sha256,
            )
        )
    return loads


def open_chain(
    pkg: Path, case: Case, *, n_ctx: int = N_CTX, n_threads: int = 1, repack: bool = False
) -> StageChain:
    """The stage runtime's ggml stages over ``case``'s layout, as one chain (close it);
    ``repack``: weights in the CPU backend's repacked layout, as llama.cpp's default."""
    from skippy.runtime.chain import StageChain, open_stage
    from skippy.runtime.stage import StageConfig

    loads = stage_loads(pkg, case.ranges)
    cfg = StageConfig(n_ctx=n_ctx, n_batch=case.n_batch, n_threads=n_threads, repack=repack)
    stages = [
        open_stage("ggml", load, cfg, stage_index=i, stage_count=len(loads))
        for i, load in enumerate(loads)
    ]
    return StageChain(stages, None)


def stage_logits(
    pkg: Path,
    ids: Sequence[int],
    case: Case,
    *,
    n_ctx: int = N_CTX,
    n_threads: int = 1,
    repack: bool = False,
) -> npt.NDArray[np.float32]:
    """The stage runtime's logits at every position of ``ids`` over ``case``'s layout."""
    with open_chain(pkg, case, n_ctx=n_ctx, n_threads=n_threads, repack=repack) as ch:
        return ch.logits(list(ids), all_positions=True)


def stage_greedy(pkg: Path, ids: Sequence[int], n_new: int, case: Case) -> list[int]:
    """The stage runtime's greedy continuation (prefill in ``case``'s chunks, then one-token
    decodes), token ids only."""
    with open_chain(pkg, case) as ch:
        return list(ch.generate(list(ids), max_tokens=n_new).tokens)


def oracle_greedy(model: Path, ids: Sequence[int], n_new: int, *, n_batch: int) -> list[int]:
    """llama.cpp's greedy continuation of ``ids`` on the original GGUF."""
    with LlamaOracle(model, repack=False) as o:
        return o.greedy(ids, n_new, n_batch=n_batch)


def split_set_logits(pkg: Path, ids: Sequence[int], layer_count: int) -> npt.NDArray[np.float32]:
    """llama.cpp's one-batch logits with the package's fragments loaded as one split set
    (every fragment a split, opened through llama.cpp's split naming: the llama.cpp stage
    runtime's own loader)."""
    from skippy.runtime.llama_cpp import model_file

    (load,) = stage_loads(pkg, (f"0..{layer_count}",))
    with model_file(load) as first:
        return oracle(first, ids)


def _decode_logits(ch: StageChain, session: str, position: int, token: int) -> RowArray:
    out = ch.decode(session, position, token)
    if out.logits is None:
        raise UsageError("the last stage returned no logits", code="stage_mismatch")
    row: RowArray = out.logits[-1]
    return row


def plain_run(
    ch: StageChain, session: str, ids: Sequence[int], n_new: int
) -> tuple[list[int], list[RowArray]]:
    """An undisturbed greedy run on ``ch``: the tokens, and the logits each was chosen from
    (the prompt's last row, then each decode step's). The session is freed afterwards."""
    try:
        out = ch.prefill(session, list(ids))
        if out.logits is None:
            raise UsageError("the last stage returned no logits", code="stage_mismatch")
        rows = [out.logits[-1]]
        tokens = [int(np.argmax(rows[-1]))]
        while len(tokens) < n_new:
            rows.append(_decode_logits(ch, session, len(ids) + len(tokens) - 1, tokens[-1]))
            tokens.append(int(np.argmax(rows[-1])))
        return tokens, rows
    finally:
        ch.free(session)


class ReplayStep(Protocol):
    """One stage call of a replay schedule (``skippy.serving.replay.Step``)."""

    @property
    def phase(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def tokens(self) -> tuple[int, ...]: ...


# (prompt, generated, chunk) -> the calls that recompute them: serving's replay schedule,
# passed in by the caller (the runtime does not import the serving layer above it).
ReplaySchedule = Callable[[Sequence[int], Sequence[int], int], Sequence[ReplayStep]]


def failover_difference(
    pkg: Path,
    ids: Sequence[int],
    n_new: int,
    case: Case,
    *,
    cut: int,
    schedule: ReplaySchedule,
) -> float:
    """A failover replay against the undisturbed run: the run loses its chain after ``cut``
    generated tokens; a fresh chain (new stages, as a replacement node has) replays the
    committed tokens by ``schedule`` (serving's ``skippy.serving.replay.schedule``: the same
    calls in the same shapes) and decodes on. The largest difference of every position's
    logits from the undisturbed run's (``inf`` when a token differs)."""
    with open_chain(pkg, case) as ch:
        tokens, rows = plain_run(ch, "plain", ids, n_new)
    worst = 0.0
    with open_chain(pkg, case) as fresh:
        try:
            out = None
            for step in schedule(ids, tokens[:cut], case.n_batch):
                if step.phase == "prefill":
                    out = fresh.prefill("replayed", step.tokens, start=step.start)
                else:
                    out = fresh.decode("replayed", step.start, step.tokens[0])
            if out is None or out.logits is None:
                raise UsageError("the replay returned no logits", code="stage_mismatch")
            row = out.logits[-1]
            for i in range(cut, n_new):
                worst = max(worst, max_difference(row, rows[i]))
                if int(np.argmax(row)) != tokens[i]:
                    return float("inf")
                if i + 1 < n_new:
                    row = _decode_logits(fresh, "replayed", len(ids) + i, tokens[i])
        finally:
            fresh.free("replayed")
    return worst


def batch_difference(
    pkg: Path, prompts: Sequence[Sequence[int]], feed: Sequence[int], case: Case
) -> float:
    """Several sessions decoded together (``Stage.decode_batch``, one graph per stage and
    step) against each decoded alone: the largest difference of any session's logits."""
    from skippy.runtime.stage import DecodeStep

    names = [f"s{i}" for i in range(len(prompts))]
    with open_chain(pkg, case) as ch:
        alone: dict[tuple[str, int], RowArray] = {}
        for name, prompt in zip(names, prompts, strict=True):
            ch.prefill(name, list(prompt))
            for k, token in enumerate(feed):
                alone[(name, k)] = _decode_logits(ch, name, len(prompt) + k, token)
            ch.free(name)
        for name, prompt in zip(names, prompts, strict=True):
            ch.prefill(name, list(prompt))
        worst = 0.0
        for k, token in enumerate(feed):
            xs: list[npt.NDArray[Any]] = [np.array([token]) for _ in names]
            for stage in ch.stages:
                outs = stage.decode_batch(
                    [
                        DecodeStep(n, len(p) + k, x)
                        for n, p, x in zip(names, prompts, xs, strict=True)
                    ]
                )
                xs = [o.activations if o.activations is not None else o.logits for o in outs]  # type: ignore[misc]
            for name, x in zip(names, xs, strict=True):
                worst = max(worst, max_difference(x[-1], alone[(name, k)]))
        for name in names:
            ch.free(name)
    return worst


def _verify_rows(
    ch: StageChain,
    ids: Sequence[int],
    tokens: Sequence[int],
    windows: Sequence[int],
    *,
    exact: bool,
) -> RowArray:
    """The logits after each of ``tokens`` but the last, fed after the prompt in verify
    windows of ``windows``' sizes in turn (``StageChain.verify``: one pass through the chain
    each, one multi-row graph per stage or, ``exact``, one-position steps)."""
    rows: list[RowArray] = []
    at, sizes = 0, itertools.cycle(windows)
    try:
        ch.prefill("verify", list(ids))
        while at + 1 < len(tokens):
            window = tokens[at : min(at + next(sizes), len(tokens) - 1)]
            out = ch.verify("verify", len(ids) + at, window, exact=exact)
            if out.logits is None:
                raise UsageError("the last stage returned no logits", code="stage_mismatch")
            rows.extend(out.logits[-len(window) :])
            at += len(window)
    finally:
        ch.free("verify")
    return np.stack(rows)


def verify_difference(
    pkg: Path, ids: Sequence[int], n_new: int, case: Case, *, windows: Sequence[int], exact: bool
) -> float:
    """Speculative verify windows against the plain run: the greedy continuation fed back
    after the prompt in verify windows; the largest difference from the plain decode's
    logits at the same positions."""
    with open_chain(pkg, case) as ch:
        tokens, rows = plain_run(ch, "plain", ids, n_new)
        got = _verify_rows(ch, ids, tokens, windows, exact=exact)
    return max_difference(got, np.stack(rows[1:]))


def verify_windows(
    pkg: Path, ids: Sequence[int], n_new: int, case: Case, *, windows: Sequence[int]
) -> RowArray:
    """The batched verify windows' logits over the greedy continuation (see
    ``_verify_rows``), to compare with ``oracle_windows``."""
    with open_chain(pkg, case) as ch:
        tokens, _ = plain_run(ch, "plain", ids, n_new)
        return _verify_rows(ch, ids, tokens, windows, exact=False)


def oracle(
    model: Path,
    ids: Sequence[int],
    *,
    n_ctx: int = N_CTX,
    n_batch: int | None = None,
    repack: bool = False,
) -> npt.NDArray[np.float32]:
    """llama.cpp's logits at every position of ``ids`` (repacking off unless ``repack``:
    its default): one batch, or in batches of ``n_batch`` (the stage's chunking, for MoE
    with K-quant experts)."""
    n = n_batch or max(len(ids), 1)
    return llama_logits(model, ids, n_batch=n, n_ctx=n_ctx, repack=repack)


def oracle_windows(
    model: Path, ids: Sequence[int], tokens: Sequence[int], windows: Sequence[int]
) -> npt.NDArray[np.float32]:
    """llama.cpp's logits at the positions after ``ids``'s last: the prompt in one batch,
    then ``tokens`` in calls of ``windows``' sizes in turn (``(1,)``: a plain generation)."""
    return llama_logits(
        model,
        [*ids, *tokens],
        n_batch=len(ids),
        n_ctx=N_CTX,
        repack=False,
        prefill=len(ids),
        steps=windows,
    )


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
    p.add_argument("--dtype", action="append", choices=synth.ALL_DTYPES)
    p.add_argument("--dir", type=Path, default=Path(".work") / "canary")
    args = p.parse_args(argv)
    spec = synth.family(args.family)
    for dtype in args.dtype or ():
        if dtype not in spec.dtypes:
            p.error(f"the {spec.name} model comes in {', '.join(spec.dtypes)}, not {dtype}")
    worst = 0.0
    for dtype in args.dtype or list(spec.dtypes):
        model, pkg = package_model(spec, dtype, args.dir)
        layers, trunk = spec.layer_count(), spec.dims().n_layers
        for n in (SHORT_PROMPT, LONG_PROMPT):
            ids = synth.long_prompt(n, vocab=spec.dims().vocab)
            ref = oracle(model, ids)
            for case in default_cases(layers, trunk):
                diff = max_difference(stage_logits(pkg, ids, case), ref)
                worst = max(worst, diff)
                print(f"{spec.name} {dtype} {n} ids, {case.name}: max |diff| {diff:.3g}")
    print(f"worst: {worst:.3g}")
    return 0 if worst == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
