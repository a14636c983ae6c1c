"""A split topology: which node runs which contiguous layer range of one package (pure).

The pure core of ``mesh_node.topology``, its shell.

The coordinator builds one, signs its canonical bytes and sends it to its workers (the signing
and the sending are ``mesh_node``'s); a worker checks it here before it stores it as its active
topology; artifact authorization (spec "Peer Cache Transfer": "the serving node checks the
active split topology and only serves artifacts needed by the requesting node's assigned stage
range") and split serving read it. Every check is done at construction, so a ``SplitTopology``
in hand always covers ``0..layer_count`` exactly once with one stage per node.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skippy.constants import MAX_LAYER_COUNT
from skippy.errors import TopologyError
from skippy.package.placement import NodeMemory, stage_fit
from skippy.package.plan import ModelSizes, plan_stages
from skippy.package.ranges import LayerRange

NODE_ID_HEX_CHARS = 64  # an Ed25519 public key, lowercase hex
MAX_ID_CHARS = 128  # topology_id, run_id, stage_id
MAX_STAGES = 1024
MAX_PACKAGE_REF_CHARS = 512
MAX_EPOCH = 2**63 - 1
_NODE_ID_RE = re.compile(r"^[0-9a-f]{64}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def check_node_id(value: object, what: str = "node_id") -> str:
    if not isinstance(value, str) or not _NODE_ID_RE.match(value):
        raise TopologyError(
            f"{what} must be {NODE_ID_HEX_CHARS} lowercase hex characters (an Ed25519 public key)",
            actual=_short(value),
        )
    return value


def _check_id(value: object, what: str) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise TopologyError(
            f"{what} must be 1-{MAX_ID_CHARS} characters of [A-Za-z0-9._:-], starting with a "
            "letter or digit",
            actual=_short(value),
        )
    return value


def _check_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"{what} must be an integer", actual=_short(value))
    return value


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class StageAssignment:
    """One stage of a split: ``node_id`` runs ``layers`` as stage ``stage_index``."""

    node_id: str
    stage_id: str
    stage_index: int
    layers: LayerRange

    def __post_init__(self) -> None:
        check_node_id(self.node_id)
        _check_id(self.stage_id, "stage_id")
        if _check_int(self.stage_index, "stage_index") < 0:
            raise TopologyError("stage_index must be >= 0", actual=self.stage_index)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "stage_id": self.stage_id,
            "stage_index": self.stage_index,
            "layer_start": self.layers.start,
            "layer_end": self.layers.stop,
        }


@dataclass(frozen=True)
class SplitTopology:
    """A complete split of one package over nodes: stage ``i`` is ``stages[i]``, the ranges are
    contiguous and cover ``0..layer_count`` exactly once, and each node holds one stage."""

    topology_id: str
    run_id: str
    package_ref: str
    manifest_sha256: str
    layer_count: int
    stages: tuple[StageAssignment, ...]
    # The coordinator's signing counter: set by the one function that signs a
    # topology (``mesh_node.coordination.sign_topology``); a worker refuses one that is not
    # newer than the last it accepted from that coordinator. 0: never signed.
    epoch: int = 0

    def __post_init__(self) -> None:
        _check_id(self.topology_id, "topology_id")
        if not 0 <= _check_int(self.epoch, "epoch") <= MAX_EPOCH:
            raise TopologyError(f"epoch must be in 0..{MAX_EPOCH}", actual=self.epoch)
        _check_id(self.run_id, "run_id")
        if not isinstance(self.package_ref, str) or not 0 < len(self.package_ref) <= (
            MAX_PACKAGE_REF_CHARS
        ):
            raise TopologyError(
                f"package_ref must be a non-empty string of at most {MAX_PACKAGE_REF_CHARS} "
                "characters",
                actual=_short(self.package_ref),
            )
        if not isinstance(self.manifest_sha256, str) or not _SHA256_RE.match(self.manifest_sha256):
            raise TopologyError(
                "manifest_sha256 must be 64 lowercase hex characters",
                actual=_short(self.manifest_sha256),
            )
        if not 1 <= _check_int(self.layer_count, "layer_count") <= MAX_LAYER_COUNT:
            # The manifest's own bound (a peer's 2^63-layer topology is refused here).
            raise TopologyError(
                f"layer_count must be in 1..{MAX_LAYER_COUNT}", actual=self.layer_count
            )
        if not 0 < len(self.stages) <= MAX_STAGES:
            raise TopologyError(
                f"a topology needs 1-{MAX_STAGES} stages", actual=len(self.stages)
            )
        self._check_coverage()

    def _check_coverage(self) -> None:
        expected_start = 0
        for i, stage in enumerate(self.stages):
            if stage.stage_index != i:
                raise TopologyError(
                    f"stage {i} has stage_index {stage.stage_index}; stages must be listed in "
                    "order 0..N-1",
                    code="topology_coverage",
                )
            if stage.layers.layer_count != self.layer_count:
                raise TopologyError(
                    f"stage {i} is planned for {stage.layers.layer_count} layers, the topology "
                    f"for {self.layer_count}",
                    code="topology_coverage",
                )
            if stage.layers.start != expected_start:
                raise TopologyError(
                    f"stage {i} starts at layer {stage.layers.start}, expected {expected_start}: "
                    "the ranges must cover 0..layer_count exactly once, in order",
                    code="topology_coverage",
                )
            expected_start = stage.layers.stop
        if expected_start != self.layer_count:
            raise TopologyError(
                f"the stages end at layer {expected_start}, not at layer_count "
                f"{self.layer_count}",
                code="topology_coverage",
            )
        for attr in ("node_id", "stage_id"):
            values = [getattr(s, attr) for s in self.stages]
            if len(set(values)) != len(values):
                raise TopologyError(
                    f"a {attr} appears in more than one stage", code="topology_coverage"
                )

    @property
    def final_stage(self) -> StageAssignment:
        return self.stages[-1]

    def stage_of(self, node_id: str) -> StageAssignment | None:
        """The stage assigned to ``node_id``, or ``None`` when it has none."""
        for stage in self.stages:
            if stage.node_id == node_id:
                return stage
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "topology_id": self.topology_id,
            "run_id": self.run_id,
            "package_ref": self.package_ref,
            "manifest_sha256": self.manifest_sha256,
            "layer_count": self.layer_count,
            "stages": [s.to_dict() for s in self.stages],
            "epoch": self.epoch,
        }

    def canonical_bytes(self) -> bytes:
        """The bytes a coordinator signs: sorted-key compact UTF-8 JSON of ``to_dict()``."""
        return json.dumps(
            self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True
        ).encode("ascii")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SplitTopology:
        """Strict parse of untrusted data (a peer's message): exact keys, exact types."""
        fields = {"topology_id", "run_id", "package_ref", "manifest_sha256", "layer_count",
                  "stages"}
        # ``epoch`` is optional on input (0: unsigned); it is always written.
        if not isinstance(data, Mapping) or set(data) - {"epoch"} != fields:
            got = sorted(map(str, data)) if isinstance(data, Mapping) else type(data).__name__
            raise TopologyError(f"a topology has exactly the fields {sorted(fields)}", actual=got)
        raw_stages = data["stages"]
        if not isinstance(raw_stages, list | tuple) or len(raw_stages) > MAX_STAGES:
            raise TopologyError(f"stages must be a list of at most {MAX_STAGES} entries")
        layer_count = _check_int(data["layer_count"], "layer_count")
        stages = tuple(_stage_from_dict(s, layer_count) for s in raw_stages)
        return cls(
            topology_id=data["topology_id"],
            run_id=data["run_id"],
            package_ref=data["package_ref"],
            manifest_sha256=data["manifest_sha256"],
            layer_count=layer_count,
            stages=stages,
            epoch=data.get("epoch", 0),
        )


def _stage_from_dict(data: object, layer_count: int) -> StageAssignment:
    fields = {"node_id", "stage_id", "stage_index", "layer_start", "layer_end"}
    if not isinstance(data, Mapping) or set(data) != fields:
        raise TopologyError(f"a stage has exactly the fields {sorted(fields)}")
    start = _check_int(data["layer_start"], "layer_start")
    stop = _check_int(data["layer_end"], "layer_end")
    if not 0 <= start < stop <= layer_count:
        raise TopologyError(
            f"stage range {start}..{stop} is empty or outside 0..{layer_count}",
            code="topology_coverage",
        )
    return StageAssignment(
        node_id=data["node_id"],
        stage_id=data["stage_id"],
        stage_index=data["stage_index"],
        layers=LayerRange(start, stop, layer_count),
    )


# --- planning (pure) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeCapacity:
    """A node that may hold a stage, and the bytes it announced it can hold: its budget, and
    with devices, what its device and RAM give (``memory``; ``skippy.package.placement``).
    Without ``memory`` a stage fits when its bytes are within the budget."""

    node_id: str
    memory_budget_bytes: int
    memory: NodeMemory | None = None

    @property
    def offer(self) -> NodeMemory:
        return self.memory or NodeMemory(self.node_id, self.memory_budget_bytes)

    @property
    def offered(self) -> int:
        """The most bytes one stage can take here (the planners' order: largest first)."""
        return self.offer.offered

    def holds(self, sizes: ModelSizes, r: LayerRange) -> bool:
        """Whether the stage of layers ``r`` fits: in device memory, with its routed experts
        in RAM, or in RAM (``skippy.package.placement.fit``)."""
        return stage_fit(self.offer, sizes, r) is not None

    def describe(self) -> str:
        return f"budget {self.memory_budget_bytes}" + (
            f", {self.memory.describe()}" if self.memory is not None else ""
        )


def plan_topology(
    sizes: ModelSizes,
    nodes: Sequence[NodeCapacity],
    *,
    topology_id: str,
    run_id: str,
    package_ref: str,
    manifest_sha256: str,
    stages: int | None = None,
    first_node: str | None = None,
) -> SplitTopology:
    """Split the package over ``nodes``, using the manifest's per-artifact bytes.
    With ``first_node`` (a serving coordinator: it hosts stage 0 and the API),
    stage 0 is placed on that node and the other stages on the others.

    Ranges are byte-balanced (``skippy.package.plan``); the largest stage goes to the node
    offering the most (``NodeCapacity.offered``: its budget, or its device memory plus RAM),
    and a stage fits its node by ``NodeCapacity.holds``. Sorted matching is optimal for
    "every stage fits its node" while each node's offer is one number (budgets alone); with
    devices a stage's fit also depends on how much of it is routed experts, and the order is a
    good one, not a proven best. With ``stages=None`` one stage per node (at most one per
    layer); nodes are dropped smallest offer first while the plan does not fit. A plan that
    cannot fit at all raises ``TopologyError(code="topology_does_not_fit")`` naming which node
    lacks how many bytes.
    """
    if not nodes:
        raise TopologyError("no capable node to place stages on", code="topology_no_nodes")
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        raise TopologyError("a node is listed twice", code="topology_coverage")
    ranked = sorted(nodes, key=lambda n: (-n.offered, n.node_id))
    pinned = next((n for n in nodes if n.node_id == first_node), None)
    if first_node is not None:
        if pinned is None:
            raise TopologyError(
                "the node asked to hold stage 0 is not among the capable nodes",
                code="topology_no_nodes",
                path=first_node,
            )
        ranked = [pinned] + [n for n in ranked if n is not pinned]
    # each stage needs a trunk layer: NextN layers go with the final stage
    cuttable = sizes.layer_count - sizes.tail_layers
    if stages is not None:
        if not 1 <= stages <= min(len(ranked), cuttable):
            raise TopologyError(
                f"{stages} stages need 1..{min(len(ranked), cuttable)} (capable nodes "
                f"{len(ranked)}, layers {sizes.layer_count})",
                code="topology_stage_count",
            )
        counts = [stages]
    else:
        top = min(len(ranked), cuttable)
        counts = list(range(top, 0, -1))
    first_failure: TopologyError | None = None
    for count in counts:
        chosen = ranked[:count]
        plans = plan_stages(sizes, count, balance="bytes")
        if pinned is not None:
            rest = sorted(plans[1:], key=lambda p: (-p.bytes, p.index))
            owner = {0: pinned, **{p.index: chosen[1 + i] for i, p in enumerate(rest)}}
        else:
            by_size = sorted(plans, key=lambda p: (-p.bytes, p.index))
            owner = {p.index: chosen[i] for i, p in enumerate(by_size)}
        short = [(p, owner[p.index]) for p in plans if not owner[p.index].holds(sizes, p.layers)]
        if not short:
            return SplitTopology(
                topology_id=topology_id,
                run_id=run_id,
                package_ref=package_ref,
                manifest_sha256=manifest_sha256,
                layer_count=sizes.layer_count,
                stages=tuple(
                    StageAssignment(owner[p.index].node_id, f"stage-{p.index}", p.index, p.layers)
                    for p in plans
                ),
            )
        if first_failure is None:
            p, node = max(short, key=lambda pn: pn[0].bytes - pn[1].offered)
            lack = max(1, p.bytes - node.offered)
            first_failure = TopologyError(
                f"the plan does not fit: node {node.node_id[:12]} lacks {lack} bytes for stage "
                f"{p.index} (layers {p.layers}, needs {p.bytes} bytes, {node.describe()})",
                code="topology_does_not_fit",
                expected=p.bytes,
                actual=node.offered,
                path=node.node_id,
            )
    assert first_failure is not None  # every count failed (typing only)
    raise first_failure


def pin_first_stage(topology: SplitTopology, first: LayerRange) -> SplitTopology:
    """``topology`` with stage 0 holding exactly ``first`` (replicas share the coordinator's
    loaded stage 0: each replica's planner may cut stage 0 differently,
    e.g. the cost planner weighting its own workers' speeds). Only the boundary between
    stages 0 and 1 moves; every stage keeps its node. A ``TopologyError`` when stage 1 would
    be left empty (the caller then cannot share stage 0 with this plan)."""
    stages = topology.stages
    head = stages[0].layers
    if (head.start, head.stop) == (first.start, first.stop) or len(stages) < 2:
        return topology
    second = stages[1].layers
    if first.start != 0 or not first.stop < second.stop:
        raise TopologyError(
            f"stage 0 cannot hold layers {first} in a plan whose stage 1 ends at {second.stop}",
            code="topology_coverage",
        )
    n = topology.layer_count
    moved = (
        StageAssignment(stages[0].node_id, stages[0].stage_id, 0, LayerRange(0, first.stop, n)),
        StageAssignment(
            stages[1].node_id, stages[1].stage_id, 1, LayerRange(first.stop, second.stop, n)
        ),
    )
    return SplitTopology(
        topology_id=topology.topology_id,
        run_id=topology.run_id,
        package_ref=topology.package_ref,
        manifest_sha256=topology.manifest_sha256,
        layer_count=n,
        stages=(*moved, *stages[2:]),
    )


def plan_like(
    topology: SplitTopology,
    like: SplitTopology,
    nodes: Sequence[NodeCapacity],
    sizes: ModelSizes,
) -> SplitTopology:
    """A replica's plan with replica 0's layer ranges: the same stages on
    other nodes, so every stage's files have a second holder (replica 0's node) a swarm
    fetch can use, and stage 0 is the coordinator's loaded one. When the stage counts differ
    or a node cannot hold its copied range, only stage 0 is pinned (``pin_first_stage``)."""
    if len(like.stages) == len(topology.stages):
        by_id = {n.node_id: n for n in nodes}
        copied = tuple(
            StageAssignment(s.node_id, s.stage_id, s.stage_index, r.layers)
            for s, r in zip(topology.stages, like.stages, strict=True)
        )
        if all(
            s.node_id in by_id and by_id[s.node_id].holds(sizes, s.layers) for s in copied
        ):
            return SplitTopology(
                topology_id=topology.topology_id,
                run_id=topology.run_id,
                package_ref=topology.package_ref,
                manifest_sha256=topology.manifest_sha256,
                layer_count=topology.layer_count,
                stages=copied,
            )
    return pin_first_stage(topology, like.stages[0].layers)


def replace_node(
    topology: SplitTopology,
    lost: str,
    candidates: Sequence[NodeCapacity],
    sizes: ModelSizes,
    *,
    topology_id: str,
) -> SplitTopology:
    """The same split with ``lost``'s stage moved to a capable candidate:
    every other stage stays where it is (its node keeps its loaded layers), the run id stays;
    the candidate is the one offering the most among those not in the topology that hold
    the stage (``NodeCapacity.holds``: its device memory and RAM, or its budget).
    ``TopologyError(code="no_capable_peer")`` when none can."""
    stage = topology.stage_of(lost)
    if stage is None:
        raise TopologyError(f"node {lost[:12]} holds no stage", code="not_in_topology", path=lost)
    need = sizes.stage_bytes(stage.layers)
    held = {s.node_id for s in topology.stages}
    fit = sorted(
        (c for c in candidates if c.node_id not in held and c.holds(sizes, stage.layers)),
        key=lambda c: (-c.offered, c.node_id),
    )
    if not fit:
        spare = [c.offered for c in candidates if c.node_id not in held]
        largest = f", the largest offering {max(spare)}" if spare else ""
        raise TopologyError(
            f"no capable peer can take stage {stage.stage_index} (layers {stage.layers}, "
            f"{need} bytes): {len(spare)} spare node(s) connected{largest}",
            code="no_capable_peer",
            expected=need,
        )
    new = fit[0].node_id
    return SplitTopology(
        topology_id=topology_id,
        run_id=topology.run_id,
        package_ref=topology.package_ref,
        manifest_sha256=topology.manifest_sha256,
        layer_count=topology.layer_count,
        stages=tuple(
            StageAssignment(new, s.stage_id, s.stage_index, s.layers) if s.node_id == lost else s
            for s in topology.stages
        ),
    )
