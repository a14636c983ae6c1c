"""`run`'s CPU threads: by default the stage runtime takes this machine's cores and gives
threads back while other processes keep them busy (the thread governor, as serving does);
``--threads N`` pins N; a count under 1 is a usage error. The engine's own contention
behaviour is measured by ``scripts/bench --only stage`` (the CLI's figure), not timed here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from pkgtools import make_package

from skippy.cli import main
from skippy.runtime.contention import machine_cores

pytestmark = pytest.mark.llama


@pytest.fixture(scope="module")
def pkg(synth_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("threads") / "pkg"
    make_package(synth_dir.llama, out)
    return out


def _run(pkg: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, Any]:
    rc = main(["run", str(pkg), "--prompt", "Ω Ω", "--max-tokens", "2", "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def test_default_is_adaptive_over_the_machine_cores(
    pkg: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out = _run(pkg, capsys)
    assert rc == 0, out
    assert out["engine"] == "ggml"
    assert out["adaptive_threads"] is True
    assert out["threads"] == machine_cores()


def test_threads_pins_the_count(pkg: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(pkg, capsys, "--threads", "1")
    assert rc == 0, out
    assert (out["threads"], out["adaptive_threads"]) == (1, False)


def test_threads_under_one_is_a_usage_error(
    pkg: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out = _run(pkg, capsys, "--threads", "0")
    assert rc == 2
    assert out["error"]["code"] == "invalid_threads"


def test_the_llama_engine_reports_fixed_threads(
    pkg: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out = _run(pkg, capsys, "--engine", "llama")
    assert rc == 0, out
    assert (out["threads"], out["adaptive_threads"]) == (machine_cores(), False)
