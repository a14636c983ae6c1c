"""The link's own WebSocket frame parser (``mesh_node.ws_receive``, issue #25 item 4): what
wsproto writes, cut anywhere into reads, comes out as the same messages, and the control
frames it passes on are frames wsproto itself reads back as the same pings, pongs and close;
every malformed or hostile frame is refused before its payload is kept."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto import ConnectionType
from wsproto.connection import Connection
from wsproto.events import BytesMessage, CloseConnection, Ping, Pong

from mesh_node.ws_frames import frame_header, mask_in_place
from mesh_node.ws_receive import CLOSE_TOO_BIG, FrameRefused, FrameTap

LIMIT = 64 * 1024


def _wire(events, *, from_client: bool) -> bytes:  # type: ignore[no-untyped-def]
    """What wsproto sends for ``events`` from a client (masked) or a server."""
    side = ConnectionType.CLIENT if from_client else ConnectionType.SERVER
    conn = Connection(side)
    return b"".join(conn.send(e) for e in events)


def _run(tap: FrameTap, wire: bytes, cuts: list[int]):  # type: ignore[no-untyped-def]
    """Feed ``wire`` cut at ``cuts``: the messages, and the control bytes as one stream."""
    messages: list[bytes] = []
    control = bytearray()
    at = 0
    for cut in [*sorted(set(cuts)), len(wire)]:
        if cut <= at:
            continue
        for is_message, payload in tap.feed(wire[at:cut]):
            if is_message:
                messages.append(bytes(payload))
            else:
                control += payload
        at = cut
    return messages, bytes(control)


def _control_events(control: bytes, *, to_server: bool) -> list[object]:
    """What wsproto, on the receiving side, reads from the control bytes passed on."""
    side = ConnectionType.SERVER if to_server else ConnectionType.CLIENT
    conn = Connection(side)
    conn.receive_data(control)
    return list(conn.events())


message_plan = st.lists(
    st.one_of(
        st.tuples(st.just("msg"), st.binary(max_size=3000), st.integers(1, 4)),
        st.tuples(st.just("ping"), st.binary(max_size=125), st.just(1)),
        st.tuples(st.just("pong"), st.binary(max_size=125), st.just(1)),
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(plan=message_plan, from_client=st.booleans(), data=st.data())
def test_what_wsproto_writes_comes_out_whole_however_the_reads_cut_it(plan, from_client, data):
    events: list[object] = []
    expected: list[bytes] = []
    pings, pongs = [], []
    for kind, payload, pieces in plan:
        if kind == "ping":
            events.append(Ping(payload=payload))
            pings.append(payload)
        elif kind == "pong":
            events.append(Pong(payload=payload))
            pongs.append(payload)
        else:  # a message, in ``pieces`` frames (fragmented when more than one)
            expected.append(payload)
            bounds = sorted(data.draw(st.lists(st.integers(0, len(payload)), max_size=pieces - 1)))
            starts = [0, *bounds]
            ends = [*bounds, len(payload)]
            for i, (a, b) in enumerate(zip(starts, ends, strict=True)):
                events.append(BytesMessage(data=payload[a:b], message_finished=i == len(ends) - 1))
    wire = _wire(events, from_client=from_client)
    cuts = data.draw(st.lists(st.integers(0, max(0, len(wire))), max_size=20))
    tap = FrameTap(server=from_client, max_message_bytes=LIMIT)
    messages, control = _run(tap, wire, cuts)
    assert messages == expected
    got = _control_events(control, to_server=from_client)
    assert [e.payload for e in got if isinstance(e, Ping)] == pings
    assert [e.payload for e in got if isinstance(e, Pong)] == pongs


def test_a_close_frame_goes_on_and_everything_after_it_passes_through_unparsed():
    wire = _wire(
        [BytesMessage(data=b"one"), CloseConnection(code=1000, reason="bye")], from_client=True
    )
    tap = FrameTap(server=True, max_message_bytes=LIMIT)
    messages, control = _run(tap, wire + b"\xff\xfe trailing", [len(wire) - 3])
    assert messages == [b"one"] and tap.closed
    assert control.endswith(b"\xff\xfe trailing")
    (close,) = _control_events(control[: -len(b"\xff\xfe trailing")], to_server=True)
    assert isinstance(close, CloseConnection) and close.code == 1000 and close.reason == "bye"


def test_a_one_read_unmasked_message_is_a_view_of_the_read_not_a_copy():
    wire = _wire([BytesMessage(data=b"x" * 1000)], from_client=False)
    tap = FrameTap(server=False, max_message_bytes=LIMIT)
    ((is_message, payload),) = list(tap.feed(wire))
    assert is_message and isinstance(payload, memoryview) and payload.obj is wire


def _frame(b0: int, payload: bytes, *, masked: bool, length: int | None = None) -> bytes:
    n = len(payload) if length is None else length
    key = os.urandom(4) if masked else None
    head = bytearray(frame_header(n, key))
    head[0] = b0
    body = bytearray(payload)
    if key is not None:
        mask_in_place(body, 0, key)
    return bytes(head) + bytes(body)


@pytest.mark.parametrize(
    ("wire", "server", "code"),
    [
        (_frame(0x82 | 0x40, b"x", masked=True), True, "ws_protocol"),  # RSV1: no extension
        (_frame(0x83, b"x", masked=True), True, "ws_protocol"),  # reserved opcode 3
        (_frame(0x8B, b"x", masked=True), True, "ws_protocol"),  # reserved opcode 0xB
        (_frame(0x09, b"p", masked=True), True, "ws_protocol"),  # a fragmented ping
        (_frame(0x89, b"p" * 126, masked=True), True, "ws_protocol"),  # a 126-byte ping
        (_frame(0x82, b"x", masked=False), True, "ws_protocol"),  # a client must mask
        (_frame(0x82, b"x", masked=True), False, "ws_protocol"),  # a server must not
        (_frame(0x80, b"x", masked=True), True, "ws_protocol"),  # continuation, no message
        (_frame(0x02, b"a", masked=True) + _frame(0x82, b"b", masked=True), True, "ws_protocol"),
        (_frame(0x81, b"text", masked=True), True, "malformed_record"),
        (_frame(0x82, b"", masked=True, length=LIMIT + 1), True, "ws_message_too_big"),
        (_frame(0x82, b"", masked=False, length=1 << 62), False, "ws_message_too_big"),
        (
            _frame(0x02, b"a" * (LIMIT // 2), masked=True)
            + _frame(0x80, b"", masked=True, length=LIMIT // 2 + 1),
            True,
            "ws_message_too_big",
        ),
    ],
    ids=[
        "reserved-bit", "reserved-opcode", "reserved-control-opcode", "fragmented-ping",
        "oversize-ping", "unmasked-from-a-client", "masked-from-a-server", "stray-continuation",
        "message-inside-a-message", "text", "oversize-message", "length-2-to-the-62",
        "oversize-fragments",
    ],
)
def test_a_hostile_frame_is_refused_before_its_payload_is_kept(wire, server, code):
    tap = FrameTap(server=server, max_message_bytes=LIMIT)
    with pytest.raises(FrameRefused) as e:
        for _ in tap.feed(wire[:16]):  # the header alone says it
            pass
        for _ in tap.feed(wire[16:]):
            pass
    assert e.value.code == code
    if code == "ws_message_too_big":
        assert e.value.close_code == CLOSE_TOO_BIG
        assert tap._header is None and tap._parts == []  # the refused frame was never begun


def test_a_message_at_the_limit_passes_and_one_byte_more_does_not():
    tap = FrameTap(server=True, max_message_bytes=LIMIT)
    wire = _wire([BytesMessage(data=b"z" * LIMIT)], from_client=True)
    assert [bytes(p) for m, p in tap.feed(wire) if m] == [b"z" * LIMIT]
    with pytest.raises(FrameRefused):
        list(FrameTap(server=True, max_message_bytes=LIMIT - 1).feed(wire))


def test_a_read_full_of_tiny_frames_is_parsed_one_at_a_time():
    """The parser is lazy: a hostile read of 2-byte frames never becomes a list of them."""
    wire = b"".join(struct.pack(">BB", 0x82, 0) for _ in range(50_000))  # unmasked, server side
    tap = FrameTap(server=False, max_message_bytes=LIMIT)
    items = tap.feed(wire)
    first = next(items)
    assert first == (True, memoryview(b""))
    assert sum(1 for _ in items) == 49_999


async def test_after_a_refused_frame_the_transport_drops_the_rest_and_holds_none_of_it():
    """A link's stream (``BudgetedStream``) over a real socket pair: the HTTP head goes to
    trio-websocket, an oversize frame is refused at its header (the link's reader hears
    why), and everything the peer sends afterwards is read and dropped, its budget given
    back, until the peer closes."""
    import trio

    from mesh_node.budget import PeerMemory
    from mesh_node.transport import BudgetedStream

    budget = PeerMemory(4 << 20)
    ours, theirs = trio.socket.socketpair()
    stream = BudgetedStream(trio.SocketStream(ours), budget, server=True, max_message_bytes=LIMIT)
    stream.established(trusted=True)
    head = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    peer = trio.SocketStream(theirs)
    await peer.send_all(head + _frame(0x82, b"", masked=True, length=LIMIT + 1)[:14])
    assert await stream.receive_some() == head  # the head is trio-websocket's
    held = stream.held  # the refused frame's header: given back when the connection closes

    async def flood() -> None:
        for _ in range(20):
            await peer.send_all(b"\x00" * 65536)
        await peer.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(flood)
        with trio.fail_after(10):
            assert await stream.receive_some() == b""  # dropped to the end, then the end
    with pytest.raises(FrameRefused) as e:
        await stream.next_message()
    assert e.value.code == "ws_message_too_big"
    assert stream.held == held == budget.held(stream.key) <= 14  # none of the 1.25 MiB after it
    await stream.aclose()
    assert budget.held(stream.key) == 0


def _held_by(feed_all) -> int:  # type: ignore[no-untyped-def]
    """The Python memory still allocated after ``feed_all()`` ran (tracemalloc)."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        keep = feed_all()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del keep
    return held


def test_a_message_cut_into_empty_fragments_costs_its_payload_not_its_frame_count():
    """A peer's fragments cost it wire bytes, not this end's memory: 50,000 empty
    continuation frames (300 KB on the wire) leave the tap holding nothing for them."""
    empty = _frame(0x00, b"", masked=True)
    wire = _frame(0x02, b"", masked=True) + empty * 50_000
    tap = FrameTap(server=True, max_message_bytes=LIMIT)

    def feed_all() -> FrameTap:
        for at in range(0, len(wire), 65536):
            assert list(tap.feed(wire[at : at + 65536])) == []  # the message is not done
        return tap

    assert _held_by(feed_all) < 16 * 1024
    assert list(tap.feed(_frame(0x80, b"end", masked=True))) == [(True, bytearray(b"end"))]


def test_a_frame_trickled_a_byte_per_read_costs_its_payload_not_its_read_count():
    """A frame whose payload comes one byte per read (a peer trickling TCP segments) is held
    as its bytes, not as one object per read: ~64 KiB for a 64 KiB payload."""
    payload = os.urandom(LIMIT)
    wire = _frame(0x82, payload, masked=False)
    tap = FrameTap(server=False, max_message_bytes=LIMIT)
    pieces = [wire[i : i + 1] for i in range(len(wire) - 1)]  # all but the last byte

    def feed_all() -> FrameTap:
        for piece in pieces:
            assert list(tap.feed(piece)) == []
        return tap

    assert _held_by(feed_all) < 2 * LIMIT
    assert [(m, bytes(p)) for m, p in tap.feed(wire[-1:])] == [(True, payload)]
