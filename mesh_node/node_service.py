"""What a service declares to the node core: the one interface between ``MeshNode`` and the
applications that run on it (split topology, artifact transfer, the stage host, serving).

The core (``mesh_node.node``) imports no service. A service is built by the composition root
(``mesh_node.composition``) and added with ``MeshNode.add_service``; from then on the core

- serves the service's **stream kinds** (``streams``: each a subprotocol envelope, a kind and
  its handler, and optionally an ``admit`` check run at each open, which can refuse a stream
  before any task or read), through the same registry ``register_subprotocol`` fills;
- advertises its **feature bits** in every hello (``features``: feature name -> bits, merged
  over all services by ``merge_features``, sorted, so the wire bytes do not depend on the
  order services were added);
- puts its **status sections** into the status document (``status_sections``: key -> a
  JSON-able value, read at each ``status()``);
- exposes its **metrics** on ``/metrics`` (``collectors``: prometheus_client collectors);
- runs it (``run``) in the node's nursery, before any link is accepted or dialed, until the
  node stops.

``config_table`` names the node TOML table the service reads, or ``None``: the table is
parsed with the node's settings (``mesh_node.settings``, the one reader's value checks), so a
bad value is refused when the file is read, before anything starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import trio
from prometheus_client.registry import Collector

from mesh_node.peers import StreamAdmission, SubprotocolHandler
from protocol import constants as pc

FeatureBits = Mapping[str, frozenset[str]]  # feature name (``skippy-stage/2``) -> its bits


@dataclass(frozen=True)
class StreamKind:
    """Streams a peer opens with envelope ``{name, major}`` and ``kind``, served by
    ``handler`` (see ``MeshNode.register_subprotocol``)."""

    kind: int
    handler: SubprotocolHandler
    name: str = pc.SKIPPY_STAGE
    major: int = pc.SKIPPY_STAGE_MAJOR
    # Asked at each open, before any handler runs: ``None`` to serve the stream, else the
    # (code, reason) the open is refused with (a budget of refusals, ``RequestGate.admit``).
    admit: StreamAdmission | None = None


class NodeService(Protocol):
    """A service of the node (the module docstring says what the core does with each)."""

    config_table: str | None

    def streams(self) -> Sequence[StreamKind]: ...

    def features(self, now_s: float) -> FeatureBits: ...

    def status_sections(self) -> Mapping[str, Any]: ...

    def collectors(self) -> Sequence[Collector]: ...

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...


def merge_features(declared: Iterable[FeatureBits]) -> dict[str, tuple[str, ...]]:
    """The hello's ``features``: every service's bits per feature, united and sorted (pure)."""
    merged: dict[str, set[str]] = {}
    for bits in declared:
        for feature, names in bits.items():
            merged.setdefault(feature, set()).update(names)
    return {feature: tuple(sorted(names)) for feature, names in sorted(merged.items())}
