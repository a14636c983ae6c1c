"""A stage that cannot be brought up, with real processes on loopback: a permanent failure (a
model family the stage runtime refuses) fails the bring-up at once with the stage's code and
reason (the lab exits 1 with it; ``serve`` says ``failed`` in /health, its status and the 503's
body, and plans again only when a capable peer joins); a transient one (a stage's file missing
for a while) is retried until the split forms.

The refused family is a synthetic llama-shaped model written under the architecture name
``baichuan`` (tests/support/synth_gguf.py ``llama_like(arch=...)``), packaged with
``write-package``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import synth_gguf
from pkgtools import make_package
from servetools import Cluster, split_cluster, wait_ready

from skippy.serving.failures import classify_failure

MESH = [sys.executable, "-m", "mesh_node"]
CODE = "unsupported_architecture"


@pytest.fixture(scope="module")
def refused_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("baichuan")
    src = synth_gguf.llama_like(root / "baichuan.gguf", arch="baichuan")
    make_package(src, root / "pkg", model_id="acme/baichuan-GGUF:Q8_0")
    return root / "pkg"


@pytest.fixture(scope="module")
def odd_layer_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model the coordinator accepts (a covered family) whose last layer no stage runtime
    loads (an F16 norm): the failure happens on the worker that holds that layer."""
    root = tmp_path_factory.mktemp("odd")
    src = synth_gguf.llama_like(root / "odd.gguf", n_layers=4, f16_norm_layer=3)
    make_package(src, root / "pkg", model_id="acme/odd-GGUF:Q8_0")
    return root / "pkg"


ODD_CODE = "unsupported_tensor_type"
ODD_WORDS = "'blk.3.attn_norm.weight' has type F16"


@pytest.fixture
def llama_pkg(tmp_path: Path) -> Path:
    """A package of this test's own (the transient test moves one of its files)."""
    src = synth_gguf.llama_like(tmp_path / "llama.gguf", n_layers=4)
    make_package(src, tmp_path / "pkg")
    return tmp_path / "pkg"


def get(url: str, body: object = None) -> tuple[int, dict[str, str], Any]:
    """(status, headers, decoded JSON) of one request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, headers, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, headers, raw = e.code, dict(e.headers), e.read()
    return status, {k.lower(): v for k, v in headers.items()}, json.loads(raw)


def wait_serving(cluster: Cluster, state: str, timeout_s: float = 90.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        doc = cluster.status()
        if (doc.get("serving") or {}).get("state") == state:
            return doc
        time.sleep(0.2)
    raise AssertionError(f"serving never became {state}: {doc.get('serving')}")


# --- the pure decision ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "code",
    [
        CODE,  # the stage runtime does not run the family
        "unsupported_tensor_type",
        "gguf_bad_magic",  # the package's files are not what they claim
        "invalid_manifest",
        "artifact_sha256_mismatch",
        "missing_hyperparameter",
        "topology_does_not_fit",  # the plan does not fit the nodes' memory
    ],
)
def test_model_and_package_failures_are_permanent(code: str) -> None:
    assert classify_failure(code) == "permanent"


@pytest.mark.parametrize(
    "code",
    [
        "hub_unreachable",  # a fetch that failed
        "hub_download_failed",
        "link_closed",  # a peer lost
        "peer_unavailable",
        "io_error",
        "missing_artifact",
        "internal_error",
        "stage_failed",
        "a_code_from_a_newer_node",  # unknown: retried rather than given up on
        None,
    ],
)
def test_fetch_and_peer_failures_are_transient(code: str | None) -> None:
    assert classify_failure(code) == "transient"


# --- the lab --------------------------------------------------------------------------------------
def test_an_unsupported_family_fails_a_lab_bring_up_at_once_with_its_code(
    refused_pkg: Path,
) -> None:
    # Today's lab waited for its whole --timeout, then said split_not_ready.
    out = subprocess.run(
        [*MESH, "lab", "--nodes", "2", "--package", str(refused_pkg), "--prompt", "hi",
         "--timeout", "120", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr[-2000:])
    error = json.loads(out.stdout)["error"]
    assert error["code"] == CODE, error
    assert "'baichuan' is not supported" in error["message"]
    assert "--engine llama" in error["remediation"]
    assert "within 120 s" not in error["message"]


def test_a_lab_split_reports_a_stage_the_runtime_refused_as_failed(refused_pkg: Path) -> None:
    # The stage was fetched and verified, then its load refused: today's report said "ready,
    # accepted" and ok (the fetch's record was never told of the load's failure).
    out = subprocess.run(
        [*MESH, "lab", "--nodes", "2", "--package", str(refused_pkg), "--timeout", "120", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert out.returncode == 1 and not report["ok"], report["problems"]
    assert any(f"({CODE})" in p for p in report["problems"]), report["problems"]
    assert all(row["state"] != "ready" for row in report["nodes"] if row["role"] != "spare")


# --- serve ----------------------------------------------------------------------------------------
def test_serve_says_failed_with_the_stages_code_and_plans_again_when_a_peer_joins(
    odd_layer_pkg: Path, tmp_path: Path
) -> None:
    with split_cluster(tmp_path, odd_layer_pkg, workers=1, stages=2) as cluster:
        doc = wait_serving(cluster, "failed")
        serving = doc["serving"]
        assert serving["code"] == ODD_CODE and ODD_WORDS in serving["reason"]
        # the worker says why over the wire too, not only its code
        worker = next(p for p in cluster.procs if p.name == "w0").address.split("#")[1]
        deadline = time.monotonic() + 60
        while worker not in doc["topology"]["ready"]:
            assert time.monotonic() < deadline, doc["topology"]["ready"]
            time.sleep(0.2)
            doc = cluster.status()
        report = doc["topology"]["ready"][worker]
        assert report["state"] == "failed" and report["code"] == ODD_CODE
        assert ODD_WORDS in report["message"]

        status, headers, health = get(cluster.api.removesuffix("/v1") + "/health")
        assert status == 503 and health["status"] == "failed", health
        assert health["code"] == ODD_CODE and "retry-after" not in headers
        status, headers, body = get(cluster.api + "/completions", {"prompt": [1], "max_tokens": 1})
        assert status == 503 and body["error"]["code"] == ODD_CODE, body
        assert "retry-after" not in headers

        text = subprocess.run(
            [*MESH, "status", "--config", str(tmp_path / "coord.toml")],
            capture_output=True, text=True, timeout=60,
        )
        assert text.returncode == 0, text.stderr
        assert f"serving  tiny failed [{ODD_CODE}]: stage " in text.stdout, text.stdout
        assert "memory   1.0 GiB budget" in text.stdout, text.stdout

        # Nothing that could change has changed: the split is not planned again...
        failed_topology = doc["topology"]["topology_id"]
        time.sleep(2.0)  # ten heartbeat intervals of the coordinator's
        assert cluster.status()["topology"]["topology_id"] == failed_topology
        # ...until a capable peer joins: planned again (and failed again, for the same reason)
        cluster.add_worker("w1")
        deadline = time.monotonic() + 90
        while cluster.status()["topology"]["topology_id"] == failed_topology:
            assert time.monotonic() < deadline, "not planned again after a peer joined"
            time.sleep(0.2)
        again = wait_serving(cluster, "failed")["serving"]
        assert again["code"] == ODD_CODE


def test_a_transient_stage_failure_is_retried_until_the_split_forms(
    llama_pkg: Path, tmp_path: Path
) -> None:
    # The worker's stage (the last layers) cannot be read for a while: missing_artifact, a
    # failure that can go away. Today's coordinator never asked again.
    last = llama_pkg / "layers" / "layer-00003.gguf"
    away = tmp_path / "layer-00003.gguf.away"
    last.rename(away)
    with split_cluster(tmp_path, llama_pkg, workers=1, stages=2) as cluster:
        deadline = time.monotonic() + 90
        while True:  # the worker failed its stage (and is asked again after a backoff)
            stage = cluster.status("w0")["transfers"]["stage"] or {}
            if stage.get("state") == "failed":
                break
            assert time.monotonic() < deadline, stage
            time.sleep(0.1)
        assert stage["error"] == "missing_artifact", stage
        assert cluster.status()["serving"]["state"] != "failed"
        away.rename(last)
        wait_ready(cluster.api)
        log = cluster.proc("coord").log
        assert any("failed (missing_artifact): planning it again" in line for line in log)
