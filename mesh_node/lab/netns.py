"""Real networks for labs and tests: network namespaces joined by veth pairs, home networks
behind kernel NAT (an nftables masquerade in a router namespace), a public segment and a LAN.

``NatLab`` builds, in namespaces it names and owns (a per-lab prefix, so two labs and the
host's own namespaces never meet):

::

    home1 (192.168.1.2) -- router1 [masquerade] 10.99.0.11 --+
    home2 (192.168.2.2) -- router2 [masquerade] 10.99.0.12 --+-- pub (bridge 10.99.0.0/24)
                                          relay 10.99.0.2 ---+
                                          coord 10.99.0.3 ---+
    lan1 (192.168.50.2) --- lan2 (192.168.50.3)                  (a LAN of its own)

A home host reaches the public segment through its router, which rewrites its source address
to the router's public one (the kernel's conntrack remembers the mapping, so answers come
back); nothing on the public segment can open a connection to a home host, and the two homes
cannot reach each other's private addresses: the situation of two nodes behind two NATs.

Each home's router is one of the ``NAT_KINDS`` (``NatLab(nat={"home1": "full-cone"})``):

- ``masquerade`` (the default): the bare Linux router. It keeps source ports where it can and
  answers an unsolicited connection with a reset (nothing listens on the router).
- ``stealth``: the same mapping, but unsolicited packets are dropped (a home router's
  firewall), so two homes dialling each other at once can meet (TCP simultaneous open).
- ``full-cone``: whatever arrives at the router's public address is forwarded to the home host
  (endpoint-independent mapping and filtering, as a DMZ host or a port forward): a home node is
  reachable at its router's address and its own port.

``NatLab(home_bytes_per_s=...)`` shapes each home's line (its router's two interfaces) to a
rate both ways, as a home's uplink and downlink: what a relayed and a direct link between
two homes then share is the line, not this machine's CPU.

``run(host, argv)`` starts a process inside a host's namespace (``ip netns exec``), and
``close()`` stops every process it started (by PID) and deletes every namespace it made, so
nothing outlives the lab; traffic never leaves those namespaces.

Needs root, ``ip`` (iproute2) and ``nft`` (nftables); ``missing()`` says what is absent. The
plan of commands (``plan``) is pure, so what the lab does can be read and tested without root.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, TypeVar

PUBLIC_NET: Final = "10.99.0"
ROUTER_PUBLIC: Final = {"router1": f"{PUBLIC_NET}.11", "router2": f"{PUBLIC_NET}.12"}
PUBLIC_HOSTS: Final = {"relay": f"{PUBLIC_NET}.2", "coord": f"{PUBLIC_NET}.3"}
HOMES: Final = {"home1": ("router1", "192.168.1"), "home2": ("router2", "192.168.2")}
LAN: Final = ("lan1", "lan2", "192.168.50")
NAT_KINDS: Final = ("masquerade", "stealth", "full-cone")
COMMAND_TIMEOUT_S: Final = 10.0
CLONE_NEWNET: Final = 0x40000000  # linux/sched.h: setns(2)'s network namespace type
T = TypeVar("T")
STOP_TIMEOUT_S: Final = 5.0


def missing() -> list[str]:
    """What this machine lacks for a NAT lab (empty when it can build one)."""
    out = []
    if os.geteuid() != 0:
        out.append("root (network namespaces and nftables need CAP_NET_ADMIN)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            out.append(f"the `{tool}` command (Debian package {package})")
    return out


@dataclass(frozen=True)
class Host:
    name: str  # the lab's name for it ("home1")
    netns: str  # the namespace's real name ("nl1234-home1")
    address: str  # the address its peers see it listen on


def plan(
    prefix: str, nat: Mapping[str, str] | None = None, home_bytes_per_s: int | None = None
) -> list[list[str]]:
    """Every command that builds the lab with namespaces named ``<prefix>-<host>``, each
    home's router of the kind ``nat`` names (``NAT_KINDS``; default masquerade), and with
    ``home_bytes_per_s`` each home's line shaped to that rate both ways (pure)."""
    nat = dict(nat or {})
    if home_bytes_per_s is not None and home_bytes_per_s <= 0:
        raise ValueError(f"NAT lab: a home line's rate must be positive, not {home_bytes_per_s}")
    for home, kind in nat.items():
        if home not in HOMES or kind not in NAT_KINDS:
            raise ValueError(
                f"NAT lab: {home!r}: {kind!r} (homes {sorted(HOMES)}, kinds {list(NAT_KINDS)})"
            )
    ns = {h: f"{prefix}-{h}" for h in ("pub", *PUBLIC_HOSTS, *ROUTER_PUBLIC, *HOMES, *LAN[:2])}
    cmds: list[list[str]] = [["ip", "netns", "add", n] for n in ns.values()]
    cmds += [["ip", "-n", n, "link", "set", "lo", "up"] for n in ns.values()]
    pub = ns["pub"]
    cmds += [
        ["ip", "-n", pub, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", pub, "link", "set", "br0", "up"],
    ]

    def veth(a: str, a_if: str, b: str, b_if: str) -> list[list[str]]:
        # created inside ``a``'s namespace, the peer end moved into ``b``'s: the host's own
        # namespace never holds either end
        return [
            ["ip", "-n", a, "link", "add", a_if, "type", "veth", "peer", "name", b_if, "netns", b],
            ["ip", "-n", a, "link", "set", a_if, "up"],
            ["ip", "-n", b, "link", "set", b_if, "up"],
        ]

    # the public segment: every public host and router on the bridge
    for i, (host, addr) in enumerate({**PUBLIC_HOSTS, **ROUTER_PUBLIC}.items()):
        port = f"p{i}"
        cmds += veth(pub, port, ns[host], "wan0")
        cmds += [
            ["ip", "-n", pub, "link", "set", port, "master", "br0"],
            ["ip", "-n", ns[host], "addr", "add", f"{addr}/24", "dev", "wan0"],
        ]
    # the homes: a host behind its router, which masquerades what leaves by wan0
    for home, (router, net) in HOMES.items():
        r, h = ns[router], ns[home]
        cmds += veth(r, "lan0", h, "eth0")
        cmds += [
            ["ip", "-n", r, "addr", "add", f"{net}.1/24", "dev", "lan0"],
            ["ip", "-n", h, "addr", "add", f"{net}.2/24", "dev", "eth0"],
            ["ip", "-n", h, "route", "add", "default", "via", f"{net}.1"],
            ["ip", "netns", "exec", r, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
            ["ip", "netns", "exec", r, "nft", "add", "table", "ip", "nat"],
            [
                "ip", "netns", "exec", r, "nft",
                "add chain ip nat post { type nat hook postrouting priority 100 ; }",
            ],
            ["ip", "netns", "exec", r, "nft", 'add rule ip nat post oifname "wan0" masquerade'],
        ]  # fmt: skip
        if home_bytes_per_s is not None:  # the home's line: its uplink and its downlink
            cmds += [shaped(r, dev, home_bytes_per_s) for dev in ("wan0", "lan0")]
        kind = nat.get(home, "masquerade")
        if kind == "stealth":  # new connections to the router itself: dropped, not reset
            cmds += [
                ["ip", "netns", "exec", r, "nft", "add", "table", "ip", "filter"],
                [
                    "ip", "netns", "exec", r, "nft",
                    "add chain ip filter input { type filter hook input priority 0 ; }",
                ],
                [
                    "ip", "netns", "exec", r, "nft",
                    'add rule ip filter input iifname "wan0" ct state new drop',
                ],
            ]  # fmt: skip
        elif kind == "full-cone":  # every new inbound connection goes to the home host
            cmds += [
                [
                    "ip", "netns", "exec", r, "nft",
                    "add chain ip nat pre { type nat hook prerouting priority -100 ; }",
                ],
                [
                    "ip", "netns", "exec", r, "nft",
                    f'add rule ip nat pre iifname "wan0" dnat to {net}.2',
                ],
            ]  # fmt: skip
    # the LAN: two hosts on one segment, nobody else
    a, b, net = LAN
    cmds += veth(ns[a], "eth0", ns[b], "eth0")
    cmds += [
        ["ip", "-n", ns[a], "addr", "add", f"{net}.2/24", "dev", "eth0"],
        ["ip", "-n", ns[b], "addr", "add", f"{net}.3/24", "dev", "eth0"],
        # no default route on the LAN (it reaches nothing else), so multicast (mDNS) is routed
        # to its one link explicitly
        ["ip", "-n", ns[a], "route", "add", "224.0.0.0/4", "dev", "eth0"],
        ["ip", "-n", ns[b], "route", "add", "224.0.0.0/4", "dev", "eth0"],
    ]
    return cmds


def shaped(netns: str, dev: str, bytes_per_s: int) -> list[str]:
    """What leaves ``dev`` in ``netns`` paced to ``bytes_per_s`` (a token bucket: the kernel's
    ``tbf``; its bucket holds 10 ms of the rate, at least 64 KiB, and a packet waits at most
    100 ms before it is dropped, as a line's buffer would)."""
    burst = max(64 * 1024, bytes_per_s // 100)
    return [
        "ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
        "rate", f"{bytes_per_s * 8}bit", "burst", str(burst), "latency", "100ms",
    ]  # fmt: skip


@dataclass
class NatLab:
    """A built lab (see the module doc); use as a context manager."""

    prefix: str = field(default_factory=lambda: f"nl{os.getpid()}")
    nat: Mapping[str, str] = field(default_factory=dict)  # home -> one of NAT_KINDS
    home_bytes_per_s: int | None = None  # each home's line, both ways (None: unshaped)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    made: list[str] = field(default_factory=list)

    @property
    def hosts(self) -> dict[str, Host]:
        out = {h: Host(h, f"{self.prefix}-{h}", a) for h, a in PUBLIC_HOSTS.items()}
        out |= {h: Host(h, f"{self.prefix}-{h}", f"{net}.2") for h, (_, net) in HOMES.items()}
        a, b, net = LAN
        out[a] = Host(a, f"{self.prefix}-{a}", f"{net}.2")
        out[b] = Host(b, f"{self.prefix}-{b}", f"{net}.3")
        return out

    def public_address(self, home: str) -> str:
        """The address a home host's connections appear to come from (its router's)."""
        return ROUTER_PUBLIC[HOMES[home][0]]

    def build(self) -> NatLab:
        lacking = missing()
        if lacking:
            raise RuntimeError("cannot build a NAT lab here: needs " + "; ".join(lacking))
        try:
            for cmd in plan(self.prefix, self.nat, self.home_bytes_per_s):
                if cmd[:3] == ["ip", "netns", "add"]:
                    self.made.append(cmd[3])
                _run(cmd)
        except BaseException:
            self.close()
            raise
        return self

    def run(self, host: str, argv: Sequence[str], **popen: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``host``'s namespace; ``close`` stops it (by PID)."""
        proc = subprocess.Popen(  # type: ignore[call-overload]
            ["ip", "netns", "exec", self.hosts[host].netns, *argv], **popen
        )
        self.procs.append(proc)
        return proc  # type: ignore[no-any-return]

    def exec(self, host: str, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S) -> str:
        """Run ``argv`` inside ``host``'s namespace to its end; its stdout (raises on failure)."""
        return _run(["ip", "netns", "exec", self.hosts[host].netns, *argv], timeout)

    def call_in(self, host: str, fn: Callable[[], T]) -> T:
        """``fn()`` with this thread inside ``host``'s network namespace (its sockets are
        made there: the lab process's HTTP client reaching a node's loopback API), then back
        in the namespace the thread had."""
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target = os.open(f"/var/run/netns/{self.hosts[host].netns}", os.O_RDONLY)
            try:
                if libc.setns(target, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {host}'s namespace")
            finally:
                os.close(target)
            try:
                return fn()
            finally:
                if libc.setns(own, CLONE_NEWNET) != 0:  # a thread left elsewhere must not run on
                    os.abort()
        finally:
            os.close(own)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(STOP_TIMEOUT_S)
        self.procs.clear()
        for name in reversed(self.made):
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                _run(["ip", "netns", "del", name])
        self.made.clear()

    def __enter__(self) -> NatLab:
        return self.build()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run(cmd: Sequence[str], timeout: float = COMMAND_TIMEOUT_S) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)
    return proc.stdout


@contextlib.contextmanager
def nat_lab(prefix: str | None = None, nat: Mapping[str, str] | None = None) -> Iterator[NatLab]:
    lab = NatLab(prefix, dict(nat or {})) if prefix else NatLab(nat=dict(nat or {}))
    with lab:
        yield lab
