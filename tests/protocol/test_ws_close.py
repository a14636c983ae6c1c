"""The WebSocket closing handshake (``protocol.ws_close``): close payloads both ways, checked
against RFC 6455 section 7.4 and against wsproto (a stock implementation), and who answers
whom."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from wsproto.frame_protocol import CloseReason as WsprotoCode
from wsproto.frame_protocol import FrameProtocol

from protocol.ws_close import (
    MAX_REASON_BYTES,
    CloseReason,
    ClosingHandshake,
    close_payload,
    parse_close,
    sendable,
)
from protocol.ws_frames import CLOSE_INVALID_DATA, CLOSE_PROTOCOL_ERROR, FrameRefused

codes = st.sampled_from([1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 3000, 4999])


@given(code=codes, reason=st.text(max_size=200))
def test_a_close_payload_round_trips_cut_to_123_bytes_on_a_character(code: int, reason: str):
    payload = close_payload(code, reason)
    assert len(payload) <= 125
    got = parse_close(payload)
    assert got.code == code and reason.startswith(got.reason)
    assert len(reason.encode()) <= MAX_REASON_BYTES or len(got.reason.encode()) > 118


@given(code=codes, reason=st.text(max_size=40))
def test_wsproto_reads_our_close_frames(code: int, reason: str) -> None:
    from protocol.ws_frames import OP_CLOSE, frame

    payload = close_payload(code, reason)
    receiver = FrameProtocol(client=True, extensions=[])
    receiver.receive_bytes(bytes(frame([payload], len(payload), masked=False, opcode=OP_CLOSE)))
    (got,) = list(receiver.received_frames())
    assert got.payload == (WsprotoCode(code) if code < 3000 else code, reason)


@pytest.mark.parametrize(
    ("payload", "close_code"),
    [
        (b"\x03", CLOSE_PROTOCOL_ERROR),  # a 1-byte payload
        (b"\x03\xed", CLOSE_PROTOCOL_ERROR),  # 1005: never sent
        (b"\x03\xee", CLOSE_PROTOCOL_ERROR),  # 1006: never sent
        (b"\x03\xf7", CLOSE_PROTOCOL_ERROR),  # 1015: never sent
        (b"\x03\xe7", CLOSE_PROTOCOL_ERROR),  # 999
        (b"\x07\xd0", CLOSE_PROTOCOL_ERROR),  # 2000: reserved
        (b"\x13\x88", CLOSE_PROTOCOL_ERROR),  # 5000
        (b"\x03\xe8\xff\xfe", CLOSE_INVALID_DATA),  # a reason that is not UTF-8
    ],
)
def test_a_close_payload_no_peer_may_send_is_refused(payload: bytes, close_code: int) -> None:
    with pytest.raises(FrameRefused) as err:
        parse_close(payload)
    assert err.value.close_code == close_code


def test_codes_we_may_send() -> None:
    assert parse_close(b"") == CloseReason(1005)  # a close frame without a code
    assert [c for c in (999, 1000, 1004, 1005, 1006, 1014, 1015, 2999, 3000) if sendable(c)] == [
        1000,
        1014,
        3000,
    ]
    with pytest.raises(ValueError):
        close_payload(1006)


def test_who_answers_whom() -> None:
    ours = ClosingHandshake()  # we close first: the peer's close is its answer
    assert ours.start(1000, "bye") == close_payload(1000, "bye")
    assert ours.start(1001) is None and not ours.done  # one close frame at most
    assert ours.receive(close_payload(1000)) == (CloseReason(1000), None) and ours.done
    theirs = ClosingHandshake()  # the peer closes first: we answer with its code
    assert theirs.receive(close_payload(4000, "x")) == (CloseReason(4000, "x"), close_payload(4000))
    assert theirs.done and theirs.sent == CloseReason(4000)
    empty = ClosingHandshake()  # a close without a code is answered with 1000
    assert empty.receive(b"") == (CloseReason(1005), close_payload(1000))
