"""The link's WebSocket frame parser (``protocol.ws_frames.FrameParser``): what wsproto (a
stock implementation) writes, cut anywhere into reads, comes out as the same messages, pings,
pongs and close; every malformed or hostile frame is refused before its payload is kept."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto import ConnectionType
from wsproto.connection import Connection
from wsproto.events import BytesMessage, CloseConnection, Ping, Pong

from protocol.ws_close import CloseReason, parse_close
from protocol.ws_frames import (
    CLOSE_TOO_BIG,
    OP_BINARY,
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    FrameParser,
    FrameRefused,
    frame_header,
    mask_in_place,
)

LIMIT = 64 * 1024


def _wire(events, *, from_client: bool) -> bytes:  # type: ignore[no-untyped-def]
    """What wsproto sends for ``events`` from a client (masked) or a server."""
    side = ConnectionType.CLIENT if from_client else ConnectionType.SERVER
    conn = Connection(side)
    return b"".join(conn.send(e) for e in events)


def _run(tap: FrameParser, wire: bytes, cuts: list[int]):  # type: ignore[no-untyped-def]
    """Feed ``wire`` cut at ``cuts``: the messages, and the control frames (opcode, payload)."""
    messages: list[bytes] = []
    control: list[tuple[int, bytes]] = []
    at = 0
    for cut in [*sorted(set(cuts)), len(wire)]:
        if cut <= at:
            continue
        for opcode, payload in tap.feed(wire[at:cut]):
            if opcode == OP_BINARY:
                messages.append(bytes(payload))
            else:
                control.append((opcode, bytes(payload)))
        at = cut
    return messages, control


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
    tap = FrameParser(server=from_client, max_message_bytes=LIMIT)
    messages, control = _run(tap, wire, cuts)
    assert messages == expected
    assert [p for op, p in control if op == OP_PING] == pings
    assert [p for op, p in control if op == OP_PONG] == pongs


def test_a_close_frame_comes_out_and_nothing_after_it_is_parsed():
    wire = _wire(
        [BytesMessage(data=b"one"), CloseConnection(code=1000, reason="bye")], from_client=True
    )
    tap = FrameParser(server=True, max_message_bytes=LIMIT)
    messages, control = _run(tap, wire + b"\xff\xfe trailing", [len(wire) - 3])
    assert messages == [b"one"] and tap.closed
    ((opcode, payload),) = control  # the trailing garbage was not parsed (nor refused)
    assert opcode == OP_CLOSE and parse_close(payload) == CloseReason(1000, "bye")


def test_a_one_read_unmasked_message_is_a_view_of_the_read_not_a_copy():
    wire = _wire([BytesMessage(data=b"x" * 1000)], from_client=False)
    tap = FrameParser(server=False, max_message_bytes=LIMIT)
    ((opcode, payload),) = list(tap.feed(wire))
    assert opcode == OP_BINARY and isinstance(payload, memoryview) and payload.obj is wire


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
    tap = FrameParser(server=server, max_message_bytes=LIMIT)
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
    tap = FrameParser(server=True, max_message_bytes=LIMIT)
    wire = _wire([BytesMessage(data=b"z" * LIMIT)], from_client=True)
    assert [bytes(p) for op, p in tap.feed(wire) if op == OP_BINARY] == [b"z" * LIMIT]
    with pytest.raises(FrameRefused):
        list(FrameParser(server=True, max_message_bytes=LIMIT - 1).feed(wire))


def test_a_read_full_of_tiny_frames_is_parsed_one_at_a_time():
    """The parser is lazy: a hostile read of 2-byte frames never becomes a list of them."""
    wire = b"".join(struct.pack(">BB", 0x82, 0) for _ in range(50_000))  # unmasked, server side
    tap = FrameParser(server=False, max_message_bytes=LIMIT)
    items = tap.feed(wire)
    first = next(items)
    assert first == (OP_BINARY, memoryview(b""))
    assert sum(1 for _ in items) == 49_999


async def test_after_a_refused_frame_the_rest_is_dropped_and_none_of_it_held():
    """A link's WebSocket over a real socket pair: an oversize frame is refused at its header
    (the link's reader hears why), and everything the peer sends afterwards is read and
    dropped (``BudgetedStream.drain``, what ``WebSocket.aclose`` does after a refusal), its
    budget given back, until the peer closes."""
    import trio

    from mesh_node.budget import PeerMemory
    from mesh_node.budgeted_tcp import BudgetedStream
    from mesh_node.websocket import WebSocket

    budget = PeerMemory(4 << 20)
    ours, theirs = trio.socket.socketpair()
    stream = BudgetedStream(trio.SocketStream(ours), budget, server=True)
    stream.established(trusted=True)
    ws = WebSocket(stream, client=False, subprotocol=None, max_message_bytes=LIMIT)
    peer = trio.SocketStream(theirs)
    await peer.send_all(_frame(0x82, b"", masked=True, length=LIMIT + 1)[:14])
    with pytest.raises(FrameRefused) as e:
        await ws.get_message()
    assert e.value.code == "ws_message_too_big" and e.value.close_code == CLOSE_TOO_BIG
    with pytest.raises(FrameRefused):  # the reader hears it again, nothing more is parsed
        await ws.get_message()
    held = stream.held  # the refused frame's header: given back when the connection closes

    async def flood() -> None:
        for _ in range(20):
            await peer.send_all(b"\x00" * 65536)
        await peer.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(flood)
        with trio.fail_after(10):
            await stream.drain()  # dropped to the end
    assert stream.held == held == budget.held(stream.key) <= 14  # none of the 1.25 MiB after it
    await ws.aclose(e.value.close_code)
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
    tap = FrameParser(server=True, max_message_bytes=LIMIT)

    def feed_all() -> FrameParser:
        for at in range(0, len(wire), 65536):
            assert list(tap.feed(wire[at : at + 65536])) == []  # the message is not done
        return tap

    assert _held_by(feed_all) < 16 * 1024
    assert list(tap.feed(_frame(0x80, b"end", masked=True))) == [(OP_BINARY, bytearray(b"end"))]


def test_a_frame_trickled_a_byte_per_read_costs_its_payload_not_its_read_count():
    """A frame whose payload comes one byte per read (a peer trickling TCP segments) is held
    as its bytes, not as one object per read: ~64 KiB for a 64 KiB payload."""
    payload = os.urandom(LIMIT)
    wire = _frame(0x82, payload, masked=False)
    tap = FrameParser(server=False, max_message_bytes=LIMIT)
    pieces = [wire[i : i + 1] for i in range(len(wire) - 1)]  # all but the last byte

    def feed_all() -> FrameParser:
        for piece in pieces:
            assert list(tap.feed(piece)) == []
        return tap

    assert _held_by(feed_all) < 2 * LIMIT
    assert [(op, bytes(p)) for op, p in tap.feed(wire[-1:])] == [(OP_BINARY, payload)]


def _outcome(server: bool, wire: bytes, cuts: list[int]) -> tuple[list[tuple[int, bytes]], str]:
    """What the parser makes of ``wire`` read in pieces cut at ``cuts``: the items it gave,
    and the code it refused with ("" when it refused nothing)."""
    tap = FrameParser(server=server, max_message_bytes=LIMIT, text=True)
    items: list[tuple[int, bytes]] = []
    at = 0
    try:
        for cut in [*sorted(set(cuts)), len(wire)]:
            if cut > at:
                for op, p in tap.feed(wire[at:cut]):  # each kept before a refusal after it
                    items.append((op, bytes(p)))
                at = cut
    except FrameRefused as exc:
        return items, exc.code
    return items, ""


frame_bytes = st.builds(
    lambda b0, payload, masked: _frame(b0, payload, masked=masked),
    st.sampled_from([0x00, 0x01, 0x02, 0x80, 0x81, 0x82, 0x88, 0x89, 0x8A, 0xC2, 0x83]),
    st.binary(max_size=300),
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(
    server=st.booleans(),
    wire=st.binary(max_size=400) | st.lists(frame_bytes, max_size=8).map(b"".join),
    data=st.data(),
)
def test_any_bytes_parse_the_same_however_cut_or_are_refused_cleanly(server, wire, data):
    """Fuzzed: random bytes and random sequences of (often invalid) frames, cut anywhere into
    reads, give the same messages and control frames, and the same refusal, as read whole; a
    ``FrameRefused`` is the only error; a text message comes out only as valid UTF-8."""
    cuts = data.draw(st.lists(st.integers(0, len(wire)), max_size=10))
    whole = _outcome(server, wire, [])
    assert _outcome(server, wire, cuts) == whole
    items, _ = whole
    for opcode, payload in items:
        assert opcode in (0x1, 0x2, 0x8, 0x9, 0xA)
        if opcode == 0x1:
            payload.decode("utf-8")
        if opcode >= 0x8:
            assert len(payload) <= 125
