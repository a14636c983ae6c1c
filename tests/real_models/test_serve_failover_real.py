"""Exact failover on the real gemma3-270m with real processes: a 3-stage
split (`mesh-node serve` + 2 `mesh-node run` workers, 2 spares), a 120-token greedy completion
of "Once upon a time", streamed; SIGKILL of the middle stage's node at one point and of the
final stage's node at another: both completions are exactly the undisturbed text. (The
batched-prefill replay this replaces diverged from token 22-64 in 5 of 5 such runs.) More
kill points run in `scripts/bench --only soak`; the property over every kill point is
tests/mesh_node/serving/test_serve_failover.py on a synthetic model."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
pytest.importorskip("openai", reason="the openai client is a dev dependency")

import openai
from servetools import split_cluster, wait_ready

pytestmark = [pytest.mark.llama, pytest.mark.slow]
PROMPT = "Once upon a time"
N = 120


def test_killing_the_middle_or_final_stage_mid_stream_keeps_the_text(
    gemma_package: Path, tmp_path: Path
) -> None:
    pkg = gemma_package
    with split_cluster(tmp_path, pkg, workers=2, stages=3, spares=2, n_ctx=512) as cluster:
        wait_ready(cluster.api, 240)
        client = openai.OpenAI(base_url=cluster.api, api_key="unused", max_retries=0, timeout=300)
        undisturbed = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=N, temperature=0
        )
        want = undisturbed.choices[0].text
        assert undisturbed.usage is not None and undisturbed.usage.completion_tokens == N
        for stage, at in ((1, 37), (2, 64)):
            topo = cluster.status()["topology"]
            victim = cluster.proc_of(topo["stages"][stage]["node_id"])
            pieces: list[str] = []
            stream = client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=N, temperature=0, stream=True
            )
            for chunk in stream:
                pieces.append(chunk.choices[0].text)
                if len(pieces) == at:
                    os.kill(victim.popen.pid, signal.SIGKILL)
            assert "".join(pieces) == want, f"kill of stage {stage} at token {at}"
            after = cluster.status()
            assert after["topology"]["stages"][stage]["node_id"] != victim.address.split("#")[1]
        assert after["serving"]["failovers_total"] >= 2
