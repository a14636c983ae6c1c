"""write-package: turn a GGUF (or a split set) into a layer package (spec "Publishing Rules").

Data flow: check every user input (shard names, projector headers, provenance, the source
header) -> take the folder's write lock -> withdraw the previous manifest -> on a thread
pool, hash the source shards and stream every fragment (raw KV + raw tensor bytes, hashed
while written, installed atomically) -> copy projectors -> delete the previous package's
stale artifacts -> render README -> write ``model-package.json`` last, atomically and durably.

What a reader can rely on:

- A run that fails on its input (source, provenance, projectors, a busy or occupied
  ``--out-dir``) leaves the previous package there untouched, whole and valid.
- A run that fails or is killed part-way (the *process* dies, the machine keeps running)
  leaves no manifest at all: the previous one is withdrawn before the first artifact is
  replaced, and the new one is written only after every artifact is installed whole.
  Leftovers are hidden ``.partial`` files, removed by the next run.
- After a *power loss or kernel crash*, only ``WriteOptions.durable`` (off by default: it
  costs ~30% of the write time on gemma3-270m) makes the same promise: the withdrawal of
  the previous manifest is fsynced before the first artifact is replaced, and every artifact
  and its folder before the new manifest is written. Without it the manifest itself is
  still fsynced but the fragments are not, so a manifest that survived can name fragments
  that are empty or short. Consumers still catch that before use, because they check every
  selected artifact's size and SHA-256 against the manifest (spec "Consumer Validation");
  re-run write-package to repair such a package.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import CancelledError, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from skippy.atomic import (
    PARTIAL_SUFFIX,
    LockBusy,
    atomic_install,
    atomic_write_bytes,
    exclusive_lock,
    fsync_path,
)
from skippy.constants import (
    ARTIFACT_DIRS,
    DEFAULT_PROJECTOR_KIND,
    KEY_ARCHITECTURE,
    KEY_GENERAL_TYPE,
    MANIFEST_NAME,
    MODEL_COORDINATE_RE,
    PROJECTOR_ARCHITECTURE,
    PROJECTORS_DIR,
    README_NAME,
    ROLE_EMBEDDINGS,
    ROLE_LAYER,
    ROLE_METADATA,
    ROLE_OUTPUT,
    RUNTIME_ABI_VERSION,
    SPLIT_SHARD_RE,
)
from skippy.errors import (
    InputUnreadable,
    ManifestError,
    ModelError,
    OutputExists,
    UnsafePath,
    UsageError,
)
from skippy.generation import infer_generation
from skippy.generation.declare import declare_speculation
from skippy.gguf.reader import GGUFFile, open_gguf
from skippy.gguf.writer import TensorSource, WrittenFragment, fragment_digest, write_fragment
from skippy.hashing import DEFAULT_WORKERS, HashingSink, copy_range, sha256_file
from skippy.package.manifest import (
    Artifact,
    LayerArtifact,
    Manifest,
    PackageManifest,
    ProjectorArtifact,
    SharedArtifacts,
    SourceFile,
    SourceModel,
    dump_manifest,
    parse_manifest,
    read_manifest_bytes,
)
from skippy.package.ownership import has_tied_embeddings, highest_layer_index
from skippy.paths import check_relative_path, is_safe_relative_path, resolve_under
from skippy.produce.artifact_hook import ArtifactHook, run_hooks
from skippy.produce.fragments import FragmentPlan, plan_fragments
from skippy.produce.model_experts import source_experts
from skippy.produce.package_readme import render_readme
from skippy.produce.source import SourceModelFiles, SourceTensor, shard_paths
from skippy.progress import OnBytes, byte_bar
from skippy.text import unsafe_char


@dataclass(frozen=True)
class Provenance:
    """Where the source came from (spec "Publishing Rules": local sources need it explicitly)."""

    model_id: str
    repo: str
    revision: str
    source_file: str

    def __post_init__(self) -> None:
        fields = (
            ("--model-id", self.model_id),
            ("--source-repo", self.repo),
            ("--source-revision", self.revision),
            ("--source-file", self.source_file),
        )
        for flag, value in fields:
            if not _is_utf8(value):  # undecodable argv bytes arrive as lone surrogates
                raise UsageError(
                    f"{flag} {value!r} is not valid UTF-8; the manifest is UTF-8 JSON",
                    code="invalid_provenance",
                    remediation=f"pass {flag} as UTF-8 text",
                )
            bad = unsafe_char(value)
            if bad is not None:  # README.md injection, terminal escapes, reversed text
                raise UsageError(
                    f"{flag} contains the control or bidi character {bad}; provenance is "
                    "written into model-package.json and README.md as plain text",
                    code="invalid_provenance",
                    remediation=f"pass {flag} without control or bidirectional characters",
                )
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
        if not is_safe_relative_path(self.source_file):
            raise UsageError(
                f"--source-file {self.source_file!r} is not a path inside the source repository "
                "(it must be relative, without '..', '//' or backslashes)",
                code="unsafe_source_path",
                remediation="name the file as the repository lists it, e.g. model-Q8_0.gguf",
            )


def _is_utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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


class TensorTransform(Protocol):
    """A producer that rewrites tensors on their way into the fragments (skippy-quantize).

    write-package calls ``prepare`` once the source header is parsed and before ``--out-dir``
    changes (raise a ``SkippyError`` there to refuse: nothing is written), ``kv_records`` on
    the source's (key, raw record) list, ``tensor_source`` for every tensor as its fragment is
    written (on the writer threads), and ``manifest_extra`` for additive manifest fields.
    """

    def prepare(self, src: SourceModelFiles) -> None: ...

    def kv_records(self, records: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]: ...

    def tensor_source(self, src: SourceModelFiles, t: SourceTensor) -> TensorSource: ...

    def manifest_extra(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class WriteOptions:
    out_dir: Path
    provenance: Provenance
    projectors: tuple[Path, ...] = ()
    overwrite: bool = False
    workers: int = DEFAULT_WORKERS
    quiet: bool = True  # kept for callers; bars follow skippy.progress (the CLI's switch)
    validation_note: str | None = None
    created_at_unix_secs: int | None = None
    # fsync every artifact (and its folder) before the manifest, so a manifest that survives
    # a power loss points only at whole files. Off by default: +~30% write time on gemma3
    # (module docstring: what holds without it).
    durable: bool = False
    # Rewrites tensors on the way (skippy-quantize); None copies them byte for byte.
    transform: TensorTransform | None = None
    # The source's parts in split order when their names do not say it (a package's
    # fragments); with ``source_model`` (the original source, already verified) nothing is
    # hashed and the provenance is copied verbatim.
    source_shards: tuple[Path, ...] | None = None
    source_model: SourceModel | None = None
    # The publisher's workflow (spec "v2 hook"): a command run after each artifact
    # is written (it may upload and delete it), and reuse of artifacts already present after
    # proving their bytes are what the source gives.
    hook: ArtifactHook | None = None
    resume: bool = False
    # N-gram speculation the publisher declares (``skippy.generation.declare``: one
    # ``TYPE:key=value,...`` each) and the strategy to make the default, only when asked.
    speculative: tuple[str, ...] = ()
    speculative_default: str | None = None


@dataclass(frozen=True)
class WriteResult:
    out_dir: Path
    manifest: Manifest
    manifest_sha256: str
    seconds: float
    bytes_written: int
    source_bytes: int
    removed_stale: tuple[str, ...] = field(default=())
    # When each phase ended, in seconds since the start (where the time goes):
    # plan (source header parsed, fragments planned), source_hash, fragments, finish.
    phases: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "package": str(self.out_dir),
            "model_id": m.model_id,
            "manifest_sha256": self.manifest_sha256,
            "layer_count": m.layer_count,
            "activation_width": m.activation_width,
            "tied_embeddings": m.tied_embeddings,
            "artifacts": 3 + len(m.layers) + len(m.projectors),
            "bytes_written": self.bytes_written,
            "source_bytes": self.source_bytes,
            "seconds": round(self.seconds, 3),
            "phases": {k: round(v, 4) for k, v in self.phases.items()},
            "generation": m.generation,
        }


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


@contextlib.contextmanager
def _write_lock(out_dir: Path) -> Iterator[None]:
    """Hold an exclusive, non-blocking flock on the ``out_dir`` folder itself for the block.

    Locking the directory leaves no lock file behind in a folder that will be published;
    closing the descriptor releases the lock, also when the process dies. The lock only saves
    work (two runs would delete each other's partials); the renames make writes correct.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(exclusive_lock(out_dir))
        except LockBusy:
            raise OutputExists(
                f"another write-package run is writing into {out_dir}; two runs into one "
                "folder would delete each other's files",
                code="package_busy",
                path=str(out_dir),
                remediation="wait for the other run to finish, or choose another --out-dir",
            ) from None
        yield


def _check_out_dir(out_dir: Path, overwrite: bool) -> bool:
    """Without --overwrite, write only into a new or empty folder (a folder holding
    anything, a package or the user's own files, is ``output_exists``). True when the folder
    is new or empty: a failed run may then remove everything it wrote (``_FreshFolder``)."""
    try:
        st = out_dir.stat()
    except FileNotFoundError:
        return True
    except OSError as exc:  # e.g. a parent is a file
        raise OutputExists(
            f"--out-dir {out_dir} cannot be a folder: {exc.strerror}", path=str(out_dir)
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise OutputExists(f"--out-dir {out_dir} exists and is not a folder", path=str(out_dir))
    entries = sorted(os.listdir(out_dir))
    if not entries:
        return True
    if overwrite:
        return False
    shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
    what = (
        f"already holds a package ({MANIFEST_NAME})"
        if MANIFEST_NAME in entries
        else f"is not empty (it holds {shown})"
    )
    raise OutputExists(
        f"--out-dir {out_dir} {what}; write-package writes into a new or empty folder",
        path=str(out_dir),
        remediation="choose a new or empty --out-dir, or pass --overwrite to write there: it "
        "replaces only the files a package holds and those the old manifest lists, never an "
        "input",
    )


@dataclass(frozen=True)
class _FreshFolder:
    """A new or empty ``--out-dir``. We hold its lock and it held nothing, so every file at a
    path we write is ours: a failed run removes them and the folders it created."""

    out_dir: Path
    created: tuple[Path, ...]  # folders the lock's mkdir creates, outermost first

    @classmethod
    def before_lock(cls, out_dir: Path) -> _FreshFolder:
        created: list[Path] = []
        p = out_dir
        while not p.exists() and p != p.parent:
            created.append(p)
            p = p.parent
        return cls(out_dir, tuple(reversed(created)))

    def undo(self, destinations: Sequence[str]) -> None:
        for rel in destinations:
            with contextlib.suppress(OSError):
                (self.out_dir / rel).unlink()
        for sub in ARTIFACT_DIRS:
            with contextlib.suppress(OSError):  # only when empty
                (self.out_dir / sub).rmdir()
        for folder in reversed(self.created):
            with contextlib.suppress(OSError):
                folder.rmdir()


Identities = dict[tuple[int, int], Path]


def _identities(paths: Sequence[Path]) -> Identities:
    """(device, inode) of every input file, symlinks followed: a hard link or a symlink to an
    input is the input."""
    out: Identities = {}
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            continue  # a missing projector is reported when it is opened
        out[(st.st_dev, st.st_ino)] = p
    return out


def _input_at(path: Path, inputs: Identities) -> Path | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return inputs.get((st.st_dev, st.st_ino))


def _refuse_inputs_as_outputs(
    out_dir: Path, destinations: Sequence[str], inputs: Identities
) -> None:
    """Never replace an input: the source, a split sibling or a projector, by any name."""
    for rel in destinations:
        hit = _input_at(out_dir / rel, inputs)
        if hit is not None:
            raise OutputExists(
                f"{out_dir / rel} is the input {hit} (the same file): writing the package there "
                "would replace the file it is made from",
                code="output_is_input",
                path=rel,
                remediation="write the package to another --out-dir, or move the input out of it",
            )


def _prepare_out_dir(
    out_dir: Path, overwrite: bool, *, durable: bool
) -> PackageManifest | None:
    """With --overwrite, withdraw the old manifest first so nothing trusts it while its
    artifacts are being replaced. Returns the old manifest (``None`` if there was none or it
    was unreadable) for ``_remove_stale``."""
    manifest_path = out_dir / MANIFEST_NAME
    # An artifact folder that is a symlink out of the package would make us write (and clean
    # up) elsewhere, and no consumer would accept the result: refuse before touching anything.
    dirs = [resolve_under(out_dir, sub) for sub in ARTIFACT_DIRS]
    old: PackageManifest | None = None
    if manifest_path.exists():
        with contextlib.suppress(OSError, ManifestError, UnsafePath):
            old = parse_manifest(read_manifest_bytes(out_dir))
        manifest_path.unlink()
        if durable:  # after a power loss the old manifest must not return over new files
            fsync_path(out_dir)
    for d in dirs:
        if d.is_dir():  # leftovers of a killed run: hidden partials nobody can trust
            for p in d.glob(f".*{PARTIAL_SUFFIX}"):
                p.unlink(missing_ok=True)
    return old


@dataclass(frozen=True)
class _Projector:
    """A --projector whose header was validated before anything in --out-dir changed."""

    gguf: GGUFFile
    path: str  # destination inside the package


def is_projector(g: GGUFFile) -> bool:
    """A llama.cpp multimodal projector: ``general.architecture`` is ``clip`` (clip.cpp's
    mmproj files), or ``general.type`` says ``mmproj`` (newer converters write both)."""
    arch, kind = g.get(KEY_ARCHITECTURE), g.get(KEY_GENERAL_TYPE)
    return bool(arch == PROJECTOR_ARCHITECTURE or kind == "mmproj")


def _open_projector(stack: contextlib.ExitStack, src: Path) -> _Projector:
    g = stack.enter_context(open_gguf(src))
    if not is_projector(g):
        raise UsageError(
            f"--projector {src} is not a multimodal projector: its general.architecture is "
            f"{g.get(KEY_ARCHITECTURE)!r}, an mmproj file says {PROJECTOR_ARCHITECTURE!r}",
            code="not_a_projector",
            path=str(src),
            remediation="pass the mmproj GGUF that belongs to this model (e.g. mmproj-*.gguf)",
        )
    return _Projector(gguf=g, path=check_relative_path(f"{PROJECTORS_DIR}/{src.name}"))


def _copy_projector(proj: _Projector, out_dir: Path, *, durable: bool) -> ProjectorArtifact:
    g = proj.gguf
    with atomic_install(out_dir / proj.path, durable=durable) as f:
        sink = HashingSink(f)
        copy_range(g.fileno(), 0, g.file_size, sink.write)
    return ProjectorArtifact(
        kind=DEFAULT_PROJECTOR_KIND,
        path=proj.path,
        tensor_count=len(g.tensors),
        tensor_bytes=sum(t.nbytes for t in g.tensors),
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


def _study_source(
    src: SourceModelFiles,
    transform: TensorTransform | None,
    speculative: Sequence[str] = (),
    speculative_default: str | None = None,
) -> _SourceFacts:
    """Everything decided from the source header alone (pure apart from reading it)."""
    if is_projector(src.head):
        raise UsageError(
            f"{src.head.path.name} is a multimodal projector (mmproj), not a language model: "
            "use --projector to add it to the package of its model",
            code="source_is_projector",
            path=str(src.head.path),
            remediation="package the language model as SOURCE and pass this file with --projector",
        )
    layer_count = _layer_count(src)
    names = [t.info.name for t in src.tensors]
    highest = highest_layer_index(names)
    if highest is None or highest + 1 != layer_count:
        found = "there is no blk.N tensor" if highest is None else f"the highest is blk.{highest}"
        raise ModelError(
            f"{src.architecture}.block_count is {layer_count} but {found}",
            code="layer_count_mismatch",
            expected=layer_count,
            actual=None if highest is None else highest + 1,
        )
    source_experts(src)  # malformed MoE metadata or expert tensors: refused before writing
    kv_records = [(f.key, src.head.raw_field(f.key)) for f in src.kv_fields()]
    if transform is not None:
        transform.prepare(src)
        kv_records = transform.kv_records(kv_records)
    plans = plan_fragments(kv_records=kv_records, tensors=src.tensors, layer_count=layer_count)
    # Spec "Generation Defaults": advertise only what the artifact really contains.
    generation = infer_generation(
        arch=src.architecture,
        metadata=src.metadata(),
        tensor_names=names,
        layer_count=layer_count,
    )
    generation = declare_speculation(
        generation, speculative, default=speculative_default, layer_count=layer_count
    )
    width = src.arch_value("embedding_length")
    return _SourceFacts(
        layer_count=layer_count,
        plans=plans,
        generation=generation,
        width=width if isinstance(width, int) and not isinstance(width, bool) else None,
        tied=has_tied_embeddings(names),
    )


def _write_fragments(
    pool: ThreadPoolExecutor,
    src: SourceModelFiles,
    plans: list[FragmentPlan],
    out_dir: Path,
    on_bytes: OnBytes,
    *,
    durable: bool,
    cancel: threading.Event,
    transform: TensorTransform | None,
    hook: ArtifactHook | None = None,
    resume: bool = False,
) -> list[WrittenFragment]:
    def write_one(plan: FragmentPlan) -> WrittenFragment:
        if cancel.is_set():  # taken off the queue after the run failed: create nothing
            raise CancelledError(plan.path)
        dest = out_dir / plan.path
        sources = [
            transform.tensor_source(src, x) if transform else src.tensor_source(x)
            for x in plan.tensors
        ]
        if resume and dest.is_file():
            reused = _reuse_verified(dest, plan, sources, src.alignment, cancel)
            if reused is not None:
                return reused
        w = write_fragment(
            dest,
            plan.kv_records,
            sources,
            src.alignment,
            on_bytes=on_bytes,
            cancel=cancel,
        )
        if durable:  # here, on the pool, so one fragment's flush overlaps the next one's copy
            fsync_path(dest)
        return w

    # Largest first so both cores finish together (gemma3: token_embd is 70% of the bytes).
    order = sorted(range(len(plans)), key=lambda i: -plans[i].tensor_bytes)
    with _signals_held():
        futures = {i: pool.submit(write_one, plans[i]) for i in order}
    try:
        if hook is not None:
            # On this thread, as each artifact is whole and its digest known: the workers
            # keep SIGINT/SIGTERM blocked (_signals_held) and a child inherits that mask, so
            # a hook started there could not be interrupted.
            index = {f: i for i, f in futures.items()}
            for fut in as_completed(futures.values()):
                fut.result()
                hook.run(out_dir, plans[index[fut]].path)
        return [futures[i].result() for i in range(len(plans))]
    except BaseException:
        # Stop every copy before the caller closes the source files they read from.
        cancel.set()
        for f in futures.values():
            f.cancel()
        wait(futures.values())
        raise


def _check_resume(opts: WriteOptions) -> None:
    """``--resume-existing-artifacts`` continues an unfinished package; a finished one (its
    manifest written) is replaced only with ``--overwrite``."""
    if opts.resume and not opts.overwrite and (opts.out_dir / MANIFEST_NAME).exists():
        raise OutputExists(
            f"--out-dir {opts.out_dir} already holds a finished package ({MANIFEST_NAME}); "
            "--resume-existing-artifacts continues an unfinished one",
            path=str(opts.out_dir),
            remediation="pass --overwrite as well to rewrite it, reusing its verified artifacts",
        )


def _reuse_verified(
    dest: Path,
    plan: FragmentPlan,
    sources: list[TensorSource],
    alignment: int,
    cancel: threading.Event,
) -> WrittenFragment | None:
    """An existing fragment whose size and SHA-256 equal what the source would give (computed
    from the source, never trusted from the file), or None: it is then rewritten."""
    size, digest = fragment_digest(plan.kv_records, sources, alignment, cancel=cancel)
    if dest.stat().st_size != size or sha256_file(dest, cancel=cancel) != digest:
        return None
    return WrittenFragment(
        artifact_bytes=size,
        sha256=digest,
        tensor_count=len(plan.tensors),
        tensor_bytes=plan.tensor_bytes,
    )


def _build_manifest(
    opts: WriteOptions,
    facts: _SourceFacts,
    written: list[WrittenFragment],
    projectors: tuple[ProjectorArtifact, ...],
    source_files: tuple[SourceFile, ...],
) -> Manifest:
    by_role = {
        plan.role: _artifact(plan, w)
        for plan, w in zip(facts.plans, written, strict=True)
        if plan.role != ROLE_LAYER
    }
    layers = tuple(
        _layer_artifact(plan, w)
        for plan, w in zip(facts.plans, written, strict=True)
        if plan.role == ROLE_LAYER
    )
    prov = opts.provenance
    source_model = opts.source_model or SourceModel(
        sha256=source_files[0].sha256,
        path=prov.source_file,
        repo=prov.repo,
        revision=prov.revision,
        primary_file=prov.source_file,
        # Spec "Manifest Schema": the model coordinate and its distribution part.
        canonical_ref=prov.model_id,
        distribution_id=prov.model_id.rsplit(":", 1)[1],
        files=source_files,
    )
    return Manifest(
        model_id=prov.model_id,
        source_model=source_model,
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
        extra=opts.transform.manifest_extra() if opts.transform else {},
    )


def write_package(source: Path, opts: WriteOptions) -> WriteResult:
    t0 = time.perf_counter()
    names = {p.name for p in opts.projectors}
    if len(names) != len(opts.projectors):
        raise UsageError("two --projector files share a file name", code="duplicate_projector")
    if not source.is_file():
        raise InputUnreadable(
            f"source model {source} does not exist or is not a file", path=str(source)
        )
    paths = list(opts.source_shards) if opts.source_shards else shard_paths(source)
    # Everything that can fail on user input is checked before --out-dir changes, so a failed
    # --overwrite leaves the previous package whole: shard names here, the folder and the
    # inputs' identities next, projector headers and names below, the source header in
    # _study_source (provenance in Provenance itself).
    given = opts.source_model is not None  # provenance copied, nothing to hash or name
    shard_names = [] if given else _shard_names(opts.provenance.source_file, len(paths))
    _check_resume(opts)
    _check_out_dir(opts.out_dir, opts.overwrite or opts.resume)
    inputs = _identities([*paths, *opts.projectors])
    sizes = [p.stat().st_size for p in paths]
    cancel = threading.Event()
    phases: dict[str, float] = {}

    with contextlib.ExitStack() as stack:
        opened = [_open_projector(stack, p) for p in opts.projectors]
        # One bar for the source digest and the fragments (about the source's size each).
        bar_total = (1 if given else 2) * sum(sizes)
        on_bytes = stack.enter_context(byte_bar(bar_total, "write-package"))

        def hash_one(path: Path) -> str:
            digest = sha256_file(path, cancel=cancel, on_bytes=on_bytes)
            phases["source_hash"] = max(phases.get("source_hash", 0.0), time.perf_counter() - t0)
            return digest

        pool = ThreadPoolExecutor(max_workers=max(1, opts.workers))
        fresh: _FreshFolder | None = None
        destinations: list[str] = []
        try:
            # The source digest is the longest single job and needs no parsing: start it
            # first, then parse and plan while it runs (one pass per file, both cores busy).
            with _signals_held():
                hash_futs = [] if given else [pool.submit(hash_one, p) for p in paths]
            with SourceModelFiles(source, shards=opts.source_shards) as src:
                facts = _study_source(
                    src, opts.transform, opts.speculative, opts.speculative_default
                )
                phases["plan"] = time.perf_counter() - t0
                fresh = _FreshFolder.before_lock(opts.out_dir)
                stack.enter_context(_write_lock(opts.out_dir))  # held until the manifest is in
                if not _check_out_dir(opts.out_dir, opts.overwrite or opts.resume):  # locked
                    fresh = None
                destinations += [
                    *(plan.path for plan in facts.plans),
                    *(proj.path for proj in opened),
                    README_NAME,
                    MANIFEST_NAME,
                ]
                _refuse_inputs_as_outputs(opts.out_dir, destinations, inputs)
                old = _prepare_out_dir(opts.out_dir, opts.overwrite, durable=opts.durable)
                written = _write_fragments(
                    pool,
                    src,
                    facts.plans,
                    opts.out_dir,
                    on_bytes,
                    durable=opts.durable,
                    cancel=cancel,
                    transform=opts.transform,
                    hook=opts.hook,
                    resume=opts.resume,
                )
                phases["fragments"] = time.perf_counter() - t0
            digests = [f.result() for f in hash_futs]
            pool.shutdown()

            projectors = tuple(
                _copy_projector(p, opts.out_dir, durable=opts.durable) for p in opened
            )
            run_hooks(opts.hook, opts.out_dir, [p.path for p in projectors])
            source_files = (
                ()
                if given
                else tuple(
                    SourceFile(n, s, d) for n, s, d in zip(shard_names, sizes, digests, strict=True)
                )
            )
            manifest = _build_manifest(opts, facts, written, projectors, source_files)
            manifest_bytes = dump_manifest(manifest)
            manifest_sha = hashlib.sha256(manifest_bytes).hexdigest()
            # Before the new manifest exists: it must never list a file this deletes.
            keep = {a.path for a in manifest.artifacts()}
            removed = _remove_stale(opts.out_dir, old, keep, inputs)
            if opts.durable:  # the renames into each folder, before the manifest that trusts them
                for sub in ARTIFACT_DIRS:
                    if (opts.out_dir / sub).is_dir():
                        fsync_path(opts.out_dir / sub)
            readme = render_readme(manifest, manifest_sha, validation_note=opts.validation_note)
            # README.md is informational: atomic, but not worth an fsync; the manifest is both.
            atomic_write_bytes(opts.out_dir / README_NAME, readme.encode("utf-8"), durable=False)
            atomic_write_bytes(opts.out_dir / MANIFEST_NAME, manifest_bytes)
            phases["finish"] = time.perf_counter() - t0
        except BaseException:
            # Failed or interrupted (SIGINT/SIGTERM arrive as Interrupted): the workers stop at
            # their next chunk and unlink their hidden partials (skippy.atomic); a folder that
            # was new or empty gets back to that state, so the next run needs no --overwrite.
            cancel.set()
            pool.shutdown(wait=True, cancel_futures=True)
            # With a hook, whole artifacts stay (no manifest names them, so nothing trusts
            # them): --resume-existing-artifacts verifies and reuses them.
            if fresh is not None and opts.hook is None:
                fresh.undo(destinations)
            raise
    return WriteResult(
        out_dir=opts.out_dir,
        manifest=manifest,
        manifest_sha256=manifest_sha,
        seconds=time.perf_counter() - t0,
        bytes_written=manifest.total_artifact_bytes(),
        source_bytes=sum(sizes),
        removed_stale=removed,
        phases=phases,
    )


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM off while the pool may start a worker thread (``submit``).

    A signal handler that raises inside ``Thread.start()`` leaves a running worker the pool
    does not know, so ``shutdown(wait=True)`` would not wait for it and it could write after
    the cleanup (measured: 6 of 20 SIGINTs left a folder behind). Threads inherit the mask, so
    every worker keeps these signals blocked and a pending one is handled in the main thread
    right after this block."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _is_artifact_path(rel: str) -> bool:
    """A safe path inside one of the artifact folders (so never the root manifest or README)."""
    parts = rel.split("/")
    return is_safe_relative_path(rel) and len(parts) >= 2 and parts[0] in ARTIFACT_DIRS


def _remove_stale(
    out_dir: Path, old: PackageManifest | None, keep: set[str], inputs: Identities
) -> tuple[str, ...]:
    """After --overwrite, delete the regular files the old manifest listed and ``keep`` does
    not: only under shared/, layers/ and projectors/, only where the real path stays inside
    ``out_dir`` (a symlinked folder is never followed out), never arbitrary files and never
    one of this run's inputs."""
    if old is None:
        return ()
    removed = []
    for ref in old.artifacts():
        rel = ref.path
        if rel in keep or not _is_artifact_path(rel):
            continue
        try:
            p = resolve_under(out_dir, rel)
            if p.is_file() and not p.is_symlink() and _input_at(p, inputs) is None:
                p.unlink()
                removed.append(rel)
        except (OSError, UnsafePath):
            continue
    return tuple(removed)


def rewrite_readme(out_dir: Path, manifest: Manifest, manifest_sha: str, note: str) -> None:
    """Refresh README.md (e.g. with a validation result) without touching the manifest."""
    atomic_write_bytes(
        out_dir / README_NAME,
        render_readme(manifest, manifest_sha, validation_note=note).encode("utf-8"),
    )


__all__: Sequence[str] = (
    "Provenance",
    "TensorTransform",
    "WriteOptions",
    "WriteResult",
    "local_provenance",
    "rewrite_readme",
    "write_package",
)
