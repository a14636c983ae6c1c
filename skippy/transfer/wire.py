"""The artifact request/response schema and its byte framing (sans-IO).

Spec "Peer Cache Transfer": "Mesh owns only the subprotocol open envelope; Skippy owns the
artifact request/response schema, authorization semantics, and byte framing." Inside one
``skippy-stage/2`` stream of kind 0x03 (artifact transfer) the requester sends one request
frame and the server answers with one response frame, then, when it accepted, the raw bytes
of the artifact from the request's ``offset`` to ``total_size``:

    requester -> server   u32 big-endian length N, then N bytes of msgpack: the request map
    server -> requester   u32 big-endian length M, then M bytes of msgpack: the response map
                          [accepted only] total_size - offset raw artifact bytes

Every field is validated on construction, so an ``ArtifactRequest`` or ``ArtifactResponse``
in hand is always well-formed, whether built locally or decoded from a peer. Decoding
untrusted bytes raises only ``ArtifactWireError`` (with a code). Maps have exactly the
schema's keys (optional ones may be absent or nil): a change of schema is a new ``gen``.
No I/O here: ``RequestReader`` and ``ResponseReader`` are fed bytes and hand back values
and events, and never buffer more than one bounded header.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from skippy.errors import UsageError
from skippy.package.refs import HfPackageRef, parse_hf_package_ref
from skippy.package.topology import MAX_ID_CHARS, MAX_PACKAGE_REF_CHARS
from skippy.paths import is_safe_relative_path
from skippy.transfer.errors import ArtifactWireError

# --- vocabulary -----------------------------------------------------------------------------
WIRE_GEN: Final = 1  # the generation of this request/response schema
REQUESTER_ID_BYTES: Final = 32  # an Ed25519 public key: the mesh node id
LENGTH_PREFIX: Final = struct.Struct(">I")
MAX_REQUEST_BYTES: Final = 8 * 1024  # a request is ~0.5 KiB; the bound keeps a reader small
MAX_RESPONSE_BYTES: Final = 1024
MAX_RELATIVE_PATH_CHARS: Final = 1024
MAX_ERROR_CHARS: Final = 200
# No artifact is larger than 1 PiB; the bound keeps arithmetic on sizes honest.
MAX_ARTIFACT_BYTES: Final = 1 << 50
_SHA256_RE: Final = re.compile(r"\A[0-9a-f]{64}\Z", re.ASCII)
# Printable ASCII without spaces: ids are compared with the topology's, never interpreted.
_ID_RE: Final = re.compile(r"\A[\x21-\x7e]+\Z", re.ASCII)
_TEXT_RE: Final = re.compile(r"\A[\x20-\x7e]+\Z", re.ASCII)

REQUEST_KEYS: Final = frozenset(
    {
        "gen",
        "requester_id",
        "topology_id",
        "run_id",
        "stage_id",
        "package_ref",
        "manifest_sha256",
        "relative_path",
        "offset",
        "expected_size",
        "expected_sha256",
        "length",
    }
)
# ``length`` (a chunk range) is sent only to a peer advertising
# ``protocol.constants.BIT_SWARM_TRANSFER``; older servers never see the key.
REQUEST_OPTIONAL: Final = frozenset({"expected_size", "expected_sha256", "length"})
RESPONSE_KEYS: Final = frozenset({"gen", "accepted", "total_size", "sha256", "error"})
RESPONSE_OPTIONAL: Final = frozenset({"sha256", "error"})


def _bad(code: str, message: str, **facts: Any) -> ArtifactWireError:
    return ArtifactWireError(message, code=code, **facts)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_gen(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad("artifact_wire_field", "gen must be an integer", actual=_short(value))
    if value != WIRE_GEN:
        raise _bad(
            "artifact_wire_unsupported_gen",
            f"artifact transfer generation {value} is not supported (this node speaks "
            f"{WIRE_GEN})",
            expected=WIRE_GEN,
            actual=value,
        )
    return value


def _check_id(value: object, what: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_ID_CHARS or not _ID_RE.match(value):
        raise _bad(
            "artifact_wire_field",
            f"{what} must be 1-{MAX_ID_CHARS} printable ASCII characters without spaces",
            actual=_short(value),
        )
    return value


def _check_sha(value: object, what: str) -> str:
    if not isinstance(value, str) or not _SHA256_RE.match(value):
        raise _bad(
            "artifact_wire_field",
            f"{what} must be 64 lowercase hex characters",
            actual=_short(value),
        )
    return value


def _check_size(value: object, what: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad("artifact_wire_field", f"{what} must be an integer", actual=_short(value))
    if not minimum <= value <= MAX_ARTIFACT_BYTES:
        raise _bad(
            "artifact_wire_field",
            f"{what} must be in {minimum}..{MAX_ARTIFACT_BYTES}",
            actual=value,
        )
    return value


def eligible_package_ref(text: object) -> HfPackageRef:
    """Spec: "Only hf://namespace/repo@revision package refs are eligible for peer transfer".

    Eligible means a Hub ref pinned to a full 40-hex commit, spelled canonically
    (``hf://ns/repo@<commit>``): a moving branch could name different bytes on each node.
    """
    if not isinstance(text, str) or not 0 < len(text) <= MAX_PACKAGE_REF_CHARS:
        raise _bad(
            "ineligible_package_ref",
            f"package_ref must be a string of 1-{MAX_PACKAGE_REF_CHARS} characters",
            actual=_short(text),
        )
    try:
        ref = parse_hf_package_ref(text)
    except UsageError as exc:
        raise _bad(
            "ineligible_package_ref",
            f"package_ref {text!r} is not an hf:// package reference ({exc.message})",
            actual=text,
        ) from None
    if not ref.is_pinned or str(ref) != text:
        raise _bad(
            "ineligible_package_ref",
            f"package_ref {text!r} is not eligible for peer transfer: only "
            "hf://namespace/repo@<40-hex commit> is",
            actual=text,
        )
    return ref


def check_wire_path(value: object) -> str:
    """The request's ``relative_path`` through the one path gate (``skippy.paths``)."""
    if not isinstance(value, str) or len(value) > MAX_RELATIVE_PATH_CHARS:
        raise _bad(
            "artifact_wire_field",
            f"relative_path must be a string of at most {MAX_RELATIVE_PATH_CHARS} characters",
            actual=_short(value),
        )
    if not is_safe_relative_path(value):
        raise _bad(
            "unsafe_artifact_path",
            f"relative_path {value!r} is not a safe repository-relative path",
            actual=_short(value),
        )
    return value


# --- values ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ArtifactRequest:
    """One artifact asked of the serving node."""

    requester_id: bytes
    topology_id: str
    run_id: str
    stage_id: str
    package_ref: str
    manifest_sha256: str
    relative_path: str
    offset: int = 0
    expected_size: int | None = None
    expected_sha256: str | None = None
    length: int | None = None  # a range: ``length`` bytes from ``offset`` (None: to the end)
    gen: int = WIRE_GEN

    def __post_init__(self) -> None:
        _check_gen(self.gen)
        if self.length is not None:
            _check_size(self.length, "length", minimum=1)
            if self.expected_size is not None and self.offset + self.length > self.expected_size:
                raise _bad(
                    "artifact_wire_field",
                    f"range {self.offset}+{self.length} runs past expected_size "
                    f"{self.expected_size}",
                    actual=self.offset + self.length,
                    expected=self.expected_size,
                )
        if not isinstance(self.requester_id, bytes) or len(self.requester_id) != (
            REQUESTER_ID_BYTES
        ):
            raise _bad(
                "artifact_wire_field",
                f"requester_id must be {REQUESTER_ID_BYTES} bytes (the node's public key)",
                actual=_short(self.requester_id),
            )
        _check_id(self.topology_id, "topology_id")
        _check_id(self.run_id, "run_id")
        _check_id(self.stage_id, "stage_id")
        eligible_package_ref(self.package_ref)
        _check_sha(self.manifest_sha256, "manifest_sha256")
        check_wire_path(self.relative_path)
        _check_size(self.offset, "offset", minimum=0)
        if self.expected_size is not None:
            _check_size(self.expected_size, "expected_size", minimum=1)
            if self.offset > self.expected_size:
                raise _bad(
                    "artifact_wire_field",
                    f"offset {self.offset} is past expected_size {self.expected_size}",
                    actual=self.offset,
                    expected=self.expected_size,
                )
        if self.expected_sha256 is not None:
            _check_sha(self.expected_sha256, "expected_sha256")

    @property
    def requester_hex(self) -> str:
        """The requester id as the topology spells node ids (64 lowercase hex)."""
        return self.requester_id.hex()

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "gen": self.gen,
            "requester_id": self.requester_id,
            "topology_id": self.topology_id,
            "run_id": self.run_id,
            "stage_id": self.stage_id,
            "package_ref": self.package_ref,
            "manifest_sha256": self.manifest_sha256,
            "relative_path": self.relative_path,
            "offset": self.offset,
        }
        if self.expected_size is not None:
            out["expected_size"] = self.expected_size
        if self.expected_sha256 is not None:
            out["expected_sha256"] = self.expected_sha256
        if self.length is not None:
            out["length"] = self.length
        return out

    def to_log(self) -> dict[str, Any]:
        """Fields for a structured log line (ids shortened: logs may shorten node ids)."""
        return {
            "requester": self.requester_hex[:12],
            "topology_id": self.topology_id,
            "run_id": self.run_id,
            "stage_id": self.stage_id,
            "package_ref": self.package_ref,
            "path": self.relative_path,
            "offset": self.offset,
        }


@dataclass(frozen=True)
class ArtifactResponse:
    """The server's answer. Accepted: ``total_size`` and ``sha256`` of the whole artifact (the
    body is its bytes from the request's offset). Refused: ``error`` says why, nothing else."""

    accepted: bool
    total_size: int = 0
    sha256: str | None = None
    error: str | None = None
    gen: int = WIRE_GEN

    def __post_init__(self) -> None:
        _check_gen(self.gen)
        if not isinstance(self.accepted, bool):
            raise _bad("artifact_wire_field", "accepted must be a boolean")
        if self.accepted:
            _check_size(self.total_size, "total_size", minimum=1)
            _check_sha(self.sha256, "sha256")
            if self.error is not None:
                raise _bad("artifact_wire_field", "an accepted response carries no error")
            return
        if (
            isinstance(self.total_size, bool)
            or not isinstance(self.total_size, int)
            or self.total_size != 0
        ):
            raise _bad("artifact_wire_field", "a refusal has total_size 0", actual=self.total_size)
        if self.sha256 is not None:
            raise _bad("artifact_wire_field", "a refusal carries no sha256")
        if (
            not isinstance(self.error, str)
            or len(self.error) > MAX_ERROR_CHARS
            or not _TEXT_RE.match(self.error)
        ):
            raise _bad(
                "artifact_wire_field",
                f"a refusal's error must be 1-{MAX_ERROR_CHARS} printable ASCII characters",
                actual=_short(self.error),
            )

    @classmethod
    def refusal(cls, error: str) -> ArtifactResponse:
        return cls(accepted=False, error=error)

    @classmethod
    def accept(cls, total_size: int, sha256: str) -> ArtifactResponse:
        return cls(accepted=True, total_size=total_size, sha256=sha256)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "gen": self.gen,
            "accepted": self.accepted,
            "total_size": self.total_size,
        }
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        if self.error is not None:
            out["error"] = self.error
        return out


# --- encoding -------------------------------------------------------------------------------
def frame(payload: bytes, limit: int) -> bytes:
    if not 0 < len(payload) <= limit:
        raise _bad("artifact_wire_too_large", f"a frame of {len(payload)} bytes is over {limit}")
    return LENGTH_PREFIX.pack(len(payload)) + payload


def encode_request(request: ArtifactRequest) -> bytes:
    """The request frame: length prefix + msgpack map."""
    return frame(msgpack.packb(request.to_wire(), use_bin_type=True), MAX_REQUEST_BYTES)


def encode_response(response: ArtifactResponse) -> bytes:
    """The response header frame; the accepted body's raw bytes follow it on the stream."""
    return frame(msgpack.packb(response.to_wire(), use_bin_type=True), MAX_RESPONSE_BYTES)


def no_duplicate_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """msgpack's ``object_pairs_hook`` for every wire map: a key given twice is malformed."""
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _bad("artifact_wire_malformed", f"key {_short(key)} appears twice")
        out[key] = value
    return out


def _unpack_map(
    payload: bytes, limit: int, keys: frozenset[str], optional: frozenset[str], what: str
) -> dict[str, Any]:
    if len(payload) > limit:
        raise _bad("artifact_wire_too_large", f"{what} of {len(payload)} bytes is over {limit}")
    try:
        data = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            object_pairs_hook=no_duplicate_keys,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=16,
            max_map_len=len(keys),
            max_ext_len=0,
        )
    except ArtifactWireError:
        raise
    # msgpack's FormatError, StackError, ExtraData and truncation are ValueErrors; a bad map
    # key is a ValueError or TypeError; invalid UTF-8 is a UnicodeDecodeError (a ValueError).
    except (ValueError, TypeError, OverflowError) as exc:
        raise _bad("artifact_wire_malformed", f"{what} is not valid msgpack: {exc}") from None
    if not isinstance(data, Mapping):
        raise _bad("artifact_wire_malformed", f"{what} must be a msgpack map")
    got = set(data)
    if not got <= keys or not (keys - optional) <= got:
        raise _bad(
            "artifact_wire_malformed",
            f"{what} must have the keys {sorted(keys - optional)} (optional: "
            f"{sorted(optional)}), got {sorted(map(str, got))[:16]}",
        )
    return {k: v for k, v in data.items() if not (k in optional and v is None)}


def decode_request(payload: bytes) -> ArtifactRequest:
    """One request frame's payload (without the length prefix) -> a validated request."""
    data = _unpack_map(payload, MAX_REQUEST_BYTES, REQUEST_KEYS, REQUEST_OPTIONAL, "a request")
    _check_gen(data["gen"])  # a different generation is named as such, not as bad fields
    return ArtifactRequest(**data)


def decode_response(payload: bytes) -> ArtifactResponse:
    """One response frame's payload (without the length prefix) -> a validated response."""
    data = _unpack_map(payload, MAX_RESPONSE_BYTES, RESPONSE_KEYS, RESPONSE_OPTIONAL, "a response")
    _check_gen(data["gen"])
    return ArtifactResponse(**data)


# --- incremental readers --------------------------------------------------------------------
class _FrameBuffer:
    """Collects one length-prefixed frame of at most ``limit`` payload bytes."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._buf = bytearray()
        self._need: int | None = None

    def feed(self, data: memoryview) -> tuple[bytes | None, memoryview]:
        """Take what belongs to the frame; return (payload once complete, the rest of data)."""
        if self._need is None:
            take = min(len(data), LENGTH_PREFIX.size - len(self._buf))
            self._buf += data[:take]
            data = data[take:]
            if len(self._buf) < LENGTH_PREFIX.size:
                return None, data
            (self._need,) = LENGTH_PREFIX.unpack(self._buf)
            self._buf.clear()
            if not 0 < self._need <= self._limit:
                raise _bad(
                    "artifact_wire_too_large",
                    f"a frame announces {self._need} bytes; the limit is 1..{self._limit}",
                )
        take = min(len(data), self._need - len(self._buf))
        self._buf += data[:take]
        if len(self._buf) < self._need:
            return None, data[take:]
        return bytes(self._buf), data[take:]


class RequestReader:
    """Server side: feed the stream's bytes until ``feed`` returns the request. The requester
    sends nothing after its request, so any further byte is an error; unless
    ``trailer_limit`` (a have-report after a source request, only from a peer
    that advertises ``partial-serve``): then one more frame of at most that many bytes may
    follow (``trailer``, complete once the stream ends)."""

    def __init__(self, trailer_limit: int = 0) -> None:
        self._frame = _FrameBuffer(MAX_REQUEST_BYTES)
        self._trailer = _FrameBuffer(trailer_limit) if trailer_limit > 0 else None
        self._trailer_started = False
        self.request: ArtifactRequest | None = None
        self.trailer: bytes | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> ArtifactRequest | None:
        view = memoryview(data)
        if self.request is not None:
            self._after(view)
            return self.request
        payload, rest = self._frame.feed(view)
        if payload is None:
            return None
        self.request = decode_request(payload)
        self._after(rest)
        return self.request

    def _after(self, view: memoryview) -> None:
        if not len(view):
            return
        if self._trailer is None or self.trailer is not None:
            raise _bad("artifact_wire_malformed", "bytes after the request")
        self._trailer_started = True
        payload, rest = self._trailer.feed(view)
        if payload is not None:
            self.trailer = payload
            if len(rest):
                raise _bad("artifact_wire_malformed", "bytes after the request's trailer")

    def eof(self) -> None:
        """The stream ended: an error unless the whole request (and a trailer begun) arrived."""
        if self.request is None:
            raise _bad("artifact_wire_truncated", "the stream ended inside the request")
        if self._trailer_started and self.trailer is None:
            raise _bad("artifact_wire_truncated", "the stream ended inside the trailer")


@dataclass(frozen=True)
class ResponseHeader:
    response: ArtifactResponse


@dataclass(frozen=True)
class BodyData:
    data: memoryview  # a view of the bytes fed in: use it before feeding more


@dataclass(frozen=True)
class BodyEnd:
    pass


ResponseEvent = ResponseHeader | BodyData | BodyEnd


class ResponseReader:
    """Requester side: feed the stream's bytes, get events: one ``ResponseHeader``, then (if
    accepted) ``BodyData`` up to exactly ``total_size - offset`` bytes (``length`` for a
    range request) and one ``BodyEnd``.
    Body bytes are handed on as views of the input, never accumulated. A refusal ends after
    its header. Any byte past the end, or an offset past ``total_size``, is an error."""

    def __init__(self, offset: int, length: int | None = None) -> None:
        self._frame = _FrameBuffer(MAX_RESPONSE_BYTES)
        self._offset = offset
        self._length = length
        self.response: ArtifactResponse | None = None
        self.remaining: int | None = None  # body bytes still due
        self.done = False

    def feed(self, data: bytes | bytearray | memoryview) -> list[ResponseEvent]:
        view = memoryview(data)
        events: list[ResponseEvent] = []
        if self.response is None:
            payload, view = self._frame.feed(view)
            if payload is None:
                return events
            self.response = decode_response(payload)
            events.append(ResponseHeader(self.response))
            if not self.response.accepted:
                self.done = True
            else:
                if self._offset > self.response.total_size:
                    raise _bad(
                        "artifact_wire_field",
                        f"resume offset {self._offset} is past the artifact's total size "
                        f"{self.response.total_size}",
                    )
                self.remaining = self.response.total_size - self._offset
                if self._length is not None:
                    if self._length > self.remaining:
                        raise _bad(
                            "artifact_wire_field",
                            f"range {self._offset}+{self._length} is past the artifact's "
                            f"total size {self.response.total_size}",
                        )
                    self.remaining = self._length
                if self.remaining == 0:
                    self.done = True
                    events.append(BodyEnd())
        if self.done:
            if len(view):
                raise _bad("artifact_wire_malformed", "bytes after the end of the response")
            return events
        if self.remaining is None or not len(view):
            return events
        if len(view) > self.remaining:
            raise _bad(
                "artifact_wire_malformed",
                f"the body runs past total_size ({len(view) - self.remaining} extra bytes)",
            )
        self.remaining -= len(view)
        events.append(BodyData(view))
        if self.remaining == 0:
            self.done = True
            events.append(BodyEnd())
        return events

    def eof(self) -> None:
        """The stream ended: an error (``artifact_wire_truncated``) unless the response did."""
        if not self.done:
            due = "the header" if self.response is None else f"{self.remaining} body bytes"
            raise _bad("artifact_wire_truncated", f"the stream ended with {due} still due")
