"""Bringing this node's stage up: the step between "the stage's parts
are installed and verified" (the fetch, ``mesh_node.transfer``) and the ready report.

``stage_ready`` is the ``ArtifactService.ready_hook``: it loads the verified ``StageLoad``
into the node's ``StageHost`` (or keeps the stage already loaded for the same manifest and
layers) and extends the report's ``StageDescriptor`` into the admission descriptor with the
runtime's facts (model id, activation width and dtype, runtime version, engine, context). The
coordinator checks it against the topology and its own runtime before the route opens.
"""

from __future__ import annotations

from dataclasses import replace

from mesh_node.serving.host import StageHost
from skippy.package.topology import SplitTopology, StageAssignment
from skippy.runtime.boundary import StageLoad
from skippy.stage.descriptor import StageDescriptor


async def stage_ready(
    host: StageHost,
    topology: SplitTopology,
    stage: StageAssignment,
    load: StageLoad,
    descriptor: StageDescriptor,
) -> StageDescriptor:
    """Load the verified stage and return the admission descriptor for the ready report."""
    loaded = await host.load(topology, stage, load, descriptor.artifact_bytes)
    return replace(descriptor, runtime=loaded.facts)
