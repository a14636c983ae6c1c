"""The mesh node's settings: the node TOML's keys (listen, peers, timeouts, trust) and its
``[serving]``, ``[http]``, ``[security]`` and ``[dial_via]`` tables, validated into frozen
objects. The file itself is read, and the environment, by the one reader,
``skippy.config`` (``load_node_config``, ``read_environment``); the helpers that validate a
value (sizes, seconds, unknown keys) are its too, so every table reports bad values the same
way. Units are in the names (``..._s``, ``..._bytes``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from protocol.constants import DEFAULT_LIMITS, MAX_RELAYS, RELAYED_MARKER
from skippy.config import (
    ENV_CALIBRATION,
    ArtifactTransfer,
    Environment,
    NodeConfig,
    RuntimeSettings,
    bad_value,
    load_node_config,
    parse_artifact_transfer,
    parse_size,
    positive_seconds,
    read_environment,
    refuse_unknown_keys,
    runtime_settings,
)
from skippy.errors import UsageError
from skippy.serving.replicas import MAX_REPLICAS

# Every top-level key a node TOML may hold; anything else is an error naming the key.
NODE_KEYS = frozenset(
    {
        "listen",
        "identity",
        "certificate",
        "data_dir",
        "peers",
        "trusted_owners",
        "artifact_transfer",
        "artifact_serve_bytes_per_s",
        "swarm_transfer",
        "memory_budget",
        "heartbeat_interval_s",
        "peer_loss_timeout_s",
        "idle_timeout_s",
        "handshake_timeout_s",
        "http",  # the HTTP surface's address, or the [http] table (HttpSettings)
        "http_public",
        "serving",  # [serving]: split serving (ServingSettings)
        "runtime",  # [runtime]: the stage runtime's device (skippy.config.RuntimeSettings)
        "security",  # [security]: who may coordinate us, peer budgets (SecuritySettings)
        "speculative",  # skippy.generation reads these two sections (skippy.config)
        "models",
        "dial_via",  # {node id = "ws://HOST:PORT"}: where to dial a given peer
        "calibration",  # auto | off: calibrate the stage runtime, advertise it
        "lan_discovery",  # find nodes of the same owner on the LAN by mDNS (off by default)
        "lab_lock",  # the lab's lifeline: the node stops once nothing holds this file's lock
        "relays",  # relays this node keeps a link to and is reachable through
        "relay",  # [relay]: this node relays circuits for others (RelaySettings)
        "direct_upgrade",  # relayed links try a direct connection (default true)
    }
)

_NODE_ID_RE = re.compile(r"^[0-9a-f]{64}$")
_HOSTPORT_RE = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9.-]+)):(?P<port>\d{1,5})$"
)

DEFAULT_HEARTBEAT_INTERVAL_S = 2.0
DEFAULT_PEER_LOSS_TIMEOUT_S = 10.0
DEFAULT_IDLE_TIMEOUT_S = DEFAULT_LIMITS.idle_timeout_s
DEFAULT_HANDSHAKE_TIMEOUT_S = DEFAULT_LIMITS.handshake_timeout_s


@dataclass(frozen=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class PeerAddress:
    """``ws://host:port#<node-id>``: where to dial, and (optionally) who must answer."""

    host: str
    port: int
    node_id: str | None = None

    @property
    def url(self) -> str:
        return f"ws://{HostPort(self.host, self.port)}"

    def __str__(self) -> str:
        return self.url + (f"#{self.node_id}" if self.node_id else "")


@dataclass(frozen=True)
class RelayedAddress:
    """``ws://relay:port#<relay id>/relayed/<node id>``: ``node_id`` reached through a circuit
    on ``relay`` (which must name its id: a circuit is asked of an authenticated relay)."""

    relay: PeerAddress
    node_id: str

    def __post_init__(self) -> None:
        if self.relay.node_id is None or not _NODE_ID_RE.match(self.node_id):
            raise bad_value("relayed address", "needs the relay's and the target's ids", self)

    def __str__(self) -> str:
        return f"{self.relay}{RELAYED_MARKER}{self.node_id}"


DialAddress = PeerAddress | RelayedAddress


SERVING_KEYS = frozenset(
    {
        "engine",
        "n_ctx",
        "threads",
        "max_sessions",
        "max_queue",
        "prefill_chunk",
        "max_frame_bytes",
        "max_inflight_frames",
        "token_timeout_s",
        "failover_timeout_s",
        "ready_timeout_s",
        "queue_timeout_s",
        "replicas",
        "expect_serve",
        "repack",
    }
)


@dataclass(frozen=True)
class ServingSettings:
    """``[serving]`` of the node TOML: how this node runs its stage of a split and, on a
    coordinator, how it admits requests. Every wait has a timeout."""

    # The stage runtime engine (ggml; numpy is the f32 oracle), or llama: the whole model in
    # llama.cpp on this node alone (also chosen for a family the stage runtime does not cover).
    engine: str = "ggml"
    n_ctx: int = 2048  # positions per session (prompt + completion); bounds KV memory
    # CPU threads of this node's stage; None ("auto", the default): this machine's cores
    # divided among the stages of the split that run on it (peers' host fingerprints).
    threads: int | None = None
    max_sessions: int = 4  # requests in flight at once (one session per request per stage)
    max_queue: int = 16  # requests waiting for a slot; beyond, 429
    prefill_chunk: int = 128  # prompt tokens per activation frame (pipelined prefill)
    max_frame_bytes: int = 8 * 1024 * 1024  # largest activation frame accepted
    max_inflight_frames: int = 4  # unacknowledged frames per link and session
    token_timeout_s: float = 60.0  # a sampled token must come back within this
    failover_timeout_s: float = 120.0  # a lost stage must be replaced (and ready) within this
    ready_timeout_s: float = 600.0  # `mesh-node serve`: peers, fetch and load within this
    queue_timeout_s: float = 300.0  # a queued request gets a slot within this, else 429
    # Coordinator: independent pipelines of the package over disjoint peers.
    replicas: int = 1
    # A `mesh-node run` node that will be told to serve (the control operation ``serve``, as
    # the lab's coordinator): /health says ``loading``, not ``ok``, until a completion would be
    # served. `mesh-node serve` implies it.
    expect_serve: bool = False
    # Repack quantized weights into the CPU backend's interleaved layout, as llama.cpp's
    # default does (ggml engine): faster decode, logits equal to llama.cpp's default rather
    # than its repacking-off run, and the repacked weights cost RAM beside the mapping.
    repack: bool = False


def serving_settings(raw: object) -> ServingSettings:
    """Parse ``[serving]`` (absent: the defaults); unknown keys are errors naming the key."""
    if raw is None:
        return ServingSettings()
    if not isinstance(raw, Mapping):
        raise bad_value("serving", "expected a table", raw)
    refuse_unknown_keys(raw, "serving", SERVING_KEYS)
    base = ServingSettings()
    values: dict[str, Any] = {}
    for key, value in raw.items():
        default = getattr(base, key)
        name = f"serving.{key}"
        if key == "engine":
            if value not in ("ggml", "numpy", "llama"):
                raise bad_value(name, "expected ggml, numpy or llama", value)
            values[key] = value
        elif key == "threads" and value == "auto":
            values[key] = None
        elif key == "threads" and (
            isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024
        ):
            raise bad_value(name, 'expected "auto" or an integer in 1..1024', value)
        elif key == "replicas" and (
            isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_REPLICAS
        ):
            raise bad_value(name, f"expected an integer in 1..{MAX_REPLICAS}", value)
        elif key in ("expect_serve", "repack"):
            if not isinstance(value, bool):
                raise bad_value(name, "expected true or false", value)
            values[key] = value
        elif key == "max_frame_bytes":
            values[key] = parse_size(value, name)
            if values[key] < 1024:
                raise bad_value(name, "must be at least 1KiB", value)
        elif isinstance(default, float):
            values[key] = positive_seconds(raw, key, default) if key in raw else default
        elif isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
            raise bad_value(name, "expected an integer in 1..1048576", value)
        else:
            values[key] = value
    return ServingSettings(**values)


# --- [http]: the node's HTTP surface (mesh_node.http) ---------------------------------
HTTP_KEYS = frozenset(
    {
        "listen",
        "public",
        "api_key_file",
        "access_log",
        "allowed_origins",
        "tls_cert",
        "tls_key",
        "max_body_bytes",
        "max_concurrent_bodies",
        "max_buffered_body_bytes",
        "body_read_timeout_s",
        "body_deadline_s",
        "max_json_depth",
        "shutdown_grace_s",
    }
)
_ORIGIN_RE = re.compile(
    r"^https?://[A-Za-z0-9.-]+(?::\d{1,5})?$|^https?://\[[0-9A-Fa-f:.]+\](?::\d{1,5})?$"
)


@dataclass(frozen=True)
class HttpSettings:
    """``[http]`` of the node TOML (``http = "HOST:PORT"`` alone is the address only): who may
    call the HTTP surface and how much a request may make the node hold. Keys are loaded (and
    their file's mode checked) by ``mesh_node.http.keys``; ``api_key`` is
    ``MESH_NODE_API_KEY``."""

    api_key_file: Path | None = None
    api_key: str | None = field(default=None, repr=False)
    access_log: bool = True  # one line per request on the node's log
    allowed_origins: tuple[str, ...] = ()  # browser origins besides the node's own
    tls_cert: Path | None = None  # both, or neither: HTTPS on the same listener
    tls_key: Path | None = None
    max_body_bytes: int = 16 * 1024 * 1024 + 64 * 1024  # the prompt guard's 16 MiB, plus JSON
    max_concurrent_bodies: int = 8  # request bodies being read at once; beyond, 503
    max_buffered_body_bytes: int = 48 * 1024 * 1024  # all bodies being read, together
    body_read_timeout_s: float = 10.0  # between two pieces of one body
    body_deadline_s: float = 30.0  # the whole body
    max_json_depth: int = 32  # nesting of arrays and objects in a request body
    shutdown_grace_s: float = 2.0  # at SIGINT/SIGTERM, open requests may finish within this


def http_settings(
    raw: Mapping[str, Any] | None, base: Path, api_key: str | None = None
) -> HttpSettings:
    """Parse ``[http]`` (``None``: the defaults); paths resolve against the config's folder;
    unknown keys are errors naming the key."""
    raw = raw or {}
    refuse_unknown_keys(raw, "http", HTTP_KEYS)

    def path(key: str, *, resolve: bool = True) -> Path | None:
        value = raw.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise bad_value(f"http.{key}", "expected a path", value)
        joined = base / Path(value).expanduser()
        return joined.resolve() if resolve else Path(os.path.abspath(joined))

    def count(key: str, default: int) -> int:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
            raise bad_value(f"http.{key}", "expected an integer in 1..1048576", value)
        return value

    d = HttpSettings()
    access_log = raw.get("access_log", True)
    if not isinstance(access_log, bool):
        raise bad_value("http.access_log", "expected true or false", access_log)
    origins = raw.get("allowed_origins", [])
    if not isinstance(origins, list) or not all(
        isinstance(o, str) and _ORIGIN_RE.match(o) for o in origins
    ):
        raise bad_value(
            "http.allowed_origins",
            "expected a list of origins such as https://app.example or http://127.0.0.1:3000",
            origins,
        )
    cert, key = path("tls_cert"), path("tls_key")
    if (cert is None) != (key is None):
        raise bad_value("http.tls_cert", "tls_cert and tls_key go together", str(cert or key))
    sizes = {
        k: parse_size(raw.get(k, getattr(d, k)), f"http.{k}")
        for k in ("max_body_bytes", "max_buffered_body_bytes")
    }
    if sizes["max_buffered_body_bytes"] < sizes["max_body_bytes"]:
        raise bad_value(
            "http.max_buffered_body_bytes",
            "must be at least max_body_bytes",
            sizes["max_buffered_body_bytes"],
        )
    grace = raw.get("shutdown_grace_s", d.shutdown_grace_s)
    if isinstance(grace, bool) or not isinstance(grace, int | float) or not 0 <= grace <= 600:
        raise bad_value("http.shutdown_grace_s", "expected seconds in 0..600", grace)
    return HttpSettings(
        # Not resolved: the key file's reader refuses a symbolic link rather than follow it.
        api_key_file=path("api_key_file", resolve=False),
        shutdown_grace_s=float(grace),
        api_key=api_key,
        access_log=access_log,
        allowed_origins=tuple(o.lower() for o in origins),
        tls_cert=cert,
        tls_key=key,
        max_concurrent_bodies=count("max_concurrent_bodies", d.max_concurrent_bodies),
        body_read_timeout_s=positive_seconds(raw, "body_read_timeout_s", d.body_read_timeout_s),
        body_deadline_s=positive_seconds(raw, "body_deadline_s", d.body_deadline_s),
        max_json_depth=count("max_json_depth", d.max_json_depth),
        **sizes,
    )


# --- [security]: untrusted peers ---------------------------------------------------
PeerScope = Literal["trusted", "any"]
MIN_PEER_MEMORY_BUDGET = 16 * 1024 * 1024  # a few streams' windows: below, nothing works
SECURITY_KEYS = frozenset(
    {
        "accept_topologies_from",
        "place_stages_on",
        "peer_memory_budget",
        "cache_budget",
        "partials_budget",
        "min_transfer_bytes_per_s",
        "max_members",
    }
)


@dataclass(frozen=True)
class SecuritySettings:
    """``[security]`` of the node TOML (docs/security.md, "Untrusted peers"). ``trusted``
    means: a verified owner that is this node's own (verified) owner or in ``trusted_owners``;
    ``any`` is for labs (the node says so in its log at start)."""

    # Whose signed topologies this node accepts (and so whom it fetches from and serves for).
    accept_topologies_from: PeerScope = "trusted"
    # Which peers this node, as coordinator, places stages on (separate from artifact policy).
    place_stages_on: PeerScope = "trusted"
    # All links' buffered and in-flight received bytes together (stream data, messages).
    peer_memory_budget_bytes: int = 256 * 1024 * 1024
    # The most the hub cache may hold after a stage's fetch: "auto" derives it from the disk
    # when the node starts (skippy.transfer.disk.auto_cache_budget); 0: no budget, only the
    # disk's free space.
    cache_budget_bytes: int | Literal["auto"] = "auto"
    # Partials of failed or abandoned fetches kept for a resume; the oldest go first.
    partials_budget_bytes: int = 2 * 1024 * 1024 * 1024
    # A peer transfer slower than this (over an idle timeout's window) falls back to the hub.
    min_transfer_bytes_per_s: int = 64 * 1024
    # Membership entries (authenticated peers) this node keeps; a bench or a small lab may
    # lower it (docs/security.md "Numbers"). Never above mesh_node's MAX_MEMBERS.
    max_members: int = 1024


# --- [relay]: circuits this node splices for others ---------------------------------------------
RELAY_KEYS = frozenset(
    {
        "enable",
        "allow",
        "circuits",
        "circuits_per_peer",
        "circuit_bytes_per_s",
        "circuit_bytes",
        "circuit_lifetime_s",
    }
)


@dataclass(frozen=True)
class RelaySettings:
    """``[relay]`` of the node TOML (docs/mesh-node.md, "Relays"). Off by default. ``allow``
    is the trust vocabulary of ``[security]``: both ends of a circuit must be in it."""

    enable: bool = False
    allow: PeerScope = "trusted"
    circuits: int = 64  # circuits open at once, all peers together
    circuits_per_peer: int = 8  # circuits one peer may have open (as either end)
    circuit_bytes_per_s: int = 16 * 1024 * 1024  # each direction of one circuit (0: no cap)
    circuit_bytes: int = 0  # both directions of one circuit together (0: no cap)
    circuit_lifetime_s: float = 24 * 3600.0


def relay_settings(raw: object) -> RelaySettings:
    """Parse ``[relay]`` (absent: relaying off); unknown keys are errors naming the key."""
    if raw is None:
        return RelaySettings()
    if not isinstance(raw, Mapping):
        raise bad_value("relay", "expected a table", raw)
    refuse_unknown_keys(raw, "relay", RELAY_KEYS)
    values: dict[str, Any] = {}
    if "enable" in raw:
        if not isinstance(raw["enable"], bool):
            raise bad_value("relay.enable", "expected true or false", raw["enable"])
        values["enable"] = raw["enable"]
    if "allow" in raw:
        if raw["allow"] not in ("trusted", "any"):
            raise bad_value("relay.allow", "expected trusted or any", raw["allow"])
        values["allow"] = raw["allow"]
    for key in ("circuits", "circuits_per_peer"):
        if key in raw:
            n = raw[key]
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 4096:
                raise bad_value(f"relay.{key}", "expected an integer from 1 to 4096", n)
            values[key] = n
    for key in ("circuit_bytes_per_s", "circuit_bytes"):
        if key in raw:
            values[key] = parse_size(raw[key], f"relay.{key}")
    if "circuit_lifetime_s" in raw:
        values["circuit_lifetime_s"] = positive_seconds(
            {"relay.circuit_lifetime_s": raw["circuit_lifetime_s"]}, "relay.circuit_lifetime_s", 1.0
        )
    return RelaySettings(**values)


def _cache_budget(value: object) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    try:
        return parse_size(value, "security.cache_budget")
    except UsageError:
        raise bad_value(
            "security.cache_budget",
            'expected "auto" (from the disk, the default), 0 (no budget) or a size such as "20GiB"',
            value,
        ) from None


def security_settings(raw: object) -> SecuritySettings:
    """Parse ``[security]`` (absent: the defaults); unknown keys are errors naming the key."""
    if raw is None:
        return SecuritySettings()
    if not isinstance(raw, Mapping):
        raise bad_value("security", "expected a table", raw)
    refuse_unknown_keys(raw, "security", SECURITY_KEYS)
    values: dict[str, Any] = {}
    for key in ("accept_topologies_from", "place_stages_on"):
        if key in raw:
            if raw[key] not in ("trusted", "any"):
                raise bad_value(f"security.{key}", "expected trusted or any", raw[key])
            values[key] = raw[key]
    for key in ("peer_memory_budget", "cache_budget", "partials_budget"):
        if key in raw:
            if key == "cache_budget":
                values["cache_budget_bytes"] = _cache_budget(raw[key])
                continue
            values[f"{key}_bytes"] = parse_size(raw[key], f"security.{key}")
    if values.get("peer_memory_budget_bytes", MIN_PEER_MEMORY_BUDGET) < MIN_PEER_MEMORY_BUDGET:
        raise bad_value(
            "security.peer_memory_budget", "must be at least 16MiB", raw["peer_memory_budget"]
        )
    if "min_transfer_bytes_per_s" in raw:
        values["min_transfer_bytes_per_s"] = parse_size(
            raw["min_transfer_bytes_per_s"], "security.min_transfer_bytes_per_s"
        )
    if "max_members" in raw:
        members = raw["max_members"]
        if not isinstance(members, int) or isinstance(members, bool) or not 1 <= members <= 1024:
            raise bad_value("security.max_members", "expected an integer from 1 to 1024", members)
        values["max_members"] = members
    return SecuritySettings(**values)


@dataclass(frozen=True)
class NodeSettings:
    """Everything ``mesh-node run`` needs, validated; paths resolved against the config file."""

    config_path: Path
    listen: HostPort
    identity_path: Path
    certificate_path: Path | None
    data_dir: Path
    peers: tuple[DialAddress, ...]  # a relayed address is dialled through its relay
    trusted_owners: tuple[str, ...]
    artifact_transfer: ArtifactTransfer
    memory_budget_bytes: int
    # Total rate at which this node serves artifacts to peers (0: unlimited): an uplink cap.
    artifact_serve_bytes_per_s: int = 0
    # Serve chunk ranges and (coordinating) signed swarm source lists beside
    # artifact-transfer; false: workers fetch each file from this node alone, as one chunk
    # checked against the manifest's SHA-256.
    swarm_transfer: bool = True
    # Announce this node's owner fingerprint on the LAN by multicast DNS and dial the nodes of
    # the same owner that announce theirs (mesh_node.lan_discovery).
    lan_discovery: bool = False
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    peer_loss_timeout_s: float = DEFAULT_PEER_LOSS_TIMEOUT_S
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    # The operator page, /api/status and /metrics (``None``: not served). A bind that is not
    # loopback needs ``http_public`` (checked where the server starts, after CLI overrides).
    http: HostPort | None = None
    http_public: bool = False
    warnings: tuple[str, ...] = ()
    serving: ServingSettings = field(default_factory=ServingSettings)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    # Node id -> the address to dial that peer at instead of the one it advertises
    # or was configured with (a relay, a tunnel, a port forward; the lab's emulated links).
    dial_via: Mapping[str, PeerAddress] = field(default_factory=dict)
    http_settings: HttpSettings = field(default_factory=HttpSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    # ``mesh-node run`` calibrates the stage runtime (cached in data_dir) and
    # advertises it in its hello, for cost-aware planning; ``calibration = "off"`` skips it.
    calibrate: bool = True
    # ``mesh-node lab`` holds this file's lock while it runs; the node stops once nobody does
    # (``mesh_node.lifeline``). None: a node on its own.
    lab_lock: Path | None = None
    # Relays this node keeps linked and advertises as its relayed addresses (a node that
    # cannot be dialled); and what it offers as a relay itself (off by default).
    relays: tuple[PeerAddress, ...] = ()
    relay: RelaySettings = field(default_factory=RelaySettings)
    # A relayed link tries a direct connection (the addresses peers observed) and moves new
    # streams to it when it works, the relayed link kept as the fallback (mesh_node.hole_punch).
    direct_upgrade: bool = True

    @property
    def hub_cache_dir(self) -> Path:
        return self.data_dir / "hub"

    @property
    def control_socket(self) -> Path:
        return self.data_dir / "mesh-node.sock"


def parse_host_port(text: object, key: str) -> HostPort:
    m = _HOSTPORT_RE.match(text) if isinstance(text, str) else None
    if m is None or not 0 <= int(m.group("port")) <= 65535:
        raise bad_value(key, "expected HOST:PORT (e.g. 127.0.0.1:7000; port 0 = any)", text)
    return HostPort(m.group("v6") or m.group("host"), int(m.group("port")))


def parse_http_bind(value: object, key: str = "http") -> HostPort:
    """The status page's address: ``HOST:PORT``, or a bare port (``8080``), which means
    loopback (``127.0.0.1:8080``): the page is local unless the operator names a host."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str) and value.strip().isdigit():
        value = f"127.0.0.1:{value.strip()}"
    return parse_host_port(value, key)


def parse_relayed_address(text: object, key: str = "peers") -> RelayedAddress:
    """``ws://HOST:PORT#<relay id>/relayed/<node id>``."""
    if not isinstance(text, str) or RELAYED_MARKER not in text:
        raise bad_value(
            key, "a relayed address is ws://HOST:PORT#<relay-id>/relayed/<node-id>", text
        )
    relay_text, _, node_id = text.partition(RELAYED_MARKER)
    relay = parse_peer_address(relay_text, key)
    if relay.node_id is None or not _NODE_ID_RE.match(node_id):
        raise bad_value(key, "a relayed address names the relay's id and the node's id", text)
    return RelayedAddress(relay, node_id)


def parse_dial_address(text: object, key: str = "peers") -> DialAddress:
    """A ``peers`` entry: ``ws://HOST:PORT#<node id>``, or a relayed address
    ``ws://HOST:PORT#<relay id>/relayed/<node id>``."""
    if isinstance(text, str) and RELAYED_MARKER in text:
        return parse_relayed_address(text, key)
    return parse_peer_address(text, key)


def parse_relays(value: object) -> tuple[PeerAddress, ...]:
    """``relays = ["ws://HOST:PORT#<relay id>", ...]``: the relay's id is required (a circuit
    is asked only of the relay that proved it), at most ``MAX_RELAYS``."""
    if not isinstance(value, list) or len(value) > MAX_RELAYS:
        raise bad_value(
            "relays", f"expected a list of at most {MAX_RELAYS} ws://HOST:PORT#<id>", value
        )
    out = tuple(dict.fromkeys(parse_peer_address(v, "relays") for v in value))
    for address in out:
        if address.node_id is None:
            raise bad_value("relays", "a relay's address needs its #<node-id>", str(address))
    return out


def parse_peer_address(text: object, key: str = "peers") -> PeerAddress:
    """``ws://host:port`` with an optional ``#<64 hex node id>`` the peer must prove."""
    if not isinstance(text, str) or not text.startswith("ws://"):
        raise bad_value(key, "a peer is ws://HOST:PORT#<node-id>", text)
    rest, _, node_id = text[len("ws://") :].partition("#")
    hp = parse_host_port(rest, key)
    if hp.port == 0:
        raise bad_value(key, "a peer's port cannot be 0", text)
    if node_id and not _NODE_ID_RE.match(node_id):
        raise bad_value(key, "the #<node-id> must be 64 lowercase hex characters", text)
    return PeerAddress(hp.host, hp.port, node_id or None)


def _default_memory_budget() -> int:
    # Half the machine's memory: a node that states nothing still gets placed sensibly.
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def node_settings(config: NodeConfig, env: Environment | None = None) -> NodeSettings:
    """The node keys of a loaded config file (``identity`` is required)."""
    if config.path is None:
        raise UsageError("mesh-node needs a config file (--config node.toml)", code="usage")
    env = read_environment() if env is None else env
    raw, base = config.raw, config.path.parent

    def path_of(key: str, default: str | None = None) -> Path | None:
        value = raw.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise bad_value(key, "expected a path", value)
        return (base / Path(value).expanduser()).resolve()

    identity = path_of("identity")
    if identity is None:
        raise bad_value("identity", "required: the node's key file (mesh-node keygen PATH)")
    peers_raw = raw.get("peers", [])
    if not isinstance(peers_raw, list):
        raise bad_value("peers", "expected a list of ws://HOST:PORT#<node-id>", peers_raw)
    owners = raw.get("trusted_owners", [])
    if not isinstance(owners, list) or not all(
        isinstance(o, str) and _NODE_ID_RE.match(o) for o in owners
    ):
        raise bad_value("trusted_owners", "expected a list of owner ids (64 lowercase hex)", owners)
    warnings = list(env.warnings)
    transfer = env.artifact_transfer  # the environment wins (spec "Peer Cache Transfer")
    if transfer is None:
        word = raw.get("artifact_transfer", "disabled")
        if not isinstance(word, str):
            raise bad_value("artifact_transfer", "expected open, trusted or disabled", word)
        transfer, warning = parse_artifact_transfer(word, "artifact_transfer")
        warnings += [warning] if warning else []
    heartbeat = positive_seconds(raw, "heartbeat_interval_s", DEFAULT_HEARTBEAT_INTERVAL_S)
    peer_loss = positive_seconds(raw, "peer_loss_timeout_s", DEFAULT_PEER_LOSS_TIMEOUT_S)
    if peer_loss <= heartbeat:
        raise bad_value(
            "peer_loss_timeout_s", "must be longer than heartbeat_interval_s", peer_loss
        )
    budget = raw.get("memory_budget")
    http = raw.get("http")
    http_public = raw.get("http_public", False)
    if not isinstance(http_public, bool):
        raise bad_value("http_public", "expected true or false", http_public)
    http_table: Mapping[str, Any] | None = None
    if isinstance(http, Mapping):  # the [http] table: its listen/public keys, and the rest
        http_table, http = http, http.get("listen")
        table_public = http_table.get("public", False)
        if not isinstance(table_public, bool):
            raise bad_value("http.public", "expected true or false", table_public)
        http_public = http_public or table_public
    data_dir = path_of("data_dir", "data")
    assert data_dir is not None  # it has a default (typing only)
    return NodeSettings(
        config_path=config.path,
        listen=parse_host_port(raw.get("listen", "127.0.0.1:0"), "listen"),
        identity_path=identity,
        certificate_path=path_of("certificate"),
        data_dir=data_dir,
        peers=tuple(parse_dial_address(p) for p in peers_raw),
        trusted_owners=tuple(dict.fromkeys(owners)),
        artifact_transfer=transfer,
        memory_budget_bytes=(
            _default_memory_budget() if budget is None else parse_size(budget, "memory_budget")
        ),
        artifact_serve_bytes_per_s=parse_size(
            raw.get("artifact_serve_bytes_per_s", 0), "artifact_serve_bytes_per_s"
        ),
        swarm_transfer=_swarm_transfer(raw),
        lan_discovery=_lan_discovery(raw),
        heartbeat_interval_s=heartbeat,
        peer_loss_timeout_s=peer_loss,
        idle_timeout_s=positive_seconds(raw, "idle_timeout_s", DEFAULT_IDLE_TIMEOUT_S),
        handshake_timeout_s=positive_seconds(
            raw, "handshake_timeout_s", DEFAULT_HANDSHAKE_TIMEOUT_S
        ),
        http=None if http is None else parse_http_bind(http),
        http_public=http_public,
        warnings=tuple(warnings),
        serving=serving_settings(raw.get("serving")),
        runtime=runtime_settings(raw.get("runtime")),
        dial_via=parse_dial_via(raw.get("dial_via", {})),
        http_settings=http_settings(http_table, base, env.api_key),
        security=security_settings(raw.get("security")),
        calibrate=_calibration(env.calibration, raw.get("calibration", "auto")),
        lab_lock=path_of("lab_lock"),
        relays=parse_relays(raw.get("relays", [])),
        relay=relay_settings(raw.get("relay")),
        direct_upgrade=_direct_upgrade(raw),
    )


def _calibration(env_word: str | None, toml_word: object) -> bool:
    """``calibration``: auto (calibrate at start, the default) or off; the environment wins."""
    for source, word in ((ENV_CALIBRATION, env_word), ("calibration", toml_word)):
        if word is None:
            continue
        if word not in ("auto", "off"):
            raise bad_value(source, "expected auto or off", word)
        return word == "auto"
    return True


def _swarm_transfer(raw: Mapping[str, Any]) -> bool:
    """``swarm_transfer = true|false`` (default true)."""
    value = raw.get("swarm_transfer", True)
    if not isinstance(value, bool):
        raise bad_value("swarm_transfer", "expected true or false", value)
    return value


def _direct_upgrade(raw: Mapping[str, Any]) -> bool:
    """``direct_upgrade = true|false`` (default true)."""
    value = raw.get("direct_upgrade", True)
    if not isinstance(value, bool):
        raise bad_value("direct_upgrade", "expected true or false", value)
    return value


def _lan_discovery(raw: Mapping[str, Any]) -> bool:
    """``lan_discovery = true|false`` (default false: a node announces nothing unasked)."""
    value = raw.get("lan_discovery", False)
    if not isinstance(value, bool):
        raise bad_value("lan_discovery", "expected true or false", value)
    return value


def parse_dial_via(value: object) -> dict[str, PeerAddress]:
    """``[dial_via]``: ``"<64 hex node id>" = "ws://HOST:PORT"``. The peer must still prove
    that id: the address changes where the bytes go, never whom the node accepts."""
    if not isinstance(value, Mapping):
        raise bad_value("dial_via", 'expected a table of "<node-id>" = "ws://HOST:PORT"', value)
    out: dict[str, PeerAddress] = {}
    for node_id, address in value.items():
        if not isinstance(node_id, str) or not _NODE_ID_RE.match(node_id):
            raise bad_value("dial_via", "keys must be node ids (64 lowercase hex)", node_id)
        parsed = parse_peer_address(address, f"dial_via.{node_id[:12]}")
        if parsed.node_id not in (None, node_id):
            raise bad_value("dial_via", "an address's #<node-id> must be its key", address)
        out[node_id] = PeerAddress(parsed.host, parsed.port, node_id)
    return out


# --- the node `mesh-node serve` creates when it has no --config (mesh_node.first_run) -------------
NODE_TOML_NAME = "node.toml"
DEFAULT_SERVE_LISTEN = "127.0.0.1:7000"


def default_node_toml(identity: str, certificate: str, listen: str = DEFAULT_SERVE_LISTEN) -> str:
    """The ``node.toml`` a first ``mesh-node serve`` writes into its data directory: paths
    relative to it, peers dialling in on loopback only, every other key at its default."""
    return (
        "# Written by `mesh-node serve` on its first run in this folder; it reads this file\n"
        "# (and so may you: mesh-node run/status --config THIS_FILE). Keys: docs/mesh-node.md.\n"
        f'identity = "{identity}"\n'
        f'certificate = "{certificate}"\n'
        'data_dir = "."\n'
        '# Where peers dial this node: loopback only. "0.0.0.0:7000" (or --listen) lets other\n'
        "# machines join; they need a certificate of this node's owner (owner.key here).\n"
        f'listen = "{listen}"\n'
    )


def read_node_config(path: Path | None) -> NodeConfig:
    """The node TOML through the one reader, every top-level key checked against the node's."""
    return load_node_config(path, NODE_KEYS)


def load_node_settings(path: Path, env: Environment | None = None) -> NodeSettings:
    return node_settings(read_node_config(path), env)
