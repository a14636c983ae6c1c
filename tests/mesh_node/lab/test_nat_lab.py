"""The NAT lab (mesh_node/lab/netns.py): real network namespaces, veth pairs and an nftables
masquerade per home router, built and torn down by the test. A home host's connection reaches
the public segment with its router's address as its source (kernel NAT), nothing public can
open a connection to a home host, the homes cannot reach each other, the LAN is a segment of
its own, and nothing of the lab is left after it closes. Needs root, ip and nft: in CI they
are required (scripts/test installs nftables), elsewhere the test is skipped with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from natmarks import needs_lab

from mesh_node.lab.netns import NatLab, plan

# A one-connection TCP server: answers each client with the address it saw, then exits.
SERVER = (
    "import socket, sys\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(); s.settimeout(20)\n"
    "print('ready', flush=True)\n"
    "c, a = s.accept(); c.sendall(a[0].encode()); c.close()\n"
)
CLIENT = (
    "import socket, sys\n"
    "c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))\n"
    "print(c.recv(64).decode())\n"
)


def test_the_plan_touches_only_the_labs_namespaces() -> None:
    for cmd in plan("nlx"):
        assert cmd[0] == "ip", cmd
        if cmd[1] == "netns":
            assert cmd[3].startswith("nlx-"), cmd  # add / exec NAME
        else:
            assert cmd[1] == "-n" and cmd[2].startswith("nlx-"), cmd


def _serve(lab: NatLab, host: str, port: int) -> subprocess.Popen[bytes]:
    proc = lab.run(host, [sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


def _connect(lab: NatLab, host: str, address: str, port: int, timeout: float = 2.0) -> str:
    return lab.exec(host, [sys.executable, "-c", CLIENT, address, str(port), str(timeout)]).strip()


@needs_lab
def test_homes_behind_nat_reach_the_public_segment_and_nothing_reaches_them() -> None:
    with NatLab(f"nt{os.getpid()}") as lab:
        relay = lab.hosts["relay"].address
        _serve(lab, "relay", 7000)
        # the relay sees the router's public address, not the home's private one
        assert _connect(lab, "home1", relay, 7000) == lab.public_address("home1")
        _serve(lab, "relay", 7001)
        assert _connect(lab, "home2", relay, 7001) == lab.public_address("home2")
        # nothing public opens a connection to a home; the homes do not see each other
        _serve(lab, "home1", 7002)
        for src, dst in (("relay", "home1"), ("home2", "home1")):
            with pytest.raises(subprocess.CalledProcessError):
                _connect(lab, src, lab.hosts[dst].address, 7002, timeout=1.0)
        # the LAN is a segment of its own: its hosts meet each other, not the public one
        _serve(lab, "lan2", 7003)
        assert _connect(lab, "lan1", lab.hosts["lan2"].address, 7003) == lab.hosts["lan1"].address
        with pytest.raises(subprocess.CalledProcessError):
            _connect(lab, "lan1", relay, 7000, timeout=1.0)
        names = [h.netns for h in lab.hosts.values()]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)


@needs_lab
def test_close_stops_the_labs_processes() -> None:
    lab = NatLab(f"nc{os.getpid()}").build()
    try:
        proc = lab.run("coord", [sys.executable, "-c", "import time; time.sleep(60)"])
        time.sleep(0.2)
        assert proc.poll() is None
    finally:
        lab.close()
    assert proc.poll() is not None


def test_the_nat_kinds_add_their_rules_to_their_router_only() -> None:
    cmds = [" ".join(c) for c in plan("nlx", {"home1": "full-cone", "home2": "stealth"})]
    dnat = [c for c in cmds if "dnat to" in c]
    drop = [c for c in cmds if "ct state new drop" in c]
    assert len(dnat) == 1 and "nlx-router1" in dnat[0] and "192.168.1.2" in dnat[0]
    assert len(drop) == 1 and "nlx-router2" in drop[0]
    plain = [" ".join(c) for c in plan("nlx")]
    assert not any("dnat to" in c or "drop" in c for c in plain)
    with pytest.raises(ValueError, match="kinds"):
        plan("nlx", {"home1": "symmetric"})
    with pytest.raises(ValueError, match="homes"):
        plan("nlx", {"home3": "stealth"})


def test_a_home_line_is_shaped_on_its_routers_two_interfaces_only() -> None:
    cmds = [c for c in plan("nlx", home_bytes_per_s=12_500_000) if "tbf" in c]
    assert sorted((c[3], c[8]) for c in cmds) == [
        ("nlx-router1", "lan0"), ("nlx-router1", "wan0"),
        ("nlx-router2", "lan0"), ("nlx-router2", "wan0"),
    ]  # fmt: skip
    assert all(c[c.index("rate") + 1] == "100000000bit" for c in cmds)
    assert not any("tc" in c for c in plan("nlx"))
    with pytest.raises(ValueError, match="positive"):
        plan("nlx", home_bytes_per_s=0)


UPLOAD = (
    "import socket, sys, time\n"
    "c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)\n"
    "t = time.monotonic(); c.sendall(bytes(int(sys.argv[3]))); c.shutdown(socket.SHUT_WR)\n"
    "c.recv(1); print(time.monotonic() - t)\n"
)
SINK = (
    "import socket, sys\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen(); s.settimeout(30)\n"
    "print('ready', flush=True)\n"
    "c, a = s.accept()\n"
    "while c.recv(1 << 16): pass\n"
    "c.sendall(b'k'); c.close()\n"
)


@needs_lab
def test_a_shaped_home_line_carries_no_more_than_its_rate() -> None:
    """2 MB up a 1 MB/s line take at least ~1.9 s (the bucket's 64 KiB go at once); the
    queue is the kernel's token bucket on the router, and the other home is left alone."""
    with NatLab(f"ns{os.getpid()}", home_bytes_per_s=1_000_000) as lab:
        router = f"{lab.prefix}-router1"
        shown = subprocess.run(
            ["ip", "netns", "exec", router, "tc", "qdisc", "show", "dev", "wan0"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout  # fmt: skip
        assert "tbf" in shown and "8Mbit" in shown, shown
        sink = lab.run("relay", [sys.executable, "-c", SINK, "7020"], stdout=subprocess.PIPE)
        assert sink.stdout is not None and sink.stdout.readline().strip() == b"ready"
        relay = lab.hosts["relay"].address
        took = float(lab.exec("home1", [sys.executable, "-c", UPLOAD, relay, "7020", "2000000"]))
        assert took >= 1.9, took


@needs_lab
def test_a_full_cone_home_is_reachable_at_its_routers_address_and_a_stealth_one_is_not() -> None:
    with NatLab(f"nk{os.getpid()}", {"home1": "full-cone", "home2": "stealth"}) as lab:
        _serve(lab, "home1", 7010)
        # forwarded as it came: the home host sees the dialler's own address
        got = _connect(lab, "relay", lab.public_address("home1"), 7010)
        assert got == lab.hosts["relay"].address
        _serve(lab, "home2", 7011)
        with pytest.raises(subprocess.CalledProcessError):
            _connect(lab, "relay", lab.public_address("home2"), 7011, timeout=1.0)
        # the lab process itself, one thread inside a host's namespace
        _serve(lab, "relay", 7012)

        def ask() -> str:
            import socket

            with socket.create_connection((lab.hosts["relay"].address, 7012), timeout=5) as c:
                return c.recv(64).decode()

        assert lab.call_in("coord", ask) == lab.hosts["coord"].address
        with pytest.raises(OSError):  # and back outside afterwards
            ask()


def test_the_report_names_the_homes_line_rate_when_shaped() -> None:
    from mesh_node.lab.report import render_nat

    nat: dict[str, object] = {
        "kinds": {"home1": "full-cone", "home2": "masquerade"},
        "home_rate_bytes_per_s": 12_500_000,
        "nodes": [],
        "links": [],
    }
    head = render_nat(nat)[0]
    assert head == (
        "NAT lab (home1 full-cone, home2 masquerade; each home's line 100 Mbit/s both ways)"
    )
    assert render_nat({**nat, "home_rate_bytes_per_s": None})[0] == (
        "NAT lab (home1 full-cone, home2 masquerade)"
    )
