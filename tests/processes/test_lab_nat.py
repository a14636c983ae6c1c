"""``mesh-node lab --nat``: the lab's 3 nodes in the NAT lab (mesh_node/lab/netns.py), the
coordinator public and relaying, the two workers in two homes. The split serves a greedy
completion; the report says where each node ran, the public address each observed, and how
each pair was linked: behind two masquerade NATs the workers' link stays relayed, with home1
behind a full-cone NAT it goes direct (the coordinator kept as its fallback relay), and both
splits generate the same tokens. Nothing of the labs' networks is left afterwards. Usage errors are
refused before anything is built. Needs root, ip and nft (required in CI)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from natmarks import needs_lab
from pkgtools import make_package
from test_lab_processes import MESH, lab_cli, worker_rows

from mesh_node.lab.netns import ROUTER_PUBLIC

PROMPT = "a a a"  # words of the synthetic vocabulary
RATE = ("--home-rate", "100Mbit")


@pytest.fixture(scope="module")
def tiny_nat_package(synth_dir, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    pkg = tmp_path_factory.mktemp("lab-nat") / "tiny-layers"
    make_package(synth_dir.gemma, pkg)
    return pkg


def _links(report: dict[str, Any]) -> dict[tuple[str, str], tuple[str, str | None, str | None]]:
    return {
        (x["a"], x["b"]): (x["link"], x["relay"], x["fallback_relay"])
        for x in report["nat"]["links"]
    }


@needs_lab
@pytest.mark.llama
def test_the_nat_lab_serves_alike_through_the_relay_and_direct_and_reports_the_links(
    tiny_nat_package: Path,
) -> None:
    pytest.importorskip("llama_cpp", reason="the stage runtime's libggml comes with llama-cpp")
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    texts = []
    cases = (("", ("relayed", "n0", None), ()), ("full-cone", ("direct", None, "n0"), RATE))
    for kinds, workers, shaped in cases:
        code, report = lab_cli(
            "--nodes", "3", "--package", str(tiny_nat_package), "--nat", kinds,
            "--prompt", PROMPT, "--max-tokens", "8", *shaped,
        )  # fmt: skip
        assert code == 0, report
        # the second lab's homes are on 100 Mbit/s lines (shaping: tests/mesh_node/lab)
        assert report["nat"]["home_rate_bytes_per_s"] == (12_500_000 if shaped else None)
        assert all(r["state"] == "ready" for r in worker_rows(report))
        nat = report["nat"]
        assert nat["kinds"] == {"home1": kinds or "masquerade", "home2": "masquerade"}
        nodes = {n["name"]: n for n in nat["nodes"]}
        assert nodes["n1"]["netns"].endswith("-home1") and nodes["n2"]["netns"].endswith("-home2")
        # the workers learnt their routers' public addresses from the coordinator
        assert nodes["n1"]["observed"] == [ROUTER_PUBLIC["router1"]]
        assert nodes["n2"]["observed"] == [ROUTER_PUBLIC["router2"]]
        links = _links(report)
        assert links[("n0", "n1")][0] == links[("n0", "n2")][0] == "direct"
        assert links[("n1", "n2")] == workers
        assert report["prompt"]["completion_tokens"] == 8, report["prompt"]
        texts.append(report["prompt"]["text"])
    # greedy through a relayed hop or a direct one: the same tokens
    assert texts[0] == texts[1]
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert after == before  # every namespace of the labs removed


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--nodes", "4", "--nat"), "3 nodes"),
        (("--nodes", "3", "--nat", "symmetric"), "kinds"),
        (("--nodes", "3", "--nat", "stealth", "--serve"), "--serve"),
        (("--nodes", "3", "--home-rate", "100Mbit"), "needs --nat"),
        (("--nodes", "3", "--nat", "--home-rate", "fast"), "--home-rate"),
    ],
)
def test_nat_lab_usage_errors_are_refused_with_exit_2(
    tmp_path: Path, args: tuple[str, ...], words: str
) -> None:
    out = subprocess.run(
        [*MESH, "lab", "--package", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert words in out.stderr and "Traceback" not in out.stderr
