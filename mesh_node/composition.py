"""The composition root: the one place that wires a node and its services together, for
``mesh-node run``, ``serve`` and every node a ``lab`` starts (``mesh_node.node_process``).

The node core (``mesh_node.node``) knows no application; each service below declares what
it adds through ``mesh_node.node_service.NodeService`` and is added here, in the order the
node runs them:

1. ``TopologyService``: split topologies (control streams, the ``topology`` section);
2. ``StageHost``: this node's stage of a split (transport streams, the stage bits);
3. ``ArtifactService``: peer artifact transfer (its streams and bits when this node would
   serve), following the topology and handing each fetched stage to the stage host;
4. ``Serving``: this node as a serving coordinator, when asked (the OpenAI API);
5. ``RelayService``: circuits through relays, for this node (``relays``) and, when
   ``[relay] enable``, for others;
6. ``LanDiscovery``: nodes of the same owner found on the LAN by mDNS, when
   ``lan_discovery = true``.

Services that need each other receive each other here, never through the node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mesh_node.identity import LocalIdentity
from mesh_node.lan_discovery import LanDiscovery
from mesh_node.node import MeshNode
from mesh_node.relay import RelayService
from mesh_node.serving.host import StageHost
from mesh_node.serving.split_service import Serving
from mesh_node.settings import NodeSettings
from mesh_node.topology import TopologyService
from mesh_node.transfer.artifact_service import ArtifactService
from mesh_node.transfer.fetch import StageResult
from skippy.config import Environment
from skippy.stage.descriptor import StageDescriptor

if TYPE_CHECKING:
    from starlette.routing import BaseRoute


@dataclass(frozen=True)
class ComposedNode:
    """A node and its services, as wired by ``compose``."""

    node: MeshNode
    topology: TopologyService
    host: StageHost
    artifacts: ArtifactService
    serving: Serving
    relay: RelayService


def compose(
    settings: NodeSettings,
    identity: LocalIdentity,
    env: Environment,
    *,
    routes: Sequence[BaseRoute] = (),
    expect_serve: bool = False,
) -> ComposedNode:
    """A node and its services (nothing runs yet: ``node.run`` runs them all)."""
    return add_services(MeshNode(settings, identity), env, routes=routes, expect_serve=expect_serve)


def add_services(
    node: MeshNode,
    env: Environment,
    *,
    routes: Sequence[BaseRoute] = (),
    expect_serve: bool = False,
) -> ComposedNode:
    """Build the services of ``node`` (not running yet) and add them. ``routes``: other
    components' HTTP routes, served beside the API; ``expect_serve``: the node is for
    serving (``/health`` says so until it serves)."""
    settings = node.settings
    topology = TopologyService(node)
    host = StageHost(node, settings.serving)

    async def ready(result: StageResult) -> StageDescriptor:
        # Imported when a stage is ready: loading pulls in the stage runtime.
        from mesh_node.serving.bringup import stage_ready

        return await stage_ready(
            host, result.topology, result.stage, result.load, result.descriptor
        )

    artifacts = ArtifactService(node, topology, env, ready_hook=ready)
    serving = Serving(node, host, topology, extra_routes=routes, expected=expect_serve)
    relay = RelayService(node)
    for service in (topology, host, artifacts, serving, relay):
        node.add_service(service)
    if settings.lan_discovery:
        node.add_service(LanDiscovery(node))
    return ComposedNode(node, topology, host, artifacts, serving, relay)
