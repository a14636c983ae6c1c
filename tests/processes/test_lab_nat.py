"""``mesh-node lab --nat``: the lab's 3 nodes in the NAT lab (mesh_node/lab/netns.py), the
coordinator public and relaying, the two workers in two homes. The split completes with every
worker's part from the coordinator; the report says where each node ran, the public address
each observed, and how each pair was linked (with home1 behind a full-cone NAT the workers'
relayed link went direct, the coordinator kept as its fallback relay; behind two masquerade
NATs it stayed relayed). Nothing of the lab's networks is left afterwards. Usage errors are
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
@pytest.mark.parametrize(
    ("kinds", "workers"),
    [
        ("full-cone", ("direct", None, "n0")),
        ("", ("relayed", "n0", None)),
    ],
    ids=["full-cone", "masquerade"],
)
def test_the_nat_lab_splits_and_reports_how_its_nodes_are_linked(
    tiny_nat_package: Path, kinds: str, workers: tuple[str, str | None, str | None]
) -> None:
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    code, report = lab_cli("--nodes", "3", "--package", str(tiny_nat_package), "--nat", kinds)
    assert code == 0, report
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
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert after == before  # every namespace of the lab removed


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--nodes", "4", "--nat"), "3 nodes"),
        (("--nodes", "3", "--nat", "symmetric"), "kinds"),
        (("--nodes", "3", "--nat", "stealth", "--serve"), "--serve"),
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
