"""skippy-quantize commands: quantize-layer-package (docs/quantize.md)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from skippy.commands.output import CommandResult, add_json_flag
from skippy.constants import MANIFEST_NAME
from skippy.errors import InputUnreadable, UsageError
from skippy.hashing import DEFAULT_WORKERS
from skippy.progress import human_bytes


def register(sub: Any) -> None:
    p = sub.add_parser(
        "quantize-layer-package",
        help="write a quantized layer package straight from an F32/F16/BF16 source",
        description="Quantize a high-precision GGUF (or split set, hub coordinate, or layer "
        "package) into a layer package, tensor by tensor, with llama.cpp's per-tensor rules "
        "and an optional recipe. Tensors are byte-identical to llama.cpp's quantizer.",
    )
    p.add_argument(
        "source",
        type=Path,
        help="a GGUF, the first shard of a split set, a layer package directory, or a hub "
        "coordinate ORG/REPO:DIST",
    )
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument(
        "--type",
        required=True,
        metavar="TYPE",
        help="llama-quantize preset: Q8_0, Q4_0, Q4_K_M (Q4_K), Q6_K, IQ4_XS, F16, ...",
    )
    p.add_argument(
        "--tensor-types",
        type=Path,
        metavar="RECIPE",
        help="file of REGEX=TYPE lines (first match wins, # comments)",
    )
    p.add_argument("--imatrix", type=Path, metavar="FILE", help="llama-imatrix output")
    p.add_argument(
        "--pure", action="store_true", help="no per-tensor mixture rules (llama-quantize --pure)"
    )
    p.add_argument("--model-id", help="model coordinate ORG/REPO:DISTRIBUTION")
    p.add_argument("--source-repo", help="source repository (default: from --model-id)")
    p.add_argument("--source-revision", help="source commit or tag")
    p.add_argument("--source-file", help="source file name inside the source repository")
    p.add_argument("--projector", type=Path, action="append", default=[], metavar="FILE")
    p.add_argument("--overwrite", action="store_true", help="replace an existing package")
    p.add_argument(
        "--allow-requantize",
        action="store_true",
        help="accept an already-quantized source (precision is lost twice)",
    )
    p.add_argument(
        "--threads", type=int, default=DEFAULT_WORKERS, help="worker threads (default: cores)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print every tensor's type; write nothing"
    )
    p.add_argument(
        "--speculative",
        action="append",
        default=[],
        metavar="TYPE:K=V,...",
        help="declare an N-gram speculation strategy (repeatable), as write-package does",
    )
    p.add_argument(
        "--speculative-default", metavar="ID", help="the declared strategy to make the default"
    )
    add_json_flag(p)
    p.set_defaults(handler=cmd_quantize)


def _read_recipe(path: Path) -> Any:
    from skippy.produce.quant_rules import QUANTIZE_TARGETS
    from skippy.produce.recipe import MAX_RECIPE_BYTES, parse_recipe

    try:
        with open(path, "rb") as f:
            data = f.read(MAX_RECIPE_BYTES + 1)  # parse_recipe refuses anything longer
    except OSError as exc:
        raise InputUnreadable(
            f"cannot read --tensor-types {path}: {exc.strerror or exc}", path=str(path)
        ) from exc
    return parse_recipe(data, allowed_types=QUANTIZE_TARGETS)


def _options(args: argparse.Namespace) -> tuple[Path, Any]:
    """The source to open and the QuantizeOptions, every flag checked."""
    from skippy.package.quantization import QUANTIZATION_KEY
    from skippy.produce.imatrix import load_imatrix
    from skippy.produce.quant_rules import parse_file_type
    from skippy.produce.quantize_package import QuantizeOptions, open_package_source
    from skippy.produce.write_package import Provenance

    if args.threads < 1:
        raise UsageError(f"--threads must be at least 1 (got {args.threads})")
    from skippy.generation.declare import parse_declaration

    for text in args.speculative:  # refused before anything is read
        parse_declaration(text)
    file_type = parse_file_type(args.type)
    recipe = _read_recipe(args.tensor_types) if args.tensor_types else None
    imatrix = load_imatrix(args.imatrix) if args.imatrix else None
    common: dict[str, Any] = {
        "out_dir": args.out_dir,
        "file_type": file_type,
        "recipe": recipe,
        "imatrix": imatrix,
        "pure": args.pure,
        "allow_requantize": args.allow_requantize,
        "overwrite": args.overwrite,
        "workers": args.threads,
        "quiet": args.json,
        "speculative": tuple(args.speculative),
        "speculative_default": args.speculative_default,
    }
    if not args.source.is_dir():
        from skippy.commands.producer import _source_and_provenance  # write-package's rule

        source, prov = _source_and_provenance(args)
        return source, QuantizeOptions(
            provenance=prov, projectors=tuple(args.projector), **common
        )

    # A layer package: re-quantize its fragments; provenance stays the original source's.
    given = [
        f
        for f, v in (
            ("--source-repo", args.source_repo),
            ("--source-revision", args.source_revision),
            ("--source-file", args.source_file),
            ("--projector", args.projector),
        )
        if v
    ]
    if given:
        raise UsageError(
            f"{', '.join(given)} cannot be combined with a package SOURCE: its manifest "
            "names the original source and its projectors are copied",
            code="usage",
        )
    if os.path.realpath(args.source) == os.path.realpath(args.out_dir):
        raise UsageError(
            "--out-dir is the source package itself: it would be overwritten while read",
            code="output_is_source",
        )
    pkg = open_package_source(args.source)
    m = pkg.manifest
    repo = m.model_id.rsplit(":", 1)[0]
    prov = Provenance(
        model_id=args.model_id or f"{repo}:{file_type.canonical}",
        repo=m.source_model.repo,
        revision=m.source_model.revision,
        source_file=m.source_model.primary_file,
    )
    earlier = m.extra.get(QUANTIZATION_KEY)
    opts = QuantizeOptions(
        provenance=prov,
        source_shards=pkg.shards,
        source_model=m.source_model,
        projectors=pkg.projectors,
        requantized_from=earlier if isinstance(earlier, dict) else None,
        **common,
    )
    return pkg.shards[0], opts


def cmd_quantize(args: argparse.Namespace) -> CommandResult:
    from skippy.produce.quantize_package import dry_run, quantize_layer_package

    source, opts = _options(args)
    if args.dry_run:
        plan = dry_run(source, opts)
        name = opts.file_type.canonical
        data: dict[str, Any] = {
            "ok": True,
            "dry_run": True,
            "type": name,
            "tensor_types": plan.type_counts(),
            "tensors": plan.tensor_rows(),
        }
        lines = [f"{name}: {_summary(plan.type_counts())} (dry run: nothing written)"]
        lines += [
            f"  {t['name']:<40} {t['source_type']:>6} -> {t['type']:<8} {t['reason']}"
            for t in data["tensors"]
        ]
        return CommandResult(data=data, text="\n".join(lines))

    result = quantize_layer_package(source, opts)
    data = {"ok": True, **result.to_dict()}
    w = result.write
    lines = [
        f"quantized to {result.block.type} and wrote {data['artifacts']} artifacts "
        f"({human_bytes(w.bytes_written)}) to {w.out_dir} in {result.seconds:.2f}s",
        f"tensors: {_summary(result.plan.type_counts())}",
        f"{MANIFEST_NAME} sha256 {w.manifest_sha256}",
    ]
    return CommandResult(data=data, text="\n".join(lines))


def _summary(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {t}" for t, n in sorted(counts.items(), key=lambda kv: -kv[1]))
