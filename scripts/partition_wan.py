"""A 5 s partition of one worker during a completion: a 3-node lab
serving PACKAGE over 20 ms RTT links (default timeouts: heartbeat 1 s, peer loss 10 s), one
undisturbed greedy completion, then the same completion while worker n2 is blackholed for
5 s. Prints whether the text is identical, whether the topology stayed the same and active
(no failover), and the relay's counts.

    python scripts/partition_wan.py PACKAGE_DIR [SECONDS]
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import trio
from bench_serve import _complete  # type: ignore[import-not-found]

from mesh_node.lab.netem import LinkSpec, LinkTable
from mesh_node.lab.run import LabOptions, open_lab

PROMPT, TOKENS = "Once upon a time", 48


async def run(package: str, seconds: float) -> dict[str, Any]:
    opts = LabOptions(
        nodes=3,
        package=package,
        transfer="open",
        links=LinkTable(LinkSpec(rtt_s=0.02)),
        serve=True,
        node_config={
            "heartbeat_interval_s": 1.0,
            "peer_loss_timeout_s": 10.0,
            "idle_timeout_s": 30.0,
            "handshake_timeout_s": 5.0,
        },
    )
    async with open_lab(opts) as lab:
        assert lab.netem is not None
        netem = lab.netem
        api, topology, _ = await lab.start_serving()
        base = await trio.to_thread.run_sync(_complete, api, PROMPT, TOKENS)

        async def cut() -> None:
            await trio.sleep(1.0)
            netem.partition("n2")
            await trio.sleep(seconds)
            netem.heal("n2")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cut)
            t0 = time.monotonic()
            got = await trio.to_thread.run_sync(_complete, api, PROMPT, TOKENS)
            wall = time.monotonic() - t0
        status = await lab.cluster.coordinator.status()
        return {
            "partition_s": seconds,
            "same_text": got["choices"][0]["text"] == base["choices"][0]["text"],
            "wall_s": round(wall, 2),
            "same_topology": status["topology"]["topology_id"] == topology["topology_id"],
            "topology_state": status["topology"]["state"],
            "lost_nodes": status["topology"]["lost_nodes"],
            "serving_state": status["serving"]["state"],
            "relay": dict(netem.counts),
        }


if __name__ == "__main__":
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    print(json.dumps(trio.run(run, sys.argv[1], seconds)))
