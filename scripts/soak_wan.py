"""Soak over emulated WAN links: a 3-node lab split, every link at
50 ms RTT with 1 ms jitter (2%) and 0.1% connection loss per 64 KiB chunk relayed, watched for
MINUTES. Prints the coordinator's topology states (sampled once a second), the relay's event
counts and what the nodes logged: broken links, links back in time, peer losses, degraded.

    python scripts/soak_wan.py PACKAGE_DIR [MINUTES]
"""

from __future__ import annotations

import json
import sys

import trio

from mesh_node.lab.netem import LinkSpec, LinkTable
from mesh_node.lab.run import LabOptions, open_lab


async def soak(package: str, minutes: float) -> dict[str, object]:
    links = LinkTable(LinkSpec(rtt_s=0.05, jitter_s=0.001, loss=0.001))
    opts = LabOptions(nodes=3, package=package, transfer="open", links=links)
    async with open_lab(opts) as lab:
        report = await lab.split()
        assert lab.netem is not None
        states: dict[str, int] = {}
        deadline = trio.current_time() + minutes * 60
        while trio.current_time() < deadline:
            status = await lab.cluster.coordinator.status()
            state = status["topology"]["state"]
            states[state] = states.get(state, 0) + 1
            await trio.sleep(1.0)
        logs = [n.log_path.read_text() for n in lab.cluster.nodes]

        def count(text: str) -> int:
            return sum(log.count(text) for log in logs)

        return {
            "split_ok": report["ok"],
            "minutes": minutes,
            "topology_states": states,
            "relay": dict(lab.netem.counts),
            "links_broken": count("broke ("),
            "links_back_in_time": count("came back in time"),
            "peer_lost": count("peer_lost"),
            "degraded": count("degraded"),
            "lost_nodes": status["topology"]["lost_nodes"],
        }


if __name__ == "__main__":
    minutes = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    print(json.dumps(trio.run(soak, sys.argv[1], minutes)))
