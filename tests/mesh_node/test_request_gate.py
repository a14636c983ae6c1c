"""The refusal budget (mesh_node/request_gate.py) on trio's mock clock: a peer's refusals
beyond its burst are refused at the open until the bucket refills, strangers share one
node-wide budget that trusted peers never wait on, served requests cost nothing, and the log
gets the first refusal and then one summary line, not a line per refusal. The flood against a
real process is tests/processes/test_refusal_flood.py."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from mesh_node.peers import AuthenticatedPeer
from mesh_node.request_gate import LIMITED, RequestGate, TokenBucket
from protocol import constants as pc

KIND = pc.KIND_ARTIFACT_TRANSFER


def _peer(n: int, *, trusted: bool = False) -> AuthenticatedPeer:
    return AuthenticatedPeer(f"{n:064x}", None, "unverified", trusted)


def test_a_bucket_refills_and_goes_into_debt() -> None:
    bucket = TokenBucket(2, 1.0)
    assert bucket.full(0.0)
    for _ in range(4):  # two tokens, then two of debt
        bucket.charge(0.0)
    assert not bucket.has(0.0) and not bucket.has(2.5)  # the debt is paid back first
    assert bucket.has(3.0) and bucket.full(4.0)


async def test_refusals_beyond_the_burst_are_refused_at_the_open_until_refilled(
    mock_clock: trio.testing.MockClock,
) -> None:
    gate = RequestGate(burst=4, per_s=2, node_burst=100, node_per_s=100)
    stranger, other = _peer(1), _peer(2)
    assert gate.admit(stranger, KIND) is None  # never refused: nothing to hold against it
    for _ in range(4):
        assert gate.admit(stranger, KIND) is None
        gate.refused(stranger, KIND, "not_trusted")
    assert gate.admit(stranger, KIND) == LIMITED
    assert gate.admit(other, KIND) is None  # per peer
    assert gate.admit(stranger, pc.KIND_SWARM_SOURCES) is None  # and per kind
    mock_clock.jump(0.5)  # one token back (2 a second)
    assert gate.admit(stranger, KIND) is None
    assert gate.counters == {"refused": 4, "limited": 1}


async def test_strangers_share_a_node_budget_that_trusted_peers_never_wait_on(
    mock_clock: trio.testing.MockClock,
) -> None:
    gate = RequestGate(burst=4, per_s=1, node_burst=6, node_per_s=1)
    strangers = [_peer(i) for i in range(1, 4)]
    for s in strangers:  # 2 refusals each: every own bucket keeps 2 tokens
        gate.refused(s, KIND, "not_trusted")
        gate.refused(s, KIND, "not_trusted")
    # The node budget is spent: a stranger refused lately waits, though its own has tokens.
    assert gate.admit(strangers[0], KIND) == LIMITED
    assert gate.admit(_peer(9), KIND) is None  # a stranger never refused is served
    friend = _peer(10, trusted=True)
    gate.refused(friend, KIND, "server_busy")
    assert gate.admit(friend, KIND) is None  # trusted: only its own bucket counts
    mock_clock.jump(2.0)  # the node budget refills
    assert gate.admit(strangers[0], KIND) is None


async def test_the_log_gets_the_first_refusal_then_one_summary(
    caplog: pytest.LogCaptureFixture, mock_clock: trio.testing.MockClock
) -> None:
    gate = RequestGate(burst=4, per_s=1)
    stranger = _peer(1)
    with caplog.at_level(logging.INFO, logger="mesh_node.request_gate"):
        for _ in range(500):
            if gate.admit(stranger, KIND) is None:
                gate.refused(stranger, KIND, "not_trusted")
        assert len(caplog.records) == 1 and "not_trusted" in caplog.records[0].getMessage()
        line = gate.summary()
    assert line is not None and "4 refused (not_trusted 4), 496 at the open" in line
    assert gate.summary() is None  # nothing since: no line
    mock_clock.autojump_threshold = 0  # sleeps end at once, on the mock clock
    async with trio.open_nursery() as nursery:  # the service's loop logs the summary
        nursery.start_soon(gate.run)
        gate.refused(stranger, KIND, "not_trusted")
        gate.refused(stranger, KIND, "not_trusted")
        await trio.sleep(10.5)
        nursery.cancel_scope.cancel()
    assert any("2 refused" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
