"""Runtime commands: ``run REF --prompt TEXT`` loads a verified stage and generates greedily.

The order is: refuse a stage shape the runtime cannot run (before fetching or hashing), then
``skippy.resolve.resolve_stage`` (a local directory or hf://: manifest, selection, fetch of just
those parts, consumer validation, SHA-256 with the verification cache: always for hf://, for
local directories unless SKIPPY_VERIFY_PACKAGE_SHA turns it off), then load the selected parts
in place and generate.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skippy.cli import CommandResult, add_json_flag
from skippy.config import load_node_config, read_environment
from skippy.constants import ENV_VERIFY_PACKAGE_SHA
from skippy.errors import UsageError
from skippy.ranges import parse_layer_range

if TYPE_CHECKING:  # the hub client, numpy and llama.cpp load only when `run` runs
    from skippy.generation import SpeculativePlan
    from skippy.manifest import Manifest

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


def speculative_plan(manifest: Manifest, args: argparse.Namespace) -> SpeculativePlan:
    """Spec "Speculative Decoding": CLI, then the model entry (named by the package's
    model_id), then global config, resolved once against the package's declared defaults."""
    from skippy.generation import (
        SpeculativeSettings,
        parse_generation,
        resolve_speculative_plan,
    )

    node = load_node_config(args.config)
    package = parse_generation(manifest.generation, layer_count=manifest.layer_count)
    cli = (
        SpeculativeSettings(strategy=args.speculative_strategy)
        if args.speculative_strategy
        else None
    )
    return resolve_speculative_plan(
        package=package, overrides=node.speculative, model=manifest.model_id, cli=cli
    )


def cmd_run(args: argparse.Namespace) -> CommandResult:
    from skippy.llama_runtime import LlamaStageRuntime
    from skippy.resolve import open_ref, resolve_stage
    from skippy.runtime import StageLoad

    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1", code="invalid_max_tokens")
    env = read_environment()
    with LlamaStageRuntime() as runtime:
        # Refuse a stage shape this runtime cannot run before fetching or hashing anything.
        head = open_ref(args.ref, env).manifest
        speculative_plan(head, args)  # a bad config or strategy is refused before any fetch
        if args.layers is not None:
            runtime.require_supported(parse_layer_range(args.layers, head.layer_count))
        resolved = resolve_stage(args.ref, env, layers_text=args.layers)
        prepared = resolved.stage
        layers = prepared.selection.layers
        runtime.require_supported(layers)
        verify = prepared.verification is not None
        plan = speculative_plan(prepared.package.manifest, args)
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
    # Notes matter when an operator asked for something (e.g. a deprecated name); the plain
    # "no speculation default" of an ordinary package stays in the JSON plan only.
    warnings = list(plan.notes) if plan.requested_source != "default" else []
    if not verify:
        warnings.append(
            f"SHA-256 of the selected parts was not verified ({ENV_VERIFY_PACKAGE_SHA} is off)"
        )
    return CommandResult(data=data, text=f"{args.prompt}{gen.text}\n{stats}", warnings=warnings)
