"""Healing a split topology whose nodes went away (pure).

``heal_topology`` keeps every stage whose node is linked now (a node that came back with the
same id keeps its own stage: its verified parts are still in its cache), and moves each stage
whose node is not linked to a capable spare (``replace_node``: the node offering the most
that holds the stage in its device memory and RAM, among linked nodes holding no stage). The
result always has a new topology id, so every stage node (a returning one too, which lost its
topology with its process) is offered it again. ``TopologyError(no_capable_peer)`` names the
first stage nobody can take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from skippy.package.plan import ModelSizes
from skippy.package.topology import NodeCapacity, SplitTopology, replace_node


def missing_nodes(topology: SplitTopology, linked: set[str]) -> list[str]:
    """The stage nodes of ``topology`` not in ``linked``, in stage order."""
    return [s.node_id for s in topology.stages if s.node_id not in linked]


def heal_topology(
    topology: SplitTopology,
    linked: Sequence[NodeCapacity],
    sizes: ModelSizes,
    *,
    topology_id: str,
) -> SplitTopology:
    """The same split over the nodes linked now (``linked`` includes the coordinator itself);
    see the module docstring."""
    here = {c.node_id for c in linked}
    healed = topology
    for lost in missing_nodes(topology, here):
        healed = replace_node(healed, lost, linked, sizes, topology_id=topology_id)
    return replace(healed, topology_id=topology_id)
