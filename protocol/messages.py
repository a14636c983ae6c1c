"""msgpack message schemas: link messages (hello, peer gossip) and control-stream messages
(topology envelopes, stage ready reports and their acknowledgements), plus the
length-prefixed stream framing.

Every decoder is strict (exact keys, exact types, bounded sizes) and raises only
``ProtocolError``. What is gossiped is exactly what these schemas allow, and nothing else: a
node's listen address, its feature bits, its memory budget, its calibrated speed and its
devices' names, types and memory (hello) and other nodes' ids and listen addresses (peers).
No inventory, paths, cache roots or tokens can be expressed.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

from protocol import constants as c
from protocol.errors import ProtocolError
from protocol.frames import unpack_bounded

_U32 = struct.Struct(">I")
_MAX_BUDGET = 2**62


def _fail(message: str) -> ProtocolError:
    return ProtocolError("malformed_message", message)


def _check_keys(data: object, keys: set[str], what: str) -> dict[str, Any]:
    if not isinstance(data, dict) or set(data) != keys:
        raise _fail(f"a {what} message has exactly the fields {sorted(keys)}")
    if data.get("gen") != c.MESSAGE_GEN:
        raise _fail(f"a {what} message of generation {data.get('gen')!r}")
    return data


def _str(value: object, what: str, max_chars: int) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= max_chars:
        raise _fail(f"{what} must be a string of 1-{max_chars} characters")
    return value


def _opt_str(value: object, what: str, max_chars: int) -> str | None:
    return None if value is None else _str(value, what, max_chars)


def _int(value: object, what: str, hi: int = _MAX_BUDGET) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
        raise _fail(f"{what} must be an integer in 0..{hi}")
    return value


def _key(value: object, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != c.KEY_BYTES:
        raise _fail(f"{what} must be {c.KEY_BYTES} bytes")
    return value


# --- link messages --------------------------------------------------------------------------
MAX_CALIBRATED_S: Final = 60.0  # seconds per layer per token: anything slower is a bad figure


@dataclass(frozen=True)
class ComputeCost:
    """A node's calibrated stage-runtime speed (the hello key
    ``compute``): seconds per layer per token for decode and prefill, measured on layers of
    ``layer_bytes`` bytes of weights (so a planner can scale them to another model's layers)."""

    decode_s_per_layer: float
    prefill_s_per_layer: float
    layer_bytes: int

    def __post_init__(self) -> None:
        for name in ("decode_s_per_layer", "prefill_s_per_layer"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, float | int)
                or not math.isfinite(v)
                or not 0 < v <= MAX_CALIBRATED_S
            ):
                raise _fail(f"compute.{name} must be a number in (0, {MAX_CALIBRATED_S:g}]")
        _int(self.layer_bytes, "compute.layer_bytes")
        if self.layer_bytes < 1:
            raise _fail("compute.layer_bytes must be positive")

    def to_wire(self) -> dict[str, object]:
        return {
            "decode_s_per_layer": float(self.decode_s_per_layer),
            "prefill_s_per_layer": float(self.prefill_s_per_layer),
            "layer_bytes": self.layer_bytes,
        }

    @classmethod
    def from_wire(cls, value: object) -> ComputeCost:
        keys = {"decode_s_per_layer", "prefill_s_per_layer", "layer_bytes"}
        if not isinstance(value, dict) or set(value) != keys:
            raise _fail(f"compute has exactly the fields {sorted(keys)}")
        return cls(value["decode_s_per_layer"], value["prefill_s_per_layer"], value["layer_bytes"])


def _device_name(value: object, what: str) -> str:
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= c.MAX_DEVICE_NAME_CHARS
        or not value.isascii()
        or not value.isprintable()
    ):
        raise _fail(f"{what} must be 1-{c.MAX_DEVICE_NAME_CHARS} printable ASCII characters")
    return value


@dataclass(frozen=True)
class DeviceReport:
    """One of a node's ggml devices as its hello advertises it: name, type, free and total
    memory (the CPU's are the machine's RAM), and the calibrated speed measured on it, if any.
    A peer's report is input: every field is checked on construction."""

    name: str
    kind: str  # one of c.DEVICE_TYPES
    free_bytes: int
    total_bytes: int
    compute: ComputeCost | None = None

    def __post_init__(self) -> None:
        _device_name(self.name, "a device name")
        if self.kind not in c.DEVICE_TYPES:
            raise _fail(f"a device type is one of {', '.join(c.DEVICE_TYPES)}")
        _int(self.free_bytes, "a device's free_bytes")
        _int(self.total_bytes, "a device's total_bytes")
        if self.free_bytes > self.total_bytes:
            raise _fail(f"device {self.name}: free_bytes exceeds total_bytes")

    def to_wire(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "name": self.name,
            "type": self.kind,
            "free_bytes": self.free_bytes,
            "total_bytes": self.total_bytes,
        }
        if self.compute is not None:
            doc["compute"] = self.compute.to_wire()
        return doc

    @classmethod
    def from_wire(cls, value: object) -> DeviceReport:
        keys = {"name", "type", "free_bytes", "total_bytes"}
        if not isinstance(value, dict) or not keys <= set(value) <= keys | {"compute"}:
            raise _fail(f"a device has the fields {sorted(keys)} (and optionally compute)")
        compute = ComputeCost.from_wire(value["compute"]) if "compute" in value else None
        return cls(
            value["name"], value["type"], value["free_bytes"], value["total_bytes"], compute
        )


@dataclass(frozen=True)
class Devices:
    """A node's devices (the hello key ``devices``): the list, the one its stages run on
    (``stage_device``: ``[runtime] device`` resolved at start-up), and whether it keeps a
    mixture of experts' routed experts in RAM (``experts_on_cpu``: ``[runtime] cpu_moe``)."""

    devices: tuple[DeviceReport, ...]
    stage_device: str
    experts_on_cpu: bool = False

    def __post_init__(self) -> None:
        if not 0 < len(self.devices) <= c.MAX_DEVICES:
            raise _fail(f"devices lists 1-{c.MAX_DEVICES} devices")
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise _fail("a device is listed twice")
        if self.stage_device not in names:
            raise _fail("devices.stage names none of the listed devices")
        if not isinstance(self.experts_on_cpu, bool):
            raise _fail("devices.experts_on_cpu must be true or false")

    def get(self, name: str) -> DeviceReport | None:
        return next((d for d in self.devices if d.name == name), None)

    def to_wire(self) -> dict[str, object]:
        return {
            "list": [d.to_wire() for d in self.devices],
            "stage": self.stage_device,
            "experts_on_cpu": self.experts_on_cpu,
        }

    @classmethod
    def from_wire(cls, value: object) -> Devices:
        keys = {"list", "stage", "experts_on_cpu"}
        if not isinstance(value, dict) or set(value) != keys:
            raise _fail(f"devices has exactly the fields {sorted(keys)}")
        raw = value["list"]
        if not isinstance(raw, list) or not 0 < len(raw) <= c.MAX_DEVICES:
            raise _fail(f"devices.list is a list of 1-{c.MAX_DEVICES} devices")
        stage = _device_name(value["stage"], "devices.stage")
        return cls(tuple(DeviceReport.from_wire(d) for d in raw), stage, value["experts_on_cpu"])


@dataclass(frozen=True)
class Hello:
    """A node's advertisement, sent once per link right after the handshake."""

    listen: str | None  # ws://host:port where it accepts links, if any
    features: dict[str, tuple[str, ...]] = field(default_factory=dict)
    memory_budget_bytes: int = 0
    # Added later (optional: a hello without it is still valid): a salted fingerprint
    # of the sender's machine, so that nodes sharing its cores know each other.
    host: str | None = None
    # Added with it (optional too): a random id of the sender's process, new at every start, so
    # that a peer that relinks fast after a restart is known to have lost its state (a broken
    # connection alone is not a peer loss; a restarted process is).
    boot: str | None = None
    # Added later (optional): the sender's calibrated compute speed, for cost planning.
    compute: ComputeCost | None = None
    # Optional: relays (``ws://HOST:PORT#<relay id>``) the sender is reachable through, when
    # it cannot be dialled; an older node ignores the key.
    relays: tuple[str, ...] = ()
    # Optional: the sender's ggml devices and their memory, for placing stages by device.
    devices: Devices | None = None

    def encode(self) -> bytes:
        doc: dict[str, object] = {
            "t": "hello",
            "gen": c.MESSAGE_GEN,
            "listen": self.listen,
            "features": {k: list(v) for k, v in self.features.items()},
            "memory_budget_bytes": self.memory_budget_bytes,
        }
        if self.host is not None:
            doc["host"] = self.host
        if self.boot is not None:
            doc["boot"] = self.boot
        if self.compute is not None:
            doc["compute"] = self.compute.to_wire()
        if self.relays:
            doc["relays"] = list(self.relays)
        if self.devices is not None:
            doc["devices"] = self.devices.to_wire()
        return _pack(doc)


@dataclass(frozen=True)
class PeerRecord:
    node_id: bytes
    address: str
    # Relays the node is reachable through: sent only to peers advertising the relayed bit
    # (an older node refuses a peer entry with other keys).
    relays: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, object]:
        entry: dict[str, object] = {"node_id": self.node_id, "address": self.address}
        if self.relays:
            entry["relays"] = list(self.relays)
        return entry


@dataclass(frozen=True)
class Peers:
    """Gossip: other authenticated nodes this node is linked to (id and listen address only)."""

    peers: tuple[PeerRecord, ...]

    def encode(self) -> bytes:
        return _pack(
            {
                "t": "peers",
                "gen": c.MESSAGE_GEN,
                "peers": [p.to_wire() for p in self.peers],
            }
        )


LinkMessage = Hello | Peers


def decode_link_message(payload: bytes, limits: c.Limits = c.DEFAULT_LIMITS) -> LinkMessage:
    if len(payload) > limits.max_control_payload:
        raise ProtocolError("message_too_large", f"a link message of {len(payload)} bytes")
    data = unpack_bounded(payload, limits)
    kind = data.get("t") if isinstance(data, dict) else None
    if kind == "hello":
        d = _hello_fields(data, limits)
        host, boot = d.get("host"), d.get("boot")
        for name, value in (("host", host), ("boot", boot)):
            if value is not None and (
                not isinstance(value, str)
                or not 0 < len(value) <= c.MAX_HOST_CHARS
                or not value.isalnum()
            ):
                raise _fail(f"{name} must be 1-{c.MAX_HOST_CHARS} letters or digits")
        return Hello(
            listen=_opt_str(d["listen"], "listen", limits.max_address_chars),
            features=_features(d["features"], limits),
            memory_budget_bytes=_int(d["memory_budget_bytes"], "memory_budget_bytes"),
            host=host,
            boot=boot,
            compute=ComputeCost.from_wire(d["compute"]) if "compute" in d else None,
            relays=_relays(d.get("relays", []), limits),
            devices=Devices.from_wire(d["devices"]) if "devices" in d else None,
        )
    if kind == "peers":
        d = _check_keys(data, {"t", "gen", "peers"}, "peers")
        raw = d["peers"]
        if not isinstance(raw, list) or len(raw) > limits.max_gossip_peers:
            raise _fail(f"peers is a list of at most {limits.max_gossip_peers} entries")
        records = []
        for entry in raw:
            if not isinstance(entry, dict) or set(entry) - {"relays"} != {"node_id", "address"}:
                raise _fail("a peer entry has node_id and address (and optionally relays)")
            address = _str(entry["address"], "address", limits.max_address_chars)
            relays = _relays(entry.get("relays", []), limits)
            records.append(PeerRecord(_key(entry["node_id"], "node_id"), address, relays))
        return Peers(tuple(records))
    raise _fail(f"unknown link message type {kind!r}")


_HELLO_REQUIRED: Final = frozenset({"t", "gen", "listen", "features", "memory_budget_bytes"})
_HELLO_KNOWN_OPTIONAL: Final = frozenset({"host", "boot", "compute", "relays", "devices"})
_HELLO_FORBIDDEN: Final = frozenset(
    {"inventory", "artifacts", "packages", "paths", "cache_root", "token", "tokens"}
)


def _hello_fields(data: object, limits: c.Limits) -> dict[str, Any]:
    """The hello's fields with any unknown extension keys dropped.

    The versioning rule (docs/mesh-node.md "Hello versioning"): a hello must carry every
    required field, and may carry up to ``limits.max_hello_extensions`` further keys this node
    does not know. Those are ignored, not refused, so a newer node can add an optional
    advertisement without cutting older nodes off. Capabilities that change behaviour on the
    wire are announced as feature bits, never inferred from an extension key."""
    if not isinstance(data, dict) or not set(data) >= _HELLO_REQUIRED:
        raise _fail(f"a hello message has at least the fields {sorted(_HELLO_REQUIRED)}")
    unknown = [k for k in data if k not in _HELLO_REQUIRED | _HELLO_KNOWN_OPTIONAL]
    if len(unknown) > limits.max_hello_extensions:
        raise _fail(f"a hello message has at most {limits.max_hello_extensions} extension keys")
    for key in unknown:
        _str(key, "a hello extension key", limits.max_feature_chars)
        if key in _HELLO_FORBIDDEN:
            # spec "Peer Cache Transfer": no gossip of inventory, paths, cache roots, tokens
            raise _fail(f"a hello must not advertise {key!r} (the spec forbids inventory gossip)")
    if data.get("gen") != c.MESSAGE_GEN:
        raise _fail(f"a hello message of generation {data.get('gen')!r}")
    return {k: v for k, v in data.items() if k not in unknown}


def _relays(value: object, limits: c.Limits) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > c.MAX_RELAYS:
        raise _fail(f"relays is a list of at most {c.MAX_RELAYS} addresses")
    return tuple(_str(v, "a relay address", limits.max_address_chars) for v in value)


def _features(value: object, limits: c.Limits) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, dict) or len(value) > limits.max_features:
        raise _fail(f"features is a map of at most {limits.max_features} entries")
    out: dict[str, tuple[str, ...]] = {}
    for name, bits in value.items():
        _str(name, "a feature name", limits.max_feature_chars)
        if not isinstance(bits, list) or len(bits) > limits.max_features:
            raise _fail(f"feature {name!r} has a list of at most {limits.max_features} bits")
        out[name] = tuple(str(_str(b, "a feature bit", limits.max_feature_chars)) for b in bits)
    return out


# --- control-stream messages (skippy-stage/2 kind 0x01) ----------------------------------------
@dataclass(frozen=True)
class TopologyOffer:
    """A coordinator's signed topology. ``topology`` is the plain dict form; its meaning (and
    exact-once coverage) is checked by ``skippy.package.topology.SplitTopology.from_dict``."""

    topology: dict[str, Any]
    signature: bytes

    def encode(self) -> bytes:
        return _pack(
            {
                "t": "topology",
                "gen": c.MESSAGE_GEN,
                "topology": self.topology,
                "sig": self.signature,
            }
        )


@dataclass(frozen=True)
class TopologyAck:
    topology_id: str
    accepted: bool
    code: str | None = None
    message: str | None = None

    def encode(self) -> bytes:
        return _pack(
            {
                "t": "topology_ack",
                "gen": c.MESSAGE_GEN,
                "topology_id": self.topology_id,
                "accepted": self.accepted,
                "code": self.code,
                "message": self.message,
            }
        )


@dataclass(frozen=True)
class StageReady:
    """A node's report on its stage of a topology: ready (every required artifact installed
    and verified) or failed (``code``/``message`` say why). ``descriptor`` is the plain dict
    form of skippy's stage descriptor (``skippy.stage.descriptor``), which checks its meaning,
    as ``SplitTopology.from_dict`` does for an offer. The answer is a ``TopologyAck``."""

    topology_id: str
    stage_id: str
    ready: bool
    descriptor: dict[str, Any] | None = None
    code: str | None = None
    message: str | None = None

    def encode(self) -> bytes:
        return _pack(
            {
                "t": "stage_ready",
                "gen": c.MESSAGE_GEN,
                "topology_id": self.topology_id,
                "stage_id": self.stage_id,
                "ready": self.ready,
                "descriptor": self.descriptor,
                "code": self.code,
                "message": self.message,
            }
        )


ControlMessage = TopologyOffer | TopologyAck | StageReady


def decode_control_message(payload: bytes, limits: c.Limits = c.DEFAULT_LIMITS) -> ControlMessage:
    data = unpack_bounded(payload, limits)
    kind = data.get("t") if isinstance(data, dict) else None
    if kind == "topology":
        d = _check_keys(data, {"t", "gen", "topology", "sig"}, "topology")
        if not isinstance(d["topology"], dict):
            raise _fail("topology must be a map")
        sig = d["sig"]
        if not isinstance(sig, bytes) or len(sig) != c.SIGNATURE_BYTES:
            raise _fail("sig must be 64 bytes")
        return TopologyOffer(d["topology"], sig)
    if kind == "topology_ack":
        keys = {"t", "gen", "topology_id", "accepted", "code", "message"}
        d = _check_keys(data, keys, "topology_ack")
        if not isinstance(d["accepted"], bool):
            raise _fail("accepted must be a boolean")
        return TopologyAck(
            topology_id=_str(d["topology_id"], "topology_id", limits.max_reason_chars),
            accepted=d["accepted"],
            code=_opt_str(d["code"], "code", limits.max_reason_chars),
            message=_opt_str(d["message"], "message", 4 * limits.max_reason_chars),
        )
    if kind == "stage_ready":
        keys = {"t", "gen", "topology_id", "stage_id", "ready", "descriptor", "code", "message"}
        d = _check_keys(data, keys, "stage_ready")
        if not isinstance(d["ready"], bool):
            raise _fail("ready must be a boolean")
        descriptor = d["descriptor"]
        if descriptor is not None and not isinstance(descriptor, dict):
            raise _fail("descriptor must be a map or nil")
        return StageReady(
            topology_id=_str(d["topology_id"], "topology_id", limits.max_reason_chars),
            stage_id=_str(d["stage_id"], "stage_id", limits.max_reason_chars),
            ready=d["ready"],
            descriptor=descriptor,
            code=_opt_str(d["code"], "code", limits.max_reason_chars),
            message=_opt_str(d["message"], "message", 4 * limits.max_reason_chars),
        )
    raise _fail(f"unknown control message type {kind!r}")


def _pack(obj: dict[str, Any]) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


# --- length-prefixed messages on a byte stream -------------------------------------------------
def frame_message(payload: bytes, limits: c.Limits = c.DEFAULT_LIMITS) -> bytes:
    if len(payload) > limits.max_stream_message_bytes:
        raise ProtocolError(
            "message_too_large", f"a stream message of {len(payload)} bytes", fatal=False
        )
    return _U32.pack(len(payload)) + payload


class MessageReader:
    """Reassembles ``u32 length | payload`` messages from stream bytes, bounded in size."""

    def __init__(self, limits: c.Limits = c.DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out = []
        while len(self._buf) >= _U32.size:
            (length,) = _U32.unpack_from(self._buf)
            if length > self.limits.max_stream_message_bytes:
                raise ProtocolError(
                    "message_too_large",
                    f"a stream message declares {length} bytes (max "
                    f"{self.limits.max_stream_message_bytes})",
                )
            if len(self._buf) < _U32.size + length:
                break
            out.append(bytes(self._buf[_U32.size : _U32.size + length]))
            del self._buf[: _U32.size + length]
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)
