"""The certification matrix: every family the stage runtime claims x every synthetic dtype
(``synth.DTYPES``, and a family's own: gpt-oss's MXFP4 experts).

A family is claimed when the runtime's registry accepts its synthetic model's metadata
(``skippy.runtime.families.spec_from_metadata``): families other helpers register join the
matrix with no change here, and a synthetic family the runtime refuses is reported as not
supported, with the runtime's own reason. Each (family, dtype) row runs ``check``'s functions
and yields one ``Record`` per check: the check's name, pass or fail, the largest difference
seen, the bound it was held to and why.

Checks (``check``'s module doc has the layouts and chunk sizes):
- ``logits``: every position's logits over 1 stage, 3 stages and one stage per layer, a 12- and
  a 320-token prompt, prefill chunks of 512, 128 and 7, bit-identical to llama.cpp's one
  batch (MoE with K-quant experts: to llama.cpp run in the same batches, chunks of 8+ rows).
- ``logits_small_chunks`` (MoE x K-quant only): chunks under 8 rows against llama.cpp's one
  batch, measured and reported, not claimed (``MOE_KQUANT_REASON``).
- ``greedy``: 16 greedy tokens after each prompt (3 stages) equal llama.cpp's greedy tokens.
- on ``HEAVY_DTYPE`` only: ``split_set`` (the package's fragments load in llama.cpp as one
  split set and give the original's logits), ``failover`` (a fresh chain replaying the
  committed tokens continues bit for bit), ``batch`` (sessions decoded in one batch equal
  each alone), ``verify`` (exact speculative verify windows equal the plain run's logits);
  ``verify_batched`` is measured against llama.cpp decoding the same windows and reported,
  not claimed (``BATCHED_VERIFY_REASON``).

``python scripts/canary_matrix.py --results FILE`` runs the whole matrix and writes one
JSON record per line; ``skippy.runtime.canary.models_doc`` renders docs/models.md from it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from skippy.runtime.canary import check, synth

HEAVY_DTYPE: Final = "Q4_K"  # failover / batch / verify / split set run on this dtype only
GREEDY_TOKENS: Final = 16
FAILOVER_CUT: Final = 6  # the chain is lost after this many generated tokens
VERIFY_WINDOWS: Final = (1, 3, 7, 2, 5)  # draft windows of up to 7 rows (+ the pending token)
BATCH_FEED: Final = (12, 90, 44, 8, 61)
EXACT_REASON: Final = "bit-identical: the same ggml kernels on the same bytes"
KQUANT_TILE_ROWS: Final = 8  # ggml's tiled K-quant kernel in mul_mat_id needs this many
MOE_KQUANT_REASON: Final = (
    "ggml's CPU backend multiplies K-quant experts with its tiled kernel only when an expert "
    "gets 8 or more tokens of a batch, with plain dot products otherwise, and the two round "
    "differently; in chunks under 8 rows neither our runtime nor llama.cpp matches llama.cpp's "
    "one batch, and they do not match each other either (our short chunks compute at least 8 "
    "rows, and the padding rows route to experts too): measured, not claimed (llama.cpp's own "
    "run in those chunks is as far from its one batch: phimoe 1.07 against our 1.08)"
)
BATCHED_VERIFY_REASON: Final = (
    "measured, not claimed: batched verify windows (one multi-row graph per stage after a "
    "prefill) are not bit-identical to llama.cpp decoding the same windows for K-quant "
    "weights; generation verifies exactly (one-position steps) by default"
)
JSONValue = Any


@dataclass(frozen=True)
class Record:
    """One check of one (family, dtype) row, as written to the results file."""

    family: str
    arch: str
    moe: bool
    dtype: str
    check: str
    passed: bool
    max_diff: float
    bound: float
    reason: str
    cases: str  # what ran: layouts, chunks, prompts

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> Record:
        return cls(**json.loads(line))


def refusal(spec: synth.FamilySpec) -> str | None:
    """None when the stage runtime's registry accepts the family's synthetic model, else the
    runtime's own reason (its ``StageUnsupported`` message)."""
    from skippy.constants import KEY_ARCHITECTURE
    from skippy.runtime.boundary import StageUnsupported
    from skippy.runtime.families import spec_from_metadata

    kv = dict(synth.model_metadata(spec, spec.dims(), "F16"))
    kv[KEY_ARCHITECTURE] = spec.arch_name
    try:
        spec_from_metadata(kv)
    except StageUnsupported as e:
        return str(e)
    return None


def claimed() -> list[synth.FamilySpec]:
    """The synthetic families the stage runtime claims (in ``synth.FAMILIES`` order)."""
    return [s for s in synth.FAMILIES if refusal(s) is None]


def _moe_kquant(spec: synth.FamilySpec, dtype: str) -> bool:
    return spec.moe is not None and dtype == "Q4_K"


def certify(
    spec: synth.FamilySpec, dtype: str, root: Path, *, replay: check.ReplaySchedule
) -> list[Record]:
    """Every check of the (family, dtype) row; the model and its package are made under
    ``root`` (reused when present). ``replay``: serving's replay schedule
    (``skippy.serving.replay.schedule``), which the failover check follows."""
    model, pkg = check.package_model(spec, dtype, root)
    d = spec.dims()
    layers, vocab = spec.layer_count(), d.vocab
    prompts = [synth.long_prompt(n, vocab=vocab) for n in (check.SHORT_PROMPT, check.LONG_PROMPT)]
    cases = check.default_cases(layers, d.n_layers)
    three = check.Case(check.layouts(layers, d.n_layers)[1], 128)

    def rec(name: str, diff: float, bound: float, reason: str, ran: str) -> Record:
        return Record(
            family=spec.name,
            arch=spec.arch_name,
            moe=spec.moe is not None,
            dtype=dtype,
            check=name,
            passed=diff <= bound,
            max_diff=diff,
            bound=bound,
            reason=reason,
            cases=ran,
        )

    out: list[Record] = []
    layouts_ran = (
        f"{len(cases)} layout x chunk cases (1 stage, 3 stages, one per layer; chunks "
        f"{'/'.join(map(str, check.CHUNKS))}) x prompts of {check.SHORT_PROMPT} and "
        f"{check.LONG_PROMPT} tokens"
    )
    kq = _moe_kquant(spec, dtype)
    exact = small = 0.0
    for ids in prompts:
        ref = check.oracle(model, ids)
        for case in cases:
            got = check.stage_logits(pkg, ids, case)
            if not kq:
                exact = max(exact, check.max_difference(got, ref))
            elif case.n_batch >= KQUANT_TILE_ROWS:
                same = check.oracle(model, ids, n_batch=case.n_batch)
                exact = max(exact, check.max_difference(got, same))
            else:
                small = max(small, check.max_difference(got, ref))
    if kq:
        big = [c for c in check.CHUNKS if c >= KQUANT_TILE_ROWS]
        out.append(
            rec(
                "logits",
                exact,
                0.0,
                EXACT_REASON + " (llama.cpp run in the same batches)",
                layouts_ran + f", chunks {'/'.join(map(str, big))}",
            )
        )
        out.append(
            rec(
                "logits_small_chunks",
                small,
                float("inf"),
                MOE_KQUANT_REASON,
                layouts_ran + f", chunks under {KQUANT_TILE_ROWS}, against llama.cpp's one batch",
            )
        )
    else:
        out.append(rec("logits", exact, 0.0, EXACT_REASON, layouts_ran))

    mismatched = 0
    for ids in prompts:
        ours = check.stage_greedy(pkg, ids, GREEDY_TOKENS, three)
        theirs = check.oracle_greedy(model, ids, GREEDY_TOKENS, n_batch=three.n_batch)
        mismatched += sum(a != b for a, b in zip(ours, theirs, strict=True))
    out.append(
        rec(
            "greedy",
            float(mismatched),
            0.0,
            "greedy tokens equal llama.cpp's (max_diff: tokens that differ)",
            f"{GREEDY_TOKENS} tokens after each prompt, {three.name}",
        )
    )
    if dtype != HEAVY_DTYPE:
        return out

    long_ids = prompts[1]
    split = check.max_difference(
        check.split_set_logits(pkg, long_ids, layers), check.oracle(model, long_ids)
    )
    out.append(
        rec(
            "split_set",
            split,
            0.0,
            "llama.cpp loads the fragments as one split set "
            "and gives the original file's logits bit for bit",
            f"{len(long_ids)}-token prompt, one batch",
        )
    )
    fail = check.failover_difference(
        pkg, long_ids, GREEDY_TOKENS, three, cut=FAILOVER_CUT, schedule=replay
    )
    out.append(
        rec(
            "failover",
            fail,
            0.0,
            "a replay recomputes the same calls in the same "
            "shapes (skippy.serving.replay.schedule), so it reaches the same state",
            f"chain lost after {FAILOVER_CUT} of {GREEDY_TOKENS} tokens, {three.name}",
        )
    )
    batch_prompts = [long_ids[:12], long_ids[40:45], long_ids[100:130]]
    batch = check.batch_difference(pkg, batch_prompts, BATCH_FEED, three)
    out.append(
        rec(
            "batch",
            batch,
            0.0,
            "each session's rows of a batched decode are its own decode's bit for bit",
            f"{len(batch_prompts)} sessions x {len(BATCH_FEED)} steps, {three.name}",
        )
    )
    verify = check.verify_difference(
        pkg, long_ids, GREEDY_TOKENS, three, windows=VERIFY_WINDOWS, exact=True
    )
    windows = f"windows {'/'.join(map(str, VERIFY_WINDOWS))}, {three.name}"
    out.append(
        rec(
            "verify",
            verify,
            0.0,
            "exact verify (one-position steps) gives the plain decode's logits bit for bit",
            windows,
        )
    )
    batched = check.verify_windows(pkg, long_ids, GREEDY_TOKENS, three, windows=VERIFY_WINDOWS)
    tokens = check.oracle_greedy(model, long_ids, GREEDY_TOKENS, n_batch=three.n_batch)
    llama_rows = check.oracle_windows(model, long_ids, tokens[:-1], VERIFY_WINDOWS)
    out.append(
        rec(
            "verify_batched",
            check.max_difference(batched, llama_rows[1:]),
            float("inf"),
            BATCHED_VERIFY_REASON,
            windows,
        )
    )
    return out


def run_matrix(
    root: Path, *, replay: check.ReplaySchedule, families: Sequence[synth.FamilySpec] | None = None
) -> Iterator[Record]:
    """Every claimed family (or ``families``) x every dtype it comes in, record by record."""
    for spec in claimed() if families is None else families:
        for dtype in spec.dtypes:
            yield from certify(spec, dtype, root, replay=replay)


def write_results(path: Path, records: Sequence[Record]) -> None:
    """The records, one JSON object a line, written atomically."""
    from skippy.atomic import atomic_write_bytes

    atomic_write_bytes(path, "".join(r.to_json() + "\n" for r in records).encode())


def read_results(path: Path) -> list[Record]:
    return [Record.from_json(line) for line in path.read_text().splitlines() if line.strip()]
