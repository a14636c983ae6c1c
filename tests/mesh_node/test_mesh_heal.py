"""Membership that heals, with real nodes on loopback in this process: a
node that is gone stays gone (gossip about it, from a peer that still had it, never brings
it back, and no node shows it connected: no ghost), a node that comes back with the same id
is linked again by the dial loop, and the redial backoff is bounded and jittered."""

from __future__ import annotations

import trio
from meshtools import address_of, identity, settings, wait_for, with_peers

from mesh_node.node import MeshNode, dial_backoff_cap_s, jittered


def test_the_redial_backoff_is_capped_and_jittered() -> None:
    assert dial_backoff_cap_s(0.1) == 1.0 and dial_backoff_cap_s(2.0) == 4.0
    draws = {jittered(1.0) for _ in range(200)}
    assert all(0.5 <= d < 1.0 for d in draws) and len(draws) > 100  # spread, not one value


async def test_a_gone_node_stays_gone_and_a_returning_one_is_linked_again(tmp_path) -> None:
    async with trio.open_nursery() as nursery:
        a = MeshNode(settings(tmp_path, "a"), identity())
        await nursery.start(a.run)
        b = MeshNode(with_peers(settings(tmp_path, "b"), a), identity())
        await nursery.start(b.run)
        c_ident = identity()
        c_scope = trio.CancelScope()
        c = MeshNode(with_peers(settings(tmp_path, "c"), a), c_ident)

        async def run_c(task_status: trio.TaskStatus[str]) -> None:
            with c_scope:
                await c.run(task_status=task_status)

        await nursery.start(run_c)
        # gossip meshes them: b and c learn each other from a
        await wait_for(lambda: all(len(n.peers(connected_only=True)) == 2 for n in (a, b, c)))
        c_scope.cancel()

        def connected(n: MeshNode) -> set[str]:
            return {p.node_id for p in n.peers(connected_only=True)}

        await wait_for(lambda: c.node_id not in connected(a) | connected(b))
        # many heartbeats and every learned redial later, c is still gone everywhere
        for _ in range(20):
            await trio.sleep(0.1)
            assert connected(a) == {b.node_id} and connected(b) == {a.node_id}
        # c comes back with the same id on a new port: it dials a (its configured peer), and
        # gossip links b to it again
        c2 = MeshNode(with_peers(settings(tmp_path, "c"), a), c_ident)
        await nursery.start(c2.run)
        await wait_for(lambda: c_ident.node_id in connected(a) and c_ident.node_id in connected(b))
        assert address_of(c2).node_id == c.node_id
        nursery.cancel_scope.cancel()
