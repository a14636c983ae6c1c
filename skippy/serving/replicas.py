"""Replicas of a split: the pure decisions.

The pure core of ``mesh_node.serving.replicas``, its shell.

A serving coordinator may run R independent pipelines of the same package. Every replica holds
stage 0 on the coordinator (it embeds the prompt, runs the API and the tokenizer) and its
other stages on peers that no other replica uses: a worker serves one stage of one topology,
so the replicas' worker sets are disjoint.

- ``peers_needed``: how many capable peers R replicas of S stages need.
- ``free_for``: the capable nodes a replica may plan over (those no other replica holds).
- ``choose_replica``: which ready replica takes a request (least outstanding tokens).
- ``check_replicas``: the replica count against the stage count (a usage error).
- ``waits_for_first``: whether another replica waits for replica 0 to be ready first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from skippy.errors import UsageError
from skippy.package.topology import NodeCapacity

MAX_REPLICAS: Final = 64  # replicas of one package: independent pipelines over disjoint peers


def peers_needed(replicas: int, stages: int) -> int:
    """Capable peers for ``replicas`` pipelines of ``stages`` stages (stage 0 is the
    coordinator's in each)."""
    return replicas * (stages - 1)


def free_for(
    capable: Sequence[NodeCapacity], held_by_others: Iterable[str], coordinator: str
) -> list[NodeCapacity]:
    """The capable nodes one replica may plan over: every one that no other replica holds a
    stage on; the coordinator always (it holds stage 0 of every replica)."""
    taken = set(held_by_others) - {coordinator}
    return [c for c in capable if c.node_id not in taken]


@dataclass(frozen=True)
class ReplicaLoad:
    """What the chooser knows of one replica: whether its route is ready, and the tokens its
    requests in flight still have to process (prompt + remaining completion)."""

    index: int
    ready: bool
    outstanding_tokens: int
    in_flight: int = 0


def choose_replica(loads: Sequence[ReplicaLoad]) -> int | None:
    """The ready replica with the fewest outstanding tokens (ties: fewer requests in flight,
    then the lower index); ``None`` when no replica is ready. A replica that is not ready is
    never chosen."""
    ready = [r for r in loads if r.ready]
    if not ready:
        return None
    return min(ready, key=lambda r: (r.outstanding_tokens, r.in_flight, r.index)).index


def check_replicas(replicas: int, stages: int | None) -> None:
    """``--replicas`` / ``[serving] replicas`` against the stage count: more than one replica
    needs a stage count of at least 2 (each replica's workers are planned apart; with one
    stage every replica would be this node alone)."""
    if not 1 <= replicas <= MAX_REPLICAS:
        raise UsageError(
            f"replicas must be in 1..{MAX_REPLICAS}", code="usage", actual=replicas
        )
    if replicas > 1 and (stages is None or stages < 2):
        raise UsageError(
            f"{replicas} replicas need a stage count of at least 2 (--stages S): each "
            "replica is stage 0 here plus S - 1 peers of its own",
            code="usage",
            remediation=f"add --stages S; {replicas} replicas of S stages need "
            f"{replicas} x (S - 1) capable peers",
        )


# How long another replica waits for replica 0 to be ready before it is planned
# anyway (its nodes then fetch from the coordinator alone, as without siblings).
STAGGER_MAX_S: Final = 60.0


def waits_for_first(
    *,
    first_ready: bool,
    waited_s: float,
    siblings_serve: bool,
    max_s: float = STAGGER_MAX_S,
    partials_serve: bool = False,
) -> bool:
    """Whether a replica other than 0 waits before it is planned. Replica 0's ready nodes hold
    every file the others need and serve them across replicas (``sibling-serve``), so
    replica 1's nodes then fetch from the coordinator *and* their counterparts instead of all
    six workers sharing the coordinator's uplink at once (docs/performance.md "Swarm
    fetch"). Without sibling serving on every capable peer waiting only delays, so it does
    not; nor beyond ``max_s`` (a replica 0 that cannot come up holds nobody back). With
    ``partials_serve`` (every capable peer serves verified chunks of its partials) nobody
    waits: the replicas come up at once and counterparts exchange what each verified, so
    the coordinator's uplink carries each distinct byte about once
    (``skippy.transfer.partials``)."""
    if partials_serve:
        return False
    return siblings_serve and not first_ready and waited_s < max_s

