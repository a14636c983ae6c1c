"""quantize-layer-package: a quantized layer package straight from a high-precision source.

Data flow: open the source (a GGUF, the first shard of a split set, or a layer package whose
fragments are re-read as one split set) -> plan every tensor's type (llama.cpp's rules,
``skippy.produce.quant_rules``, plus the recipe) and check the whole plan -> hand
write-package a ``QuantizeTransform``: it writes the metadata fragment with llama.cpp's
``general.file_type`` / ``general.quantization_version`` and streams every converted tensor
through ``skippy.produce.quant_stream`` into its fragment, hashed while written, installed
atomically; the manifest (last) carries the ``quantization`` block.

Every check that can refuse (unknown type, recipe rules that decide nothing or do not fit a
tensor, an already-quantized source without ``allow_requantize``, a missing imatrix, a
truncated source) runs in ``QuantizeTransform.prepare``, which write-package calls before
``--out-dir`` changes: a refused run leaves nothing behind (and a previous package whole).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skippy.constants import ROLE_PROJECTOR
from skippy.consume.preflight import load_package
from skippy.consume.verify import check_refs
from skippy.errors import ManifestError, ModelError, UsageError
from skippy.gguf import ggml
from skippy.gguf.writer import TensorSource
from skippy.hashing import DEFAULT_WORKERS
from skippy.package.manifest import Manifest, SourceModel
from skippy.package.quantization import (
    QUANTIZATION_KEY,
    QuantizationBlock,
    quantized_kv_records,
)
from skippy.produce.imatrix import Imatrix
from skippy.produce.quant_rules import (
    UNQUANTIZED,
    FileType,
    QuantPlan,
    TensorChoice,
    TensorFacts,
    block_size,
    is_quantized,
    model_facts,
    plan_types,
    type_name,
)
from skippy.produce.quant_stream import Conversion, Converter, output_info
from skippy.produce.recipe import Recipe
from skippy.produce.source import SourceModelFiles, SourceTensor
from skippy.produce.validate import stat_artifact
from skippy.produce.write_package import Provenance, WriteOptions, WriteResult, write_package

TOOL_NAME = "skippy-quantize"
_MAX_NAMED = 5  # tensors named in one error message


def tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("skippy-mesh")
    except PackageNotFoundError:  # running from a checkout without an install
        ours = "unknown"
    return f"{TOOL_NAME} {ours}; ggml {ggml.GGML_VERSION} ({ggml.GGML_COMMIT})"


@dataclass(frozen=True)
class QuantizeOptions:
    out_dir: Path
    provenance: Provenance
    file_type: FileType
    recipe: Recipe | None = None
    imatrix: Imatrix | None = None
    pure: bool = False
    allow_requantize: bool = False
    overwrite: bool = False
    workers: int = DEFAULT_WORKERS
    quiet: bool = True
    # A layer package as the source: its fragments in split order, its projectors, and the
    # original source's provenance (copied verbatim).
    source_shards: tuple[Path, ...] | None = None
    source_model: SourceModel | None = None
    projectors: tuple[Path, ...] = ()
    created_at_unix_secs: int | None = None
    # The source package's own quantization block, when it had one (recorded: the bytes can
    # then no longer be redone from source_model).
    requantized_from: dict[str, Any] | None = None
    # N-gram speculation to declare (write-package --speculative; skippy.generation.declare)
    speculative: tuple[str, ...] = ()
    speculative_default: str | None = None


@dataclass(frozen=True)
class QuantizeResult:
    write: WriteResult
    plan: QuantPlan
    block: QuantizationBlock
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.write.to_dict(),
            "seconds": round(self.seconds, 3),
            QUANTIZATION_KEY: self.block.to_dict(),
            "tensor_types": self.plan.type_counts(),
            "tensors": self.plan.tensor_rows(),
        }


def _names(items: Sequence[str]) -> str:
    more = f" and {len(items) - _MAX_NAMED} more" if len(items) > _MAX_NAMED else ""
    return ", ".join(items[:_MAX_NAMED]) + more


def check_plan(
    plan: QuantPlan,
    tensors: Sequence[TensorFacts],
    *,
    recipe: Recipe | None,
    imatrix: Imatrix | None,
    allow_requantize: bool,
) -> None:
    """Refuse a plan that cannot be carried out, before anything is written (pure)."""
    if recipe is not None and not is_quantized(plan.file_type.default_type):
        raise UsageError(
            f"a recipe needs a quantized --type; {plan.file_type.name} keeps every tensor "
            "unquantized (llama.cpp ignores tensor types there)",
            code="recipe_needs_quantized_type",
        )
    if recipe is not None:
        unused = [r for r, hits in zip(recipe.rules, plan.recipe_hits, strict=True) if not hits]
        if unused:
            r = unused[0]
            raise UsageError(
                f"recipe line {r.line_no}: {r.pattern!r} decides no tensor (it matches no "
                "quantizable tensor name, or an earlier line already decides every one it "
                "matches)",
                code="recipe_rule_unused",
                actual=r.line_no,
                remediation="fix or remove the line; norms and 1-D tensors are never quantized",
            )
    by_name = {t.name: t for t in tensors}
    converting = [c for c in plan.choices if c.converts]
    requant = [c.name for c in converting if is_quantized(c.source_type)]
    if requant and not allow_requantize:
        src = type_name(next(c.source_type for c in converting if c.name == requant[0]))
        raise ModelError(
            f"the source is already quantized ({src} and others): requantizing "
            f"{len(requant)} tensors ({_names(requant)}) loses precision twice",
            code="source_already_quantized",
            remediation="quantize from the F32/F16/BF16 original, or pass --allow-requantize "
            "(as llama-quantize --allow-requantize)",
        )
    odd = [
        c.name
        for c in converting
        if c.source_type not in UNQUANTIZED and not is_quantized(c.source_type)
    ]
    if odd:
        raise ModelError(
            f"cannot convert tensors of type {type_name(by_name[odd[0]].ggml_type)} "
            f"({_names(odd)})",
            code="unsupported_source_type",
        )
    four_d = [c.name for c in converting if by_name[c.name].ne(3) > 1]
    if four_d:
        raise ModelError(
            f"4-D tensors cannot be quantized ({_names(four_d)}); llama.cpp cannot either",
            code="unsupported_tensor_shape",
        )
    for c in converting:
        t = by_name[c.name]
        if t.ne(0) % block_size(c.target_type):  # the rules' fallback makes this unreachable
            raise ModelError(
                f"{c.name}: rows of {t.ne(0)} do not fit {type_name(c.target_type)} blocks",
                code="quant_type_shape",
            )
        values = imatrix.for_tensor(c.name) if imatrix is not None else None
        if values is not None and len(values) != t.ne(0) * t.ne(2):
            if c.name not in ("token_embd.weight", "per_layer_token_embd.weight"):
                raise UsageError(
                    f"--imatrix has {len(values)} values for {c.name}, which needs "
                    f"{t.ne(0) * t.ne(2)}: it was computed for another model",
                    code="imatrix_mismatch",
                )
            values = None
        if c.requires_imatrix and values is None:
            raise UsageError(
                f"{c.name} becomes {type_name(c.target_type)}, which needs an importance "
                "matrix" + (" entry for it" if imatrix is not None else ""),
                code="imatrix_required",
                remediation="pass --imatrix FILE (llama-imatrix output for this model), or "
                "choose a type that needs none",
            )


def plan_quantization(src: SourceModelFiles, opts: QuantizeOptions) -> QuantPlan:
    """Every tensor's type for this source and these options, checked (raises to refuse)."""
    facts = [TensorFacts(t.info.name, t.info.shape, t.info.ggml_type) for t in src.tensors]
    plan = plan_types(
        facts,
        model_facts(src.metadata()),
        opts.file_type,
        pure=opts.pure,
        recipe=opts.recipe,
        has_imatrix=opts.imatrix is not None,
    )
    check_plan(
        plan,
        facts,
        recipe=opts.recipe,
        imatrix=opts.imatrix,
        allow_requantize=opts.allow_requantize,
    )
    return plan


class QuantizeTransform:
    """write-package's ``TensorTransform`` for quantizing (see module docstring)."""

    def __init__(self, opts: QuantizeOptions, converter: Converter) -> None:
        self.opts = opts
        self.converter = converter
        self.plan: QuantPlan | None = None
        self._choices: dict[str, TensorChoice] = {}

    def prepare(self, src: SourceModelFiles) -> None:
        plan = plan_quantization(src, self.opts)
        for c in plan.choices:
            if c.converts:
                self.converter.prepare_type(c.source_type, c.target_type)
        self.plan = plan
        self._choices = plan.by_name()

    def kv_records(self, records: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        return quantized_kv_records(records, self.opts.file_type.ftype)

    def tensor_source(self, src: SourceModelFiles, t: SourceTensor) -> TensorSource:
        choice = self._choices[t.info.name]  # KeyError: prepare() was not called
        raw = src.tensor_source(t)
        if not choice.converts:  # copied, but validated like llama.cpp's loader does
            return TensorSource(t.info, raw.fd, produce=self.converter.copier(t.info, raw.fd))
        imatrix = self.opts.imatrix.for_tensor(t.info.name) if self.opts.imatrix else None
        if imatrix is not None and len(imatrix) != t.info.shape[0] * (
            t.info.shape[2] if len(t.info.shape) > 2 else 1
        ):
            imatrix = None  # token_embd with a mismatched entry: llama.cpp ignores it
        conv = Conversion(src=t.info, fd=raw.fd, target_type=choice.target_type, imatrix=imatrix)
        return TensorSource(
            output_info(t.info, choice.target_type), raw.fd, produce=self.converter.producer(conv)
        )

    def block(self) -> QuantizationBlock:
        r, ft = self.opts.recipe, self.opts.file_type
        return QuantizationBlock(
            type=ft.canonical,
            ftype=ft.ftype,
            pure=self.opts.pure,
            recipe=r.text if r is not None else None,
            recipe_sha256=r.sha256 if r is not None else None,
            tool_version=tool_version(),
            imatrix_sha256=self.opts.imatrix.sha256 if self.opts.imatrix else None,
            requantized_from=self.opts.requantized_from,
        )

    def manifest_extra(self) -> dict[str, Any]:
        return {QUANTIZATION_KEY: self.block().to_dict()}


@dataclass
class _Timer:
    t0: float = field(default_factory=time.perf_counter)

    def seconds(self) -> float:
        return time.perf_counter() - self.t0


def quantize_layer_package(source: Path, opts: QuantizeOptions) -> QuantizeResult:
    """Quantize ``source`` (a GGUF or a split set's first shard; for a package, the first
    fragment with ``opts.source_shards``) into a layer package at ``opts.out_dir``."""
    timer = _Timer()
    g = ggml.load()
    workers = max(1, opts.workers)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="quantize") as pool:
        transform = QuantizeTransform(opts, Converter(g, pool, workers))
        result = write_package(
            source,
            WriteOptions(
                out_dir=opts.out_dir,
                provenance=opts.provenance,
                projectors=opts.projectors,
                overwrite=opts.overwrite,
                workers=workers,
                quiet=opts.quiet,
                created_at_unix_secs=opts.created_at_unix_secs,
                transform=transform,
                source_shards=opts.source_shards,
                source_model=opts.source_model,
                speculative=opts.speculative,
                speculative_default=opts.speculative_default,
            ),
        )
    if transform.plan is None:  # write_package always prepares before writing
        raise RuntimeError("the quantization plan was never made")
    return QuantizeResult(
        write=result, plan=transform.plan, block=transform.block(), seconds=timer.seconds()
    )


@dataclass(frozen=True)
class PackageSource:
    """A layer package used as the source: its fragments form one split set."""

    root: Path
    manifest: Manifest
    shards: tuple[Path, ...]  # metadata, embeddings, layers, output (split order)
    projectors: tuple[Path, ...]


def open_package_source(root: Path) -> PackageSource:
    """Check the package like a consumer (spec "Consumer Validation": manifest, paths, sizes,
    and every fragment's SHA-256) before any of its bytes is trusted."""
    pkg = load_package(root)
    if not isinstance(pkg.manifest, Manifest):  # v2 preserves source bytes (spec "v2 transforms")
        raise ManifestError(
            f"{root} is a schema-version-2 package; skippy-quantize reads schema-1 packages "
            "(v2 never transforms: quantize the source, then package it)",
            code="unsupported_schema_version",
            path=str(root),
        )
    refs = list(pkg.manifest.artifacts())
    check_refs(root, refs, manifest_sha256=pkg.manifest_sha256, cache=None).raise_for_mismatch()
    paths = [(ref, stat_artifact(root, ref)[0]) for ref in refs]
    return PackageSource(
        root=root,
        manifest=pkg.manifest,
        shards=tuple(p for ref, p in paths if ref.role != ROLE_PROJECTOR),
        projectors=tuple(p for ref, p in paths if ref.role == ROLE_PROJECTOR),
    )


def dry_run(source: Path, opts: QuantizeOptions) -> QuantPlan:
    """The plan alone: nothing is quantized or written."""
    with SourceModelFiles(source, shards=opts.source_shards) as src:
        return plan_quantization(src, opts)


__all__ = [
    "PackageSource",
    "QuantizeOptions",
    "QuantizeResult",
    "QuantizeTransform",
    "check_plan",
    "dry_run",
    "open_package_source",
    "plan_quantization",
    "quantize_layer_package",
    "tool_version",
]
