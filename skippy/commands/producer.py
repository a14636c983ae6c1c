"""Producer commands: write-package, inspect, plan, validate-package."""

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
from skippy.errors import InputUnreadable, UsageError
from skippy.paths import require_dir, require_file
from skippy.progress import human_bytes

if TYPE_CHECKING:
    from skippy.package.plan import ModelSizes
    from skippy.produce.write_package import Provenance


def register(sub: Any) -> None:
    p = sub.add_parser("write-package")
    p.add_argument(
        "source",
        type=_nonempty,
        help="a GGUF file, the first shard of a split set, or a hub coordinate ORG/REPO:DIST "
        "(a path starting with ./ or / is always local)",
    )
    p.add_argument("--out-dir", type=path_arg, required=True, help="the package folder to write")
    p.add_argument("--model-id", help="model coordinate ORG/REPO:DISTRIBUTION (local SOURCE)")
    p.add_argument("--source-repo", help="source repository (default: from --model-id)")
    p.add_argument(
        "--source-revision", help="source commit or tag (for a hub coordinate: what to resolve)"
    )
    p.add_argument(
        "--source-file",
        help="source file name inside the source repository (for a hub coordinate: the file "
        "to package, when the distribution alone does not pick it)",
    )
    p.add_argument(
        "--projector",
        type=path_arg,
        action="append",
        default=[],
        metavar="FILE",
        help="a projector (mmproj) GGUF to copy into projectors/ (repeatable)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing package")
    p.add_argument(
        "--durable",
        action="store_true",
        help="fsync every fragment before the manifest (survives power loss; ~30%% slower)",
    )
    p.add_argument(
        "--validate",
        action="store_true",
        help="run validate-package afterwards and record the result in README.md",
    )
    p.add_argument(
        "--schema",
        type=int,
        choices=(1, 2),
        default=1,
        help="manifest schema version: 1 (default, our spec) or 2 (upstream's "
        "source-complete package-v2 format)",
    )
    p.add_argument(
        "--max-artifact-bytes",
        type=_positive_int,
        default=None,
        metavar="N",
        help="schema 2: split a payload group into -partNN files past N stored tensor bytes "
        "(default 8 GiB)",
    )
    p.add_argument(
        "--after-artifact-command",
        metavar="CMD",
        help="run CMD after each artifact is written and verified, with "
        "SKIPPY_PACKAGE_ARTIFACT_PATH and SKIPPY_PACKAGE_ARTIFACT_RELATIVE_PATH set (it may "
        "upload and delete the file); a non-zero exit aborts",
    )
    p.add_argument(
        "--resume-existing-artifacts",
        action="store_true",
        help="reuse artifacts already in --out-dir after verifying them against the source; "
        "missing or different ones are rewritten",
    )
    p.add_argument(
        "--speculative",
        action="append",
        default=[],
        metavar="TYPE:K=V,...",
        help="declare an N-gram speculation strategy (repeatable), e.g. ngram-suffix:ngram_min=3,"
        "ngram_max=16,max_proposal_tokens=8,window=adaptive,max_window=8 (docs/generation.md)",
    )
    p.add_argument(
        "--speculative-default",
        metavar="ID",
        help="the declared strategy to recommend as the package default (set only when given)",
    )
    add_all_flag(p)
    p.set_defaults(handler=cmd_write_package)

    p = sub.add_parser("verify-package-v2")
    p.add_argument("package", type=path_arg, help="the schema-2 package directory")
    p.add_argument(
        "--source", type=path_arg, required=True, help="the source GGUF (first shard)"
    )
    p.add_argument(
        "--source-file", help="the primary source file's logical name (default: the manifest's)"
    )
    p.add_argument(
        "--source-projector",
        type=path_arg,
        action="append",
        default=[],
        metavar="FILE",
        help="the source of a declared projector (one per sidecar; repeatable)",
    )
    p.set_defaults(handler=cmd_verify_v2)

    p = sub.add_parser("inspect")
    p.add_argument(
        "path", type=path_arg, help="a GGUF file, a split set's first shard or a package"
    )
    p.set_defaults(handler=cmd_inspect)

    p = sub.add_parser("plan")
    p.add_argument("path", type=path_arg, help="a GGUF file or a package directory")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--stages", type=int, help="number of pipeline stages")
    how.add_argument(
        "--nodes",
        type=path_arg,
        metavar="TOML",
        help="place the layers on these nodes by the memory each gives ([[node]] id, memory, "
        "device, device_memory, unified): GPUs hold attention, their RAM the routed experts",
    )
    p.add_argument(
        "--balance",
        choices=("layers", "bytes"),
        default="layers",
        help="even layer counts (default) or the smallest largest stage in bytes",
    )
    p.set_defaults(handler=cmd_plan)

    p = sub.add_parser("validate-package")
    p.add_argument("source", type=path_arg, help="the source GGUF (first shard of a split set)")
    p.add_argument("package", type=path_arg, help="the package directory to check")
    add_all_flag(p)
    p.set_defaults(handler=cmd_validate)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _nonempty(text: str) -> str:
    path_arg(text)  # the same refusal of ""
    return text


def _source_and_provenance(args: argparse.Namespace) -> tuple[Path, Provenance]:
    """A local GGUF needs explicit provenance; a hub coordinate ``org/repo:DIST`` gets it from
    the hub (spec "Publishing Rules"), with ``--source-revision`` choosing the revision and
    ``--source-file`` naming the file when the distribution alone does not."""
    from skippy.produce.write_package import local_provenance

    # write-package passes a str, not a Path: Path("./a/b:Q") would drop the "./" that says
    # "local" (skippy-quantize, which shares this function, still passes a Path).
    text = str(args.source)
    local = Path(text)
    if local.exists() or text.startswith((".", "/", "~")):
        return local, local_provenance(
            model_id=args.model_id,
            source_repo=args.source_repo,
            source_revision=args.source_revision,
            source_file=args.source_file,
        )
    from skippy.config import read_environment
    from skippy.produce.hub_source import fetch_model_source, parse_model_coordinate

    if parse_model_coordinate(text) is None:
        raise InputUnreadable(
            f"source {text} is neither a file nor a model coordinate ORG/REPO:DIST",
            path=text,
        )
    given = [
        f for f, v in (("--model-id", args.model_id), ("--source-repo", args.source_repo)) if v
    ]
    if given:
        raise UsageError(
            f"{', '.join(given)} cannot be combined with a hub coordinate: the hub provides "
            "the provenance",
            code="usage",
        )
    hub_source = fetch_model_source(
        text, args.source_revision, read_environment(), source_file=args.source_file
    )
    return hub_source.first_shard, hub_source.provenance


def _yes_no(flag: bool | None) -> str:
    return "unknown" if flag is None else "yes" if flag else "no"


def _known(value: object, unit: str = "") -> str:
    """A header value for a human: ``unknown`` rather than ``None``."""
    return "unknown" if value is None else f"{field_text(value)}{unit}"


def cmd_write_package(args: argparse.Namespace) -> CommandResult:
    from skippy.constants import MANIFEST_NAME
    from skippy.produce.artifact_hook import ArtifactHook
    from skippy.produce.write_package import WriteOptions, rewrite_readme, write_package

    hook = ArtifactHook.parse(args.after_artifact_command)
    if args.schema == 2:
        return _write_v2(args, hook)
    if args.max_artifact_bytes is not None:
        raise UsageError("--max-artifact-bytes applies to --schema 2 only", code="usage")
    from skippy.generation.declare import parse_declaration

    for text in args.speculative:  # refused before anything is read
        parse_declaration(text)
    source, prov = _source_and_provenance(args)
    opts = WriteOptions(
        speculative=tuple(args.speculative),
        speculative_default=args.speculative_default,
        out_dir=args.out_dir,
        provenance=prov,
        projectors=tuple(args.projector),
        overwrite=args.overwrite,
        durable=args.durable,
        hook=hook,
        resume=args.resume_existing_artifacts,
    )
    result = write_package(source, opts)
    m = result.manifest
    data = {"source": args.source, **result.to_dict()}
    lines = [
        f"wrote {data['artifacts']} artifacts ({human_bytes(result.bytes_written)}) to "
        f"{field_text(args.out_dir)} in {result.seconds:.2f}s",
        f"model {field_text(m.model_id)}: {m.layer_count} layers, width "
        f"{_known(m.activation_width)}, tied embeddings: {_yes_no(m.tied_embeddings)}",
        f"{MANIFEST_NAME} sha256 {result.manifest_sha256}",
    ]
    exit_code = 0
    if args.validate:
        from skippy.produce.validate import validate_package

        report = validate_package(source, args.out_dir)
        verdict = "valid" if report.valid else "INVALID"
        note = (
            f"Result at write time: {verdict} ({report.artifacts_checked} artifacts, "
            f"{report.tensors_checked} tensors checked byte-for-byte against the source, "
            f"{len(report.findings)} findings)."
        )
        rewrite_readme(args.out_dir, m, result.manifest_sha256, note)
        data["validation"] = report.to_dict()
        lines.append(f"validate-package: {verdict}")
        lines += finding_lines(report.findings, show_all=args.show_all)
        exit_code = exit_for(report.valid)
    return CommandResult(data=data, text="\n".join(lines), exit_code=exit_code)


def _write_v2(args: argparse.Namespace, hook: Any) -> CommandResult:
    from skippy.constants import V2_DEFAULT_MAX_ARTIFACT_BYTES
    from skippy.produce.write_package_v2 import WriteOptionsV2, write_package_v2

    for flag, on in (("--overwrite", args.overwrite), ("--validate", args.validate)):
        if on:
            raise UsageError(
                f"{flag} does not apply to --schema 2 (a v2 package is never rewritten in "
                "place; check it with verify-package-v2)",
                code="usage",
            )
    if args.speculative or args.speculative_default is not None:
        raise UsageError(
            "--speculative applies to --schema 1 only (this writer copies a v2 package's "
            "generation block from upstream's format)",
            code="usage",
        )
    source, prov = _source_and_provenance(args)
    opts = WriteOptionsV2(
        out_dir=args.out_dir,
        provenance=prov,
        projectors=tuple(args.projector),
        max_artifact_bytes=args.max_artifact_bytes or V2_DEFAULT_MAX_ARTIFACT_BYTES,
        hook=hook,
        resume=args.resume_existing_artifacts,
    )
    result = write_package_v2(source, opts)
    data = {"source": args.source, **result.to_dict()}
    lines = [
        f"wrote {len(result.written)} and reused {len(result.reused)} of "
        f"{data['artifacts']} artifacts ({human_bytes(data['bytes_written'])}) to "
        f"{field_text(args.out_dir)} in {result.seconds:.2f}s (schema 2)",
        f"model {field_text(result.root.model_id)}: {result.root.layer_count} layers",
        f"package_id {result.root.package_id}",
    ]
    return CommandResult(data=data, text="\n".join(lines))


def cmd_verify_v2(args: argparse.Namespace) -> CommandResult:
    import json

    from skippy.produce.verify_v2 import verify_package_v2

    report = verify_package_v2(
        require_dir(args.package, "package directory"),
        require_file(args.source, "source model"),
        source_file=args.source_file,
        source_projectors=tuple(args.source_projector),
    )
    data = report.to_dict()
    return CommandResult(data=data, text=json.dumps(data))


def _model_lines(data: dict[str, Any]) -> list[str]:
    """inspect's lines on a whole model: the stage runtime's verdict, experts, parameters."""
    lines = []
    rt = data.get("stage_runtime")
    if rt is not None:
        verdict = "yes" if rt["runs"] else f"no ({rt['code']}: {field_text(rt['reason'])})"
        lines.append(f"  stage runtime: {verdict}")
    ex = data.get("experts")
    if ex is not None:
        moe = f"{ex['expert_count']} ({ex['expert_used_count']} used per token)"
        lines.append(f"  experts: {moe if ex['moe'] else 'none'}")
    params = data.get("parameters")
    if params is not None:
        lines.append(
            f"  parameters: total {params['total']:,}, active per token "
            f"{params['active_per_token']:,}"
        )
    return lines


def _package_lines(data: dict[str, Any]) -> list[str]:
    src = data["source_model"]
    lines = [
        f"package {field_text(data['model_id'])}",
        f"  source: {field_text(src['repo'])}@{field_text(src['revision'])} "
        f"{field_text(src['primary_file'])}",
        f"  layers: {data['layer_count']}  width: {_known(data['activation_width'])}  "
        f"tied embeddings: {_yes_no(data['tied_embeddings'])}  "
        f"ABI: {_known(data['skippy_abi_version'] or None)}",
        f"  total: {human_bytes(data['total_bytes'])}",
        *_model_lines(data),
    ]
    if data.get("schema_version") == 2:
        lines.insert(1, f"  schema 2, package_id {data['package_id']}")
        if not data["carrier_read"]:
            lines.append(
                "  (width, tied embeddings and tensors are in the metadata carrier, which this "
                "folder does not hold)"
            )
        width = max(len(field_text(a["path"])) for a in data["artifacts"])
        for a in data["artifacts"]:
            label = a["role"] if a["layer_index"] is None else f"layer {a['layer_index']}"
            count = "" if a["tensor_count"] is None else f"{a['tensor_count']:>5} tensors "
            lines.append(
                f"  {label:<11} {field_text(a['path']):<{width}} {count}"
                f"{human_bytes(a['artifact_bytes']):>10}"
            )
        return lines
    rows = [(role, a) for role, a in data["shared"].items()]
    rows += [(f"layer {e['layer_index']}", e) for e in data["layers"]]
    rows += [("projector", p) for p in data["projectors"]]
    width = max(len(field_text(a["path"])) for _, a in rows)
    for label, a in rows:
        lines.append(
            f"  {label:<11} {field_text(a['path']):<{width}} {a['tensor_count']:>5} tensors "
            f"{human_bytes(a['artifact_bytes']):>10}"
        )
    return lines


def _gguf_lines(data: dict[str, Any]) -> list[str]:
    name = Path(data["source"]).name
    if len(data["files"]) > 1:
        name += f" (+{len(data['files']) - 1} shards)"
    what = [f"GGUF v{data['gguf_version']}", _known(data["architecture"])]
    held, frag, mat = data["layers_held"], data["fragment"], data["materialized"]
    if mat is not None:
        what.append(
            f"materialized layers {mat['layer_start']}..{mat['layer_stop']} of "
            f"{_known(mat['layer_count'])} ({held['count'] if held else 0} layers)"
        )
    elif frag is not None:
        where = f" (layer {held['start']})" if held and held["count"] == 1 else ""
        what.append(f"package fragment {field_text(frag['role'])!r}{where}")
    else:
        what.append(f"{_known(data['layer_count'])} layers")
    if frag is None:
        what.append(f"width {_known(data['activation_width'])}")
        what.append(f"tied embeddings: {_yes_no(data['tied_embeddings'])}")
    lines = [
        f"{field_text(name)}: {', '.join(what)}",
        f"  {data['tensor_count']} tensors, {human_bytes(data['tensor_bytes'])}, "
        f"{data['kv_count']} KV pairs",
        *_model_lines(data),
    ]
    if data["tensors"]:
        width = max(40, *(len(field_text(t["name"])) for t in data["tensors"]))
        lines.append(f"  {'name':<{width}} {'role':<10} {'layer':>5} {'type':<8} {'bytes':>12}")
        for t in data["tensors"]:
            layer = "" if t["layer_index"] is None else str(t["layer_index"])
            lines.append(
                f"  {field_text(t['name']):<{width}} {t['role']:<10} {layer:>5} "
                f"{t['ggml_type']:<8} {t['bytes']:>12}"
            )
    return lines


def cmd_inspect(args: argparse.Namespace) -> CommandResult:
    from skippy.produce.inspect import inspect_gguf, inspect_package
    from skippy.runtime.support import support_verdict

    path: Path = args.path
    if path.is_dir():
        data = inspect_package(path, verdict=support_verdict)
        return CommandResult(data=data, text="\n".join(_package_lines(data)))
    data = inspect_gguf(require_file(path, "GGUF"), verdict=support_verdict)
    return CommandResult(data=data, text="\n".join(_gguf_lines(data)))


def cmd_plan(args: argparse.Namespace) -> CommandResult:
    from skippy.package.plan import plan_stages
    from skippy.produce.inspect import read_manifest
    from skippy.produce.sizes import sizes_from_package, sizes_from_source

    path: Path = args.path
    if path.is_dir():
        sizes, key = sizes_from_package(path, read_manifest(path)), "package"
    else:
        sizes, key = sizes_from_source(require_file(path, "GGUF")), "source"
    if args.nodes is not None:
        return _placement(path, key, sizes, args.nodes)
    stages = plan_stages(sizes, args.stages, args.balance)
    data = {
        key: str(path),
        "layer_count": sizes.layer_count,
        "stages": [s.to_dict() for s in stages],
        "balance": args.balance,
        "tied_embeddings": sizes.tied_embeddings,
    }
    noun = "stage" if len(stages) == 1 else "stages"
    lines = [f"{len(stages)} {noun} over {sizes.layer_count} layers (balance: {args.balance})"]
    active = f"  {'active':>10}" if sizes.moe else ""
    if sizes.moe:
        lines.append(
            "  mixture of experts: a stage holds all its bytes; a token reads its active bytes"
        )
    lines.append(f"  {'stage':>5}  {'layers':<13} {'count':>5}  {'bytes':>10}{active}  holds")
    for s in stages:
        d = s.to_dict()
        held = [
            name
            for name, on in (("embeddings", d["holds_embeddings"]), ("output", d["owns_output"]))
            if on
        ]
        read = f"  {human_bytes(d['active_bytes']):>10}" if sizes.moe else ""
        lines.append(
            f"  {s.index:>5}  {s.layers!s:<13} {len(s.layers):>5}  "
            f"{human_bytes(s.bytes):>10}{read}  {', '.join(['metadata', *held])}"
        )
    return CommandResult(data=data, text="\n".join(lines))


def _placement(path: Path, key: str, sizes: ModelSizes, nodes_file: Path) -> CommandResult:
    from skippy.config import read_toml
    from skippy.package.placement import nodes_from_toml, place

    nodes = nodes_from_toml(read_toml(nodes_file, "nodes file"))
    p = place(sizes, nodes)
    data = {key: str(path), "layer_count": sizes.layer_count, "nodes": str(nodes_file)}
    data |= p.to_dict()
    noun = "stage" if len(p.stages) == 1 else "stages"
    lines = [
        f"{len(p.stages)} {noun} over {sizes.layer_count} layers on {len(nodes)} nodes "
        f"({human_bytes(p.total_bytes)} placed, {human_bytes(p.offered_bytes)} offered)"
    ]
    lines.append(f"  {'stage':>5}  {'node':<16} {'layers':<10} {'device':>10} {'RAM':>10}  mode")
    for s in p.stages:
        lines.append(
            f"  {s.index:>5}  {s.node_id[:16]:<16} {s.layers!s:<10} "
            f"{human_bytes(s.device_bytes):>10} {human_bytes(s.host_bytes):>10}  {s.mode}"
        )
        lines.append(f"         {s.why}")
    lines += [f"  unused: {node_id}: {why}" for node_id, why in p.unused]
    return CommandResult(data=data, text="\n".join(lines))


def cmd_validate(args: argparse.Namespace) -> CommandResult:
    from skippy.produce.validate import validate_package

    report = validate_package(
        require_file(args.source, "source model"), require_dir(args.package, "package directory")
    )
    verdict = "valid" if report.valid else "INVALID"
    lines = [
        f"{field_text(args.package)}: {verdict} ({report.artifacts_checked} artifacts, "
        f"{report.tensors_checked} tensors, {human_bytes(report.bytes_hashed)} hashed in "
        f"{report.seconds:.2f}s)"
    ]
    lines += finding_lines(report.findings, show_all=args.show_all)
    return CommandResult(
        data=report.to_dict(), text="\n".join(lines), exit_code=exit_for(report.valid)
    )
