"""The certification canary: every family the stage runtime claims x F32/F16/Q8_0/Q4_K against
llama.cpp (``skippy.runtime.canary.matrix``), and docs/models.md generated from its results.

The families come from the runtime's registry when the tests are collected: a family another
change registers joins the matrix with no edit here. Each (family, dtype) row is computed once
per session and cached; the checks (matrix's module doc) are asserted per row. With
``SKIPPY_CANARY_RESULTS=path`` the session's records are also written there, one JSON object a
line, for ``python -m skippy.runtime.canary.models_doc``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

from skippy.runtime.canary import check, matrix, models_doc, synth
from skippy.serving.replay import schedule

pytestmark = pytest.mark.llama

ROOT = Path(__file__).resolve().parents[4]
RESULTS_ENV = "SKIPPY_CANARY_RESULTS"
FAMILIES = [s.name for s in matrix.claimed()]
# (family, dtype): every dtype a family's model comes in (synth.DTYPES and the family's own)
ROWS = [(f, d) for f in FAMILIES for d in synth.family(f).dtypes]


class Rows:
    """The matrix's rows, each certified on first use and kept for the session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[tuple[str, str], list[matrix.Record]] = {}

    def row(self, family: str, dtype: str) -> list[matrix.Record]:
        key = (family, dtype)
        if key not in self.done:
            self.done[key] = matrix.certify(synth.family(family), dtype, self.root, replay=schedule)
        return self.done[key]

    def all(self) -> list[matrix.Record]:
        return [r for f, d in ROWS for r in self.row(f, d)]


@pytest.fixture(scope="session")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rows]:
    out = Rows(tmp_path_factory.mktemp("canary"))
    yield out
    path = os.environ.get(RESULTS_ENV)
    if path:
        ordered = [r for f, d in ROWS for r in out.done.get((f, d), [])]
        matrix.write_results(Path(path), ordered)


def test_the_layouts_cut_inside_the_trunk_and_keep_nextn_layers_with_the_final_stage() -> None:
    assert check.layouts(4) == [
        ("0..4",),
        ("0..1", "1..2", "2..4"),
        ("0..1", "1..2", "2..3", "3..4"),
    ]
    # glm4moe's canary model: 4 trunk layers, then its NextN layer
    spec = synth.family("glm4moe")
    assert (spec.layer_count(), spec.dims().n_layers) == (5, 4)
    assert check.layouts(5, 4) == [
        ("0..5",),
        ("0..1", "1..2", "2..5"),
        ("0..1", "1..2", "2..3", "3..5"),
    ]


def test_the_matrix_covers_every_registered_family() -> None:
    """Every synthetic family the registry accepts is a row; the five the runtime shipped with
    are among them (a registry that silently lost one would shrink the matrix)."""
    from skippy.runtime.families import FAMILIES as REGISTRY

    assert {"llama", "qwen2", "qwen3", "gemma3", "qwen3moe"} <= set(FAMILIES)
    assert {synth.family(f).arch_name for f in FAMILIES} <= set(REGISTRY)


@pytest.mark.parametrize(("family", "dtype"), ROWS, ids=[f"{f}-{d}" for f, d in ROWS])
def test_family_equals_llama_cpp(rows: Rows, family: str, dtype: str) -> None:
    """Logits bit-identical to llama.cpp over every layout, chunking and prompt (MoE x K-quant
    in chunks under 8 rows: within llama.cpp's own chunking difference), greedy tokens equal
    llama.cpp's; on Q4_K also the split set, failover replay, batched decode and exact verify."""
    records = rows.row(family, dtype)
    checks = {r.check for r in records}
    assert {"logits", "greedy"} <= checks
    if dtype == matrix.HEAVY_DTYPE:
        assert {"split_set", "failover", "batch", "verify", "verify_batched"} <= checks
    failed = [r for r in records if not r.passed]
    assert not failed, [(r.check, r.max_diff, r.bound, r.cases) for r in failed]
    for r in records:
        if r.check in ("logits", "greedy", "split_set", "failover", "batch", "verify"):
            assert r.bound == 0.0 and r.max_diff == 0.0, r


def test_models_md_is_generated_from_this_runs_results(rows: Rows, tmp_path: Path) -> None:
    """docs/models.md equals the generator's output on the whole matrix's records of this
    session (the generator run as users run it, from a results file): a family registered or
    a number changed without regenerating the page fails here."""
    results = tmp_path / "results.jsonl"
    matrix.write_results(results, rows.all())
    done = subprocess.run(
        [sys.executable, "-m", "skippy.runtime.canary.models_doc", str(results)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    page = (ROOT / "docs" / "models.md").read_text()
    assert done.stdout == page, (
        "docs/models.md is stale: run SKIPPY_CANARY_RESULTS=/tmp/r.jsonl pytest tests/"
        "test_canary.py, then python -m skippy.runtime.canary.models_doc /tmp/r.jsonl > "
        "docs/models.md"
    )
    assert models_doc.render(matrix.read_results(results)) == page
    for family in FAMILIES:
        assert f"| {family} | `{synth.family(family).arch_name}` |" in page


def test_the_page_shows_a_failed_check_and_a_registered_family_without_results() -> None:
    """A record that failed renders as FAILED in its family's row, never as exact; a claimed
    family absent from the results is listed as missing rather than dropped."""
    base = matrix.Record(
        family="llama", arch="llama", moe=False, dtype="F16", check="logits", passed=True,
        max_diff=0.0, bound=0.0, reason=matrix.EXACT_REASON, cases="x",
    )  # fmt: skip
    bad = matrix.Record(**{**base.__dict__, "dtype": "Q8_0", "passed": False, "max_diff": 0.5})
    page = models_doc.render([base, bad])
    row = next(line for line in page.splitlines() if line.startswith("| llama |"))
    assert "logits (F16/Q8_0): FAILED" in row and "exact" not in row
    for family in FAMILIES:
        if family != "llama":
            assert f"| {family} | " in page and "missing from these results" in page


def test_the_generator_refuses_unreadable_results_with_usage_status(tmp_path: Path) -> None:
    garbage = tmp_path / "results.jsonl"
    garbage.write_text('{"family": "llama"}\n')
    for path in (tmp_path / "absent.jsonl", garbage):
        done = subprocess.run(
            [sys.executable, "-m", "skippy.runtime.canary.models_doc", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2 and done.stdout == ""
        assert "cannot read canary results" in done.stderr and "Traceback" not in done.stderr
