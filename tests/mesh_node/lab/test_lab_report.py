"""The lab report's accounting (``mesh_node.lab.report``, pure, from status documents shaped
as the nodes send them): peer bytes that crossed the links but were not kept (a transfer a
dropped link cut short, then fetched whole from the hub), and, with replicas, whose stage
each worker holds and which replica served the prompt. The wiring runs in a real lab:
``test_a_replica_lab_says_whose_stage_each_worker_holds_and_who_served``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mesh_node.lab.report import (
    NodeFacts,
    build_report,
    render_report,
    replica_of,
    serving_replica,
)
from mesh_node.serving.completion_report import render_prompt_report

COORD, W1, W2 = "c" * 64, "a" * 64, "b" * 64
LAYER = "layers/layer-00001.gguf"
LAYER_BYTES = 3_158_784


def _status(
    node_id: str, *, source: str, fallback: str | None, peer_fetched: int
) -> dict[str, Any]:
    """A worker's status document after its stage: the layer arrived from ``source``; its
    counter of bytes written from peers (every attempt) is ``peer_fetched``."""
    return {
        "node_id": node_id,
        "transfers": {
            "stage": {
                "topology_id": "t1",
                "state": "ready",
                "report": "accepted",
                "required": [LAYER],
                "error": None,
            },
            "recent": [
                {"direction": "fetch", "path": LAYER, "source": source, "total": LAYER_BYTES,
                 "bytes_done": LAYER_BYTES, "verified": True, "fallback": fallback},
                {"direction": "fetch", "path": "model-package.json", "source": "peer",
                 "total": 4000, "bytes_done": 4000, "verified": True, "fallback": None},
            ],
            "counters": {
                "served_bytes": 0,
                "refusals": {},
                "fetched_bytes": {"peer": peer_fetched, "hub": 0, "cache": 0},
            },
        },
    }


def _coordinator() -> NodeFacts:
    status = {"node_id": COORD, "transfers": {"stage": None, "recent": [], "counters": {}}}
    return NodeFacts(0, COORD, "coordinator", "primary", "o" * 64, None, status)


def _worker(index: int, node_id: str, status: dict[str, Any], **kw: Any) -> NodeFacts:
    stage = {"node_id": node_id, "stage_index": 1, "layer_start": 1, "layer_end": 2}
    return NodeFacts(index, node_id, "worker", "primary", "o" * 64, stage, status, **kw)


def _report(*workers: NodeFacts, replicas: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    topology = {"topology_id": "t1", "stages": []}
    doc = build_report(
        package_ref="hf://lab/tiny@1", transfer="trusted", foreign_owners=0,
        topology=topology, nodes=[_coordinator(), *workers], seconds=2.0,
    )
    if replicas is not None:
        doc["replicas"] = replicas
    return doc


def test_peer_bytes_that_crossed_but_were_not_kept_are_reported_beside_the_kept_ones() -> None:
    # The layer's peer transfer was cut twice (link loss) after 70 MB in all; the hub then
    # sent it whole. The manifest (4,000 bytes) came from the peer and was kept.
    cut = _status(W1, source="hub", fallback="link_closed", peer_fetched=70_004_000)
    doc = _report(_worker(1, W1, cut))
    (row,) = [r for r in doc["nodes"] if r["role"] == "worker"]
    assert row["bytes"] == {"peer": 4000, "hub": LAYER_BYTES, "cache": 0}
    assert row["peer_bytes_received"] == 70_004_000
    assert doc["totals"]["peer_bytes"] == 4000
    assert doc["totals"]["peer_bytes_discarded"] == 70_000_000
    text = render_report(doc)
    assert "workers received: peer 4.0 KB, hub 3.2 MB" in text
    assert "and 70.0 MB from peers that were not kept" in text


def test_a_second_split_counts_only_its_own_peer_bytes() -> None:
    # The counter is cumulative since the node started; the lab marks it when a split is
    # sent (``peer_bytes_before``), so a revision's split does not count the first one's.
    kept = _status(W1, source="peer", fallback=None, peer_fetched=10_000_000 + LAYER_BYTES + 4000)
    doc = _report(_worker(1, W1, kept, peer_bytes_before=10_000_000))
    assert doc["totals"]["peer_bytes"] == LAYER_BYTES + 4000
    assert doc["totals"]["peer_bytes_discarded"] == 0
    assert "not kept" not in render_report(doc)


REPLICAS = [
    {"replica": 0, "state": "ready", "nodes": [COORD, W2], "requests_total": 1},
    {"replica": 1, "state": "ready", "nodes": [COORD, W1], "requests_total": 0},
]


def test_replica_rows_say_whose_stage_each_worker_holds() -> None:
    assert [replica_of(n, REPLICAS) for n in (COORD, W1, W2, "d" * 64)] == [None, 1, 0, None]
    s1 = _status(W1, source="peer", fallback=None, peer_fetched=LAYER_BYTES + 4000)
    s2 = _status(W2, source="peer", fallback=None, peer_fetched=LAYER_BYTES + 4000)
    doc = _report(
        _worker(1, W1, s1, replica=replica_of(W1, REPLICAS)),
        _worker(2, W2, s2, replica=replica_of(W2, REPLICAS)),
        replicas=REPLICAS,
    )
    assert {r["node_id"]: r["replica"] for r in doc["nodes"]} == {COORD: None, W1: 1, W2: 0}
    head, *rows = render_report(doc).splitlines()[2:6]
    assert head.split()[:5] == ["node", "role", "owner", "replica", "stage"]
    cells = {r.split()[0]: r.split()[3] for r in rows}
    assert cells == {COORD[:12]: "all", W1[:12]: "1", W2[:12]: "0"}  # stage 0 is everyone's


def test_the_replica_that_took_the_request_is_named() -> None:
    before = [{"replica": 0, "requests_total": 0}, {"replica": 1, "requests_total": 0}]
    after = [{"replica": 0, "requests_total": 0}, {"replica": 1, "requests_total": 1}]
    assert serving_replica(before, after) == 1
    # replayed on a second replica: not one answer
    both = [{"replica": 0, "requests_total": 1}, {"replica": 1, "requests_total": 1}]
    assert serving_replica(before, both) is None
    prompt = {
        "text": " x", "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 1,
        "prefill_tokens_per_s": None, "decode_tokens_per_s": None,
        "time_to_first_token_s": 0.1, "replica": 1,
        "nodes": [
            {"node_id": COORD, "stage_index": 0, "layer_start": 0, "layer_end": 1,
             "artifact_bytes": 0, "peak_rss_bytes": 0, "replica": None},
            {"node_id": W2, "stage_index": 1, "layer_start": 1, "layer_end": 2,
             "artifact_bytes": 0, "peak_rss_bytes": 0, "replica": 0},
            {"node_id": W1, "stage_index": 1, "layer_start": 1, "layer_end": 2,
             "artifact_bytes": 0, "peak_rss_bytes": 0, "replica": 1},
        ],
    }
    text = render_prompt_report(prompt)
    assert "replica  1 served this completion" in text
    assert f"stage 1 (replica 1): layers 1..2 on {W1[:12]}" in text


@pytest.mark.slow
def test_a_replica_lab_says_whose_stage_each_worker_holds_and_who_served(
    gemma_package: Path,
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mesh_node", "lab", "--nodes", "3", "--replicas", "2",
         "--stages", "2", "--package", str(gemma_package), "--prompt",
         "The capital of France is", "--max-tokens", "2", "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert "Traceback" not in out.stderr, out.stderr
    doc = json.loads(out.stdout)
    assert out.returncode == 0 and doc["ok"], doc.get("problems") or doc
    replicas = {r["replica"]: r["nodes"][1:] for r in doc["replicas"]}
    workers = {n["node_id"]: n["replica"] for n in doc["nodes"] if n["role"] == "worker"}
    assert workers == {replicas[0][0]: 0, replicas[1][0]: 1}
    assert [n["replica"] for n in doc["nodes"] if n["role"] == "coordinator"] == [None]
    prompt = doc["prompt"]
    assert prompt["replica"] in (0, 1)
    rows = {n["node_id"]: n["replica"] for n in prompt["nodes"] if n["stage_index"] == 1}
    assert rows == workers
