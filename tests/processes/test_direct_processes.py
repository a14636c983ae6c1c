"""Direct upgrades of relayed links with real ``mesh-node run`` processes in the NAT lab
(mesh_node/lab/netns.py): a relay on the public segment, two nodes that name it as their relay.
Where the network allows a direct connection (one home behind a full-cone NAT, one node on the
public segment, or two homes whose NATs drop unsolicited packets, where the two ends' dials
meet in a TCP simultaneous open) the link goes direct, keeps the relay as its fallback, and
outlives the relay; behind two masquerade NATs the upgrade fails, the relayed link stays and
works, and the failures are counted in the status. Needs root, ip and nft (required in CI, as
tests/mesh_node/lab/test_nat_lab.py); elsewhere skipped."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from natmarks import needs_lab
from test_mesh_processes import make_keys, status, wait_status
from test_relay_processes import RELAY_PORT, _start_in, link_to, write_config

from mesh_node.lab.netns import NatLab

NODE_PORT = 7401


def _how(doc: dict[str, Any], node_id: str) -> tuple[str, str | None] | None:
    link = link_to(doc, node_id)
    return None if link is None else (link["link"], link["fallback_relay"])


def _lab_pair(
    lab: NatLab, tmp_path: Path, hosts: tuple[str, str]
) -> tuple[dict[str, str], Any]:
    """The relay and two relayed nodes ``n1``, ``n2`` on ``hosts`` (a home or ``coord``,
    which listens on every address and so advertises none it can be dialled at)."""
    ids, _ = make_keys(tmp_path, ("relay", "n1", "n2"))
    relay_url = f"ws://{lab.hosts['relay'].address}:{RELAY_PORT}#{ids['relay']}"
    write_config(tmp_path / "relay.toml", "relay", f"0.0.0.0:{RELAY_PORT}", relays=[], relay=True)
    for name, host in zip(("n1", "n2"), hosts, strict=True):
        listen = "0.0.0.0" if host == "coord" else lab.hosts[host].address
        write_config(
            tmp_path / f"{name}.toml",
            name,
            f"{listen}:{NODE_PORT}",
            relays=[relay_url],
            relay=False,
            direct=True,
        )
    relay = _start_in(lab, "relay", tmp_path, "relay.toml")
    for name, host in zip(("n1", "n2"), hosts, strict=True):
        _start_in(lab, host, tmp_path, f"{name}.toml")
    return ids, relay


@needs_lab
@pytest.mark.parametrize(
    ("nat", "hosts"),
    [
        ({"home1": "full-cone"}, ("home1", "home2")),  # n2 dials n1's router: forwarded
        ({}, ("coord", "home2")),  # n1 is public: n2 dials it at the address the relay saw
        # both drop unsolicited packets: the two ends' dials meet (TCP simultaneous open)
        ({"home1": "stealth", "home2": "stealth"}, ("home1", "home2")),
    ],
    ids=["full-cone", "one-public", "stealth-both"],
)
def test_a_relayed_link_goes_direct_where_the_network_allows_and_outlives_the_relay(
    tmp_path: Path, nat: dict[str, str], hosts: tuple[str, str]
) -> None:
    with NatLab(f"dp{os.getpid() % 10000}", nat) as lab:
        ids, relay = _lab_pair(lab, tmp_path, hosts)
        upgraded = ("direct", ids["relay"])
        doc = wait_status(tmp_path, "n1.toml", lambda d: _how(d, ids["n2"]) == upgraded, 30)
        assert _how(doc, ids["n2"]) == upgraded, doc["peers"]
        doc2 = wait_status(tmp_path, "n2.toml", lambda d: _how(d, ids["n1"]) == upgraded, 30)
        assert _how(doc2, ids["n1"]) == upgraded, doc2["peers"]
        # n1 learnt its public address from the relay (the router's, or its own)
        public = "10.99.0.11" if hosts[0] == "home1" else lab.hosts["coord"].address
        assert doc["direct"]["observed"] == [public]
        assert doc["direct"]["offered"] == [f"{public}:{NODE_PORT}"]
        # each end moved its link to the direct one
        assert doc["direct"]["upgraded"] + doc2["direct"]["upgraded"] >= 2
        # The relay goes: the direct link stays, with no fallback left.
        relay.send_signal(signal.SIGKILL)
        relay.wait(20)
        doc = wait_status(tmp_path, "n1.toml", lambda d: _how(d, ids["n2"]) == ("direct", None), 30)
        assert _how(doc, ids["n2"]) == ("direct", None), doc["peers"]
        time.sleep(3)  # past peer_loss_timeout_s: the link is up, not merely not yet lost
        assert _how(status(tmp_path, "n2.toml"), ids["n1"]) == ("direct", None)


@needs_lab
def test_behind_two_masquerade_nats_the_upgrade_fails_and_the_relayed_link_stays(
    tmp_path: Path,
) -> None:
    with NatLab(f"dm{os.getpid() % 10000}") as lab:
        ids, _ = _lab_pair(lab, tmp_path, ("home1", "home2"))
        relay_id = ids["relay"]
        relayed = ("relayed", None)
        doc = wait_status(tmp_path, "n1.toml", lambda d: _how(d, ids["n2"]) == relayed, 30)
        assert _how(doc, ids["n2"]) == relayed, doc["peers"]
        # every try (UPGRADE_DELAYS_S: 0, 1, 3 s after the hello) failed; the link is relayed
        doc = wait_status(tmp_path, "n1.toml", lambda d: d["direct"]["failed"] >= 6, 30)
        assert doc["direct"]["failed"] >= 6 and doc["direct"]["upgraded"] == 0, doc["direct"]
        time.sleep(3)
        for name, other in (("n1", "n2"), ("n2", "n1")):
            doc = status(tmp_path, f"{name}.toml")
            link = link_to(doc, ids[other])
            assert link is not None and (link["link"], link["relay"]) == ("relayed", relay_id)
            assert doc["direct"]["upgraded"] == 0
