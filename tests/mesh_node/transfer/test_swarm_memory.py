"""Swarm chunk buffers are taken from the node's peer-memory budget (with
the budget): a chunk is requested only once its bytes fit, all swarm chunks together
hold at most half of the budget, and a released chunk lets the next one in."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio

from mesh_node.budget import PeerMemory
from mesh_node.transfer.swarm import CHUNK_ACCOUNT, ChunkMemory, SwarmFailed

MIB = 1024 * 1024


def _memory(budget_bytes: int) -> tuple[ChunkMemory, PeerMemory]:
    budget = PeerMemory(budget_bytes)
    node: Any = SimpleNamespace(peer_memory=budget)  # ChunkMemory reads only this
    return ChunkMemory(node), budget


async def test_a_chunk_waits_for_room_and_the_chunks_hold_at_most_half_the_budget() -> None:
    memory, budget = _memory(32 * MIB)
    await memory.reserve(8 * MIB)
    await memory.reserve(8 * MIB)
    assert budget.held(CHUNK_ACCOUNT) == 16 * MIB == memory.cap
    got = trio.Event()

    async def third() -> None:
        await memory.reserve(8 * MIB)
        got.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(third)
        await trio.sleep(0.1)
        assert not got.is_set()  # over half the budget: it waits
        memory.release(8 * MIB)
        with trio.fail_after(5):
            await got.wait()
    assert budget.held(CHUNK_ACCOUNT) == 16 * MIB and budget.total == 16 * MIB


async def test_a_chunk_larger_than_the_chunk_budget_fails_the_swarm_fetch() -> None:
    memory, budget = _memory(16 * MIB)
    with pytest.raises(SwarmFailed):
        await memory.reserve(16 * MIB)
    assert budget.held(CHUNK_ACCOUNT) == 0
