"""Who may coordinate this node, and on whom it places stages.

Pure decisions over plain values, plus the one small store they need: topology epochs.

- ``offer_refusal``: a topology offer is accepted only from a coordinator the policy admits
  (``[security] accept_topologies_from``: ``trusted`` = verified owner that is ours or in
  ``trusted_owners``; ``any`` for labs), never while this node coordinates one itself, and only
  when its epoch is newer than the last accepted from that coordinator.
- ``bounds_problem``: sanity bounds checked before anything is fetched (no more stages than
  nodes this node can vouch for; the layer bounds are ``SplitTopology``'s own). It counts
  only what this node verified: itself, the peers whose links authenticated them, the
  coordinator whose signature it checked and, when that coordinator is trusted, the stage
  nodes its signed topology names (a NATed stage node that only dials out is never linked to
  the other workers). Gossip is hearsay: any stranger can list invented ids, so it counts
  for nothing. That ``layer_count``
  equals the manifest's is checked as soon as the manifest is proven, before any artifact
  (``skippy.transfer.fetch_plan.plan_fetch``).
- ``placeable``: the coordinator's capable-peer listing passes through it (``place_stages_on``),
  so re-planning and replacement see only peers this node may place stages on.
- ``sign_topology``: the one function that signs a topology; it stamps the next epoch of this
  coordinator (persisted in ``data_dir`` before the signature exists) into the signed bytes.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Final

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from mesh_node.peers import AuthenticatedPeer, PeerInfo
from mesh_node.settings import PeerScope
from protocol import constants as pc
from protocol.certificates import sign_domain
from skippy.atomic import atomic_write_bytes
from skippy.package.topology import MAX_EPOCH, SplitTopology

log = logging.getLogger("mesh_node.coordination")

EPOCHS_FILE: Final = "topology-epochs.json"
MAX_EPOCH_FILE_BYTES: Final = 1024 * 1024
# Coordinators whose last epoch is remembered; beyond, the lowest epochs are forgotten (a
# forgotten coordinator could replay an old topology: with ``trusted`` only trusted ones count).
MAX_REMEMBERED_COORDINATORS: Final = 1024


def admits(scope: PeerScope, trusted: bool) -> bool:
    """``trusted`` admits trusted peers only; ``any`` admits every authenticated peer."""
    return scope == "any" or trusted


def offer_refusal(
    *,
    scope: PeerScope,
    coordinator: AuthenticatedPeer,
    coordinating: bool,
    epoch: int,
    last_epoch: int,
) -> tuple[str, str] | None:
    """Why this node refuses a (validly signed) topology offer, as ``(code, message)``."""
    if not admits(scope, coordinator.trusted):
        return (
            "untrusted_coordinator",
            "this node accepts topologies only from trusted coordinators "
            f"({coordinator.trust_reason or 'not trusted'})",
        )
    if coordinating:
        return ("coordinating", "this node coordinates a topology itself")
    if epoch <= last_epoch:
        return (
            "stale_epoch",
            f"epoch {epoch} is not newer than {last_epoch}, the last accepted from this "
            "coordinator",
        )
    return None


def bounds_problem(
    topology: SplitTopology, verified: Iterable[str], *, coordinator_trusted: bool
) -> tuple[str, str] | None:
    """A topology naming more stages than nodes this node can vouch for is nonsense: refuse
    it before anything is fetched. ``verified``: this node, its authenticated peers and the
    coordinator (its signature checked); a trusted coordinator's signed word adds the stage
    nodes it names."""
    known = set(verified)
    if coordinator_trusted:
        known.update(stage.node_id for stage in topology.stages)
    if len(topology.stages) > len(known):
        return (
            "topology_bounds",
            f"{len(topology.stages)} stages, but this node knows only {len(known)} nodes "
            "(itself, its authenticated peers and, from a trusted coordinator, the stage "
            "nodes it names)",
        )
    return None


def placeable(peers: Iterable[PeerInfo], scope: PeerScope) -> list[PeerInfo]:
    """The peers a coordinator may place stages on (``place_stages_on``)."""
    return [p for p in peers if admits(scope, p.peer.trusted)]


class EpochStore:
    """``data_dir/topology-epochs.json``: the last epoch this node signed, and per coordinator
    the last epoch it accepted. Every change is written (atomically, durably) before it counts."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / EPOCHS_FILE
        self._lock = threading.Lock()
        self.issued = 0
        self.accepted: dict[str, int] = {}
        self._load()

    def _load(self) -> None:
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_EPOCH_FILE_BYTES + 1)
        except FileNotFoundError:
            return
        try:
            doc = json.loads(raw)
            issued = doc["issued"]
            accepted = doc["accepted"]
            if not (isinstance(issued, int) and isinstance(accepted, dict)):
                raise ValueError("wrong types")
            self.issued = max(0, min(issued, MAX_EPOCH))
            self.accepted = {
                str(k): int(v) for k, v in accepted.items() if isinstance(v, int)
            }
        except (ValueError, KeyError, TypeError) as exc:
            # Refusing to start would lock the operator out; starting from zero only makes
            # this node refuse old epochs less strictly, so say it loudly.
            log.warning("%s is unreadable (%s): topology epochs start again", self.path, exc)

    def _save(self) -> None:
        doc = {"version": 1, "issued": self.issued, "accepted": dict(sorted(self.accepted.items()))}
        atomic_write_bytes(self.path, json.dumps(doc).encode(), durable=True)

    def next_epoch(self, now_s: float) -> int:
        """A new epoch, larger than every one issued before (also after a restart, and after
        a lost data_dir: it is at least the wall clock in milliseconds)."""
        with self._lock:
            self.issued = min(MAX_EPOCH, max(self.issued + 1, int(now_s * 1000)))
            self._save()
            return self.issued

    def last_accepted(self, coordinator_id: str) -> int:
        with self._lock:
            return self.accepted.get(coordinator_id, 0)

    def record_accepted(self, coordinator_id: str, epoch: int) -> None:
        with self._lock:
            self.accepted[coordinator_id] = max(epoch, self.accepted.get(coordinator_id, 0))
            if len(self.accepted) > MAX_REMEMBERED_COORDINATORS:
                oldest = sorted(self.accepted.items(), key=lambda kv: kv[1])
                for key, _ in oldest[: len(self.accepted) - MAX_REMEMBERED_COORDINATORS]:
                    del self.accepted[key]
            self._save()


def sign_topology(
    key: Ed25519PrivateKey, topology: SplitTopology, epochs: EpochStore, now_s: float
) -> tuple[SplitTopology, bytes]:
    """The only way a topology gets signed: with this coordinator's next epoch in it."""
    stamped = replace(topology, epoch=epochs.next_epoch(now_s))
    return stamped, sign_domain(key, pc.SIG_DOMAIN_TOPOLOGY, stamped.canonical_bytes())
