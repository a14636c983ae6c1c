"""Stream windows sized to the bandwidth-delay product (protocol/streams.py; sans-IO,
time passed in as numbers): a window that limits a stream on a long link doubles up to
``stream_window_max_bytes``; a slow reader never grows it; without a clock it stays fixed
(the old behaviour); only bigger window updates reach the wire, which the sender simply
accepts as credit."""

from __future__ import annotations

from test_protocol_frames_streams import opened_pair, pump

from protocol import constants as c
from protocol import streams as ev
from protocol.streams import Multiplexer

KIB = 1024
LIMITS = c.Limits(stream_window_bytes=256 * KIB, stream_window_max_bytes=1024 * KIB)


def _round(a: Multiplexer, b: Multiplexer, sid: int, now: float, rtt: float | None) -> int:
    """The sender fills its credit, the receiver reads it all at ``now``; the credit after."""
    room = a.send_capacity(sid)
    a.send_data(sid, b"x" * room)
    got = sum(len(e.data) for e in pump(a, b) if isinstance(e, ev.DataReceived))
    assert got == room
    b.consumed(sid, got, now_s=None if rtt is None else now, rtt_s=rtt)
    pump(b, a)
    return a.send_capacity(sid)


def test_a_window_that_limits_a_long_link_doubles_up_to_the_cap() -> None:
    a, b, sid = opened_pair(LIMITS)
    rtt = 0.05
    windows = []
    for i in range(8):  # a reader that keeps up: a window's worth every round trip
        _round(a, b, sid, now=i * rtt, rtt=rtt)
        windows.append(b.receive_window(sid))
    assert windows[0] == 256 * KIB  # the first update has nothing to compare with
    assert windows[1:4] == [512 * KIB, 1024 * KIB, 1024 * KIB]
    assert max(windows) == LIMITS.stream_window_max_bytes
    # The sender may now have a whole grown window in flight, and the receiver accepts it.
    assert a.send_capacity(sid) == 1024 * KIB
    a.send_data(sid, b"y" * (1024 * KIB))
    assert sum(len(e.data) for e in pump(a, b) if isinstance(e, ev.DataReceived)) == 1024 * KIB


def test_a_reader_that_keeps_up_from_its_first_read_grows_the_window_at_the_first_update() -> None:
    # The bytes arrive a piece at a time (a long link at its rate): half the window read
    # within two round trips of the first read already shows the window is the bottleneck.
    a, b, sid = opened_pair(LIMITS)
    rtt = 0.05
    a.send_data(sid, b"x" * (256 * KIB))
    pump(a, b)
    for i in range(4):  # 4 x 32 KiB = half the window, 10 ms apart
        b.consumed(sid, 32 * KIB, now_s=i * 0.01, rtt_s=rtt)
    assert b.receive_window(sid) == 512 * KIB
    pump(b, a)
    assert a.send_capacity(sid) == 512 * KIB - 128 * KIB  # 128 KiB still unread in flight


def test_a_reader_slower_than_two_round_trips_per_half_window_never_grows_it() -> None:
    a, b, sid = opened_pair(LIMITS)
    for i in range(6):
        _round(a, b, sid, now=i * 1.0, rtt=0.05)  # one window per second at 50 ms RTT
    assert b.receive_window(sid) == 256 * KIB
    assert a.send_capacity(sid) == 256 * KIB


def test_without_a_clock_the_window_stays_fixed() -> None:
    a, b, sid = opened_pair(LIMITS)
    for _ in range(6):
        assert _round(a, b, sid, now=0.0, rtt=None) == 256 * KIB
    assert b.receive_window(sid) == 256 * KIB


def test_the_cap_is_never_exceeded_and_a_small_cap_keeps_the_initial_window() -> None:
    fixed = c.Limits(stream_window_bytes=256 * KIB, stream_window_max_bytes=128 * KIB)
    a, b, sid = opened_pair(fixed)
    for i in range(4):
        _round(a, b, sid, now=i * 0.001, rtt=0.05)
    assert b.receive_window(sid) == 256 * KIB  # never shrinks below where both ends start
