"""A split as a value, and the duties one split of a coordinator's replicas is given.

``SplitSpec`` is what every replica plans and serves: the package (ref, manifest, sizes),
the stage count (stage 0 is always pinned to the coordinator), how many equal replicas, and
the ``[serving]`` settings the route managers and admission read.
``mesh_node.serving.split_service`` builds it once; ``SplitServer``, ``ReplicaSet`` and every
``RouteManager`` take it whole.

The replicas are equal; a few things only one of them may do are handed to it as named
duties (``SplitDuties``) when it is built, never decided from its position:

- where its stage 0 comes from: ``LoadsStage0`` (its topology is the node's own, so the
  artifact service fetches and loads stage 0 for it) or ``SharesStage0`` (the stage 0 loaded
  for another replica: the same manifest and layers serve here);
- ``run_file``: the run it persists and re-forms after a restart (``data_dir/serving/split.json``);
- ``layout``: another replica's plan whose layer ranges it takes (they share stage 0);
- ``held_elsewhere``: the nodes the other replicas hold, which it never plans over;
- ``tokenizer``: one tokenizer load for every replica (they share stage 0's metadata).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import trio

from mesh_node.serving.host import LoadedStage, StageHost
from mesh_node.serving.state import RunFile
from mesh_node.settings import ServingSettings
from mesh_node.topology import ActiveTopology, StageReport
from skippy.package.plan import ModelSizes
from skippy.package.topology import SplitTopology
from skippy.runtime.tokenizer import LlamaTokenizer
from skippy.serving.replicas import check_replicas


@dataclass(frozen=True)
class SplitSpec:
    """One package split into ``stages`` stages (``None``: as many as the capable peers
    allow, and the split may grow), ``replicas`` times over disjoint peers; stage 0 of every
    replica is on the coordinator. A replica count the stage count cannot carry is a usage
    error here (``skippy.serving.replicas.check_replicas``)."""

    package_ref: str
    manifest_sha256: str
    sizes: ModelSizes
    stages: int | None = None
    replicas: int = 1
    settings: ServingSettings = field(default_factory=ServingSettings)

    def __post_init__(self) -> None:
        check_replicas(self.replicas, self.stages)


async def load_tokenizer(metadata_path: Path) -> LlamaTokenizer:
    """The package's tokenizer, loaded on a thread (gemma3's: ~1-3 s of CPU)."""
    return await trio.to_thread.run_sync(LlamaTokenizer, metadata_path)


class SharedTokenizer:
    """One tokenizer for every replica: the first to ask loads it, the others wait for that
    load. Each replica reached its tokenizer while the first load still ran and loaded its
    own (gemma3's: ~3 s of CPU each here, on the cores the workers' transfers needed at
    bring-up)."""

    def __init__(self) -> None:
        self._lock = trio.Lock()
        self._loaded: tuple[Path, LlamaTokenizer] | None = None

    async def load(self, metadata_path: Path) -> LlamaTokenizer:
        async with self._lock:
            if self._loaded is None or self._loaded[0] != metadata_path:
                self._loaded = (metadata_path, await load_tokenizer(metadata_path))
            return self._loaded[1]


class Stage0(Protocol):
    """Where a split's stage 0 (on the coordinator) comes from."""

    def ready(self, active: ActiveTopology) -> LoadedStage | str:
        """The loaded stage 0 that serves ``active``, or why there is none yet."""
        ...


@dataclass(frozen=True)
class LoadsStage0:
    """Stage 0 is loaded for this split's own topology: the node's topology service plans it,
    and the artifact service (which follows that service) fetches and loads the stage."""

    host: StageHost

    def ready(self, active: ActiveTopology) -> LoadedStage | str:
        loaded = self.host.loaded
        if loaded is not None and loaded.topology.topology_id == active.topology.topology_id:
            return loaded
        own = active.reports.get(active.own_id)
        if own is not None and own.state != "ready":
            return f"stage 0 failed to load ({own.code})"
        return "stage 0 is loading"


@dataclass(frozen=True)
class SharesStage0:
    """Stage 0 is the one loaded for another replica: the same manifest and layers serve
    here (the layout duty gives this split the same ranges). Its ready report is the loaded
    stage itself."""

    host: StageHost

    def ready(self, active: ActiveTopology) -> LoadedStage | str:
        loaded = self.host.loaded
        if loaded is None:
            return "stage 0 is loading"
        first = active.topology.stages[0].layers
        if (loaded.load.layers.start, loaded.load.layers.stop) != (first.start, first.stop):
            return (
                f"stage 0 of this replica has layers {first}, the coordinator holds "
                f"{loaded.load.layers}: replicas share stage 0"
            )
        active.reports.setdefault(active.own_id, StageReport("ready"))
        return loaded


def nobody_else() -> set[str]:
    """``held_elsewhere`` of a split alone: no other replica holds a node."""
    return set()


@dataclass(frozen=True)
class SplitDuties:
    """What one split of a coordinator's replicas does beside keeping its own route (see the
    module docstring): each duty is given, never inferred from the replica's position."""

    stage0: Stage0
    tokenizer: SharedTokenizer
    run_file: RunFile | None = None
    layout: Callable[[], SplitTopology | None] | None = None
    held_elsewhere: Callable[[], set[str]] = nobody_else
