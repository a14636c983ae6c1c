"""Run the certification canary's whole matrix and write its results (one JSON record a line).

    python scripts/canary_matrix.py --results /tmp/canary.jsonl [--dir .work/canary]
    python -m skippy.runtime.canary.models_doc /tmp/canary.jsonl > docs/models.md

The same records as ``SKIPPY_CANARY_RESULTS=... pytest
tests/skippy/runtime/canary/test_canary.py`` writes; exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    from skippy.runtime.canary.matrix import run_matrix, write_results
    from skippy.serving.replay import schedule

    p = argparse.ArgumentParser(
        prog="scripts/canary_matrix.py",
        description="the certification matrix: every claimed family x dtype against llama.cpp",
    )
    p.add_argument("--results", type=Path, required=True, help="JSON-lines file to write")
    p.add_argument("--dir", type=Path, default=Path(".work") / "canary", help="model cache")
    args = p.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    records = []
    for r in run_matrix(args.dir, replay=schedule):
        records.append(r)
        verdict = "ok" if r.passed else "FAIL"
        print(
            f"{r.family} {r.dtype} {r.check}: {verdict} max {r.max_diff:.3g} (bound {r.bound:.3g})"
        )
    write_results(args.results, records)
    return 0 if all(r.passed for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
