"""``mesh-node lab``: a split on N real local nodes, and what moved where.

``open_lab`` brings a lab up: the package (a directory is published on a lab hub under
``hf://lab/<name>@<commit>``; an ``hf://`` reference is pinned), imported whole into the
coordinator's hub cache, then N ``mesh-node run`` processes (``mesh_node.lab.cluster``) with
fresh identities, all of one owner except the last ``foreign_owners`` workers (a second owner
in nobody's trust store), workers with empty caches and the hub as their fallback. The lab is
torn down on the way out, whatever happens (Ctrl-C included).

``Lab.split`` is the transfer experiment: the coordinator plans the split and sends it, the
workers fetch and report ready, the lab checks every worker's cache itself and builds the
report. The steps: ``Lab.start_serving`` makes the coordinator serve the package
(control operation ``serve``: it plans the split with stage 0 on itself, the workers fetch,
load and report, the route opens), then ``--prompt`` runs one greedy completion through it
(``mesh_node.serving.completion_report``) and ``--serve`` keeps the lab up with the API's address.
Passes per-node arguments through ``LabOptions.run_args``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Final

import trio

from mesh_node import hole_punch
from mesh_node.lab.cluster import LabCluster, LabError, LabNode, NodeSpec
from mesh_node.lab.hub_server import FakeHub
from mesh_node.lab.netem import LinkTable, Netem, open_netem
from mesh_node.lab.netns import PUBLIC_HOSTS, NatLab
from mesh_node.lab.package import (
    LabPackage,
    import_package,
    publish_directory,
    revise_directory,
)
from mesh_node.lab.report import (
    CacheCheck,
    NodeFacts,
    build_report,
    peer_bytes_fetched,
    replica_of,
    revision_change,
)
from mesh_node.packages import manifest_speculation
from protocol.constants import RELAYED_MARKER
from skippy.config import ArtifactTransfer, read_environment
from skippy.constants import MANIFEST_NAME
from skippy.consume.verify import VerifyCache
from skippy.errors import UsageError
from skippy.generation import SpeculativePlan
from skippy.package.ranges import LayerRange
from skippy.package.refs import LocalPackageRef, parse_package_ref
from skippy.serving.failures import classify_failure
from skippy.transfer.hubcache import RepoCache
from skippy.transfer.required import stage_refs

# Timeouts for lab nodes: loopback and local processes, so shorter than a WAN's defaults.
LAB_NODE_CONFIG: Final[Mapping[str, Any]] = {
    "heartbeat_interval_s": 1.0,
    "peer_loss_timeout_s": 5.0,
    "idle_timeout_s": 10.0,
    "handshake_timeout_s": 5.0,
}
MESH_TIMEOUT_S: Final = 60.0
POLL_S: Final = 0.2
MODES: Final = ("open", "trusted", "disabled")


@dataclass(frozen=True)
class LabOptions:
    nodes: int
    package: str  # hf://ns/repo[@rev] or a package directory
    transfer: ArtifactTransfer = "trusted"
    foreign_owners: int = 0  # the last K workers belong to a second, untrusted owner
    root: Path | None = None  # where the nodes live; default a temporary folder, removed after
    keep: bool = False  # keep ``root`` (logs, caches) afterwards
    timeout_s: float = 600.0  # for the whole split to become ready
    node_config: Mapping[str, Any] = field(default_factory=lambda: dict(LAB_NODE_CONFIG))
    node_overrides: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)  # TOML, by index
    node_env: Mapping[int, Mapping[str, str]] = field(default_factory=dict)  # per node index
    run_args: Callable[[int], tuple[str, ...]] | None = None  # per node: after `mesh-node run`
    prompt: str | None = None  # one completion through the split
    max_tokens: int = 16
    serve: bool = False  # serve the split behind the API (the lab stays up)
    links: LinkTable | None = None  # emulated WAN links between every pair of nodes
    stages: int | None = None  # serve over this many stages (the rest are spares)
    revision_change: int | None = None  # then split a second revision, this layer
    replicas: int = 1  # serve R pipelines over disjoint workers
    speculative_strategy: str | None = None  # serve with this strategy (None: auto)
    # The NAT lab (mesh_node.lab.netns): n0 on the public segment (coordinator and relay),
    # n1 and n2 in two homes behind NATs of these kinds (home -> kind; {}: masquerade both).
    nat: Mapping[str, str] | None = None
    # Where the NAT lab's nodes run, n0 first: hosts of mesh_node.lab.netns (the first node on
    # a public host relays for the others; a coordinator in a home is reached through it).
    nat_places: tuple[str, ...] = ("coord", "home1", "home2")
    nat_home_bytes_per_s: int | None = None  # each home's line, both ways (None: unshaped)

    @property
    def serve_stages(self) -> int:
        """Stages per replica when serving: ``stages``, else every node (one replica) or an
        equal share of the workers per replica."""
        if self.stages is not None:
            return self.stages
        return self.nodes if self.replicas == 1 else 1 + (self.nodes - 1) // self.replicas

    def __post_init__(self) -> None:
        if self.replicas != 1:
            from skippy.serving.replicas import check_replicas, peers_needed

            if self.prompt is None and not self.serve:
                raise UsageError("--replicas needs --prompt or --serve", code="usage")
            check_replicas(self.replicas, self.serve_stages)
            need = peers_needed(self.replicas, self.serve_stages)
            if need > self.nodes - 1:
                raise UsageError(
                    f"{self.replicas} replicas of {self.serve_stages} stages need {need} "
                    f"workers; --nodes {self.nodes} has {self.nodes - 1}",
                    code="usage",
                    remediation=f"use --nodes {need + 1} or more",
                )
        if self.speculative_strategy is not None and self.prompt is None and not self.serve:
            raise UsageError("--speculative-strategy needs --prompt or --serve", code="usage")
        if self.stages is not None and not 1 <= self.stages <= self.nodes:
            raise UsageError(
                f"--stages must be 1..{self.nodes} (--nodes), not {self.stages}", code="usage"
            )
        if self.max_tokens < 1:
            raise UsageError("--max-tokens must be at least 1", code="usage")
        if self.nodes < 2:
            raise UsageError(
                f"a lab needs at least 2 nodes (a coordinator and a worker), not {self.nodes}",
                code="usage",
            )
        if not 0 <= self.foreign_owners <= self.nodes - 1:
            raise UsageError(
                f"--foreign-owner must be 0..{self.nodes - 1} (workers only), not "
                f"{self.foreign_owners}",
                code="usage",
            )
        if self.revision_change is not None and (self.prompt is not None or self.serve):
            raise UsageError(
                "--revision-change shows a second split's transfers; it does not combine with "
                "--prompt or --serve",
                code="usage",
            )
        if self.revision_change is not None and self.revision_change < 0:
            raise UsageError("--revision-change must be a layer index (>= 0)", code="usage")
        if self.transfer not in MODES:
            raise UsageError(f"--transfer must be one of {', '.join(MODES)}", code="usage")
        if self.nat is not None:
            self._check_nat(self.nat)
        if self.nat_home_bytes_per_s is not None and (
            self.nat is None or self.nat_home_bytes_per_s <= 0
        ):
            raise UsageError(
                "a home line's rate needs the NAT lab (--nat) and must be positive", code="usage"
            )

    def _check_nat(self, nat: Mapping[str, str]) -> None:
        from mesh_node.lab import netns

        if self.nodes != 3:
            raise UsageError(
                f"--nat runs 3 nodes (a public coordinator, two homes), not --nodes {self.nodes}",
                code="usage",
            )
        if self.links is not None or self.replicas != 1:
            raise UsageError(
                "--nat does not combine with emulated links or --replicas", code="usage"
            )
        for home, kind in nat.items():
            if home not in netns.HOMES or kind not in netns.NAT_KINDS:
                raise UsageError(
                    f"--nat: {home} = {kind!r}: the kinds are {', '.join(netns.NAT_KINDS)}",
                    code="usage",
                )
        lacking = netns.missing()
        if lacking:
            raise UsageError(
                "--nat needs " + "; ".join(lacking), code="usage", remediation="run it as root"
            )


@dataclass
class Lab:
    options: LabOptions
    cluster: LabCluster
    package: LabPackage
    hub_url: str | None  # the lab hub (a published directory), else None
    netem: Netem | None = None  # the emulated links (partition, heal, event log)
    nat: NatLab | None = None  # the NAT lab's namespaces the nodes run in
    revision: LabPackage | None = None  # the second revision (one layer changed)
    replicas: list[dict[str, Any]] = field(default_factory=list)  # once serving
    speculative: SpeculativePlan | None = None  # the plan the coordinator serves with
    # Each node's peer-fetched counter when the split was sent: the report counts from it.
    peer_bytes_before: dict[str, int] = field(default_factory=dict)

    async def split(self) -> dict[str, Any]:
        """Plan the split on the coordinator, wait for every stage, check, report."""
        coordinator = self.cluster.coordinator
        await self.mark_peer_bytes()
        t0 = time.monotonic()
        response = await coordinator.request(
            {
                "op": "topology",
                "package": self.package.ref,
                # Explicit: calibrated nodes would otherwise be planned by cost,
                # which uses fewer stages when memory allows; the lab is about a split.
                "stages": self.options.stages or self.options.nodes,
                "include_self": True,
            },
            timeout_s=self.options.timeout_s,
        )
        topology: dict[str, Any] = response["topology"]
        problems = [
            f"worker {node[:12]} did not accept the topology: {ack}"
            for node, ack in topology["acks"].items()
            if ack != "accepted"
        ]
        problem = await self._wait_stages(topology, t0 + self.options.timeout_s)
        seconds = time.monotonic() - t0
        if problem is not None:
            problems.append(problem)
        return await self.report(topology, seconds, problems)

    async def start_serving(self) -> tuple[str, dict[str, Any], float]:
        """Make the coordinator serve the package over every node; wait until
        its route is ready. Returns the API's base URL, the topology and the seconds taken."""
        coordinator = self.cluster.coordinator
        await self.mark_peer_bytes()
        t0 = time.monotonic()
        response = await coordinator.request(
            {
                "op": "serve",
                "package": self.package.ref,
                "stages": self.options.serve_stages,
                "replicas": self.options.replicas,
                "speculative_strategy": self.options.speculative_strategy,
            },
            timeout_s=self.options.timeout_s,
        )
        api = str(response["api"])
        deadline = t0 + self.options.timeout_s
        while True:
            status = await coordinator.status()
            serving = status.get("serving") or {}
            replicas = serving.get("replicas") or []
            if serving.get("state") == "ready" and all(r["state"] == "ready" for r in replicas):
                self.replicas = list(replicas)
                return api, dict(status["topology"]), time.monotonic() - t0
            if serving.get("state") == "failed":  # for good: no point waiting for the deadline
                raise LabError(
                    f"the split failed: {serving.get('reason')}",
                    code=str(serving.get("code")),
                )
            # The serving core never gives up by itself (it waits like a service:
            # ``ready``, ``waiting`` or ``not_ready``) unless a stage failed for good
            # (``failed``, above); the lab does, at its deadline, with what the core says it
            # waits for.
            if time.monotonic() > deadline:
                raise LabError(
                    f"the split did not become ready within {self.options.timeout_s:g} s: "
                    f"{serving.get('reason')} [{serving.get('code')}]",
                    code="split_not_ready",
                )
            await trio.sleep(POLL_S)

    async def mark_peer_bytes(self) -> None:
        """Remember every node's peer-fetched counter: what the next split receives is the
        difference (a lab that splits twice, or whose nodes fetched before, counts only it)."""
        statuses = await self.cluster.statuses()
        self.peer_bytes_before = {
            node.node_id: peer_bytes_fetched(status)
            for node, status in zip(self.cluster.nodes, statuses, strict=True)
        }

    async def report(
        self, topology: dict[str, Any], seconds: float, problems: list[str]
    ) -> dict[str, Any]:
        """Check every worker's cache and build the report for ``topology``."""
        statuses = await self.cluster.statuses()
        stages = {s["node_id"]: s for s in topology["stages"]}
        for replica in self.replicas[1:]:  # the other replicas' workers
            tid = replica["topology_id"]
            stages.update({s["node_id"]: {**s, "topology_id": tid} for s in replica["stages"][1:]})
        facts = []
        for node, status in zip(self.cluster.nodes, statuses, strict=True):
            stage = stages.get(node.node_id)
            check = None
            if node.index > 0 and stage is not None:
                check = await trio.to_thread.run_sync(self.check_cache, node, stage)
            role = "coordinator" if node.index == 0 else ("worker" if stage else "spare")
            facts.append(
                NodeFacts(
                    node.index,
                    node.node_id,
                    role,
                    node.spec.owner,
                    node.owner_id,
                    stage,
                    status,
                    check,
                    replica=replica_of(node.node_id, self.replicas),
                    peer_bytes_before=self.peer_bytes_before.get(node.node_id, 0),
                )
            )
        report = build_report(
            package_ref=self.package.ref,
            transfer=self.options.transfer,
            foreign_owners=self.options.foreign_owners,
            topology=topology,
            nodes=facts,
            seconds=seconds,
            problems=problems,
        )
        report["links"] = self.netem.report() if self.netem is not None else None
        if len(self.replicas) > 1:
            report["replicas"] = self.replicas
        return report

    async def _wait_stages(self, topology: Mapping[str, Any], deadline: float) -> str | None:
        """Until every stage node's fetch ended (ready or failed) and its report was answered,
        or a stage node is down (None), or one stage failed for good: the others cannot make
        the split whole (the problem, with its code); at the deadline, the problem."""
        tid = topology["topology_id"]
        nodes = {n.node_id: n for n in self.cluster.nodes}
        # A worker that did not accept the topology (refused, or its ack lost with its link)
        # will never report its stage: the split's problems already name it.
        acks = topology.get("acks", {})
        wanted = [
            nodes[s["node_id"]]
            for s in topology["stages"]
            if s["node_id"] in nodes and acks.get(s["node_id"], "accepted") == "accepted"
        ]
        while time.monotonic() < deadline:
            statuses = await self.cluster.statuses()
            if all(_stage_done(statuses[n.index], tid) or not n.running for n in wanted):
                return None
            for n in wanted:
                if _stage_failed_for_good(statuses[n.index], tid):
                    stage = (statuses[n.index] or {})["transfers"]["stage"]
                    return (
                        f"stage {stage['stage_index']} (node {n.node_id[:12]}) failed for good "
                        f"({stage['error']}): the lab did not wait for the other stages"
                    )
            await trio.sleep(POLL_S)
        return f"the split was not ready within {self.options.timeout_s:g} s"

    def check_cache(self, node: LabNode, stage: Mapping[str, Any]) -> CacheCheck:
        """The worker's snapshot of the package, checked by the lab: exactly the stage's
        required set and the manifest, each hashing to its declared SHA-256, no leftovers."""
        cache = RepoCache.for_ref(node.hub_cache_dir, self.package.ref)
        m = self.package.manifest
        layers = LayerRange(stage["layer_start"], stage["layer_end"], m.layer_count)
        expected = {MANIFEST_NAME: self.package.manifest_sha256}
        expected.update(
            {r.path: r.artifact.sha256.lower() for r in stage_refs(m, layers)}
        )
        snap = cache.snapshot_dir
        held = (
            {p.relative_to(snap).as_posix(): p for p in snap.rglob("*") if not p.is_dir()}
            if snap.is_dir()
            else {}
        )
        verified = frozenset(
            path for path, sha in expected.items() if path in held and _sha256(held[path]) == sha
        )
        blobs = cache.repo_root / "blobs"
        names = os.listdir(blobs) if blobs.is_dir() else []
        leftovers = sorted(n for n in names if n.endswith((".part", ".incomplete")))
        return CacheCheck(
            required=tuple(expected),
            verified=verified,
            missing=tuple(sorted(set(expected) - set(held))),
            extra=tuple(sorted(set(held) - set(expected))),
            partials=tuple(leftovers),
        )


def _stage_done(status: Mapping[str, Any] | None, topology_id: str) -> bool:
    stage = ((status or {}).get("transfers") or {}).get("stage") or {}
    return (
        stage.get("topology_id") == topology_id
        and stage.get("state") in ("ready", "failed")
        and stage.get("report") is not None
    )


def _stage_failed_for_good(status: Mapping[str, Any] | None, topology_id: str) -> bool:
    stage = ((status or {}).get("transfers") or {}).get("stage") or {}
    return (
        _stage_done(status, topology_id)
        and stage.get("state") == "failed"
        and classify_failure(stage.get("error")) == "permanent"
    )


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def node_specs(options: LabOptions, hub_url: str | None) -> list[NodeSpec]:
    """Node 0 coordinates; the last ``foreign_owners`` workers belong to another owner. The
    nodes share this machine's cores: each stage gets an equal share of threads (ggml's
    spinning threads stall each other when oversubscribed)."""
    specs = []
    threads = max(1, (os.cpu_count() or 1) // options.nodes)
    first_foreign = options.nodes - options.foreign_owners
    # The coordinator of a serving lab: its /health is not ok before its route is ready.
    serves = options.prompt is not None or options.serve
    for i in range(options.nodes):
        env = {"HF_ENDPOINT": hub_url} if hub_url else {}
        env.update(options.node_env.get(i, {}))
        specs.append(
            NodeSpec(
                name=f"n{i}",
                owner="foreign" if i >= first_foreign else "primary",
                config={
                    "serving": {"threads": threads, "expect_serve": serves and i == 0},
                    # A lab mixes owners on purpose (foreign workers): the lab setting, which
                    # each node states in its log at start.
                    "security": {"accept_topologies_from": "any", "place_stages_on": "any"},
                    **options.node_config,
                    "artifact_transfer": options.transfer,
                    **options.node_overrides.get(i, {}),
                },
                env=env,
                run_args=options.run_args(i) if options.run_args else (),
            )
        )
    return specs


@asynccontextmanager
async def open_lab(options: LabOptions) -> AsyncIterator[Lab]:
    """A running lab (see the module docstring); torn down on exit."""
    root = options.root or Path(tempfile.mkdtemp(prefix="mesh-lab-"))
    if options.root is not None:
        root.mkdir(parents=True, exist_ok=True)
        if any(root.iterdir()):
            raise UsageError(f"lab folder {root} is not empty", code="output_exists")
    lab_hub: FakeHub | None = None
    cluster: LabCluster | None = None
    try:
        ref = parse_package_ref(options.package)
        revision_text = None
        if isinstance(ref, LocalPackageRef):
            lab_hub = FakeHub()
            lab_hub.start()
            ref_text = await trio.to_thread.run_sync(publish_directory, lab_hub, ref.path)
            endpoint: str | None = lab_hub.url
            if options.revision_change is not None:
                revision_text = await trio.to_thread.run_sync(
                    publish_revision, lab_hub, ref.path, root, options.revision_change
                )
        elif options.revision_change is not None:
            raise UsageError(
                "--revision-change needs a package directory (the lab publishes both revisions)",
                code="usage",
            )
        else:
            ref_text, endpoint = str(ref), read_environment().hf_endpoint
        cluster = LabCluster(root, node_specs(options, lab_hub.url if lab_hub else None))
        coordinator = cluster.coordinator

        def load() -> LabPackage:
            return import_package(
                ref_text,
                coordinator.hub_cache_dir,
                endpoint=endpoint,
                verify_cache=VerifyCache.under(coordinator.skippy_cache_dir),
            )

        package = await trio.to_thread.run_sync(load)
        speculative = None
        if options.prompt is not None or options.serve:
            # Before any node starts, so that a strategy the package cannot serve is a usage
            # error at once; the coordinator (no [speculative] table) resolves the same plan.
            speculative = manifest_speculation(package.manifest, None, options.speculative_strategy)
        revision = None
        if revision_text is not None:
            revision = await trio.to_thread.run_sync(
                partial(
                    import_package,
                    revision_text,
                    coordinator.hub_cache_dir,
                    endpoint=endpoint,
                    verify_cache=VerifyCache.under(coordinator.skippy_cache_dir),
                )
            )
        async with AsyncExitStack() as stack:
            netem = None
            if options.links is not None:
                netem = await stack.enter_async_context(open_netem(options.links))
                await route_through(netem, cluster)
            nat = None
            if options.nat is not None:
                nat = NatLab(
                    f"ml{os.getpid() % 100000}",
                    dict(options.nat),
                    home_bytes_per_s=options.nat_home_bytes_per_s,
                )
                stack.callback(nat.close)  # also when the build fails half way
                await trio.to_thread.run_sync(nat.build)
                place_in_nat(nat, cluster, options.nat_places)
            try:
                await cluster.start_all()
                await cluster.wait_meshed(MESH_TIMEOUT_S)
                url = lab_hub.url if lab_hub else None
                yield Lab(
                    options, cluster, package, url, netem, nat, revision, speculative=speculative
                )
            finally:
                await cluster.aclose()
    finally:
        if cluster is not None:  # also when it never started (its lock is let go)
            await cluster.aclose()
        if lab_hub is not None:
            lab_hub.stop()
        if not options.keep:
            shutil.rmtree(root, ignore_errors=True)


NAT_PORT: Final = 7460  # every NAT lab node listens on this port of its host's address
NAT_SETTLE_SLACK_S: Final = 3.0  # beyond the upgrade's schedule: a dial and its handshake


def place_in_nat(nat: NatLab, cluster: LabCluster, places: Sequence[str]) -> None:
    """The NAT lab's places (by default n0, the coordinator, on the public segment, n1 and
    n2 in the two homes behind their routers): the first node on a public host relays for the
    others, which name it as their relay (reachable through it, and directly where their NAT
    lets a direct link through); nodes dial a coordinator in a home through it. Call before
    the nodes start."""
    if len(places) != len(cluster.nodes) or any(p not in nat.hosts for p in places):
        raise UsageError(f"NAT lab places {list(places)}: one host each", code="usage")
    relay = next((n for n in cluster.nodes if places[n.index] in PUBLIC_HOSTS), None)
    if relay is None:
        raise UsageError("a NAT lab needs a node on a public host (the relay)", code="usage")
    relay_place = places[relay.index]
    relay_url = f"ws://{PUBLIC_HOSTS[relay_place]}:{NAT_PORT}#{relay.node_id}"
    first = cluster.coordinator
    for node, host in zip(cluster.nodes, places, strict=True):
        extra: dict[str, Any] = (
            {"relay": {**node.spec.config.get("relay", {}), "enable": True}}
            if node is relay
            else {"relays": [relay_url]}
        )
        if places[0] not in PUBLIC_HOSTS and node is not first:
            # the coordinator cannot be dialled: its relay can reach it
            relayed = f"{relay_url}{RELAYED_MARKER}{first.node_id}"
            extra["peers"] = [] if node is relay else [relayed]
        node.spec = replace(
            node.spec,
            netns=nat.hosts[host].netns,
            listen=f"{nat.hosts[host].address}:{NAT_PORT}",
            config={**node.spec.config, **extra},
        )


async def route_through(netem: Netem, cluster: LabCluster) -> None:
    """Every node dials every other node through that ordered pair's relay (its
    ``dial_via`` table), so configured and gossip-learned links alike cross an emulated link.
    Call before the nodes start; relays look their target's address up per connection."""
    for node in cluster.nodes:
        netem.set_target(node.spec.name, partial(_listening_at, node))
    for node in cluster.nodes:
        via = {
            other.node_id: await netem.route(node.spec.name, other.spec.name)
            for other in cluster.nodes
            if other is not node
        }
        node.spec = replace(node.spec, config={**node.spec.config, "dial_via": via})


def _listening_at(node: LabNode) -> tuple[str, int] | None:
    if node.url is None:
        return None
    host, _, port = node.url.removeprefix("ws://").split("#", 1)[0].rpartition(":")
    return host.strip("[]"), int(port)


async def experiment(lab: Lab) -> dict[str, Any]:
    """The lab's experiment: the split and its transfer report; with ``prompt`` or ``serve``
    the coordinator serves the split, the report gains ``api``, ``speculative``
    (the strategy served with and its acceptance) and, with ``prompt``, ``prompt`` (one
    greedy completion through the split)."""
    from mesh_node.lab.report import predicted_vs_measured, serving_replica, speculative_report
    from mesh_node.serving.completion_report import complete, prompt_report

    options = lab.options
    if lab.revision is not None and options.revision_change is not None:
        return await delta_split(lab, options.revision_change)
    if options.prompt is None and not options.serve:
        return await lab.split()
    api, topology, seconds = await lab.start_serving()
    report = await lab.report(topology, seconds, [])
    report["api"] = api
    operable(lab, report)
    if options.prompt is not None:
        # In the NAT lab the coordinator's API is on its namespace's loopback.
        within = None if lab.nat is None else partial(lab.nat.call_in, "coord")
        completion = await complete(
            api,
            options.prompt,
            max_tokens=options.max_tokens,
            timeout_s=options.timeout_s,
            within=within,
        )
        statuses = await lab.cluster.statuses()
        report["prompt"] = prompt_report(completion, statuses)
        replicas_now = ((statuses[0] or {}).get("serving") or {}).get("replicas") or []
        report["prompt"]["replica"] = serving_replica(lab.replicas, replicas_now)
        for row in report["prompt"]["nodes"]:
            row["replica"] = replica_of(row["node_id"] or "", replicas_now)
    if lab.speculative is not None:  # the prompt's drafts (before the replicas' requests)
        serving = (await lab.cluster.coordinator.status()).get("serving")
        report["speculative"] = speculative_report(lab.speculative, serving)
    if options.prompt is not None:
        if options.replicas > 1:
            await across_replicas(lab, report, api)
        report["predicted_vs_measured"] = predicted_vs_measured(
            report.get("plan"), report["prompt"]
        )
        if lab.netem is not None:  # the links' bytes include the completion's
            report["links"] = lab.netem.report()
    return report


def nat_links(lab: Lab, statuses: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Where each NAT lab node runs and how each pair is linked (direct, or relayed and
    through whom; a direct link's fallback relay), from the nodes' status documents."""
    assert lab.nat is not None  # only called for a NAT lab (typing)
    names = {n.node_id: n.spec.name for n in lab.cluster.nodes}
    nodes, links = [], []
    for node, doc in zip(lab.cluster.nodes, statuses, strict=True):
        direct = (doc or {}).get("direct") or {}
        nodes.append(
            {
                "name": node.spec.name,
                "netns": node.spec.netns,
                "listen": node.spec.listen,
                "observed": direct.get("observed", []),
                "upgraded": direct.get("upgraded", 0),
                "failed": direct.get("failed", 0),
            }
        )
        for p in (doc or {}).get("peers", []):
            other = names.get(p["node_id"])
            if p["connected"] and other is not None and node.spec.name < other:
                links.append(
                    {
                        "a": node.spec.name,
                        "b": other,
                        "link": p["link"],
                        "relay": names.get(p["relay"] or "", p["relay"]),
                        "fallback_relay": names.get(
                            p["fallback_relay"] or "", p["fallback_relay"]
                        ),
                    }
                )
    return {"kinds": {h: lab.nat.nat.get(h, "masquerade") for h in ("home1", "home2")},
            "home_rate_bytes_per_s": lab.nat.home_bytes_per_s,
            "nodes": nodes, "links": links}  # fmt: skip


async def settled_nat_links(lab: Lab) -> dict[str, Any]:
    """``nat_links`` once the direct upgrades had their chance: where a home's NAT may let a
    direct link through (any kind but masquerade), the links are read again until no pair is
    relayed, for at most the upgrade's own schedule plus ``NAT_SETTLE_SLACK_S`` (a pair still
    relayed then is reported so); behind two masquerading routers, at once."""
    assert lab.nat is not None  # only called for a NAT lab (typing)
    report = nat_links(lab, await lab.cluster.statuses())
    if all(kind == "masquerade" for kind in report["kinds"].values()):
        return report
    deadline = trio.current_time() + sum(hole_punch.UPGRADE_DELAYS_S) + NAT_SETTLE_SLACK_S
    while any(x["link"] == "relayed" for x in report["links"]):
        if trio.current_time() > deadline:
            break
        await trio.sleep(POLL_S)
        report = nat_links(lab, await lab.cluster.statuses())
    return report


async def across_replicas(lab: Lab, report: dict[str, Any], api: str) -> None:
    """The done-when: the prompt again, ``2 x replicas`` times at once, so the
    least-outstanding-tokens chooser spreads them; the report's ``replicas`` then show each
    one's ``requests_total``, and a replica that served none is a problem."""
    from mesh_node.serving.completion_report import complete

    options = lab.options
    prompt = options.prompt or ""
    async with trio.open_nursery() as nursery:
        for _ in range(2 * options.replicas):
            nursery.start_soon(
                partial(
                    complete, api, prompt, max_tokens=options.max_tokens,
                    timeout_s=options.timeout_s,
                )
            )
    status = await lab.cluster.coordinator.status()
    replicas = (status.get("serving") or {}).get("replicas") or []
    if replicas:
        report["replicas"] = replicas
    idle = [r["replica"] for r in replicas if not r.get("requests_total")]
    if idle:
        report["problems"].append(f"replicas {idle} served no request")
        report["ok"] = False


def publish_revision(lab_hub: FakeHub, directory: Path, root: Path, layer: int) -> str:
    """A copy of the package with ``layer`` changed, published as the next commit
    of the same lab repository."""
    out = root / "revision-2" / directory.resolve().name
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        revise_directory(directory, out, layer=layer)
    except ValueError as exc:
        raise UsageError(f"--revision-change: {exc}", code="usage") from None
    return publish_directory(lab_hub, out)


async def delta_split(lab: Lab, layer: int) -> dict[str, Any]:
    """The delta: split the first revision, then the second (``layer`` changed) over
    the same nodes. The report is the second split's, with the first's summary and what the
    change moved (``revision_change``): only the changed layer's bytes should move."""
    if lab.revision is None:
        raise LabError("no second revision was published", code="usage")
    first = await lab.split()
    first_package = lab.package
    lab.package = lab.revision
    second = await lab.split()
    second["first_revision"] = {
        k: first[k] for k in ("package", "ok", "seconds", "totals", "problems")
    }
    second["revision_change"] = revision_change(second, lab.revision.manifest.artifacts(), layer)
    second["revision_change"]["from"] = first_package.ref
    second["problems"] = [*(f"first revision: {p}" for p in first["problems"]), *second["problems"]]
    second["ok"] = bool(first["ok"] and second["ok"])
    return second


def operable(lab: Lab, report: dict[str, Any]) -> None:
    """What a person or a test needs to operate on a serving lab: per node
    its ``stage`` and ``layers`` (``None`` for a spare), ``pid``, ``config`` (the TOML it
    runs with) and ``env`` (the lab's variables), so that it can be killed and started again
    with ``mesh-node run --config <config>`` (with ``env``) where its peers dial it."""
    for row in report["nodes"]:
        node = lab.cluster.nodes[row["index"]]
        start, end = row.get("layer_start"), row.get("layer_end")
        env = lab.cluster.environment(node)
        row.update(
            stage=row.get("stage_index"),
            layers=None if start is None else f"{start}..{end}",
            pid=node.process.pid if node.process is not None else None,
            config=str(node.config_path),
            env={k: env[k] for k in LAB_ENV if k in env},
        )


LAB_ENV: Final = ("XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE", "HF_ENDPOINT")


async def run_lab(options: LabOptions) -> dict[str, Any]:
    """The whole experiment: bring the lab up, split (and serve), report, tear down. A
    signal at any point tears it down and raises ``Interrupted``; the coordinator's exit, a
    ``LabError`` (``mesh_node.lab.lifetime``)."""
    from mesh_node.lab.lifetime import interrupted, run_until_signal, supervised

    reports: list[dict[str, Any]] = []
    root: list[Path] = []

    async def body() -> None:
        async with open_lab(options) as lab:
            root.append(lab.cluster.root)
            report = await supervised(lab.cluster, partial(experiment, lab))
            if lab.nat is not None:
                report["nat"] = await settled_nat_links(lab)
            report["root"] = str(lab.cluster.root) if options.keep else None
            reports.append(report)

    signum = await run_until_signal(body)
    if signum is not None:
        raise interrupted(signum, options.keep, root[0] if root else options.root)
    return reports[0]


__all__ = ["Lab", "LabError", "LabOptions", "experiment", "node_specs", "open_lab", "run_lab"]
