"""The bench's recorded history (docs/perf/runs.jsonl) and the charts docs/performance.md
shows: every line is a run the charts can read, every chart the page links exists and is drawn
from the history by scripts/perf_history.py, and the page stays a page (under 400 lines)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts import perf_history as ph

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "performance.md"


def test_every_recorded_run_is_readable() -> None:
    runs = ph.read_history()
    assert len(runs) >= 50
    for run in runs:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(run["date"])), run.get("title")
        for row in run["rows"]:
            assert set(row) == {"model", "measurement", "value", "note"}


def test_the_page_links_every_chart_and_each_exists() -> None:
    linked = set(re.findall(r"\]\(perf/([\w-]+)\.png\)", PAGE.read_text()))
    assert linked == {c.name for c in ph.CHARTS}
    for name in linked:
        assert (ROOT / "docs" / "perf" / f"{name}.png").stat().st_size > 0


def test_every_chart_has_points_in_the_history() -> None:
    runs = ph.read_history()
    for chart in ph.CHARTS:
        assert any(list(ph.points(runs, s)) for s in chart.series), chart.name


@pytest.mark.parametrize(
    ("note", "want"),
    [
        ("1.07 (0.85..3.81) x llama.cpp (target >= 0.9; met)", (1.07, 0.85, 3.81)),
        ("0.75x single (target >= 0.85x)", (0.75, 0.75, 0.75)),
        ("0.813 (0.742..0.834)x coordinator-only (goal <= 0.5)", (0.813, 0.742, 0.834)),
        ("ratio 1.59; 1.38 (target <= 1.0)", None),  # no "x": not a ratio this reads
        ("target <= 200 MiB", None),
    ],
)
def test_ratio_reads_the_notes_the_bench_writes(
    note: str, want: tuple[float, float, float] | None
) -> None:
    assert ph.ratio(note) == want


def test_a_recorded_run_is_drawn(tmp_path: Path) -> None:
    history = tmp_path / "runs.jsonl"
    row = {"model": "m", "measurement": "decode: ggml stage 0..18", "value": "1 tok/s"}
    for note in ("0.91 (0.80..1.00) x llama.cpp", "1.02 (0.95..1.10) x llama.cpp"):
        ph.append_run(
            {"date": "2026-12-07", "title": "t", "notes": [], "rows": [row | {"note": note}]},
            history,
        )
    drawn = ph.draw_all(history, tmp_path)
    assert drawn == [tmp_path / "stage-vs-llama.png"]  # the only chart with points
    assert drawn[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_page_is_read_in_minutes() -> None:
    assert len(PAGE.read_text().splitlines()) < 400
