"""The artifact request/response schema and framing: round trips, every field rule, the
incremental readers, and hypothesis fuzzing of the decoders (arbitrary bytes raise only
ArtifactWireError)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from skippy.transfer.errors import ArtifactWireError
from skippy.transfer.wire import (
    LENGTH_PREFIX,
    MAX_REQUEST_BYTES,
    WIRE_GEN,
    ArtifactRequest,
    ArtifactResponse,
    BodyData,
    BodyEnd,
    RequestReader,
    ResponseHeader,
    ResponseReader,
    decode_request,
    decode_response,
    eligible_package_ref,
    encode_request,
    encode_response,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REF = f"hf://lab/tiny-layers@{COMMIT}"
SHA = hashlib.sha256(b"x").hexdigest()
ID = bytes(range(32))


def request(**changes: Any) -> ArtifactRequest:
    fields: dict[str, Any] = {
        "requester_id": ID,
        "topology_id": "topo-1",
        "run_id": "run-1",
        "stage_id": "stage-2",
        "package_ref": REF,
        "manifest_sha256": SHA,
        "relative_path": "layers/layer-00003.gguf",
        "offset": 10,
        "expected_size": 44000,
        "expected_sha256": SHA,
    }
    fields.update(changes)
    return ArtifactRequest(**fields)


def raw_request(**changes: Any) -> bytes:
    """A request payload built by hand (bypassing validation), for hostile-peer cases."""
    data = request().to_wire()
    for key, value in changes.items():
        if value is dataclasses.MISSING:
            data.pop(key, None)
        else:
            data[key] = value
    return msgpack.packb(data, use_bin_type=True)


# --- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "req",
    [
        request(),
        request(offset=0, expected_size=None, expected_sha256=None),
        request(relative_path="model-package.json", offset=0, expected_size=None),
        request(offset=44000),  # resuming a complete partial: offset == expected size
    ],
)
def test_request_round_trip(req: ArtifactRequest) -> None:
    frame = encode_request(req)
    (n,) = LENGTH_PREFIX.unpack(frame[:4])
    assert n == len(frame) - 4
    assert decode_request(frame[4:]) == req


@pytest.mark.parametrize(
    "resp",
    [
        ArtifactResponse.accept(44000, SHA),
        ArtifactResponse.refusal("artifact unavailable"),
        ArtifactResponse.refusal("artifact transfer disabled"),
    ],
)
def test_response_round_trip(resp: ArtifactResponse) -> None:
    frame = encode_response(resp)
    assert decode_response(frame[4:]) == resp


def test_optional_fields_may_be_nil_on_the_wire() -> None:
    payload = raw_request(expected_size=None, expected_sha256=None)
    got = decode_request(payload)
    assert got.expected_size is None and got.expected_sha256 is None


# --- field rules -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"gen": WIRE_GEN + 1}, "artifact_wire_unsupported_gen"),
        ({"gen": True}, "artifact_wire_field"),
        ({"requester_id": bytes(31)}, "artifact_wire_field"),
        ({"requester_id": "00" * 32}, "artifact_wire_field"),
        ({"topology_id": ""}, "artifact_wire_field"),
        ({"run_id": "x" * 129}, "artifact_wire_field"),
        ({"stage_id": "stage 2"}, "artifact_wire_field"),
        ({"stage_id": 2}, "artifact_wire_field"),
        ({"package_ref": "hf://lab/tiny-layers"}, "ineligible_package_ref"),
        ({"package_ref": "hf://lab/tiny-layers@main"}, "ineligible_package_ref"),
        ({"package_ref": f"hf://lab/tiny-layers:{COMMIT}"}, "ineligible_package_ref"),
        ({"package_ref": "/srv/packages/tiny"}, "ineligible_package_ref"),
        ({"package_ref": "hf://" + "a" * 600}, "ineligible_package_ref"),
        ({"manifest_sha256": SHA.upper()}, "artifact_wire_field"),
        ({"manifest_sha256": SHA[:63]}, "artifact_wire_field"),
        ({"relative_path": "../../blobs/x"}, "unsafe_artifact_path"),
        ({"relative_path": "layers/../../x"}, "unsafe_artifact_path"),
        ({"relative_path": "/etc/passwd"}, "unsafe_artifact_path"),
        ({"relative_path": "a\\b"}, "unsafe_artifact_path"),
        ({"relative_path": "a/\x00"}, "unsafe_artifact_path"),
        ({"relative_path": ""}, "unsafe_artifact_path"),
        ({"relative_path": "a/" * 600}, "artifact_wire_field"),
        ({"offset": -1}, "artifact_wire_field"),
        ({"offset": 44001}, "artifact_wire_field"),  # past expected_size
        ({"offset": 1.5}, "artifact_wire_field"),
        ({"expected_size": 0}, "artifact_wire_field"),
        ({"expected_size": 1 << 60}, "artifact_wire_field"),
        ({"expected_sha256": "zz" * 32}, "artifact_wire_field"),
    ],
)
def test_request_field_rules(changes: dict[str, Any], code: str) -> None:
    with pytest.raises(ArtifactWireError) as built:
        request(**changes)
    assert built.value.code == code
    with pytest.raises(ArtifactWireError) as decoded:  # the same rule on the wire
        decode_request(raw_request(**changes))
    assert decoded.value.code == code


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (raw_request(extra=1), "artifact_wire_malformed"),
        (raw_request(offset=dataclasses.MISSING), "artifact_wire_malformed"),
        (msgpack.packb([1, 2, 3]), "artifact_wire_malformed"),
        (b"\xc1", "artifact_wire_malformed"),  # never-used msgpack byte
        (raw_request()[:-3], "artifact_wire_malformed"),  # truncated map
        (raw_request() + b"\x00", "artifact_wire_malformed"),  # trailing data
        (b"\x82\xa3gen\x01\xa3gen\x01", "artifact_wire_malformed"),  # duplicate key
        (b"\x81\x01\x01", "artifact_wire_malformed"),  # integer map key
        (b"\x81\xa3gen\xd6\xff\x00\x00\x00\x00", "artifact_wire_malformed"),  # ext type
        (b"\x91" * 200, "artifact_wire_malformed"),  # deep nesting
        (b"\x00" * (MAX_REQUEST_BYTES + 1), "artifact_wire_too_large"),
    ],
)
def test_malformed_request_payloads(payload: bytes, code: str) -> None:
    with pytest.raises(ArtifactWireError) as exc:
        decode_request(payload)
    assert exc.value.code == code


@pytest.mark.parametrize(
    "fields",
    [
        {"accepted": True, "total_size": 0, "sha256": SHA},
        {"accepted": True, "total_size": 10},
        {"accepted": True, "total_size": 10, "sha256": SHA, "error": "x"},
        {"accepted": False, "total_size": 10, "error": "x"},
        {"accepted": False, "total_size": 0},
        {"accepted": False, "total_size": 0, "error": ""},
        {"accepted": False, "total_size": 0, "error": "\x1b[31mred"},
        {"accepted": False, "total_size": 0, "error": "x" * 201},
        {"accepted": False, "total_size": 0.0, "error": "x"},
        {"accepted": 1, "total_size": 10, "sha256": SHA},
    ],
)
def test_response_field_rules(fields: dict[str, Any]) -> None:
    with pytest.raises(ArtifactWireError):
        ArtifactResponse(**fields)
    with pytest.raises(ArtifactWireError):
        decode_response(msgpack.packb({"gen": WIRE_GEN, **fields}))


def test_eligible_refs() -> None:
    assert eligible_package_ref(REF).revision == COMMIT
    with pytest.raises(ArtifactWireError) as exc:
        eligible_package_ref(f"hf://lab/tiny-layers@{COMMIT.upper()}")
    assert exc.value.code == "ineligible_package_ref"


# --- readers ---------------------------------------------------------------------------------
def test_request_reader_assembles_a_request_fed_byte_by_byte() -> None:
    frame = encode_request(request())
    reader = RequestReader()
    got = None
    for i in range(len(frame)):
        got = reader.feed(frame[i : i + 1])
    assert got == request()
    reader.eof()


@pytest.mark.parametrize(
    ("stream", "code"),
    [
        (LENGTH_PREFIX.pack(MAX_REQUEST_BYTES + 1), "artifact_wire_too_large"),
        (LENGTH_PREFIX.pack(0), "artifact_wire_too_large"),
        (encode_request(request()) + b"!", "artifact_wire_malformed"),
    ],
)
def test_request_reader_rejects(stream: bytes, code: str) -> None:
    with pytest.raises(ArtifactWireError) as exc:
        RequestReader().feed(stream)
    assert exc.value.code == code


def test_request_reader_eof_inside_the_request() -> None:
    reader = RequestReader()
    reader.feed(encode_request(request())[:20])
    with pytest.raises(ArtifactWireError) as exc:
        reader.eof()
    assert exc.value.code == "artifact_wire_truncated"


def _events(reader: ResponseReader, pieces: list[bytes]) -> list[object]:
    out: list[object] = []
    for piece in pieces:
        for event in reader.feed(piece):
            out.append(BodyData(bytes(event.data)) if isinstance(event, BodyData) else event)  # type: ignore[arg-type]
    return out


def test_response_reader_header_body_end_in_any_split() -> None:
    body = bytes(range(256)) * 4
    stream = encode_response(ArtifactResponse.accept(len(body) + 100, SHA)) + body
    for step in (1, 3, 1000, len(stream)):
        reader = ResponseReader(offset=100)
        events = _events(reader, [stream[i : i + step] for i in range(0, len(stream), step)])
        assert isinstance(events[0], ResponseHeader)
        assert isinstance(events[-1], BodyEnd)
        got = b"".join(bytes(e.data) for e in events if isinstance(e, BodyData))
        assert got == body
        reader.eof()


def test_response_reader_refusal_has_no_body() -> None:
    reader = ResponseReader(offset=0)
    stream = encode_response(ArtifactResponse.refusal("artifact unavailable"))
    events = _events(reader, [stream])
    assert [type(e) for e in events] == [ResponseHeader]
    reader.eof()
    with pytest.raises(ArtifactWireError):
        reader.feed(b"x")


def test_response_reader_rejects_excess_truncation_and_bad_offset() -> None:
    header = encode_response(ArtifactResponse.accept(10, SHA))
    with pytest.raises(ArtifactWireError) as excess:
        ResponseReader(0).feed(header + b"x" * 11)
    assert excess.value.code == "artifact_wire_malformed"
    short = ResponseReader(0)
    short.feed(header + b"x" * 9)
    with pytest.raises(ArtifactWireError) as truncated:
        short.eof()
    assert truncated.value.code == "artifact_wire_truncated"
    with pytest.raises(ArtifactWireError) as offset:
        ResponseReader(11).feed(header)
    assert offset.value.code == "artifact_wire_field"


def test_resume_at_the_end_has_an_empty_body() -> None:
    reader = ResponseReader(offset=10)
    events = reader.feed(encode_response(ArtifactResponse.accept(10, SHA)))
    assert [type(e) for e in events] == [ResponseHeader, BodyEnd]


# --- fuzzing ---------------------------------------------------------------------------------
_ANY_VALUE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
    | st.floats()
    | st.text(max_size=70)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=16), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_fuzz_arbitrary_bytes_raise_only_the_wire_error(data: bytes) -> None:
    for decode in (decode_request, decode_response):
        with contextlib.suppress(ArtifactWireError):
            decode(data)
    reader = RequestReader()
    try:
        reader.feed(data)
        reader.eof()
    except ArtifactWireError:
        pass
    response_reader = ResponseReader(offset=0)
    try:
        response_reader.feed(data)
        response_reader.eof()
    except ArtifactWireError:
        pass


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([*sorted(request().to_wire()), "accepted", "total_size", "sha256", "x"]),
        _ANY_VALUE,
        max_size=12,
    ),
    st.dictionaries(st.sampled_from(sorted(request().to_wire())), _ANY_VALUE, max_size=3),
)
def test_fuzz_hostile_maps_raise_only_the_wire_error(
    fields: dict[str, Any], overrides: dict[str, Any]
) -> None:
    for base in (fields, {**request().to_wire(), **overrides}):
        payload = msgpack.packb(base, use_bin_type=True)
        for decode in (decode_request, decode_response):
            try:
                got = decode(payload)
            except ArtifactWireError:
                continue
            # Whatever decodes is a valid value that re-encodes to itself.
            encoder = encode_request if isinstance(got, ArtifactRequest) else encode_response
            assert decode(encoder(got)[4:]) == got  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    offset=st.integers(0, 5000),
    expected=st.one_of(st.none(), st.integers(5000, 1 << 40)),
    path=st.from_regex(r"\A[a-z0-9_-]{1,12}(/[a-z0-9_.-]{1,12}){0,3}\Z"),
    ids=st.tuples(*[st.from_regex(r"\A[A-Za-z0-9._:-]{1,40}\Z")] * 3),
)
def test_fuzz_valid_requests_round_trip(
    offset: int, expected: int | None, path: str, ids: tuple[str, str, str]
) -> None:
    assume(not any(part in (".", "..") for part in path.split("/")))  # the gate refuses them
    req = request(
        offset=offset,
        expected_size=expected,
        relative_path=path,
        topology_id=ids[0],
        run_id=ids[1],
        stage_id=ids[2],
    )
    assert decode_request(encode_request(req)[4:]) == req
