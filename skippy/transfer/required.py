"""A stage's required set: what a node holding a layer range may fetch from a peer (pure).

Spec "Peer Cache Transfer": "The serving node checks the active split topology and only
serves artifacts needed by the requesting node's assigned stage range. Stage 0 may fetch
input boundary files and projector artifacts; final stages may fetch output boundary files."
There is one selection rule, ``skippy.package.select.select_stage`` (metadata; embeddings
when the stage owns layer 0; its own layers; output when it owns the last layer; embeddings
for the final stage of a tied-embedding package; the default projector for stage 0). This
module only asks it, once per choice a stage may make.

Schema 2: the rule is spec "v2 stages", the required set: the carrier plus every artifact
holding one of the stage's tensors. A node authorizing or planning from a bare root (its
carrier not resolved) gets the path-derived superset: the carrier, every common part and the
stage's layer parts, so a worker never asks for more than a server allows.
"""

from __future__ import annotations

from collections.abc import Mapping

from skippy.package.manifest import ArtifactRef, PackageManifest
from skippy.package.ranges import LayerRange
from skippy.package.select import select_stage


def stage_refs(
    manifest: PackageManifest,
    layers: LayerRange,
    *,
    projector_path: str | None = None,
    text_only: bool = False,
) -> tuple[ArtifactRef, ...]:
    """What the stage will load (and so fetch): its parts in load order, then its projector."""
    return select_stage(
        manifest, layers, projector_path=projector_path, text_only=text_only
    ).all_refs


def servable_refs(manifest: PackageManifest, layers: LayerRange) -> Mapping[str, ArtifactRef]:
    """Every artifact a peer holding ``layers`` may receive, by manifest path.

    The stage's default selection, and for the stage that owns layer 0 every declared
    projector: the selection rule lets an explicit ``projector_path`` pick any declared one
    (spec "Layer Selection": "an explicit stage projector_path wins"), and the server cannot
    know the worker's configuration. Downstream stages get no projector.
    """
    out = {r.path: r for r in stage_refs(manifest, layers)}
    if layers.owns_input:
        for proj in manifest.projectors:
            chosen = select_stage(manifest, layers, projector_path=proj.path).projector
            if chosen is not None:
                out.setdefault(chosen.path, chosen)
    return out
