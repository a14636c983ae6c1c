"""The emulated WAN link (mesh_node/lab/netem.py): the pure schedule, then real relays on
loopback. Delays and rates are checked against the relay's own event log (trio's clock), never
against a wall clock; bytes are checked for identity and order."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from mesh_node.lab.netem import (
    DelayLine,
    LinkSpec,
    LinkTable,
    Netem,
    due_count,
    link_table_from_toml,
    open_netem,
    parse_duration,
    parse_probability,
    parse_rate,
    sleep_target,
    wait_until,
)
from skippy.errors import UsageError

MBIT = 1e6 / 8


# --- spelling ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "seconds"), [("20ms", 0.02), ("1.5s", 1.5), ("500us", 0.0005), ("7", 0.007)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text, "x") == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [("100Mbit", 12.5e6), ("1Gbit", 125e6), ("512kbit", 64e3), ("20MB", 20e6), ("8mbps", 1e6)],
)
def test_rates(text: str, bytes_per_s: float) -> None:
    assert parse_rate(text, "x") == pytest.approx(bytes_per_s)


def test_probabilities_and_bad_spellings() -> None:
    assert parse_probability("0.1%", "x") == pytest.approx(0.001)
    assert parse_probability("0.25", "x") == pytest.approx(0.25)
    for bad, parse in [("fast", parse_rate), ("-1ms", parse_duration), ("150%", parse_probability)]:
        with pytest.raises(UsageError):
            parse(bad, "x")  # type: ignore[operator]


def test_lab_file_pairs_override_the_default() -> None:
    table = link_table_from_toml(
        {
            "links": {
                "latency": "5ms",
                "pair": [{"a": 0, "b": 2, "latency": "50ms", "rate": "10Mbit"}],
            }
        },
        LinkSpec(),
    )
    assert table.spec("n0", "n1").rtt_s == pytest.approx(0.005)
    assert table.spec("n2", "n0").rtt_s == pytest.approx(0.05)  # both directions
    assert table.spec("n0", "n2").rate_bytes_per_s == pytest.approx(10 * MBIT)
    with pytest.raises(UsageError, match="unknown link key"):
        link_table_from_toml({"links": {"latncy": "5ms"}}, LinkSpec())


# --- the pure schedule ---------------------------------------------------------------------------
def test_schedule_serialises_at_the_rate_and_adds_half_the_rtt() -> None:
    line = DelayLine(LinkSpec(rtt_s=0.04, rate_bytes_per_s=1e6), random.Random(0))
    first = line.schedule(100_000, now=10.0, not_before=0.0)
    second = line.schedule(100_000, now=10.0, not_before=first.arrive_s)  # read at once
    assert first.depart_s == pytest.approx(10.1)  # 100 kB at 1 MB/s
    assert second.depart_s == pytest.approx(10.2)  # waits for the bottleneck
    assert first.arrive_s == pytest.approx(10.12)  # + 20 ms one way
    later = line.schedule(1000, now=20.0, not_before=second.arrive_s)  # idle link: no backlog
    assert later.depart_s == pytest.approx(20.001)


def test_the_timer_sleeps_only_to_just_before_a_deadline_it_could_overshoot() -> None:
    # epoll sleeps whole milliseconds, rounded up: a timed sleep stops TIMER_SLACK_S short.
    assert sleep_target(10.0, 10.02, slack_s=0.0015) == pytest.approx(10.0185)
    assert sleep_target(10.0, 10.001, slack_s=0.0015) is None  # too close: yield instead
    assert sleep_target(10.0, 9.0, slack_s=0.0015) is None  # overdue


def test_chunks_due_together_leave_in_one_write_in_order() -> None:
    queue = [(1.0, 100), (1.5, 100), (2.0, 100), (9.0, 100)]
    assert due_count(queue, now=2.0, max_bytes=1000) == 3  # the last is not due yet
    assert due_count(queue, now=2.0, max_bytes=250) == 2  # the write's size cap
    assert due_count(queue, now=0.5, max_bytes=50) == 1  # the one waited for always goes
    assert due_count([(1.0, 100), (1.0, 0), (1.0, 100)], now=5.0, max_bytes=1000) == 1  # EOF


async def test_wait_until_is_never_early_on_the_real_clock() -> None:
    for delay in (0.0, 0.0005, 0.004):  # no sleep, only yielding, sleep then yielding
        deadline = trio.current_time() + delay
        await wait_until(deadline)
        assert trio.current_time() >= deadline


async def test_wait_until_under_a_mock_clock_lands_on_the_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    deadline = trio.current_time() + 0.02
    await wait_until(deadline)  # a yield loop would never see virtual time move
    assert trio.current_time() == pytest.approx(deadline)


def test_jitter_never_reorders_and_stays_in_its_band() -> None:
    line = DelayLine(LinkSpec(rtt_s=0.05, jitter_s=0.01), random.Random(1))
    last, delays = 0.0, []
    for i in range(2000):
        now = i * 0.001
        s = line.schedule(100, now, last)
        assert s.arrive_s >= last
        delays.append(s.arrive_s - now)
        last = s.arrive_s
    assert min(delays) >= 0.015 - 1e-9
    assert max(delays) <= 0.035 + 1e-9
    assert max(delays) - min(delays) > 0.01  # it does jitter


def test_loss_and_stall_draws_follow_their_probabilities() -> None:
    line = DelayLine(LinkSpec(loss=0.01, stall=0.02, stall_s=0.3), random.Random(2))
    outcomes = [line.schedule(10, float(i), 0.0) for i in range(20_000)]
    drops = sum(s.drop for s in outcomes)
    stalls = [s for s in outcomes if s.stalled]
    assert 120 < drops < 290  # 1% of 20k, generously
    assert 250 < len(stalls) < 550
    assert all(s.arrive_s - s.depart_s == pytest.approx(0.3) for s in stalls)


# --- real relays on loopback -------------------------------------------------------------------
async def _sink_server(
    nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]]
) -> int:
    async def tolerant(stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError):  # the relay reset it on purpose
            await handler(stream)

    listeners = await nursery.start(trio.serve_tcp, tolerant, 0)
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def _relayed(
    netem: Netem, nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]]
) -> trio.SocketStream:
    port = await _sink_server(nursery, handler)
    netem.set_target("b", lambda: ("127.0.0.1", port))
    url = await netem.route("a", "b")
    host, relay_port = url.removeprefix("ws://").split(":")
    return await trio.open_tcp_stream(host, int(relay_port))


async def test_relay_delivers_every_byte_in_order_after_the_one_way_delay() -> None:
    spec = LinkSpec(rtt_s=0.02, jitter_s=0.004, rate_bytes_per_s=40 * MBIT)
    payload = random.Random(3).randbytes(2_000_000)
    got = bytearray()
    done = trio.Event()

    async def sink(stream: trio.SocketStream) -> None:
        while data := await stream.receive_some(1 << 16):
            got.extend(data)
        done.set()

    async with open_netem(LinkTable(spec)) as netem, trio.open_nursery() as nursery:
        client = await _relayed(netem, nursery, sink)
        await client.send_all(payload)
        await client.send_eof()
        with trio.fail_after(60):
            await done.wait()
        nursery.cancel_scope.cancel()
    assert bytes(got) == payload
    chunks = list(netem.chunks("a", "b"))
    assert sum(c.nbytes for c in chunks) == len(payload)
    for c in chunks:  # the relay's own log: delivered no earlier than due, due after the delay
        assert c.arrive_s - c.read_s >= spec.one_way_s - spec.jitter_s - 1e-9
        assert c.sent_s >= c.arrive_s
    arrivals = [c.arrive_s for c in chunks]
    assert arrivals == sorted(arrivals)
    # The bottleneck: everything after the first chunk needed at least its bytes / rate.
    spread = arrivals[-1] - arrivals[0] + 2 * spec.jitter_s
    assert spread >= (len(payload) - chunks[0].nbytes) / spec.rate_bytes_per_s  # type: ignore[operator]


async def test_answers_take_the_reverse_direction_spec() -> None:
    table = LinkTable(
        LinkSpec(),
        {("a", "b"): LinkSpec(rtt_s=0.002), ("b", "a"): LinkSpec(rtt_s=0.06)},
    )

    async def echo(stream: trio.SocketStream) -> None:
        while data := await stream.receive_some(1 << 16):
            await stream.send_all(data)

    async with open_netem(table) as netem, trio.open_nursery() as nursery:
        client = await _relayed(netem, nursery, echo)
        await client.send_all(b"ping")
        assert await client.receive_some(4) == b"ping"
        nursery.cancel_scope.cancel()
    (forward,) = netem.chunks("a", "b")
    (back,) = netem.chunks("b", "a")
    assert forward.arrive_s - forward.read_s == pytest.approx(0.001)
    assert back.arrive_s - back.read_s == pytest.approx(0.03)


async def test_blackhole_partition_holds_bytes_until_heal_and_keeps_the_connection() -> None:
    got = bytearray()
    arrived = trio.Event()

    async def sink(stream: trio.SocketStream) -> None:
        while data := await stream.receive_some(1 << 16):
            got.extend(data)
            if len(got) >= 6:
                arrived.set()

    async with open_netem(LinkTable()) as netem, trio.open_nursery() as nursery:
        client = await _relayed(netem, nursery, sink)
        await client.send_all(b"one")
        while len(got) < 3:
            await trio.sleep(0.01)
        netem.partition("b")
        await client.send_all(b"two")
        await trio.sleep(0.3)
        assert bytes(got) == b"one"  # nothing crosses a partition
        netem.heal("b")
        with trio.fail_after(10):
            await arrived.wait()
        nursery.cancel_scope.cancel()
    assert bytes(got) == b"onetwo"
    kinds = [e.kind for e in netem.events]
    assert "close" not in kinds[: kinds.index("heal")]  # the connection survived it
    heal_t = next(e.t for e in netem.events if e.kind == "heal")
    (late,) = [c for c in netem.chunks("a", "b") if c.nbytes == 3 and c.sent_s >= heal_t]
    assert late.read_s < heal_t  # read during the partition, sent only after the heal


async def test_reset_partition_resets_and_refuses_until_heal() -> None:
    async def echo(stream: trio.SocketStream) -> None:
        while data := await stream.receive_some(1 << 16):
            await stream.send_all(data)

    async with open_netem(LinkTable()) as netem, trio.open_nursery() as nursery:
        client = await _relayed(netem, nursery, echo)
        await client.send_all(b"x")
        assert await client.receive_some(1) == b"x"
        netem.partition("a", mode="reset")
        with trio.fail_after(10), pytest.raises(trio.BrokenResourceError):
            await client.receive_some(1)
        url = netem.routes()[("a", "b")].removeprefix("ws://")
        host, port = url.split(":")
        refused = await trio.open_tcp_stream(host, int(port))
        with trio.fail_after(10):
            with contextlib.suppress(trio.BrokenResourceError):  # a reset: refused either way
                assert await refused.receive_some(1) == b""
        netem.heal("a")
        again = await trio.open_tcp_stream(host, int(port))
        await again.send_all(b"y")
        with trio.fail_after(10):
            assert await again.receive_some(1) == b"y"
        nursery.cancel_scope.cancel()
    assert netem.counts["refuse"] == 1


async def test_loss_drops_the_whole_connection() -> None:
    table = LinkTable(LinkSpec(), {("a", "b"): LinkSpec(loss=1.0)})

    async def sink(stream: trio.SocketStream) -> None:
        while await stream.receive_some(1 << 16):
            pass

    async with open_netem(table) as netem, trio.open_nursery() as nursery:
        client = await _relayed(netem, nursery, sink)
        await client.send_all(b"lost")
        with trio.fail_after(10), pytest.raises(trio.BrokenResourceError):
            while await client.receive_some(1):
                pass
        nursery.cancel_scope.cancel()
    assert netem.counts["drop"] == 1
    assert not list(netem.chunks("a", "b"))


async def test_wait_until_sleeps_on_a_timerfd_where_linux_has_one() -> None:
    # the relay's core stays free while it waits: no yield loop before the frame is due
    from mesh_node.lab.netem import _timerfd_wait

    deadline = trio.current_time() + 0.01
    assert await _timerfd_wait(deadline)
    assert trio.current_time() >= deadline - 1e-4  # fired at the deadline, not before it
