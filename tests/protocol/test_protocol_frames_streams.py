"""protocol.frames and protocol.streams: codec, limits, flow control, priorities (sans-IO)."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import constants as c
from protocol import frames as f
from protocol import streams as ev
from protocol.errors import ProtocolError
from protocol.streams import Multiplexer

OPEN = f.SubprotocolOpen(c.SKIPPY_STAGE, c.SKIPPY_STAGE_MAJOR, c.KIND_CONTROL)


def pump(src: Multiplexer, dst: Multiplexer) -> list[ev.Event]:
    out: list[ev.Event] = []
    while (record := src.next_record()) is not None:
        out += dst.receive(record)
    return out


def opened_pair(limits: c.Limits = c.DEFAULT_LIMITS) -> tuple[Multiplexer, Multiplexer, int]:
    a, b = Multiplexer(initiator=True, limits=limits), Multiplexer(initiator=False, limits=limits)
    sid = a.open_stream(OPEN)
    (event,) = pump(a, b)
    assert isinstance(event, ev.StreamOpenRequested) and event.open == OPEN
    b.accept_stream(sid)
    assert pump(b, a) == [ev.StreamAccepted(sid)]
    return a, b, sid


def test_frame_header_is_ten_bytes_and_round_trips():
    frame = f.encode_frame(c.FRAME_DATA, 7, b"abc")
    assert len(frame) == c.FRAME_HEADER_BYTES + 3
    (decoded,) = f.decode_frames(frame)
    assert (decoded.type, decoded.stream_id, bytes(decoded.payload)) == (c.FRAME_DATA, 7, b"abc")


@pytest.mark.parametrize(
    ("ftype", "length", "code"),
    [
        (c.FRAME_DATA, c.MAX_FRAME_PAYLOAD + 1, "frame_too_large"),
        (c.FRAME_MESSAGE, c.DEFAULT_LIMITS.max_control_payload + 1, "frame_too_large"),
        (0x7F, 0, "unknown_frame_type"),
        (c.FRAME_DATA, 100, "malformed_frame"),  # declares more than the record holds
    ],
)
def test_frame_limits_are_enforced_on_receive(ftype, length, code):
    header = struct.pack(">BBII", ftype, 0, 1, length)
    with pytest.raises(ProtocolError) as exc:
        f.decode_frames(header + b"x" * 10)
    assert exc.value.code == code


def test_link_message_limits():
    one = f.record_prefix(20) + b"r" * 20
    assert len(f.split_records(one * 16)) == 16
    with pytest.raises(ProtocolError, match="message_too_large"):
        f.split_records(one * 17)
    big = c.DEFAULT_LIMITS.max_ws_message_bytes + 1
    with pytest.raises(ProtocolError, match="message_too_large"):
        f.split_records(b"\x00" * big)
    with pytest.raises(ProtocolError, match="malformed_record"):
        f.split_records(f.record_prefix(5) + b"short")  # shorter than a Noise tag


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_arbitrary_bytes_raise_only_the_protocol_error(data):
    for decode in (f.decode_frames, f.split_records, f.decode_open, f.decode_reason):
        with contextlib.suppress(ProtocolError):
            decode(data)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(sorted(c.FRAME_TYPES)), st.integers(0, 9), st.binary(max_size=40)
        ),
        max_size=12,
    )
)
@settings(max_examples=300, deadline=None)
def test_arbitrary_frame_sequences_raise_only_the_protocol_error(frames):
    mux = Multiplexer(initiator=True)
    for ftype, sid, payload in frames:
        try:
            mux.receive(f.encode_frame(ftype, sid, payload))
        except ProtocolError as exc:
            assert exc.fatal
            return


def test_open_accept_data_and_half_close():
    a, b, sid = opened_pair()
    a.send_data(sid, b"hello")
    a.send_eof(sid)
    assert pump(a, b) == [ev.DataReceived(sid, b"hello"), ev.StreamEnded(sid)]
    b.send_data(sid, b"world")
    b.send_eof(sid)
    assert pump(b, a) == [ev.DataReceived(sid, b"world"), ev.StreamEnded(sid)]
    assert not a.has_stream(sid) and not b.has_stream(sid)  # both ends closed: forgotten


def test_a_stream_finished_then_reset_sends_its_data_and_fin_before_the_reset():
    """``finish_then_reset``: a side that queued its answer and FIN and then closes before
    the peer's end sends the answer, the FIN, and only then the RESET (a RESET alone goes
    ahead of queued data and drops it: ``reset_stream``, checked last)."""
    a, b, sid = opened_pair()
    b.send_data(sid, b"answer")
    b.send_eof(sid)
    assert b.finish_then_reset(sid, "closed_early", "the stream was closed early")
    assert b.consumed(sid, 10) is False  # it reads no more: no credit is granted
    events = pump(b, a)
    assert events == [
        ev.DataReceived(sid, b"answer"),
        ev.StreamEnded(sid),
        ev.StreamReset(sid, "closed_early", "the stream was closed early"),
    ]
    assert not a.has_stream(sid) and not b.has_stream(sid)
    # not taken without a FIN queued (the caller then resets)
    _a1, b1, sid1 = opened_pair()
    b1.send_data(sid1, b"half an answer")
    assert not b1.finish_then_reset(sid1, "closed_early", "")
    assert b1.has_stream(sid1)
    # a whole window queued, then the FIN: all of it goes, then the RESET
    a2, b2, sid2 = opened_pair(c.Limits(stream_window_bytes=1000))
    b2.send_data(sid2, b"x" * 1000)
    b2.send_eof(sid2)
    assert b2.finish_then_reset(sid2, "closed_early", "")
    events = pump(b2, a2)
    assert sum(len(e.data) for e in events if isinstance(e, ev.DataReceived)) == 1000
    assert events[-2:] == [ev.StreamEnded(sid2), ev.StreamReset(sid2, "closed_early", "")]
    # after the FIN went out, the RESET goes at once
    a3, b3, sid3 = opened_pair()
    b3.send_eof(sid3)
    assert pump(b3, a3) == [ev.StreamEnded(sid3)]
    assert b3.finish_then_reset(sid3, "closed_early", "")
    assert pump(b3, a3) == [ev.StreamReset(sid3, "closed_early", "")]
    # a plain reset: the RESET goes first and the queued data never leaves
    a4, b4, sid4 = opened_pair()
    b4.send_data(sid4, b"answer")
    b4.send_eof(sid4)
    b4.reset_stream(sid4, "closed_early", "")
    assert pump(b4, a4) == [ev.StreamReset(sid4, "closed_early", "")]


def test_sender_never_exceeds_credit_and_consumption_grants_more():
    limits = c.Limits(stream_window_bytes=256 * 1024)
    a, b, sid = opened_pair(limits)
    assert a.send_capacity(sid) == 256 * 1024
    a.send_data(sid, b"x" * (256 * 1024))
    assert a.send_capacity(sid) == 0
    with pytest.raises(ProtocolError, match="flow_control"):
        a.send_data(sid, b"y")
    got = sum(len(e.data) for e in pump(a, b) if isinstance(e, ev.DataReceived))
    assert got == 256 * 1024
    b.consumed(sid, 100 * 1024)  # under half the window: no update yet
    assert pump(b, a) == []
    b.consumed(sid, 28 * 1024)
    assert pump(b, a) == [ev.CreditAvailable(sid)]
    assert a.send_capacity(sid) == 128 * 1024


def test_bulk_data_is_a_view_of_the_record_and_small_data_is_copied():
    """A bulk payload is handed on without a copy; a small one beside other frames is copied,
    so buffered views never pin more than twice the bytes the stream window admits."""
    a, b, sid = opened_pair()
    a.send_data(sid, b"d" * 60_000)
    (bulk,) = pump(a, b)
    assert isinstance(bulk, ev.DataReceived) and isinstance(bulk.data, memoryview)
    assert bytes(bulk.data) == b"d" * 60_000 and len(bulk.data.obj) <= 2 * len(bulk.data)
    record = f.encode_frame(c.FRAME_DATA, sid, b"x") + f.encode_frame(
        c.FRAME_MESSAGE, c.LINK_STREAM_ID, b"m" * 30_000
    )
    small, _message = b.receive(record)
    assert isinstance(small, ev.DataReceived) and type(small.data) is bytes
    assert small.data == b"x"


def test_data_beyond_the_window_kills_the_link():
    limits = c.Limits(stream_window_bytes=1000)
    _a, b, sid = opened_pair(limits)
    with pytest.raises(ProtocolError) as exc:
        b.receive(f.encode_frame(c.FRAME_DATA, sid, b"z" * 1001))
    assert exc.value.code == "flow_control" and exc.value.fatal


def test_control_frames_go_before_queued_bulk_data():
    a, _b, sid = opened_pair()
    a.send_data(sid, b"d" * (1024 * 1024))
    first = a.next_record()
    assert first is not None
    a.ping(b"12345678")  # queued behind 15 records of bulk data
    record = a.next_record()
    assert record is not None
    frames = f.decode_frames(record)
    assert frames[0].type == c.FRAME_PING


def test_streams_per_link_limit_refuses_the_excess_and_keeps_the_link():
    limits = c.Limits(max_streams_per_link=4)
    a = Multiplexer(initiator=True, limits=limits)
    b = Multiplexer(initiator=False, limits=limits)
    peer_open = OPEN.encode()
    events = []
    for i in range(6):
        events += b.receive(f.encode_frame(c.FRAME_OPEN, 2 * i + 1, peer_open))
    refused = [e for e in events if isinstance(e, ev.StreamOpenRefused)]
    assert len(refused) == 2 and all(e.code == "stream_limit" for e in refused)
    assert b.live_streams(local=False) == 4
    resets = [fr for fr in f.decode_frames(b.next_record() or b"") if fr.type == c.FRAME_RESET]
    assert len(resets) == 2
    for _ in range(4):
        a.open_stream(OPEN)
    with pytest.raises(ProtocolError, match="stream_limit"):
        a.open_stream(OPEN)


def test_control_backlog_is_bounded_for_a_peer_that_never_reads():
    limits = c.Limits(max_control_backlog_bytes=4096)
    b = Multiplexer(initiator=False, limits=limits)
    ping = f.encode_frame(c.FRAME_PING, 0, b"p" * 8)
    with pytest.raises(ProtocolError) as exc:
        for _ in range(1000):  # each ping queues a pong nobody collects
            b.receive(ping)
    assert exc.value.code == "peer_not_reading"


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"\x07", "unknown_stream_type"),
        (bytes([c.STREAM_SUBPROTOCOL]) + b"\x00\x03abc\x01", "malformed_open"),  # not msgpack map
        (f.SubprotocolOpen("skippy-stage", 2, 1, gen=9).encode(), "unsupported_envelope"),
        (bytes([c.STREAM_SUBPROTOCOL]) + b"\x10\x00", "malformed_open"),  # oversize envelope
    ],
)
def test_bad_open_envelopes_are_refused_with_a_reason_not_a_dead_link(payload, code):
    b = Multiplexer(initiator=False)
    (event,) = b.receive(f.encode_frame(c.FRAME_OPEN, 1, payload))
    assert isinstance(event, ev.StreamOpenRefused) and event.code == code
    (reset,) = f.decode_frames(b.next_record() or b"")
    assert reset.type == c.FRAME_RESET and f.decode_reason(reset.payload)[0] == code


def test_open_envelope_is_length_prefixed_then_one_kind_byte():
    raw = f.SubprotocolOpen("skippy-stage", 2, c.KIND_ARTIFACT_TRANSFER).encode()
    assert raw[0] == c.STREAM_SUBPROTOCOL == 0x0D
    (length,) = struct.unpack(">H", raw[1:3])
    assert len(raw) == 3 + length + 1 and raw[-1] == 0x03
    assert f.decode_open(raw) == f.SubprotocolOpen("skippy-stage", 2, 3)


def test_peer_cannot_open_with_our_parity_or_reuse_ids():
    b = Multiplexer(initiator=False)
    with pytest.raises(ProtocolError, match="stream_state"):
        b.receive(f.encode_frame(c.FRAME_OPEN, 2, OPEN.encode()))  # even: the responder's own
    b.receive(f.encode_frame(c.FRAME_OPEN, 3, OPEN.encode()))
    with pytest.raises(ProtocolError, match="stream_state"):
        b.receive(f.encode_frame(c.FRAME_OPEN, 1, OPEN.encode()))  # going backwards
    with pytest.raises(ProtocolError, match="stream_state"):
        b.receive(f.encode_frame(c.FRAME_DATA, 9, b"x"))  # never opened
