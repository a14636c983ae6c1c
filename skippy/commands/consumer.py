"""Consumer commands: preflight, select, materialize (spec "Consumer Validation", "Layer
Selection").

Each handler parses its arguments at the edge (the package reference through
``skippy.consume.resolve``, which also parses the layer range), calls one library
function and renders text or ``--json``. Exit codes come from ``skippy.cli``'s one table:
1 when the package is invalid (any error finding), 2 for bad usage or unreadable input.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skippy.commands.output import (
    CommandResult,
    add_all_flag,
    exit_for,
    field_text,
    finding_lines,
    path_arg,
)
from skippy.errors import UsageError
from skippy.package.refs import HfPackageRef, parse_package_ref
from skippy.paths import require_dir
from skippy.progress import human_bytes

if TYPE_CHECKING:  # each handler imports what it needs (skippy.consume.resolve: the hub client)
    from skippy.consume.preflight import PreparedStage
    from skippy.consume.resolve import ResolvedStage

REF_HELP = "a package directory, or hf://namespace/repo[@revision]"


def package_dir_for_cli(text: str) -> Path:
    """``preflight`` checks a package directory as published (every artifact): a hub package
    is checked stage by stage through ``select``/``fetch`` instead, never downloaded whole."""
    ref = parse_package_ref(text)
    if isinstance(ref, HfPackageRef):
        raise UsageError(
            f"{ref}: preflight checks a local package directory",
            code="preflight_needs_directory",
            remediation="use `select`/`fetch REF --layers A..B` to check a hub package's stage",
        )
    return require_dir(ref.path, "package directory")


def register(sub: Any) -> None:
    p = sub.add_parser("preflight")
    p.add_argument("package", metavar="PKG", help="a package directory")
    p.add_argument(
        "--stages", type=int, metavar="N", help="also list each stage's parts for N even stages"
    )
    p.add_argument("--verify-sha256", action="store_true", help="hash every checked artifact")
    p.add_argument(
        "--metadata-only",
        action="store_true",
        help="check only the manifest and shared/metadata.gguf (no layer range needed)",
    )
    add_all_flag(p)
    p.set_defaults(handler=cmd_preflight)

    for name, handler in (("select", cmd_select), ("fetch", cmd_fetch)):
        p = sub.add_parser(name)
        p.add_argument("ref", metavar="REF", help=REF_HELP)
        p.add_argument("--layers", required=True, metavar="A..B", help="half-open layer range")
        p.add_argument("--projector", metavar="P", help="a projector path declared in the manifest")
        p.set_defaults(handler=handler)

    p = sub.add_parser("materialize")
    p.add_argument("ref", metavar="REF", help=REF_HELP)
    p.add_argument("--layers", required=True, metavar="A..B", help="half-open layer range")
    p.add_argument(
        "--out",
        required=True,
        type=path_arg,
        metavar="FILE",
        help="the GGUF to write, outside the package",
    )
    p.set_defaults(handler=cmd_materialize)


def cmd_preflight(args: argparse.Namespace) -> CommandResult:
    from skippy.consume.preflight import preflight_package

    root = package_dir_for_cli(args.package)
    report = preflight_package(
        root,
        stages=args.stages,
        verify_sha256=args.verify_sha256,
        metadata_only=args.metadata_only,
    )
    verdict = "ok" if report.valid else "INVALID"
    scope = "metadata only" if args.metadata_only else f"{report.artifacts_checked} artifacts"
    sha = ""
    if report.verification is not None:
        v = report.verification
        sha = f", {v.hashed} hashed ({human_bytes(v.bytes_hashed)})"
    lines = [f"{root}: {verdict} ({scope}{sha}, {report.seconds:.2f}s)"]
    for s in report.stages:
        if s.selection is None:
            lines.append(f"  stage {s.index}: layers {s.layers}: {s.error}")
            continue
        sel = s.selection
        lines.append(
            f"  stage {s.index}: layers {s.layers}  {len(sel.parts)} parts  "
            f"{human_bytes(sel.total_bytes)}"
        )
        for r in sel.all_refs:
            size = human_bytes(r.artifact.artifact_bytes)
            lines.append(f"    {r.role:<10} {field_text(r.path):<32} {size}")
    lines += finding_lines(report.findings, show_all=args.show_all)
    return CommandResult(
        data=report.to_dict(), text="\n".join(lines), exit_code=exit_for(report.valid)
    )


def _resolve(args: argparse.Namespace, projector: str | None) -> ResolvedStage:
    from skippy.config import read_environment
    from skippy.consume.resolve import resolve_stage

    return resolve_stage(
        args.ref, read_environment(), layers_text=args.layers, projector_path=projector
    )


def _parts_lines(stage: PreparedStage) -> list[str]:
    sel = stage.selection
    lines = [
        f"{field_text(sel.manifest.model_id)} layers {sel.layers}: {len(sel.parts)} parts, "
        f"{human_bytes(sel.total_bytes)}"
        + (" (SHA-256 verified)" if stage.verification is not None else "")
    ]
    for r in sel.all_refs:
        index = "" if r.layer_index is None else str(r.layer_index)
        size = human_bytes(r.artifact.artifact_bytes)
        lines.append(
            f"  {r.role:<10} {index:>5} {field_text(r.path):<32} {size:>10}"
            f"  {field_text(r.artifact.sha256[:16])}"
        )
    return lines


def cmd_select(args: argparse.Namespace) -> CommandResult:
    resolved = _resolve(args, args.projector)
    return CommandResult(
        data=resolved.stage.to_dict(), text="\n".join(_parts_lines(resolved.stage))
    )


def cmd_fetch(args: argparse.Namespace) -> CommandResult:
    resolved = _resolve(args, args.projector)
    f = resolved.fetch
    share = f.bytes_selected / f.package_bytes if f.package_bytes else 0.0
    lines = _parts_lines(resolved.stage)
    lines.append(
        f"fetched {human_bytes(f.bytes_downloaded)} ({len([x for x in f.files if x.downloaded])}"
        f" files) in {f.seconds:.2f}s; stage holds {human_bytes(f.bytes_selected)} of the "
        f"package's {human_bytes(f.package_bytes)} ({share:.0%})"
    )
    lines.append(f"files under {resolved.stage.package.root}")
    data = {**resolved.stage.to_dict(), "fetch": f.to_dict()}
    return CommandResult(data=data, text="\n".join(lines))


def cmd_materialize(args: argparse.Namespace) -> CommandResult:
    from skippy.consume.materialize import materialize_stage

    # Projectors are never merged into a materialization (spec "Repository Layout").
    stage = _resolve(args, None).stage
    result = materialize_stage(
        stage.package.root,
        stage.selection,
        args.out,
        manifest_sha256=stage.package.manifest_sha256,
        containment_root=stage.package.containment_root,
    )
    verb = "wrote" if result.built else "kept existing"
    sel = stage.selection
    text = (
        f"{verb} {field_text(result.path)} (layers {sel.layers}: {len(sel.layers)} of "
        f"{sel.layers.layer_count} layers, {result.tensor_count} tensors, "
        f"{human_bytes(result.artifact_bytes)}, {result.seconds:.2f}s)\n"
        f"  sha256 {result.sha256}\n"
        f"  cache key {result.cache_key}"
    )
    data = {"package": stage.package.display, **result.to_dict(), "stage": stage.to_dict()}
    return CommandResult(data=data, text=text)
