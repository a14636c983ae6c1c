"""What the node knows about peers, as plain frozen values (the registration API's types), and
the one function that builds the status document (``mesh-node status``, later the web page)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mesh_node.link import MeshStream
from protocol.certificates import OwnerStatus
from protocol.messages import ComputeCost, Devices
from skippy.progress import human_bytes
from skippy.text import escape


def peer_text(value: object) -> str:
    """The one rule for a peer's words on a terminal: every string that
    came from a peer (its Hello address, an ack's reason, a refusal) is printed through this,
    so a control sequence or a newline cannot clear the screen or forge a line. (The log
    lines are JSON-escaped by ``mesh-node``'s formatter, ASCII only.)"""
    return escape(str(value))


@dataclass(frozen=True)
class AuthenticatedPeer:
    """The peer at the other end of a link, as its handshake proved it. Plain data for policy
    code (artifact-transfer authorization reads ``trusted`` and ``owner_status``)."""

    node_id: str  # 64 lowercase hex: the Ed25519 key that authenticated the link
    owner_id: str | None  # from its certificate, when it sent one
    owner_status: OwnerStatus  # verified | unverified | invalid
    trusted: bool  # verified owner, and this node's own owner or in trusted_owners
    trust_reason: str = ""  # why (mesh_node.identity.trust_decision), for operators


@dataclass(frozen=True)
class InboundStream:
    """What a subprotocol handler receives for each stream a peer opens."""

    peer: AuthenticatedPeer
    name: str  # "skippy-stage"
    major: int  # 2
    kind: int  # protocol.constants.KIND_CONTROL / KIND_TRANSPORT / KIND_ARTIFACT_TRANSFER
    stream: MeshStream


SubprotocolHandler = Callable[[InboundStream], Awaitable[None]]
# At a stream's open, with the peer and the kind: None to serve it, else (code, reason).
StreamAdmission = Callable[[AuthenticatedPeer, int], "tuple[str, str] | None"]


@dataclass(frozen=True)
class PeerInfo:
    """A membership entry: an authenticated peer, connected now or seen before."""

    peer: AuthenticatedPeer
    address: str | None  # its advertised listen address (ws://host:port), if any
    features: Mapping[str, tuple[str, ...]]
    memory_budget_bytes: int
    connected: bool
    last_seen_s: float  # seconds since anything was received from it
    rtt_s: float | None = None
    rtt_min_s: float | None = None  # the least of the link's recent RTTs
    bytes_received: int = 0  # link bytes over every link to this peer since this node started
    bytes_sent: int = 0
    host_id: str | None = None  # its machine's fingerprint (Hello), if it sent one
    compute: ComputeCost | None = None  # its calibrated speed (Hello), if it sent one
    devices: Devices | None = None  # its devices and their memory (Hello), if it sent them
    link_cipher: str | None = None  # the connected link's Noise cipher
    relay: str | None = None  # the relay's node id when the link is a relayed circuit

    @property
    def node_id(self) -> str:
        return self.peer.node_id

    def has_features(self, feature: str, bits: frozenset[str]) -> bool:
        return bits <= set(self.features.get(feature, ()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.peer.node_id,
            "address": self.address,
            "connected": self.connected,
            "features": {k: list(v) for k, v in self.features.items()},
            "owner_id": self.peer.owner_id,
            "owner_status": self.peer.owner_status,
            "trusted": self.peer.trusted,
            "trust_reason": self.peer.trust_reason,
            "memory_budget": self.memory_budget_bytes,
            "last_seen_s": round(self.last_seen_s, 3),
            "rtt_ms": None if self.rtt_s is None else round(self.rtt_s * 1000, 3),
            "bytes_received": self.bytes_received,
            "bytes_sent": self.bytes_sent,
            "compute": None if self.compute is None else self.compute.to_wire(),
            "devices": None if self.devices is None else self.devices.to_wire(),
            "link_cipher": self.link_cipher,
            "link": "direct" if self.relay is None else "relayed",
            "relay": self.relay,
        }


# --- node events (``MeshNode.subscribe``) -----------------------------------------------------
@dataclass(frozen=True)
class PeerUp:
    peer: PeerInfo


@dataclass(frozen=True)
class PeerDown:
    node_id: str
    reason: str


@dataclass(frozen=True)
class TopologyChanged:
    state: str  # active | degraded | none
    topology_id: str | None


@dataclass(frozen=True)
class StageReported:
    """A coordinator recorded a stage node's report (``ready``, ``failed`` or ``rejected``)."""

    topology_id: str
    node_id: str
    state: str
    code: str | None = None


NodeEvent = PeerUp | PeerDown | TopologyChanged | StageReported


def status_document(
    *,
    node_id: str,
    listen: str | None,
    owner_id: str | None,
    owner_status: OwnerStatus,
    features: Mapping[str, Sequence[str]],
    memory_budget_bytes: int,
    artifact_transfer: str,
    peers: Sequence[PeerInfo],
    uptime_s: float = 0.0,
) -> dict[str, Any]:
    """The core of the status document: one function so every renderer agrees
    (the CLI's ``status``, the control socket, the status page's ``/api/status``). Services
    add their sections beside it (``NodeService.status_sections``: ``topology``,
    ``transfers``, ``cache``, ``stage``, ``serving``)."""
    return {
        "node_id": node_id,
        "uptime_s": round(uptime_s, 3),
        "listen": listen,
        "owner_id": owner_id,
        "owner_status": owner_status,
        "features": {k: list(v) for k, v in features.items()},
        "memory_budget": memory_budget_bytes,
        "artifact_transfer": artifact_transfer,
        "peers": [p.to_dict() for p in sorted(peers, key=lambda p: p.node_id)],
    }


def link_text(p: Mapping[str, Any]) -> str:
    """How a connected peer is linked: direct, or relayed via which relay; and its RTT."""
    how = "direct" if not p.get("relay") else f"relayed via {peer_text(p['relay'][:12])}"
    rtt = p.get("rtt_ms")
    return how + ("" if rtt is None else f", rtt {rtt:.1f} ms")


def render_status(doc: Mapping[str, Any]) -> str:
    """The status document as text for a terminal."""
    features = "; ".join(f"{k}: {', '.join(v)}" for k, v in doc["features"].items())
    lines = [
        f"node     {doc['node_id']}",
        f"listen   {doc['listen']}",
        f"owner    {doc['owner_id'] or '-'} ({doc['owner_status']})",
        f"features {features or '-'}",
        f"memory   {human_bytes(doc['memory_budget'])} budget; artifact transfer "
        f"{doc['artifact_transfer']}",
        *device_lines(doc.get("devices")),
        f"peers    {len(doc['peers'])}",
    ]
    for p in doc["peers"]:
        state = "up" if p["connected"] else "down"
        trust = "trusted" if p["trusted"] else "untrusted"
        lines.append(
            f"  {peer_text(p['node_id'][:16])} {state:4} {peer_text(p['owner_status']):10} "
            f"{trust:9} {peer_text(p['address'] or '-')} seen {p['last_seen_s']:.1f}s ago"
            + (f"; {link_text(p)}" if p["connected"] else "")
        )
    relay = doc.get("relay")
    if relay and relay["enabled"]:
        lines.append(
            f"relay    {relay['circuits_open']} circuits open, {relay['circuits_total']} opened, "
            f"{human_bytes(relay['bytes_forwarded'])} forwarded (allow {relay['allow']})"
        )
    topo = doc.get("topology")
    if topo:
        lines.append(
            f"topology {peer_text(topo['topology_id'])} ({topo['role']}, {topo['state']})"
        )
        placed = {
            st["stage_index"]: st.get("placement") for st in topo.get("stage_status", [])
        }
        for s in topo["stages"]:
            where = placed.get(s["stage_index"])
            lines.append(
                f"  stage {s['stage_index']}: layers {s['layer_start']}..{s['layer_end']} on "
                f"{peer_text(s['node_id'][:16])}"
                + ("" if not where else f" ({peer_text(where['device'])}: {where['mode']})")
            )
    else:
        lines.append("topology none")
    transfers = doc.get("transfers")
    if transfers:
        stage, c = transfers["stage"], transfers["counters"]
        if stage:
            lines.append(
                f"stage    {stage['stage_index']} (layers {stage['layer_start']}.."
                f"{stage['layer_end']}) {stage['state']}"
                + (f" ({peer_text(stage['error'])})" if stage["error"] else "")
                + (f", report {peer_text(stage['report'])}" if stage["report"] else "")
            )
        got = c["fetched_bytes"]
        lines.append(
            f"bytes    fetched peer {got['peer']} hub {got['hub']} cached {got['cache']}; "
            f"served {c['served_bytes']}; {len(transfers['active'])} transfers active"
        )
    loaded = doc.get("stage")
    if loaded:
        lines.append(
            f"runs     on {peer_text(loaded.get('device', 'CPU'))} "
            f"({loaded.get('placement', 'cpu')}), "
            f"{human_bytes(loaded.get('device_memory_bytes', 0))} in device memory"
            + (f"; fallback: {loaded['device_fallback']}" if loaded.get("device_fallback") else "")
        )
    cache = doc.get("cache")
    if cache:
        lines.append(render_cache(cache))
    serving = doc.get("serving")
    if serving:
        lines += render_serving(serving)
    return "\n".join(lines)


def device_lines(devices: Mapping[str, Any] | None) -> list[str]:
    """This node's devices (what its hello advertises): name, type, free/total memory."""
    if not devices:
        return []
    parts = [
        f"{peer_text(d['name'])} {d['type']} {human_bytes(d['free_bytes'])} free of "
        f"{human_bytes(d['total_bytes'])}"
        for d in devices["list"]
    ]
    moe = "; experts in RAM" if devices.get("experts_on_cpu") else ""
    return [f"devices  {'; '.join(parts)}; stages on {peer_text(devices['stage'])}{moe}"]


def render_cache(cache: Mapping[str, Any]) -> str:
    """Hub cache use vs budget (``auto``: derived from the disk), and what eviction did."""
    used = cache.get("used_bytes")
    budget = cache.get("budget_bytes") or 0
    text = f"cache    {'-' if used is None else used} bytes used of "
    text += f"{budget} budget" if budget else "no budget (disk free space only)"
    notes = [f"{100 * used / budget:.0f}%"] if budget and used is not None else []
    notes += ["auto"] if budget and cache.get("budget_auto") else []
    text += f" ({', '.join(notes)})" if notes else ""
    return text + (
        f"; evicted {cache.get('evicted_blobs', 0)} blobs ({cache.get('evicted_bytes', 0)} "
        f"bytes), {cache.get('refusals', 0)} fetches refused"
    )


def render_serving(serving: Mapping[str, Any]) -> list[str]:
    """A serving coordinator's section of ``mesh-node status`` (text)."""
    state = serving.get("state")
    head = f"serving  {serving.get('model')} {state}"
    if state == "ready":
        head += f" ({serving.get('stages')} stage(s), topology {serving.get('topology_id')})"
    else:
        # a failed stage's reason is its node's words
        head += f" [{peer_text(serving.get('code'))}]: {peer_text(serving.get('reason'))}"
    requests = serving.get("requests") or {}
    done = ", ".join(f"{k} {v}" for k, v in sorted(requests.items())) if requests else "none"
    speed = serving.get("decode_tokens_per_s")
    lines = [
        head,
        f"  requests in flight {serving.get('requests_in_flight', 0)}, queued "
        f"{serving.get('requests_queued', 0)}; done: {done}; failovers "
        f"{serving.get('failovers_total', 0)}; decode "
        + (f"{speed} tok/s" if speed is not None else "-"),
    ]
    strategy = serving.get("speculative_strategy")
    if strategy:
        sp = serving.get("speculative") or {}
        lines.append(
            f"  speculative {peer_text(str(strategy))}: accepted {sp.get('accepted', 0)} of "
            f"{sp.get('proposed', 0)} drafted tokens in {sp.get('verify_passes', 0)} verify "
            "windows"
        )
    replicas = serving.get("replicas") or []
    if len(replicas) > 1:  # one line per replica
        for r in replicas:
            why = (
                ""
                if r.get("state") == "ready"
                else f" [{peer_text(r.get('code'))}]: {peer_text(r.get('reason'))}"
            )
            lines.append(
                f"  replica {r.get('replica')} {r.get('state')}{why}; nodes "
                + (", ".join(peer_text(str(n))[:12] for n in r.get("nodes") or []) or "-")
                + f"; in flight {r.get('requests_in_flight', 0)}, outstanding "
                f"{r.get('outstanding_tokens', 0)} tok, total {r.get('requests_total', 0)}"
            )
    return lines


def render_topology(topo: Mapping[str, Any]) -> str:
    """``mesh-node topology``'s text: the coordinator's view, each stage with its worker's
    answer (a peer's words: escaped)."""
    lines = [
        f"topology {peer_text(topo['topology_id'])} ({topo['state']}) run "
        f"{peer_text(topo['run_id'])}",
        f"package {peer_text(topo['package_ref'])} manifest {topo['manifest_sha256'][:16]}...",
    ]
    placed = {
        st["stage_index"]: st.get("placement") for st in topo.get("stage_status", [])
    }
    for s in topo["stages"]:
        ack = topo["acks"].get(s["node_id"], "coordinator")
        where = placed.get(s["stage_index"])
        on = "" if not where else f", {peer_text(where['device'])}: {where['mode']}"
        lines.append(
            f"  stage {s['stage_index']}: layers {s['layer_start']}..{s['layer_end']} on "
            f"{peer_text(s['node_id'][:12])} ({peer_text(ack)}{on})"
        )
    plan = topo.get("prediction")  # which planner, and what it predicted
    if plan:
        ms = plan.get("predicted_ms_per_token")
        predicted = "" if ms is None else f", predicted {ms:.2f} ms/token"
        lines.append(f"planner {plan.get('planner')}{predicted}: {plan.get('why')}")
    return "\n".join(lines)
