"""``mesh_node.metrics``: the event counters other components call, and the families read
from the status document (parsed back with prometheus_client's own text parser)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import trio
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from mesh_node.metrics import (
    RATE_WINDOW_S,
    SectionCollector,
    ServingMetrics,
    TransferDurations,
    node_registry,
    topology_families,
    transfer_families,
)
from mesh_node.transfer.records import TransferLog

REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def samples(metrics: Collector, doc: dict) -> dict[tuple[str, tuple], float]:
    """``/metrics`` of a node whose status is ``doc``, with the topology and transfer
    services' collectors over its sections, and ``metrics``."""
    sections = [
        SectionCollector(lambda: doc.get("topology"), topology_families),
        SectionCollector(lambda: doc.get("transfers") or {}, transfer_families),
    ]
    text = generate_latest(node_registry(lambda: doc, [*sections, metrics])).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


QUIET_DOC = {
    "node_id": "ab" * 32,
    "uptime_s": 12.5,
    "owner_id": None,
    "owner_status": "unverified",
    "memory_budget": 1 << 30,
    "artifact_transfer": "disabled",
    "peers": [],
    "topology": None,
}


def test_request_outcomes_tokens_ttft_and_rate():
    clock = Clock()
    m = ServingMetrics(clock)
    with m.request(prompt_tokens=5) as req:
        assert m.serving_status()["requests_in_flight"] == 1
        clock.now += 0.3
        req.tokens()  # the first token: time to first token 0.3 s
        clock.now += 0.1
        req.tokens(9)
    with pytest.raises(ValueError), m.request(prompt_tokens=2):
        raise ValueError("the split failed")
    with m.request() as req:
        req.outcome = "rejected"  # e.g. 429: the queue is full

    async def cancelled() -> None:
        with trio.move_on_after(0), m.request(prompt_tokens=1):
            await trio.sleep(1)

    trio.run(cancelled)
    status = m.serving_status()
    assert status["requests"] == {"ok": 1, "error": 1, "cancelled": 1, "rejected": 1}
    assert status["requests_in_flight"] == 0
    assert (status["prompt_tokens"], status["completion_tokens"]) == (8, 10)
    assert status["ttft_ms_median"] == pytest.approx(300.0)
    assert status["tokens_per_s"] == pytest.approx(10 / RATE_WINDOW_S)
    clock.now += RATE_WINDOW_S + 1
    assert m.serving_status()["tokens_per_s"] == 0  # the window moved past those tokens
    got = samples(m, QUIET_DOC)
    assert got[("mesh_node_requests_total", (("outcome", "cancelled"),))] == 1
    assert got[("mesh_node_time_to_first_token_seconds_count", ())] == 1
    assert got[("mesh_node_time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 0
    assert got[("mesh_node_time_to_first_token_seconds_bucket", (("le", "0.5"),))] == 1
    assert got[("mesh_node_request_duration_seconds_count", ())] == 4


def test_transfer_durations_are_observed_as_the_transfer_log_finishes_them():
    m = TransferDurations()
    log = TransferLog(on_finish=m.transfer_finished)
    fetched = log.start("fetch", "layers/layer-00000.gguf", total=10, source="peer")
    log.finish(fetched, verified=True)
    failed = log.start("fetch", "layers/layer-00001.gguf", total=10, source="hub")
    log.finish(failed, verified=False, error="artifact_sha256_mismatch")
    log.found_in_cache("shared/metadata.gguf", 5)  # nothing moved: not a transfer
    served = log.start("serve", "layers/layer-00002.gguf", total=10, peer_id="ab" * 32)
    log.finish(served, verified=True)
    got = samples(m, QUIET_DOC)
    name = "mesh_node_artifact_transfer_duration_seconds_count"
    assert got[(name, (("direction", "fetch"),))] == 1
    assert got[(name, (("direction", "serve"),))] == 1


def test_transfer_families_read_the_documents_counters_with_bounded_labels():
    log = TransferLog()
    log.counters.served_bytes = 300
    log.counters.fetched_bytes.update({"peer": 200, "cache": 7})
    log.counters.verification_failures = 2
    log.counters.refusals.update({"not_in_stage": 1, **{f"made-up-{i}": 1 for i in range(100)}})
    log.counters.refusals_received.update({"artifact unavailable": 3})
    log.start("fetch", "layers/layer-00003.gguf", total=10, source="peer")
    got = samples(ServingMetrics(), {**QUIET_DOC, "transfers": log.status()})
    assert got[("mesh_node_artifact_served_bytes_total", ())] == 300
    assert got[("mesh_node_artifact_fetched_bytes_total", (("source", "peer"),))] == 200
    assert got[("mesh_node_artifact_fetched_bytes_total", (("source", "hub"),))] == 0
    assert got[("mesh_node_artifact_verification_failures_total", ())] == 2
    refusals = {
        k[1][0][1]: v
        for k, v in got.items()
        if k[0] == "mesh_node_artifact_transfer_refusals_total"
    }
    assert refusals["not_in_stage"] == 1 and refusals["other"] == 100  # no label explosion
    assert len(refusals) < 40
    answer = (("answer", "artifact unavailable"),)
    assert got[("mesh_node_artifact_refusals_received_total", answer)] == 3
    assert got[("mesh_node_artifact_transfers_in_progress", (("direction", "fetch"),))] == 1
    assert got[("mesh_node_stage_ready", ())] == 0


def test_state_families_follow_the_document():
    peer = {
        "node_id": "cd" * 32,
        "connected": True,
        "trusted": False,
        "owner_status": "verified",
        "bytes_received": 1234,
        "bytes_sent": 99,
        "rtt_ms": 2.5,
    }
    stages = [{"ready": True}, {"ready": None}, {"ready": False}]
    doc = {
        **QUIET_DOC,
        "peers": [peer],
        "topology": {
            "topology_id": "t1",
            "role": "worker",
            "state": "active",
            "stage_status": stages,
        },
        "transfers": {"active": [{"direction": "fetch"}, {"direction": "serve"}]},
    }
    got = samples(ServingMetrics(), doc)
    key = (("connected", "true"), ("owner_status", "verified"), ("trust", "untrusted"))
    assert got[("mesh_node_peers", key)] == 1
    assert got[("mesh_node_link_received_bytes_total", (("peer", "cd" * 32),))] == 1234
    assert got[("mesh_node_peer_rtt_seconds", (("peer", "cd" * 32),))] == 0.0025
    assert got[("mesh_node_topology_stages", ())] == 3
    assert got[("mesh_node_topology_stages_ready", ())] == 1  # unknown is not ready
    assert got[("mesh_node_artifact_transfers_in_progress", (("direction", "serve"),))] == 1
    topo = (("role", "worker"), ("state", "active"), ("topology_id", "t1"))
    assert got[("mesh_node_topology_info", topo)] == 1
    assert got[("mesh_node_uptime_seconds", ())] == 12.5


def test_the_page_assets_ship_in_the_wheel(tmp_path):
    """The page works offline from an installed package: its assets are package data."""
    src = tmp_path / "src"
    for name in ("pyproject.toml", "README.md"):
        (src / name).parent.mkdir(exist_ok=True)
        (src / name).write_bytes((REPO / name).read_bytes())
    for package in ("skippy", "mesh_node", "protocol"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    static = REPO / "mesh_node" / "http" / "static"
    for asset in static.iterdir():
        assert f"mesh_node/http/static/{asset.name}" in names, asset.name
