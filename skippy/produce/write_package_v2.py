"""write-package --schema 2: a package-v2 ("source-complete") package from a source GGUF.

Spec "v2 writer", in order: refuse an existing ``model-package.json``; plan the payload groups
("v2 parts": every non-layer tensor in ``common``, one group per layer, names sorted, split into
``-partNN`` past ``--max-artifact-bytes``); write each payload part (the source KV copied
raw minus ``split.*``, tensors in sorted-name order, bytes verbatim, no trailing padding), or
with ``--resume-existing-artifacts`` reuse an existing one whose bytes equal what the source
would give; run the after-artifact hook; build the metadata carrier ("v2 carrier") from the plan
(not from the parts, which a hook may have uploaded and deleted), re-resolve it through the reader
the consumers use; copy projectors (sidecars); compute ``package_id`` and write the root last,
atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skippy.atomic import atomic_install, atomic_write_bytes
from skippy.constants import (
    KEY_ALIGNMENT,
    KEY_V2_LOCATOR_SCHEMA,
    KEY_V2_METADATA_ONLY,
    KEY_V2_PART_COUNT,
    KEY_V2_TENSOR_ALIGNMENT,
    KEY_V2_TENSOR_OFFSET,
    KEY_V2_TENSOR_PART,
    KEY_V2_TENSOR_SIZE,
    MANIFEST_NAME,
    METADATA_PATH,
    PROJECTORS_DIR,
    V2_DEFAULT_MAX_ARTIFACT_BYTES,
    V2_GENERATOR_VERSION,
    V2_LOCATOR_SCHEMA,
    V2_METADATA_ARTIFACT_ID,
    V2_NATIVE_ABI_VERSION,
    v2_common_id,
    v2_common_path,
    v2_layer_id,
    v2_layer_path,
)
from skippy.errors import InputUnreadable, ModelError, OutputExists, UsageError
from skippy.gguf.constants import ValueType
from skippy.gguf.writer import (
    TensorSource,
    build_header,
    encode_kv,
    fragment_digest,
    write_fragment,
)
from skippy.hashing import HashingSink, copy_range, sha256_file
from skippy.package.ownership import owner_of
from skippy.package.v2_carrier import read_catalog
from skippy.package.v2_root import (
    CatalogArtifact,
    PackageRootV2,
    Sidecar,
    V2SourceFile,
    V2SourceModel,
    check_root,
)
from skippy.produce.artifact_hook import ArtifactHook
from skippy.produce.model_experts import source_experts
from skippy.produce.source import SourceModelFiles, SourceTensor, shard_paths
from skippy.produce.write_package import (
    Provenance,
    _layer_count,
    _open_projector,
    _shard_names,
    _write_lock,
)

MIN_MAX_ARTIFACT_BYTES = 1


@dataclass(frozen=True)
class PayloadPlan:
    id: str
    path: str
    layer: int | None
    tensors: tuple[SourceTensor, ...]  # sorted by name

    @property
    def tensor_bytes(self) -> int:
        return sum(t.info.nbytes for t in self.tensors)


def _split(tensors: list[SourceTensor], max_bytes: int) -> list[list[SourceTensor]]:
    """Spec "v2 parts", ``split_oversized_group``: one part when the stored bytes fit; otherwise
    greedy over the sorted names, a part closed before the tensor that would overflow it (a
    tensor larger than the budget stays whole in its own part)."""
    if sum(t.info.nbytes for t in tensors) <= max_bytes:
        return [tensors]
    parts: list[list[SourceTensor]] = [[]]
    size = 0
    for t in tensors:
        if parts[-1] and size + t.info.nbytes > max_bytes:
            parts.append([])
            size = 0
        parts[-1].append(t)
        size += t.info.nbytes
    return parts


def plan_payloads(
    tensors: Sequence[SourceTensor], layer_count: int, max_bytes: int
) -> list[PayloadPlan]:
    """Pure: common first, then layers ascending (spec "v2 parts")."""
    groups: dict[int | None, list[SourceTensor]] = {}
    for t in tensors:
        layer = owner_of(t.info.name).layer_index
        if layer is not None and layer >= layer_count:
            raise ModelError(
                f"tensor {t.info.name} belongs to layer {layer}, the model declares "
                f"{layer_count} layers",
                code="layer_count_mismatch",
            )
        groups.setdefault(layer, []).append(t)
    plans: list[PayloadPlan] = []
    for layer in [None, *range(layer_count)]:
        members = sorted(groups.get(layer, []), key=lambda t: t.info.name)
        if not members:
            continue
        parts = _split(members, max_bytes)
        for i, part in enumerate(parts):
            k = None if len(parts) == 1 else i
            if layer is None:
                pid, path = v2_common_id(k), v2_common_path(k)
            else:
                pid, path = v2_layer_id(layer, k), v2_layer_path(layer, k)
            plans.append(PayloadPlan(pid, path, layer, tuple(part)))
    return plans


@dataclass(frozen=True)
class WriteOptionsV2:
    out_dir: Path
    provenance: Provenance
    projectors: tuple[Path, ...] = ()
    max_artifact_bytes: int = V2_DEFAULT_MAX_ARTIFACT_BYTES
    hook: ArtifactHook | None = None
    resume: bool = False
    created_at_unix_secs: int | None = None


@dataclass(frozen=True)
class WriteResultV2:
    out_dir: Path
    root: PackageRootV2
    manifest_sha256: str
    seconds: float
    written: tuple[str, ...]
    reused: tuple[str, ...]
    source_bytes: int

    def to_dict(self) -> dict[str, Any]:
        r = self.root
        return {
            "package": str(self.out_dir),
            "schema_version": r.schema_version,
            "package_id": r.package_id,
            "model_id": r.model_id,
            "manifest_sha256": self.manifest_sha256,
            "layer_count": r.layer_count,
            "artifacts": len(r.artifacts),
            "written": list(self.written),
            "reused": list(self.reused),
            "bytes_written": sum(a.byte_size for a in r.artifacts),
            "source_bytes": self.source_bytes,
            "seconds": round(self.seconds, 3),
        }


def normalized_kv_records(src: SourceModelFiles) -> list[bytes]:
    """Spec "v2 carrier", "v2 parts": the source KV records raw, ``split.*`` removed,
    ``general.alignment`` added (u32) when the source lacks it."""
    records = [src.head.raw_field(f.key) for f in src.kv_fields()]
    if KEY_ALIGNMENT not in src.head.fields:
        records.append(encode_kv(KEY_ALIGNMENT, ValueType.UINT32, src.alignment))
    return records


def _carrier_bytes(
    src: SourceModelFiles,
    kv: list[bytes],
    plans: list[PayloadPlan],
    part_headers: dict[str, int],
) -> bytes:
    """The carrier: normalized KV + the seven locator keys, the source's tensor directory
    (dense offsets, so ggml's reader would accept it, spec "v2 carrier"), and no payload."""
    order = sorted(plans, key=lambda p: p.id.encode("utf-8"))
    index = {p.id: i for i, p in enumerate(order)}
    where: dict[str, tuple[int, int]] = {}
    align = src.alignment
    for p in plans:
        _, offsets = build_header(kv, [t.info for t in p.tensors], align)
        for t, off in zip(p.tensors, offsets, strict=True):
            where[t.info.name] = (index[p.id], part_headers[p.id] + off)
    infos = [t.info for t in src.tensors]
    loc = [
        encode_kv(KEY_V2_METADATA_ONLY, ValueType.BOOL, True),
        encode_kv(KEY_V2_PART_COUNT, ValueType.UINT32, len(plans)),
        encode_kv(KEY_V2_LOCATOR_SCHEMA, ValueType.UINT32, V2_LOCATOR_SCHEMA),
        encode_kv(
            KEY_V2_TENSOR_PART, ValueType.ARRAY, [where[t.name][0] for t in infos], ValueType.UINT32
        ),
        encode_kv(
            KEY_V2_TENSOR_OFFSET,
            ValueType.ARRAY,
            [where[t.name][1] for t in infos],
            ValueType.UINT64,
        ),
        encode_kv(KEY_V2_TENSOR_SIZE, ValueType.ARRAY, [t.nbytes for t in infos], ValueType.UINT64),
        encode_kv(KEY_V2_TENSOR_ALIGNMENT, ValueType.ARRAY, [align] * len(infos), ValueType.UINT32),
    ]
    header, _ = build_header(kv + loc, infos, align)
    return header


def _check_out_dir(out_dir: Path, resume: bool) -> None:
    if (out_dir / MANIFEST_NAME).exists():
        raise OutputExists(
            f"{out_dir} already contains {MANIFEST_NAME}; use a new directory for v2 creation",
            path=str(out_dir),
            remediation="a v2 package is never rewritten in place: choose a new --out-dir",
        )
    if not resume and out_dir.is_dir() and any(out_dir.iterdir()):
        raise OutputExists(
            f"--out-dir {out_dir} is not empty",
            path=str(out_dir),
            remediation="choose a new or empty --out-dir, or pass --resume-existing-artifacts "
            "to verify and reuse the artifacts already there",
        )


def _emit_payload(
    src: SourceModelFiles,
    kv: list[bytes],
    plan: PayloadPlan,
    opts: WriteOptionsV2,
) -> tuple[CatalogArtifact, bool]:
    """Write (or, resuming, verify and reuse) one payload part; True when reused."""
    dest = opts.out_dir / plan.path
    sources: list[TensorSource] = [src.tensor_source(t) for t in plan.tensors]
    if dest.exists():
        if not opts.resume:
            raise OutputExists(
                f"artifact {plan.path} already exists; use --resume-existing-artifacts to "
                "verify it",
                path=plan.path,
            )
        size, digest = fragment_digest(kv, sources, src.alignment, trailing_pad=False)
        if dest.is_file() and dest.stat().st_size == size and sha256_file(dest) == digest:
            return CatalogArtifact(plan.id, plan.path, size, digest), True
        dest.unlink()  # not the bytes the source gives: rewritten below
    w = write_fragment(dest, kv, sources, src.alignment, trailing_pad=False)
    return CatalogArtifact(plan.id, plan.path, w.artifact_bytes, w.sha256), False


def _copy_projector(path: Path, index: int, opts: WriteOptionsV2) -> tuple[CatalogArtifact, bool]:
    aid = f"projector-{index:05d}"
    rel = f"{PROJECTORS_DIR}/{aid}.gguf"
    dest = opts.out_dir / rel
    want = sha256_file(path)
    if dest.exists() and opts.resume and dest.is_file() and sha256_file(dest) == want:
        return CatalogArtifact(aid, rel, dest.stat().st_size, want), True
    with open(path, "rb") as f, atomic_install(dest) as out:
        sink = HashingSink(out)
        copy_range(f.fileno(), 0, os.fstat(f.fileno()).st_size, sink.write)
    if sink.hexdigest() != want:
        raise ModelError(f"written projector differs from source {path}", code="projector_changed")
    return CatalogArtifact(aid, rel, sink.nbytes, sink.hexdigest()), False


def write_package_v2(source: Path, opts: WriteOptionsV2) -> WriteResultV2:
    """One writer per folder (the v1 writer's flock on the folder itself, ``package_busy``).
    A failed run keeps the parts it verified (no root names them, so nothing trusts them):
    ``--resume-existing-artifacts`` reuses them."""
    if not source.is_file():  # before the lock's mkdir: a failed start creates nothing
        raise InputUnreadable(
            f"source model {source} does not exist or is not a file", path=str(source)
        )
    if opts.max_artifact_bytes < MIN_MAX_ARTIFACT_BYTES:
        raise UsageError("--max-artifact-bytes must be > 0", code="usage")
    _check_out_dir(opts.out_dir, opts.resume)
    with _write_lock(opts.out_dir):
        return _write_package_v2(source, opts)


def _write_package_v2(source: Path, opts: WriteOptionsV2) -> WriteResultV2:
    t0 = time.perf_counter()
    if opts.max_artifact_bytes < MIN_MAX_ARTIFACT_BYTES:
        raise UsageError("--max-artifact-bytes must be > 0", code="usage")
    if not source.is_file():
        raise InputUnreadable(
            f"source model {source} does not exist or is not a file", path=str(source)
        )
    paths = shard_paths(source)
    shard_names = _shard_names(opts.provenance.source_file, len(paths))
    _check_out_dir(opts.out_dir, opts.resume)
    with contextlib.ExitStack() as stack:
        for p in opts.projectors:  # headers checked before anything is written
            _open_projector(stack, p)
    written: list[str] = []
    reused: list[str] = []
    with SourceModelFiles(source) as src:
        layer_count = _layer_count(src)
        source_experts(src)  # malformed MoE metadata or expert tensors: refused before writing
        plans = plan_payloads(src.tensors, layer_count, opts.max_artifact_bytes)
        kv = normalized_kv_records(src)
        files = tuple(
            V2SourceFile(name, p.stat().st_size, sha256_file(p))
            for name, p in zip(shard_names, paths, strict=True)
        )
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        artifacts: list[CatalogArtifact] = []
        headers: dict[str, int] = {}
        for plan in plans:
            art, was_reused = _emit_payload(src, kv, plan, opts)
            headers[plan.id] = len(
                build_header(kv, [t.info for t in plan.tensors], src.alignment)[0]
            )
            artifacts.append(art)
            (reused if was_reused else written).append(plan.path)
            if opts.hook is not None:
                opts.hook.run(opts.out_dir, plan.path)
        carrier = _carrier_bytes(src, kv, plans, headers)
    carrier_art = CatalogArtifact(
        V2_METADATA_ARTIFACT_ID, METADATA_PATH, len(carrier), hashlib.sha256(carrier).hexdigest()
    )
    dest = opts.out_dir / METADATA_PATH
    if opts.resume and dest.is_file() and sha256_file(dest) == carrier_art.sha256:
        reused.append(METADATA_PATH)
    else:
        atomic_write_bytes(dest, carrier, durable=False)
        written.append(METADATA_PATH)
    artifacts.insert(0, carrier_art)
    sidecars: list[Sidecar] = []
    for i, p in enumerate(opts.projectors):
        art, was_reused = _copy_projector(p, i, opts)
        artifacts.append(art)
        sidecars.append(Sidecar("mmproj", art.id, art.id))
        (reused if was_reused else written).append(art.path)
    prov = opts.provenance
    root = PackageRootV2(
        package_id="",
        model_id=prov.model_id,
        source_model=V2SourceModel(
            sha256=files[0].sha256,
            metadata_artifact_id=V2_METADATA_ARTIFACT_ID,
            repo=prov.repo,
            revision=prov.revision,
            primary_file=prov.source_file,
            canonical_ref=prov.model_id,
            distribution_id=prov.model_id.rsplit(":", 1)[1],
            files=files,
        ),
        layer_count=layer_count,
        artifacts=tuple(artifacts),
        sidecars=tuple(sidecars),
        native_abi_version=V2_NATIVE_ABI_VERSION,
        generator_version=V2_GENERATOR_VERSION,
        created_at_unix_secs=(
            opts.created_at_unix_secs if opts.created_at_unix_secs is not None else int(time.time())
        ),
    ).with_identity()
    # Re-resolve the carrier through the consumers' reader (spec "v2 writer") before the hook
    # may take it away: the catalog must hold every source tensor at the planned place.
    catalog = read_catalog(root, dest)
    if catalog.names() != {t.info.name for t in src.tensors}:
        raise ModelError(
            "emitted payload tensor catalog differs from independent source inventory",
            code="source_completeness_failed",
        )
    problems = check_root(root)
    if problems:
        raise ModelError(
            f"the v2 root fails its own checks: {problems[0].message}", code=problems[0].code
        )
    if opts.hook is not None:
        opts.hook.run(opts.out_dir, METADATA_PATH)
        for s in sidecars:
            opts.hook.run(opts.out_dir, root.artifact(s.artifact_id).path)
    from skippy.package.v2_view import dump_root

    raw = dump_root(root)
    atomic_write_bytes(opts.out_dir / MANIFEST_NAME, raw)
    return WriteResultV2(
        out_dir=opts.out_dir,
        root=root,
        manifest_sha256=hashlib.sha256(raw).hexdigest(),
        seconds=time.perf_counter() - t0,
        written=tuple(written),
        reused=tuple(reused),
        source_bytes=sum(f.byte_size for f in files),
    )
