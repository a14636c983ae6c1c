"""Runtime commands: ``run REF --prompt TEXT`` loads a verified stage and generates greedily.

The order is: read the manifest once (``open_ref``; for a moving hf:// ref this is the one
revision lookup) and refuse what the runtime cannot run before fetching or hashing anything (a
bad speculation config or strategy, checked against the manifest alone; a partial range); then
``skippy.consume.resolve.resolve_stage`` on the commit just read (``head.origin``), text-only
because this runtime loads no projector (selection, fetch of just those parts, consumer validation,
SHA-256 with the verification cache: always for hf://, for local directories unless
SKIPPY_VERIFY_PACKAGE_SHA turns it off); then the final speculation plan, whose native-MTP layer
indices are checked against the NextN tensors of the verified layer files; then load the
selected parts in place and generate.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skippy.commands.output import CommandResult, add_json_flag
from skippy.config import load_node_config, read_environment
from skippy.constants import ENV_VERIFY_PACKAGE_SHA
from skippy.errors import UsageError
from skippy.package.ranges import parse_layer_range

if TYPE_CHECKING:  # the hub client, numpy and llama.cpp load only when `run` runs
    from skippy.config import NodeConfig
    from skippy.consume.resolve import ResolvedStage
    from skippy.generation import SpeculativePlan
    from skippy.package.manifest import Manifest

DEFAULT_MAX_TOKENS = 32


def register(sub: Any) -> None:
    p = sub.add_parser("run", help="load a package stage with llama.cpp and generate greedily")
    p.add_argument("ref", help="a package directory, or hf://namespace/repo[@revision]")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS})",
    )
    p.add_argument(
        "--layers",
        metavar="A..B",
        help="half-open layer range to load (default: every layer)",
    )
    p.add_argument("--config", type=Path, metavar="TOML", help="node config ([speculative] ...)")
    p.add_argument(
        "--speculative-strategy",
        metavar="S",
        help="auto, mtp, disabled, or a strategy id the package declares (overrides --config)",
    )
    add_json_flag(p)
    p.set_defaults(handler=cmd_run)


def speculative_plan(
    manifest: Manifest,
    node: NodeConfig,
    args: argparse.Namespace,
    *,
    layer_tensor_names: Callable[[int], Collection[str]] | None = None,
) -> SpeculativePlan:
    """Spec "Speculative Decoding": CLI, then the model entry (named by the package's
    model_id), then global config, resolved once against the package's declared defaults.

    Without ``layer_tensor_names`` this is the cheap check against the manifest alone; with
    it, native-MTP ``layer_indices`` are cross-checked against the layers' NextN tensors
    (``mtp_layer_missing_nextn_tensors``), as ``preflight`` does."""
    from skippy.generation import SpeculativeSettings, parse_generation, resolve_speculative_plan

    package = parse_generation(
        manifest.generation,
        layer_count=manifest.layer_count,
        layer_tensor_names=layer_tensor_names,
    )
    cli = (
        SpeculativeSettings(strategy=args.speculative_strategy)
        if args.speculative_strategy
        else None
    )
    return resolve_speculative_plan(
        package=package, overrides=node.speculative, model=manifest.model_id, cli=cli
    )


def stage_layer_tensor_names(resolved: ResolvedStage) -> Callable[[int], Collection[str]]:
    """Tensor names of a selected layer's (verified, local) artifact, read on demand: only the
    layers a check asks about are opened. A layer outside the selection holds nothing here."""
    from skippy.constants import ROLE_LAYER
    from skippy.gguf.reader import open_gguf

    stage = resolved.stage
    files = {
        r.layer_index: path
        for r, path in zip(stage.selection.parts, stage.part_paths, strict=True)
        if r.role == ROLE_LAYER and r.layer_index is not None
    }

    def names(index: int) -> Collection[str]:
        path = files.get(index)
        if path is None:
            return ()
        with open_gguf(path) as g:
            return tuple(t.name for t in g.tensors)

    return names


def _operator_configured(node: NodeConfig, args: argparse.Namespace) -> bool:
    """Whether the operator set anything about speculation (CLI or config file)."""
    from skippy.generation import SpeculativeSettings

    spec = node.speculative
    return bool(
        args.speculative_strategy or spec.models or spec.global_settings != SpeculativeSettings()
    )


def cmd_run(args: argparse.Namespace) -> CommandResult:
    from skippy.consume.resolve import open_ref, resolve_stage
    from skippy.runtime.boundary import StageLoad
    from skippy.runtime.llama_cpp import LlamaStageRuntime

    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1", code="invalid_max_tokens")
    env = read_environment()
    node = load_node_config(args.config)
    with LlamaStageRuntime() as runtime:
        # Refuse what this runtime cannot run before fetching or hashing anything: a bad config
        # or strategy (checked against the manifest alone) and an unsupported range.
        head = open_ref(args.ref, env)
        speculative_plan(head.manifest, node, args)
        if args.layers is not None:
            runtime.require_supported(parse_layer_range(args.layers, head.manifest.layer_count))
        # The stage is the commit just read: a moving hf:// ref is resolved once (one lookup,
        # one warning), so the checks above and the load agree. Text-only: this runtime
        # cannot load a projector, so none is selected, fetched or hashed (spec "Compatibility").
        pinned = head.origin if head.from_hub else args.ref
        resolved = resolve_stage(pinned, env, layers_text=args.layers, text_only=True)
        prepared = resolved.stage
        layers = prepared.selection.layers
        runtime.require_supported(layers)
        verify = prepared.verification is not None
        # The final plan: native-MTP layer indices must hold NextN tensors in the verified
        # layer files (spec "Speculative Decoding"; run serves full ranges, so all are here).
        plan = speculative_plan(
            prepared.package.manifest,
            node,
            args,
            layer_tensor_names=stage_layer_tensor_names(resolved),
        )
        stage = StageLoad.from_selection(
            prepared.selection,
            resolved.files(),
            manifest_sha256=prepared.package.manifest_sha256,
            sha256_verified=verify,
            speculative=plan,
        )
        runtime.load(stage)
        prompt_ids = runtime.tokenize(args.prompt)
        gen = runtime.generate(prompt_ids, max_tokens=args.max_tokens)
        load_s = runtime.load_s
    data: dict[str, Any] = {
        "package": prepared.package.display,
        "model_id": stage.model_id,
        "manifest_sha256": stage.manifest_sha256,
        "layers": str(layers),
        "sha256_verified": stage.sha256_verified,
        "parts": len(stage.part_paths),
        "load_s": load_s,
        "prompt": args.prompt,
        "speculative": plan.to_dict(),
        **gen.to_dict(),
    }
    rate = gen.decode_tokens_per_s or gen.tokens_per_s
    stats = (
        f"[{len(gen.tokens)} tokens, stop: {gen.stop_reason}, "
        f"{rate:.1f} tok/s, load {load_s or 0:.2f}s, "
        f"{len(stage.part_paths)} parts, sha256 {'verified' if verify else 'NOT verified'}]"
        if rate
        else f"[{len(gen.tokens)} tokens, stop: {gen.stop_reason}]"
    )
    # Notes matter when an operator set something (a deprecated name, a bound that does not
    # apply, a model entry that matches nothing); the plain "no speculation default" of an
    # ordinary package with no speculative settings stays in the JSON plan only.
    warnings = list(plan.notes) if _operator_configured(node, args) else []
    if not verify:
        warnings.append(
            f"SHA-256 of the selected parts was not verified ({ENV_VERIFY_PACKAGE_SHA} is off)"
        )
    return CommandResult(data=data, text=f"{args.prompt}{gen.text}\n{stats}", warnings=warnings)
