"""write-package: turn a GGUF (or a split set) into a layer package (spec "Publishing Rules").

Data flow: open the source (bounded header parse) -> plan fragments (pure) -> on a thread
pool, hash the source shards and stream every fragment (raw KV + raw tensor bytes, hashed
while written, installed atomically) -> copy projectors -> render README -> write
``model-package.json`` last, atomically and durably. A run killed at any point leaves either
the previous manifest or none: never one that points at missing or partial files.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skippy.atomic import PARTIAL_SUFFIX, atomic_install, atomic_write_bytes
from skippy.constants import (
    DEFAULT_PROJECTOR_KIND,
    LAYERS_DIR,
    MANIFEST_NAME,
    MODEL_COORDINATE_RE,
    OUTPUT_WEIGHT_TENSOR,
    PROJECTORS_DIR,
    README_NAME,
    ROLE_EMBEDDINGS,
    ROLE_LAYER,
    ROLE_METADATA,
    ROLE_OUTPUT,
    RUNTIME_ABI_VERSION,
    SHARED_DIR,
    SPLIT_SHARD_RE,
)
from skippy.errors import InputUnreadable, ManifestError, ModelError, OutputExists, UsageError
from skippy.fragments import FragmentPlan, plan_fragments
from skippy.generation import infer_generation
from skippy.gguf.reader import open_gguf
from skippy.gguf.writer import WrittenFragment, write_fragment
from skippy.hashing import DEFAULT_WORKERS, HashingSink, copy_range, sha256_file
from skippy.manifest import (
    Artifact,
    LayerArtifact,
    Manifest,
    ProjectorArtifact,
    SharedArtifacts,
    SourceFile,
    SourceModel,
    dump_manifest,
    parse_manifest,
)
from skippy.package_readme import render_readme
from skippy.paths import check_relative_path
from skippy.progress import Progress
from skippy.source import SourceModelFiles, shard_paths


@dataclass(frozen=True)
class Provenance:
    """Where the source came from (spec "Publishing Rules": local sources need it explicitly)."""

    model_id: str
    repo: str
    revision: str
    source_file: str

    def __post_init__(self) -> None:
        if not MODEL_COORDINATE_RE.match(self.model_id):
            raise UsageError(
                f"--model-id {self.model_id!r} is not a model coordinate ORG/REPO:DISTRIBUTION",
                code="invalid_model_id",
                remediation="e.g. --model-id google/gemma-3-270m-GGUF:Q4_K_M",
            )
        for flag, value in (
            ("--source-revision", self.revision),
            ("--source-file", self.source_file),
        ):
            if not value.strip():
                raise UsageError(f"{flag} must not be empty", code="missing_provenance")


def local_provenance(
    *,
    model_id: str | None,
    source_repo: str | None,
    source_revision: str | None,
    source_file: str | None,
) -> Provenance:
    """Provenance for a local SOURCE: each missing flag is named in the error."""
    missing = [
        flag
        for flag, value in (
            ("--model-id", model_id),
            ("--source-revision", source_revision),
            ("--source-file", source_file),
        )
        if not value
    ]
    if missing:
        raise UsageError(
            f"a local SOURCE needs explicit provenance: missing {', '.join(missing)}",
            code="missing_provenance",
            remediation="pass --model-id ORG/REPO:DIST --source-revision COMMIT --source-file NAME",
        )
    return Provenance(
        model_id=str(model_id),
        repo=source_repo or str(model_id).split(":", 1)[0],
        revision=str(source_revision),
        source_file=str(source_file),
    )


@dataclass(frozen=True)
class WriteOptions:
    out_dir: Path
    provenance: Provenance
    projectors: tuple[Path, ...] = ()
    overwrite: bool = False
    workers: int = DEFAULT_WORKERS
    quiet: bool = True
    validation_note: str | None = None
    created_at_unix_secs: int | None = None


@dataclass(frozen=True)
class WriteResult:
    out_dir: Path
    manifest: Manifest
    manifest_sha256: str
    seconds: float
    bytes_written: int
    source_bytes: int
    removed_stale: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "out_dir": str(self.out_dir),
            "model_id": m.model_id,
            "manifest_sha256": self.manifest_sha256,
            "layer_count": m.layer_count,
            "activation_width": m.activation_width,
            "tied_embeddings": m.tied_embeddings,
            "artifacts": 3 + len(m.layers) + len(m.projectors),
            "bytes_written": self.bytes_written,
            "source_bytes": self.source_bytes,
            "seconds": round(self.seconds, 3),
            "generation": m.generation,
        }


def _distribution_id(source_file: str) -> str:
    name = source_file.rsplit("/", 1)[-1]
    m = SPLIT_SHARD_RE.match(name)
    if m:
        return m.group("prefix")
    return name[:-5] if name.endswith(".gguf") else name


def _shard_names(source_file: str, n: int) -> list[str]:
    """Repository names of every shard, derived from the first shard's declared name."""
    if n == 1:
        return [source_file]
    head, _, name = source_file.rpartition("/")
    m = SPLIT_SHARD_RE.match(name)
    if not m:
        raise UsageError(
            f"--source-file {source_file!r} must name the first shard of the split set",
            code="missing_provenance",
        )
    prefix = f"{head}/" if head else ""
    return [f"{prefix}{m.group('prefix')}-{k:05d}-of-{n:05d}.gguf" for k in range(1, n + 1)]


def _layer_count(src: SourceModelFiles) -> int:
    block_count = src.arch_value("block_count")
    if isinstance(block_count, bool) or not isinstance(block_count, int) or block_count < 1:
        raise ModelError(
            f"{src.head.path.name} has no valid {src.architecture}.block_count",
            code="missing_model_key",
        )
    return block_count


def _prepare_out_dir(out_dir: Path, overwrite: bool) -> Manifest | None:
    """Refuse to clobber a package unless asked; with --overwrite, withdraw the old manifest
    first so nothing trusts it while its artifacts are being replaced."""
    manifest_path = out_dir / MANIFEST_NAME
    old: Manifest | None = None
    if manifest_path.exists():
        if not overwrite:
            raise OutputExists(
                f"{out_dir} already holds a package ({MANIFEST_NAME}); pass --overwrite to "
                "replace it",
                path=str(manifest_path),
            )
        with contextlib.suppress(OSError, ManifestError):
            old = parse_manifest(manifest_path.read_bytes())
        manifest_path.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    for sub in (SHARED_DIR, LAYERS_DIR, PROJECTORS_DIR):
        d = out_dir / sub
        if d.is_dir():  # leftovers of a killed run: hidden partials nobody can trust
            for p in d.glob(f".*{PARTIAL_SUFFIX}"):
                p.unlink(missing_ok=True)
    return old


def _copy_projector(src: Path, out_dir: Path) -> ProjectorArtifact:
    with open_gguf(src) as g:
        tensor_count = len(g.tensors)
        tensor_bytes = sum(t.nbytes for t in g.tensors)
        rel = check_relative_path(f"{PROJECTORS_DIR}/{src.name}")
        with atomic_install(out_dir / rel) as f:
            sink = HashingSink(f)
            copy_range(g.fileno(), 0, g.file_size, sink.write)
    return ProjectorArtifact(
        kind=DEFAULT_PROJECTOR_KIND,
        path=rel,
        tensor_count=tensor_count,
        tensor_bytes=tensor_bytes,
        artifact_bytes=sink.nbytes,
        sha256=sink.hexdigest(),
    )


def _artifact(plan: FragmentPlan, w: WrittenFragment) -> Artifact:
    return Artifact(
        path=plan.path,
        tensor_count=w.tensor_count,
        tensor_bytes=w.tensor_bytes,
        artifact_bytes=w.artifact_bytes,
        sha256=w.sha256,
    )


def _layer_artifact(plan: FragmentPlan, w: WrittenFragment) -> LayerArtifact:
    return LayerArtifact(
        layer_index=plan.layer_index if plan.layer_index is not None else -1,
        path=plan.path,
        tensor_count=w.tensor_count,
        tensor_bytes=w.tensor_bytes,
        artifact_bytes=w.artifact_bytes,
        sha256=w.sha256,
    )


@dataclass(frozen=True)
class _SourceFacts:
    layer_count: int
    plans: list[FragmentPlan]
    generation: dict[str, Any] | None
    width: int | None
    tied: bool


def _study_source(src: SourceModelFiles) -> _SourceFacts:
    """Everything decided from the source header alone (pure apart from reading it)."""
    layer_count = _layer_count(src)
    highest = max(
        (t.info.name.split(".")[1] for t in src.tensors if t.info.name.startswith("blk.")),
        key=int,
        default=None,
    )
    if highest is None or int(highest) + 1 != layer_count:
        raise ModelError(
            f"{src.architecture}.block_count is {layer_count} but the highest block tensor "
            f"is blk.{highest}",
            code="layer_count_mismatch",
        )
    plans = plan_fragments(
        kv_records=[(f.key, src.head.raw_field(f.key)) for f in src.kv_fields()],
        tensors=src.tensors,
        layer_count=layer_count,
    )
    # Spec "Generation Defaults": advertise only what the artifact really contains.
    generation = infer_generation(
        arch=src.architecture,
        metadata=src.metadata(),
        tensor_names=[t.info.name for t in src.tensors],
        layer_count=layer_count,
    )
    width = src.arch_value("embedding_length")
    return _SourceFacts(
        layer_count=layer_count,
        plans=plans,
        generation=generation,
        width=width if isinstance(width, int) and not isinstance(width, bool) else None,
        tied=not any(t.info.name == OUTPUT_WEIGHT_TENSOR for t in src.tensors),
    )


def _write_fragments(
    pool: ThreadPoolExecutor,
    src: SourceModelFiles,
    plans: list[FragmentPlan],
    out_dir: Path,
    progress: Progress,
) -> list[WrittenFragment]:
    def write_one(plan: FragmentPlan) -> WrittenFragment:
        t = time.perf_counter()
        w = write_fragment(
            out_dir / plan.path,
            plan.kv_records,
            [src.tensor_source(x) for x in plan.tensors],
            src.alignment,
        )
        progress.item(plan.path, w.artifact_bytes, time.perf_counter() - t)
        return w

    # Largest first so both cores finish together (gemma3: token_embd is 70% of the bytes).
    order = sorted(range(len(plans)), key=lambda i: -plans[i].tensor_bytes)
    futures = {i: pool.submit(write_one, plans[i]) for i in order}
    return [futures[i].result() for i in range(len(plans))]


def write_package(source: Path, opts: WriteOptions) -> WriteResult:
    t0 = time.perf_counter()
    names = {p.name for p in opts.projectors}
    if len(names) != len(opts.projectors):
        raise UsageError("two --projector files share a file name", code="duplicate_projector")
    if not source.is_file():
        raise InputUnreadable(
            f"source model {source} does not exist or is not a file", path=str(source)
        )
    paths = shard_paths(source)
    sizes = [p.stat().st_size for p in paths]
    progress = Progress.for_terminal(len(paths), quiet=opts.quiet)
    cancel = threading.Event()

    def hash_one(path: Path) -> str:
        t = time.perf_counter()
        digest = sha256_file(path, cancel=cancel)
        progress.item(f"sha256 {path.name}", path.stat().st_size, time.perf_counter() - t)
        return digest

    pool = ThreadPoolExecutor(max_workers=max(1, opts.workers))
    try:
        # The source digest is the longest single job and needs no parsing: start it first,
        # then parse and plan while it runs (one pass per file, both cores busy).
        hash_futs = [pool.submit(hash_one, p) for p in paths]
        with SourceModelFiles(source) as src:
            facts = _study_source(src)
            old = _prepare_out_dir(opts.out_dir, opts.overwrite)
            progress.total += len(facts.plans)
            written = _write_fragments(pool, src, facts.plans, opts.out_dir, progress)
        digests = [f.result() for f in hash_futs]
    except BaseException:
        cancel.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    plans = facts.plans

    projectors = tuple(_copy_projector(p, opts.out_dir) for p in opts.projectors)
    by_role = {
        plan.role: _artifact(plan, w)
        for plan, w in zip(plans, written, strict=True)
        if plan.role != ROLE_LAYER
    }
    layers = tuple(
        _layer_artifact(plan, w)
        for plan, w in zip(plans, written, strict=True)
        if plan.role == ROLE_LAYER
    )
    prov = opts.provenance
    shard_names = _shard_names(prov.source_file, len(sizes))
    manifest = Manifest(
        model_id=prov.model_id,
        source_model=SourceModel(
            sha256=digests[0],
            path=prov.source_file,
            repo=prov.repo,
            revision=prov.revision,
            primary_file=prov.source_file,
            canonical_ref=f"{prov.repo}@{prov.revision}/{prov.source_file}",
            distribution_id=_distribution_id(prov.source_file),
            files=tuple(
                SourceFile(n, s, d) for n, s, d in zip(shard_names, sizes, digests, strict=True)
            ),
        ),
        layer_count=facts.layer_count,
        activation_width=facts.width,
        shared=SharedArtifacts(
            metadata=by_role[ROLE_METADATA],
            embeddings=by_role[ROLE_EMBEDDINGS],
            output=by_role[ROLE_OUTPUT],
        ),
        layers=layers,
        projectors=projectors,
        generation=facts.generation,
        skippy_abi_version=RUNTIME_ABI_VERSION,
        created_at_unix_secs=(
            opts.created_at_unix_secs if opts.created_at_unix_secs is not None else int(time.time())
        ),
        tied_embeddings=facts.tied,
    )
    manifest_bytes = dump_manifest(manifest)
    manifest_sha = hashlib.sha256(manifest_bytes).hexdigest()
    readme = render_readme(manifest, manifest_sha, validation_note=opts.validation_note)
    atomic_write_bytes(opts.out_dir / README_NAME, readme.encode("utf-8"))
    atomic_write_bytes(opts.out_dir / MANIFEST_NAME, manifest_bytes)
    removed = _remove_stale(opts.out_dir, old, manifest)
    return WriteResult(
        out_dir=opts.out_dir,
        manifest=manifest,
        manifest_sha256=manifest_sha,
        seconds=time.perf_counter() - t0,
        bytes_written=manifest.total_artifact_bytes(),
        source_bytes=sum(sizes),
        removed_stale=removed,
    )


def _remove_stale(out_dir: Path, old: Manifest | None, new: Manifest) -> tuple[str, ...]:
    """After --overwrite, delete artifacts the old manifest listed and the new one does not
    (only those: never arbitrary files in the folder)."""
    if old is None:
        return ()
    keep = {a.path for a in new.artifacts()}
    removed = []
    for ref in old.artifacts():
        if ref.path not in keep:
            with contextlib.suppress(OSError, ValueError):
                p = out_dir / check_relative_path(ref.path)
                if p.is_file() and not p.is_symlink():
                    os.unlink(p)
                    removed.append(ref.path)
    return tuple(removed)


def rewrite_readme(out_dir: Path, manifest: Manifest, manifest_sha: str, note: str) -> None:
    """Refresh README.md (e.g. with a validation result) without touching the manifest."""
    atomic_write_bytes(
        out_dir / README_NAME,
        render_readme(manifest, manifest_sha, validation_note=note).encode("utf-8"),
    )


__all__: Sequence[str] = (
    "Provenance",
    "WriteOptions",
    "WriteResult",
    "local_provenance",
    "rewrite_readme",
    "write_package",
)
