"""The recorded bench runs (docs/perf/runs.jsonl) and the charts drawn from them.

``scripts/bench --record`` appends one JSON object per run to the history: its date, the
machine, the sections, how many runs, a sentence on the conditions, and the table's rows
(model, measurement, value, note: the strings the bench prints). docs/performance.md shows the
current figures and links the charts; the history is the data behind both.

``python scripts/perf_history.py charts`` (and ``scripts/bench --charts``) redraws every chart
in ``CHARTS`` as docs/perf/<name>.png from the history. A chart plots, for each matching row
of each recorded run in order, the ratio the row's note starts with ("0.94 (0.87..1.10) x
llama.cpp ..."): its median as a point, its spread as a bar, the target as a line.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HISTORY = ROOT / "docs" / "perf" / "runs.jsonl"
CHART_DIR = ROOT / "docs" / "perf"

# "1.07 (0.85..3.81) x llama.cpp", "0.75x single", "0.813 (0.742..0.834)x coordinator-only"
_RATIO = re.compile(r"^\s*(?:ratio\s+)?([\d.]+)\s*(?:\(([\d.]+)\s*\.\.\s*([\d.]+)\))?\s*x")


@dataclass(frozen=True)
class Series:
    label: str
    measurement: str  # the row's measurement, exactly


@dataclass(frozen=True)
class Chart:
    name: str  # docs/perf/<name>.png
    title: str
    ylabel: str
    series: tuple[Series, ...]
    target: float | None = None
    lower_is_better: bool = False


CHARTS: tuple[Chart, ...] = (
    Chart(
        "stage-vs-llama",
        "gemma3-270m: our stage vs llama.cpp (same machine, same run)",
        "speed ratio (x llama.cpp)",
        (
            Series("decode", "decode: ggml stage 0..18"),
            Series("prefill 512", "prefill 512: ggml stage 0..18"),
            Series("prefill 128", "prefill 128: ggml stage 0..18"),
        ),
        target=0.9,
    ),
    Chart(
        "link",
        "256 MiB over one link: mesh vs raw WebSocket (same tuning)",
        "throughput ratio (x raw)",
        (
            Series(
                "stream, download", "download 256 MiB, mesh stream alone (Noise + mux, no files)"
            ),
            Series("stream, upload", "upload 256 MiB, mesh stream alone (Noise + mux, no files)"),
            Series(
                "verified, download",
                "download 256 MiB, verified peer transfer (two mesh-node processes)",
            ),
            Series(
                "verified, upload",
                "upload 256 MiB, verified peer transfer (two mesh-node processes)",
            ),
        ),
        target=0.6,
    ),
    Chart(
        "serve-split",
        "gemma3-270m served: 3-node loopback split vs one stage",
        "decode ratio (x one stage)",
        (Series("decode", "serve: decode tok/s, 3-node loopback split"),),
        target=0.85,
    ),
    Chart(
        "wan-decode",
        "3-stage lab split vs one stage over emulated WAN links",
        "decode ratio (x one stage)",
        tuple(
            Series(f"{ms} ms RTT", f"wan {ms} ms RTT: decode tok/s, 3-stage lab split / 1 stage")
            for ms in (0, 5, 20, 50)
        ),
    ),
    Chart(
        "swarm",
        "7 nodes, 2 replicas: every worker ready, swarm vs coordinator only",
        "time ratio (x coordinator only)",
        (Series("bring-up", "every worker ready, swarm"),),
        target=0.5,
        lower_is_better=True,
    ),
    Chart(
        "moe-vs-llama",
        "synthetic qwen3moe (8 layers, 32 experts, Q4_K): our stage vs llama.cpp",
        "speed ratio (x llama.cpp default)",
        (
            Series("decode", "decode: ggml stage 0..8"),
            Series("decode, repacked", "decode: ggml stage 0..8, repack = true"),
            Series("prefill 512", "prefill 512: ggml stage 0..8"),
        ),
        target=0.95,
    ),
)


def read_history(path: Path = HISTORY) -> list[dict[str, Any]]:
    """Every recorded run, oldest first; a line that is not a JSON object is an error."""
    runs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            run = json.loads(line)
            if not isinstance(run, dict) or not isinstance(run.get("rows", []), list):
                raise ValueError(f"{path}:{n}: not a recorded run")
            runs.append(run)
    return runs


def append_run(run: dict[str, Any], path: Path = HISTORY) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(run, ensure_ascii=False, sort_keys=True) + "\n")


def ratio(note: str) -> tuple[float, float, float] | None:
    """The ratio a row's note starts with: (median, min, max); None if it starts otherwise."""
    m = _RATIO.match(note)
    if m is None:
        return None
    med = float(m.group(1))
    lo = float(m.group(2)) if m.group(2) else med
    hi = float(m.group(3)) if m.group(3) else med
    return med, lo, hi


def points(
    runs: Iterable[dict[str, Any]], series: Series
) -> Iterator[tuple[int, str, tuple[float, float, float]]]:
    """(run index, date, ratio) for every row of ``series`` with a ratio in its note."""
    for i, run in enumerate(runs):
        for row in run.get("rows", []):
            if row.get("measurement") == series.measurement:
                r = ratio(str(row.get("note", "")))
                if r is not None:
                    yield i, str(run.get("date")), r


def draw(chart: Chart, runs: list[dict[str, Any]], out_dir: Path = CHART_DIR) -> Path | None:
    """Draw ``chart`` as a PNG; None when no recorded run has a point for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = [(s, list(points(runs, s))) for s in chart.series]
    if not any(p for _, p in found):
        return None
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=100)
    used = {i: d for _, pts in found for i, d, _ in pts}
    order = sorted(used)
    slot = {i: n for n, i in enumerate(order)}  # runs with a point, side by side
    width = 0.12
    for k, (s, pts) in enumerate(found):
        if not pts:
            continue
        shift = (k - (len(found) - 1) / 2) * width
        xs = [slot[i] + shift for i, _, _ in pts]
        med = [r[0] for _, _, r in pts]
        err = [[r[0] - r[1] for _, _, r in pts], [r[2] - r[0] for _, _, r in pts]]
        ax.errorbar(xs, med, yerr=err, fmt="o", capsize=2, markersize=4, label=s.label)
    if chart.target is not None:
        ax.axhline(chart.target, color="grey", linestyle="--", linewidth=1)
        ax.annotate(
            f"target {'<=' if chart.lower_is_better else '>='} {chart.target}",
            (0.995, chart.target),
            xycoords=("axes fraction", "data"),
            textcoords="offset points",
            xytext=(0, 3),
            ha="right",
            fontsize=8,
            color="grey",
        )
    ax.set_xticks(range(len(order)), [f"{used[i][5:]}\n#{i + 1}" for i in order], fontsize=7)
    ax.set_xlabel("recorded run (date, line of docs/perf/runs.jsonl)", fontsize=8)
    ax.set_ylabel(chart.ylabel, fontsize=8)
    ax.set_title(chart.title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    out = out_dir / f"{chart.name}.png"
    fig.savefig(out, metadata={"Software": None})
    plt.close(fig)
    return out


def draw_all(path: Path = HISTORY, out_dir: Path = CHART_DIR) -> list[Path]:
    runs = read_history(path)
    return [p for c in CHARTS if (p := draw(c, runs, out_dir)) is not None]


def main(argv: list[str]) -> int:
    if argv != ["charts"]:
        print("usage: perf_history.py charts", file=sys.stderr)
        return 2
    for p in draw_all():
        print(p.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
