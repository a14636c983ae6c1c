"""Multicast DNS (RFC 6762, DNS-SD names of RFC 6763) for LAN discovery, sans-IO: bytes in,
values out. Only what a node needs: a query for the mesh's service, and an announcement of one
instance of it (PTR service -> instance, SRV instance -> port, TXT ``fp=<owner fingerprint>``).

An announcement says no more than that a node of the owner with that fingerprint listens on
this port: the instance name is random per start, and no A record is sent (the receiver dials
the address the datagram came from). Decoding bounds everything a stranger on the LAN controls
(size, record counts, name lengths, compression pointers: only backwards, a bounded number)
and raises ``ProtocolError("malformed_mdns")`` for anything else.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Final

from protocol.errors import ProtocolError

MDNS_GROUP: Final = "224.0.0.251"
MDNS_PORT: Final = 5353
SERVICE: Final = "_skippy-mesh._tcp.local"
ANNOUNCE_TTL_S: Final = 120
MAX_MESSAGE_BYTES: Final = 9000  # RFC 6762 section 17: a multicast DNS message's ceiling
MAX_RECORDS: Final = 64
MAX_POINTER_JUMPS: Final = 16
MAX_NAME_BYTES: Final = 255

TYPE_PTR: Final = 12
TYPE_TXT: Final = 16
TYPE_SRV: Final = 33
CLASS_IN: Final = 1
CACHE_FLUSH: Final = 0x8000  # top bit of a record's class (unique records)
UNICAST_RESPONSE: Final = 0x8000  # top bit of a question's class
FLAGS_RESPONSE: Final = 0x8400  # QR + AA

_HEADER: Final = struct.Struct(">HHHHHH")
_RR: Final = struct.Struct(">HHIH")
_SRV: Final = struct.Struct(">HHH")
_INSTANCE_RE: Final = re.compile(r"^[0-9a-f]{8,32}$")
_FINGERPRINT_RE: Final = re.compile(r"^[0-9a-f]{16}$")


@dataclass(frozen=True)
class Record:
    name: str
    rtype: int
    ttl: int
    data: object  # PTR: str; SRV: (priority, weight, port, target); TXT: tuple[bytes, ...]


@dataclass(frozen=True)
class Message:
    response: bool
    questions: tuple[tuple[str, int], ...]  # (name, type)
    records: tuple[Record, ...]  # answers and additional records


@dataclass(frozen=True)
class Announcement:
    instance: str  # random per start (hex)
    port: int
    fingerprint: str  # the owner's (protocol.invite.owner_fingerprint)

    def __post_init__(self) -> None:
        if not _INSTANCE_RE.match(self.instance):
            raise ProtocolError("malformed_mdns", "an instance is 8..32 lowercase hex")
        if not 1 <= self.port <= 65535:
            raise ProtocolError("malformed_mdns", "a port is 1..65535")
        if not _FINGERPRINT_RE.match(self.fingerprint):
            raise ProtocolError("malformed_mdns", "a fingerprint is 16 lowercase hex")


# --- encoding ----------------------------------------------------------------------------------
def _name(name: str) -> bytes:
    out = b""
    for label in name.split("."):
        raw = label.encode()
        if not 1 <= len(raw) <= 63:
            raise ProtocolError("malformed_mdns", f"label {label!r} is not 1..63 bytes")
        out += bytes([len(raw)]) + raw
    return out + b"\x00"


def _record(name: str, rtype: int, rclass: int, ttl: int, rdata: bytes) -> bytes:
    return _name(name) + _RR.pack(rtype, rclass, ttl, len(rdata)) + rdata


def encode_query(service: str = SERVICE) -> bytes:
    """One question: PTR ``service``, answered by multicast."""
    return _HEADER.pack(0, 0, 1, 0, 0, 0) + _name(service) + struct.pack(">HH", TYPE_PTR, CLASS_IN)


def encode_announcement(ann: Announcement, ttl_s: int = ANNOUNCE_TTL_S) -> bytes:
    """A response: PTR, SRV and TXT of ``ann``'s instance of ``SERVICE``."""
    full = f"{ann.instance}.{SERVICE}"
    target = f"{ann.instance}.local"
    txt = f"fp={ann.fingerprint}".encode()
    records = [
        _record(SERVICE, TYPE_PTR, CLASS_IN, ttl_s, _name(full)),
        _record(
            full, TYPE_SRV, CLASS_IN | CACHE_FLUSH, ttl_s, _SRV.pack(0, 0, ann.port) + _name(target)
        ),
        _record(full, TYPE_TXT, CLASS_IN | CACHE_FLUSH, ttl_s, bytes([len(txt)]) + txt),
    ]
    return _HEADER.pack(0, FLAGS_RESPONSE, 0, len(records), 0, 0) + b"".join(records)


# --- decoding ----------------------------------------------------------------------------------
def _read_name(data: bytes, pos: int) -> tuple[str, int]:
    """The name at ``pos`` and the offset just after it (in the original run of bytes)."""
    labels: list[str] = []
    end: int | None = None
    jumps = total = 0
    while True:
        if pos >= len(data):
            raise ProtocolError("malformed_mdns", "a name runs past the message")
        length = data[pos]
        if length & 0xC0 == 0xC0:
            if pos + 1 >= len(data):
                raise ProtocolError("malformed_mdns", "a cut compression pointer")
            target = ((length & 0x3F) << 8) | data[pos + 1]
            if target >= pos or jumps >= MAX_POINTER_JUMPS:
                raise ProtocolError("malformed_mdns", "a compression pointer that loops")
            if end is None:
                end = pos + 2
            jumps += 1
            pos = target
            continue
        if length & 0xC0:
            raise ProtocolError("malformed_mdns", "a reserved label type")
        pos += 1
        if length == 0:
            break
        total += length + 1
        if total > MAX_NAME_BYTES or pos + length > len(data):
            raise ProtocolError("malformed_mdns", "a name too long or cut")
        try:
            labels.append(data[pos : pos + length].decode())
        except UnicodeDecodeError:
            raise ProtocolError("malformed_mdns", "a label that is not UTF-8") from None
        pos += length
    return ".".join(labels), end if end is not None else pos


def decode_message(data: bytes) -> Message:
    if not _HEADER.size <= len(data) <= MAX_MESSAGE_BYTES:
        raise ProtocolError("malformed_mdns", f"a message is {_HEADER.size}..{MAX_MESSAGE_BYTES}")
    _id, flags, qd, an, ns, ar = _HEADER.unpack_from(data)
    if qd + an + ns + ar > MAX_RECORDS:
        raise ProtocolError("malformed_mdns", f"more than {MAX_RECORDS} records")
    pos = _HEADER.size
    questions = []
    for _ in range(qd):
        name, pos = _read_name(data, pos)
        if pos + 4 > len(data):
            raise ProtocolError("malformed_mdns", "a cut question")
        qtype, _qclass = struct.unpack_from(">HH", data, pos)
        pos += 4
        questions.append((name.lower(), qtype))
    records = []
    for _ in range(an + ns + ar):
        name, pos = _read_name(data, pos)
        if pos + _RR.size > len(data):
            raise ProtocolError("malformed_mdns", "a cut record")
        rtype, _rclass, ttl, rdlen = _RR.unpack_from(data, pos)
        pos += _RR.size
        end = pos + rdlen
        if end > len(data):
            raise ProtocolError("malformed_mdns", "a record's data runs past the message")
        value: object = data[pos:end]
        if rtype == TYPE_PTR:
            value, after = _read_name(data, pos)
            if after != end:
                raise ProtocolError("malformed_mdns", "a PTR's length is not its name's")
        elif rtype == TYPE_SRV:
            if rdlen < _SRV.size + 1:
                raise ProtocolError("malformed_mdns", "a cut SRV record")
            target, after = _read_name(data, pos + _SRV.size)
            if after != end:
                raise ProtocolError("malformed_mdns", "an SRV's length is not its fields'")
            value = (*_SRV.unpack_from(data, pos), target)
        elif rtype == TYPE_TXT:
            strings, p = [], pos
            while p < end:
                n = data[p]
                if p + 1 + n > end:
                    raise ProtocolError("malformed_mdns", "a cut TXT string")
                strings.append(data[p + 1 : p + 1 + n])
                p += 1 + n
            value = tuple(strings)
        records.append(Record(name.lower(), rtype, ttl, value))
        pos = end
    return Message(bool(flags & 0x8000), tuple(questions), tuple(records))


def asks_for(message: Message, service: str = SERVICE) -> bool:
    """A query with a question for ``service``'s instances (PTR, or ANY = 255)."""
    return not message.response and any(
        name == service.lower() and qtype in (TYPE_PTR, 255) for name, qtype in message.questions
    )


def announcements_in(message: Message, service: str = SERVICE) -> list[Announcement]:
    """Every complete instance of ``service`` a response announces (PTR + SRV + TXT with a
    well-formed ``fp=``); anything partial or malformed is not an announcement. A TTL of 0
    (a goodbye) is not one either."""
    if not message.response:
        return []
    suffix = "." + service.lower()
    srv: dict[str, int] = {}
    fps: dict[str, str] = {}
    instances: list[str] = []
    for r in message.records:
        if r.ttl == 0:
            continue
        if r.rtype == TYPE_PTR and r.name == service.lower() and isinstance(r.data, str):
            instances.append(r.data.lower())
        elif r.rtype == TYPE_SRV and isinstance(r.data, tuple):
            srv[r.name] = int(r.data[2])
        elif r.rtype == TYPE_TXT and isinstance(r.data, tuple):
            for item in r.data:
                if isinstance(item, bytes) and item.startswith(b"fp="):
                    fps[r.name] = item[3:].decode("ascii", "replace")
    out = []
    for full in dict.fromkeys(instances):
        if not full.endswith(suffix) or full not in srv or full not in fps:
            continue
        try:
            out.append(Announcement(full[: -len(suffix)], srv[full], fps[full]))
        except ProtocolError:
            continue
    return out
