"""inspect: what a GGUF (or a whole split set) or a package holds, without touching tensor
bytes. (plan's inputs, which need the fragment planner and the writer, are in
``skippy.produce.sizes``: ``inspect`` as a command imports only this module's light needs.)

Uses only the bounded header reader (no ``import gguf``: it alone costs ~0.23 s), so
inspecting gemma3-270m takes tens of milliseconds where ``gguf.GGUFReader`` needs ~12 s. A
split set is read whole from its first shard, as write-package reads it.

Of a whole model (a GGUF, a package) it also says whether the stage runtime runs it, its
experts (``skippy.package.experts``, whose MoE checks raise a coded error here) and its
parameters, total and read per token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skippy.constants import (
    KEY_ARCHITECTURE,
    KEY_FRAGMENT_LAYER_START,
    KEY_FRAGMENT_LAYER_STOP,
    KEY_FRAGMENT_ROLE,
    KEY_MATERIALIZED_LAYER_COUNT,
    KEY_MATERIALIZED_LAYER_START,
    KEY_MATERIALIZED_LAYER_STOP,
    ROLE_COMMON,
    ROLE_LAYER,
    ROLE_METADATA,
    arch_key,
)
from skippy.gguf.constants import ggml_type_name
from skippy.gguf.reader import GGUFFile
from skippy.package.experts import ExpertSummary, metadata_from, summarize
from skippy.package.ownership import has_tied_embeddings, owner_of
from skippy.produce.model_experts import package_experts
from skippy.produce.source import SourceModelFiles

# Whether the stage runtime runs a model, from its metadata (``skippy.runtime.support.
# support_verdict``, which the command passes in: produce does not import the runtime).
RuntimeVerdict = Callable[[Mapping[str, Any]], dict[str, Any]]

if TYPE_CHECKING:
    from skippy.package.manifest import PackageManifest
    from skippy.package.v2_view import ManifestV2


def read_manifest(package_dir: Path) -> PackageManifest:
    # Imported here: inspecting a GGUF (the common, start-up-bound case) never needs it.
    from skippy.package.manifest import parse_manifest, read_manifest_bytes

    return parse_manifest(read_manifest_bytes(package_dir))


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def arch_int(g: GGUFFile, name: str) -> int | None:
    arch = g.get(KEY_ARCHITECTURE)
    return _int_or_none(g.get(arch_key(arch, name))) if isinstance(arch, str) else None


def _layers_held(names: list[str]) -> dict[str, int] | None:
    """The ``blk.N`` layers whose tensors this file holds: what a partial file really has."""
    indices = {i for i in (owner_of(n).layer_index for n in names) if i is not None}
    if not indices:
        return None
    return {"start": min(indices), "stop": max(indices) + 1, "count": len(indices)}


def _keys(g: GGUFFile, **keys: str) -> dict[str, Any] | None:
    """The given keys of ``g`` (name -> key), or None when the first one is absent."""
    first = next(iter(keys.values()))
    if g.get(first) is None:
        return None
    return {name: g.get(key) for name, key in keys.items()}


def model_facts(
    kv: Mapping[str, Any] | None,
    experts: ExpertSummary | None,
    verdict: RuntimeVerdict | None,
) -> dict[str, Any]:
    """What ``inspect`` says of a whole model: whether the stage runtime runs it, its experts
    and its parameters (``null`` where the files they are read from are not here)."""
    return {
        "stage_runtime": None if kv is None or verdict is None else verdict(kv),
        "experts": None if experts is None else experts.to_dict(),
        "parameters": None
        if experts is None
        else {"total": experts.total_params, "active_per_token": experts.active_params},
    }


def inspect_gguf(path: Path, *, verdict: RuntimeVerdict | None = None) -> dict[str, Any]:
    """A GGUF file, or the whole split set its first shard names. Its MoE metadata and expert
    tensors are checked (a coded ``ModelError``); ``verdict`` says whether the stage runtime
    runs a whole model (a package fragment is only part of one)."""
    with SourceModelFiles(path) as src:
        head = src.head
        names = [t.info.name for t in src.tensors]
        tensors = []
        for t in src.tensors:
            owner = owner_of(t.info.name)
            tensors.append(
                {
                    "name": t.info.name,
                    "shard": t.shard,
                    "role": owner.role,
                    "layer_index": owner.layer_index,
                    "ggml_type": ggml_type_name(t.info.ggml_type),
                    "shape": list(t.info.shape),
                    "bytes": t.info.nbytes,
                }
            )
        fragment = _keys(
            head,
            role=KEY_FRAGMENT_ROLE,
            layer_start=KEY_FRAGMENT_LAYER_START,
            layer_stop=KEY_FRAGMENT_LAYER_STOP,
        )
        materialized = _keys(
            head,
            layer_start=KEY_MATERIALIZED_LAYER_START,
            layer_stop=KEY_MATERIALIZED_LAYER_STOP,
            layer_count=KEY_MATERIALIZED_LAYER_COUNT,
        )
        whole = fragment is None and materialized is None
        kv = metadata_from(head.get)
        experts = summarize(kv, [t.info for t in src.tensors], whole_model=whole)
        facts = model_facts(kv if whole else None, experts, verdict)
        return {
            "kind": "gguf",
            "source": str(path),
            "files": [str(p) for p in src.paths],
            "file_bytes": sum(g.file_size for g in src.shards),
            "gguf_version": head.version,
            "alignment": head.alignment,
            "kv_count": len(head.fields),
            "tensor_count": len(tensors),
            "tensor_bytes": sum(t.info.nbytes for t in src.tensors),
            "architecture": _str_or_none(head.get(KEY_ARCHITECTURE)),
            "name": _str_or_none(head.get("general.name")),
            "layer_count": arch_int(head, "block_count"),
            "layers_held": _layers_held(names),
            "activation_width": arch_int(head, "embedding_length"),
            "tied_embeddings": has_tied_embeddings(names),
            "fragment": fragment,
            "materialized": materialized,
            **facts,
            "tensors": tensors,
        }


def _read_carrier(
    package_dir: Path, m: ManifestV2
) -> tuple[ManifestV2, int | None, bool, dict[str, Any] | None]:
    """The v2 manifest with the tensor catalog its metadata carrier resolves to, the
    carrier's ``{arch}.embedding_length``, whether the carrier was there to read, and its
    metadata. A carrier not fetched yet leaves them unknown; one that breaks a rule is the
    package's error (``ManifestError``), as in every other reader of it."""
    from skippy.errors import ArtifactMissing
    from skippy.package.artifacts import stat_artifact
    from skippy.package.v2_carrier import open_carrier, resolve_carrier

    if m.root.metadata_artifact is None:  # an invalid root: the carrier is not named
        return m, None, False, None
    try:
        path, _ = stat_artifact(package_dir, m.metadata_ref())
    except ArtifactMissing as exc:
        if exc.code != "missing_artifact":
            raise
        return m, None, False, None
    with open_carrier(path) as g:
        catalog = resolve_carrier(m.root, g)
        return m.with_catalog(catalog), arch_int(g, "embedding_length"), True, metadata_from(g.get)


def _inspect_v2(
    package_dir: Path, m: ManifestV2, verdict: RuntimeVerdict | None
) -> dict[str, Any]:
    """A v2 root's summary: the same keys as a v1 package's, with what only its metadata
    carrier says (width, tied embeddings, each part's tensors) read from the carrier when
    the package holds it (else ``null``); ``shared`` keyed by artifact id (the carrier,
    the common group's parts), ``layers`` one entry per layer part; and the artifact
    catalog with each file's role."""
    m, width, has_carrier, kv = _read_carrier(package_dir, m)
    experts = package_experts(package_dir, m) if has_carrier else None
    refs = list(m.artifacts())
    src = m.root.source_model
    return {
        "kind": "package",
        "package": str(package_dir),
        "schema_version": 2,
        "package_id": m.package_id,
        "model_id": m.model_id,
        "source_model": {
            "repo": src.repo or "",
            "revision": src.revision or "",
            "primary_file": src.primary_file or "",
            "sha256": src.sha256,
        },
        "layer_count": m.layer_count,
        "activation_width": width,
        "tied_embeddings": m.tied_embeddings if has_carrier else None,
        "carrier_read": has_carrier,
        "skippy_abi_version": m.skippy_abi_version,
        "created_at_unix_secs": m.created_at_unix_secs,
        "total_bytes": m.total_artifact_bytes(),
        "shared": {
            m.artifact_id_of(r.path): r.artifact.to_dict()
            for r in refs
            if r.role in (ROLE_METADATA, ROLE_COMMON)
        },
        "layers": [
            {"layer_index": r.layer_index, **r.artifact.to_dict()}
            for r in refs
            if r.role == ROLE_LAYER
        ],
        "artifacts": [
            {
                "role": r.role,
                "layer_index": r.layer_index,
                "path": r.path,
                "tensor_count": r.artifact.tensor_count if has_carrier else None,
                "artifact_bytes": r.artifact.artifact_bytes,
                "sha256": r.artifact.sha256,
            }
            for r in refs
        ],
        "projectors": [p.to_dict() for p in m.projectors],
        "generation": m.generation,
        **model_facts(kv, experts, verdict),
    }


def _metadata_kv(package_dir: Path, m: PackageManifest) -> dict[str, Any] | None:
    """A v1 package's model metadata (its metadata part), ``None`` when the part is not here."""
    from skippy.errors import ArtifactMissing
    from skippy.gguf.reader import open_gguf
    from skippy.package.artifacts import stat_artifact

    try:
        path, _ = stat_artifact(package_dir, next(iter(m.artifacts())))
    except ArtifactMissing as exc:
        if exc.code != "missing_artifact":
            raise
        return None
    with open_gguf(path) as g:
        return metadata_from(g.get)


def inspect_package(package_dir: Path, *, verdict: RuntimeVerdict | None = None) -> dict[str, Any]:
    """A package's manifest summary, in the manifest's own field names, and what ``inspect``
    says of the model it holds (``model_facts``; its MoE checks raise, as for a GGUF)."""
    from skippy.package.v2_view import ManifestV2

    m = read_manifest(package_dir)
    if isinstance(m, ManifestV2):
        return _inspect_v2(package_dir, m, verdict)
    facts = model_facts(_metadata_kv(package_dir, m), package_experts(package_dir, m), verdict)
    return {
        "kind": "package",
        "package": str(package_dir),
        "model_id": m.model_id,
        "source_model": m.source_model.to_dict(),
        "layer_count": m.layer_count,
        "activation_width": m.activation_width,
        "tied_embeddings": m.tied_embeddings,
        "skippy_abi_version": m.skippy_abi_version,
        "created_at_unix_secs": m.created_at_unix_secs,
        "total_bytes": m.total_artifact_bytes(),
        "shared": m.shared.to_dict(),
        "layers": [e.to_dict() for e in sorted(m.layers, key=lambda e: e.layer_index)],
        "projectors": [p.to_dict() for p in m.projectors],
        "generation": m.generation,
        **facts,
    }
