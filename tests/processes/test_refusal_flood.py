"""A hostile link's refused requests stay cheap and quiet, with real ``mesh-node run``
processes (``mesh_node.lab``: a coordinator and a worker of one owner, a lab hub): the
coordinator serves artifacts to trusted peers only; a certificate-less stranger
(tests/support/hostile_peer.py) floods it with requests on each artifact kind (0x03 artifact, 0x04
source list, 0x05 sibling topology); then the worker's stage moves from the coordinator as
usual.

Counted, not timed: how many of the stranger's requests the coordinator answered (each one
read, decided and answered: work), how many it refused at the open (``rate_limited``: no
task, no read), and how many log lines name the stranger."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import trio
from test_lab_processes import fetches, options, propose, tiny_package, worker_stage

from mesh_node.identity import write_private_key
from mesh_node.lab.run import open_lab
from mesh_node.request_gate import REFUSALS_BURST, REFUSALS_PER_S

__all__ = ["tiny_package"]  # a module fixture, shared

HOSTILE = str(Path(__file__).resolve().parents[1] / "support" / "hostile_peer.py")
PER_KIND = 600  # requests per kind
KINDS = ("0x03", "0x04", "0x05")
IN_FLIGHT = 32  # streams one link may have open at once (Limits.max_streams_per_link)


async def test_a_hostile_links_refused_requests_are_bounded_and_quiet(tiny_package, tmp_path):
    opts = dataclasses.replace(options(tiny_package, tmp_path), transfer="trusted")
    async with open_lab(opts) as lab:
        coordinator = lab.cluster.coordinator
        assert coordinator.url is not None
        key = tmp_path / "stranger.key"
        stranger = write_private_key(key).public_key().public_bytes_raw().hex()
        began = trio.current_time()
        hostile = await trio.run_process(
            [sys.executable, HOSTILE, "requests", str(key), coordinator.url, str(PER_KIND)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        lifetime_s = trio.current_time() - began  # the stranger's whole life, start-up included
        out = hostile.stdout.decode()
        assert hostile.returncode == 0, hostile.stderr.decode()[-3000:]
        results = {}
        for line in out.splitlines():
            m = re.fullmatch(r"result (0x0\d) answered=(\d+) limited=(\d+) other=(\d+)", line)
            if m:
                results[m[1]] = (int(m[2]), int(m[3]), int(m[4]))
        assert set(results) == set(KINDS), out
        # Per kind, answered (read, decided, answered) at most the burst, the refill over the
        # stranger's lifetime and the streams in flight; the rest refused at the open.
        most = REFUSALS_BURST + REFUSALS_PER_S * lifetime_s + IN_FLIGHT
        for kind, (answered, limited, other) in results.items():
            assert answered + limited + other == PER_KIND, (kind, results)
            assert answered <= most < PER_KIND, (kind, results, lifetime_s)
            assert limited >= PER_KIND - most, (kind, results)

        # The log: the first refusal of each kind, then summaries; never a line per refusal.
        text = coordinator.log_path.read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if stranger[:12] in ln and "refused" in ln]
        assert 0 < len(lines) <= len(KINDS) + 2, lines[:10]

        # The honest worker's requests are still served: its stage comes from the peer.
        topology = await propose(lab)
        status = await worker_stage(lab, topology["topology_id"], ("ready",))
        peer = [r for r in fetches(status) if r["source"] == "peer"]
        assert peer and all(r["error"] is None for r in peer), fetches(status)
