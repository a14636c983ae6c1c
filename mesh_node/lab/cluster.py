"""N real ``mesh-node run`` processes on loopback: identities, configs, start, stop.

The one piece that starts and tears down a lab's nodes, reused by ``mesh-node lab``, the
process tests and the benchmarks. Node 0 is the coordinator; every other node dials it (gossip
then meshes them all). Each node has its own folder (key, certificate, config, data with its
hub cache, its own verification and hub caches, stdout and log), a fresh identity, and the
owner certificate of its ``NodeSpec.owner`` (owners are created on demand; none is in any
node's trust store).

Extension points: ``NodeSpec.config`` (extra TOML keys, e.g. the ``http``),
``NodeSpec.run_args`` (appended to ``mesh-node run``, e.g. ``--http 127.0.0.1:PORT``) and
``NodeSpec.env``. A started node's address is written back into its config, so ``restart``
brings it up where its peers dial it.

The cluster holds ``root/lab.lock`` locked from its construction to ``aclose`` and writes it
into every config (``lab_lock``): a node stops by itself once nothing holds it, so no node
outlives the process that runs the cluster, however that process ends
(``mesh_node.lifeline``). Nodes run in their own process groups, stopped by the cluster only.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from mesh_node import control, lifeline
from mesh_node.errors import MeshError, surfaced
from mesh_node.identity import (
    issue_certificate,
    node_id_of,
    write_certificate,
    write_private_key,
)
from skippy.atomic import atomic_write_bytes
from skippy.config import ENV_ARTIFACT_TRANSFER

log = logging.getLogger("mesh_node.lab")

START_TIMEOUT_S: Final = 60.0  # interpreter start + imports on a loaded 2-core machine
STOP_TIMEOUT_S: Final = 15.0
CONTROL_TIMEOUT_S: Final = 10.0
POLL_S: Final = 0.1
LOCK_NAME: Final = "lab.lock"  # in the lab's root: the nodes' lifeline


class LabError(MeshError):
    """A lab node did not start, answer or stop as it should."""

    code = "lab_failed"


@dataclass(frozen=True)
class NodeSpec:
    """How to run one lab node."""

    name: str  # folder name and label: n0, n1, ...
    owner: str = "primary"  # owner label; nodes with the same label share an owner
    config: Mapping[str, Any] = field(default_factory=dict)  # extra TOML keys
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment
    run_args: tuple[str, ...] = ()  # appended to `mesh-node run --config FILE`
    memory_budget: str = "4GiB"
    listen: str = "127.0.0.1:0"  # its first listen address (then the one it got, kept)
    netns: str | None = None  # runs inside this network namespace (the NAT lab's hosts)


@dataclass
class LabNode:
    index: int
    spec: NodeSpec
    root: Path
    node_id: str
    owner_id: str
    process: trio.Process | None = None
    url: str | None = None  # ws://host:port#<node id>, once it listened
    peak_rss_bytes: int | None = None  # VmHWM read just before it was stopped

    @property
    def config_path(self) -> Path:
        return self.root / "node.toml"

    @property
    def data_dir(self) -> Path:
        return self.root / "d"

    @property
    def hub_cache_dir(self) -> Path:
        return self.data_dir / "hub"

    @property
    def skippy_cache_dir(self) -> Path:
        return self.root / "cache" / "skippy"  # XDG_CACHE_HOME/skippy: its verification cache

    @property
    def log_path(self) -> Path:
        return self.root / "node.log"

    @property
    def control_socket(self) -> Path:
        return self.data_dir / "mesh-node.sock"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def request(self, payload: dict[str, Any], timeout_s: float = CONTROL_TIMEOUT_S) -> Any:
        """One control-socket request (``control.request``); its error if the node refused."""
        return await control.request(self.control_socket, payload, timeout_s)

    async def status(self) -> dict[str, Any]:
        response = await self.request({"op": "status"})
        status: dict[str, Any] = response["status"]
        return status

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class LabCluster:
    """Nodes in ``root``; use ``open_cluster`` so they are always stopped."""

    def __init__(
        self, root: Path, specs: Sequence[NodeSpec], *, python: str = sys.executable
    ) -> None:
        if not specs:
            raise LabError("a lab needs at least one node", code="usage")
        self.root = root
        self.python = python
        self._owners: dict[str, Ed25519PrivateKey] = {}
        self.nodes = [self._prepare(i, spec) for i, spec in enumerate(specs)]
        # The nodes' lifeline (``mesh_node.lifeline``): held from here until ``aclose``, and
        # by the kernel only as long as this process lives, so the nodes stop with the lab
        # whatever ends it (a SIGKILL too), and so does a node restarted from its config.
        self._lifeline: int | None = lifeline.hold(self.lock_path)

    @property
    def lock_path(self) -> Path:
        return self.root / LOCK_NAME

    @property
    def coordinator(self) -> LabNode:
        return self.nodes[0]

    def owner_id(self, label: str) -> str:
        return node_id_of(self._owner(label))

    # --- identities and configs -------------------------------------------------------------
    def _owner(self, label: str) -> Ed25519PrivateKey:
        key = self._owners.get(label)
        if key is None:
            key = self._owners[label] = write_private_key(self.root / "owners" / f"{label}.key")
        return key

    def _prepare(self, index: int, spec: NodeSpec) -> LabNode:
        root = self.root / spec.name
        root.mkdir(parents=True, exist_ok=False)
        key = write_private_key(root / "node.key")
        node_id = node_id_of(key)
        owner = self._owner(spec.owner)
        write_certificate(root / "node.cert", issue_certificate(owner, node_id, days=30))
        return LabNode(index, spec, root, node_id, node_id_of(owner))

    def _write_config(self, node: LabNode, listen: str) -> None:
        values: dict[str, Any] = {
            "listen": listen,
            "identity": "node.key",
            "certificate": "node.cert",
            "data_dir": "d",
            "memory_budget": node.spec.memory_budget,
        }
        first = self.coordinator
        if node is not first and first.url is not None:
            values["peers"] = [first.url]
        values.update(node.spec.config)
        values["lab_lock"] = str(self.lock_path)
        node.config_path.write_text(_toml(values))

    def environment(self, node: LabNode) -> dict[str, str]:
        """The node's environment: its own caches, the TOML's transfer mode (the variable
        would win over it), then the spec's additions."""
        env = {k: v for k, v in os.environ.items() if k != ENV_ARTIFACT_TRANSFER}
        env.update(
            XDG_CACHE_HOME=str(node.root / "cache"),
            HF_HOME=str(node.root / "hf"),
            HF_HUB_CACHE=str(node.root / "hf" / "hub"),
            PYTHONUNBUFFERED="1",
        )
        env.update(node.spec.env)
        return env

    # --- processes ----------------------------------------------------------------------------
    async def start_all(self) -> None:
        """The coordinator first (the others dial its address), then every other node at
        once: a node's start is mostly its own imports and calibration, so starting them one
        after another only added each one's start-up to the lab's. The nodes share this
        machine, so the coordinator's calibration, measured while it started alone, is
        theirs too (``share_calibration``)."""
        await self.start(self.coordinator.index)
        await trio.to_thread.run_sync(self.share_calibration)
        try:
            async with trio.open_nursery() as nursery:
                for node in self.nodes:
                    if node is not self.coordinator:
                        nursery.start_soon(self.start, node.index)
        except BaseExceptionGroup as group:  # raised as itself, as a sequential start would
            found = surfaced(group)
            if found is None:
                raise
            raise found from None

    def share_calibration(self) -> None:
        """Copy the coordinator's calibration cache into every other node's
        data_dir that has none, so they neither measure the machine again nor measure it
        while the others start (several processes calibrating on the same cores at once
        would each read slower than the machine is). A node whose calibration key differs
        (another engine or thread count) still measures its own."""
        from mesh_node.calibration import CACHE_NAME

        source = self.coordinator.data_dir / CACHE_NAME
        if not source.is_file():  # calibration off, or it failed: each node does its own
            return
        for node in self.nodes:
            target = node.data_dir / CACHE_NAME
            if node is self.coordinator or target.exists():
                continue
            node.data_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(target, source.read_bytes(), durable=False)

    async def start(self, index: int) -> LabNode:
        """Start (or restart) node ``index`` and wait until it listens."""
        node = self.nodes[index]
        if node.running:
            raise LabError(f"{node.spec.name} is already running", code="usage")
        if node.url is None:
            self._write_config(node, node.spec.listen)
        stdout = node.root / "stdout"
        stdout.write_bytes(b"")
        with open(stdout, "wb") as out, open(node.log_path, "ab") as err:
            inside = ["ip", "netns", "exec", node.spec.netns] if node.spec.netns else []
            node.process = await trio.lowlevel.open_process(
                [*inside, self.python, "-m", "mesh_node", "run", "--config",
                 str(node.config_path), *node.spec.run_args],
                stdout=out,
                stderr=err,
                env=self.environment(node),
                # Its own process group: a terminal's Ctrl-C (or `timeout`'s signal to its
                # group) reaches the lab alone, which stops the nodes in order; the lifeline
                # covers the lab's own death.
                process_group=0,
            )
        with trio.move_on_after(START_TIMEOUT_S):
            while True:
                first, newline, _ = stdout.read_text(errors="replace").partition("\n")
                if newline and first.startswith("listening "):
                    break
                if newline or node.process.poll() is not None:
                    raise LabError(
                        f"{node.spec.name} did not start (exit {node.process.returncode}):\n"
                        f"{first}\n{node.log_tail()}"
                    )
                await trio.sleep(POLL_S / 2)
            url = first.split(" ", 1)[1].strip()
            if node.url is None:  # pin the port it got: a restart must listen there again
                node.url = url
                self._write_config(node, url.removeprefix("ws://").split("#", 1)[0])
            return node
        raise LabError(f"{node.spec.name} did not listen within {START_TIMEOUT_S:g} s")

    def send_signal(self, index: int, signum: int) -> None:
        """Send ``signum`` to a running node (``SIGSTOP``/``SIGCONT`` to stall it)."""
        node = self.nodes[index]
        if node.process is not None and node.process.returncode is None:
            node.process.send_signal(signum)

    async def stop(self, index: int, signum: int = signal.SIGTERM) -> int | None:
        """Stop node ``index`` (``SIGKILL`` for a crash); its exit code."""
        node = self.nodes[index]
        proc = node.process
        if proc is None:
            return None
        if proc.returncode is None:
            node.peak_rss_bytes = peak_rss_bytes(proc.pid)
            if signum != signal.SIGKILL:
                proc.send_signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            proc.send_signal(signum)
            with trio.move_on_after(STOP_TIMEOUT_S):
                await proc.wait()
            if proc.returncode is None:
                log.warning("%s did not stop in time: killing it", node.spec.name)
                proc.kill()
                await proc.wait()
        node.process = None
        return proc.returncode

    async def aclose(self) -> None:
        """Stop every node (shielded: also on Ctrl-C and on cancellation), then let go of
        the lifeline (a node that outlived its stop, or was started by hand, stops too)."""
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for node in self.nodes:
                    nursery.start_soon(self.stop, node.index)
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    # --- waiting --------------------------------------------------------------------------------
    async def statuses(self) -> list[dict[str, Any] | None]:
        """Every running node's status document (None for a stopped or silent node)."""
        out: list[dict[str, Any] | None] = [None] * len(self.nodes)

        async def one(node: LabNode) -> None:
            if node.running:
                try:
                    out[node.index] = await node.status()
                except (MeshError, OSError, trio.TooSlowError):
                    out[node.index] = None

        async with trio.open_nursery() as nursery:
            for node in self.nodes:
                nursery.start_soon(one, node)
        return out

    async def wait_meshed(self, timeout_s: float) -> None:
        """Until every running node is linked to every other running node."""
        with trio.move_on_after(timeout_s):
            while True:
                running = {n.node_id for n in self.nodes if n.running}
                docs = [d for d in await self.statuses() if d is not None]
                if len(docs) == len(running) and all(
                    running - {d["node_id"]} <= {p["node_id"] for p in d["peers"] if p["connected"]}
                    for d in docs
                ):
                    return
                await trio.sleep(POLL_S)
        raise LabError(f"the lab's nodes did not all link up within {timeout_s:g} s")


@asynccontextmanager
async def open_cluster(root: Path, specs: Sequence[NodeSpec]) -> AsyncIterator[LabCluster]:
    """Start every node; stop them all on the way out, whatever happens."""
    cluster = LabCluster(root, specs)
    try:
        await cluster.start_all()
        yield cluster
    finally:
        await cluster.aclose()


def peak_rss_bytes(pid: int) -> int | None:
    """A process's peak resident set size (``VmHWM``), while it runs."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _toml(values: Mapping[str, Any]) -> str:
    """The few TOML value types a node config uses (strings, numbers, booleans, lists, inline
    tables)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)  # a JSON string is a valid TOML basic string
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, Mapping):  # an inline table, e.g. serving = {threads = 1}
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        raise LabError(f"cannot write {v!r} into a node config", code="usage")

    return "".join(f"{k} = {value(v)}\n" for k, v in values.items())
