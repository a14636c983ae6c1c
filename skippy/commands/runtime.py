"""Runtime commands: ``run REF --prompt TEXT`` loads verified stages and generates.

Engines: ``ggml`` (the stage runtime, ``skippy.runtime.ggml_engine``; the default, for one
stage as for N, so one stage and a split compute the same way), ``numpy`` (its f32 reference)
and ``llama`` (llama.cpp on one whole-range stage); ``--stages N`` runs the model as N chained
stages in this process, each loaded only from its own selection.

The order is: refuse a bad command line (sizes, an empty or undecodable prompt, an engine
that cannot do what was asked) and load the engine's library; read the manifest once
(``open_ref``; for a moving hf:// ref this is the one revision lookup) and refuse what cannot
run before fetching or hashing anything (a bad speculation config or strategy, checked against
the manifest alone; a partial range; a bad stage count); then, per stage,
``skippy.consume.resolve.resolve_stage`` on the commit just read (``head.origin``), text-only
because no runtime here loads a projector (selection, fetch of just those parts, consumer
validation, SHA-256 with the verification cache: always for hf://, for local directories
unless SKIPPY_VERIFY_PACKAGE_SHA turns it off); then the final speculation plan, whose
native-MTP layer indices are checked against the NextN tensors of the verified layer files;
then load the selected parts in place, tokenize behind the prompt guard, and generate.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skippy.commands.output import CommandResult, add_json_flag
from skippy.config import load_node_config, read_environment
from skippy.constants import ENV_VERIFY_PACKAGE_SHA
from skippy.errors import UsageError
from skippy.package.ranges import LayerRange, parse_layer_range

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the hub client, numpy, ggml and llama.cpp load only when `run` runs
    from skippy.config import NodeConfig
    from skippy.consume.resolve import ResolvedStage
    from skippy.generation import SpeculativePlan
    from skippy.package.manifest import PackageManifest
    from skippy.runtime.boundary import Generation, StageLoad
    from skippy.runtime.chain import StageChain
    from skippy.runtime.llama_cpp import LlamaStageRuntime
    from skippy.runtime.sampling import SamplingParams
    from skippy.runtime.speculation import SpeculativeStats
    from skippy.runtime.stage import Stage

DEFAULT_MAX_TOKENS = 32


ENGINES = ("ggml", "numpy", "llama")
DEFAULT_N_CTX = 512


def register(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="load a package and generate with the stage runtime on N chained stages (default "
        "1), or with llama.cpp on the whole range",
    )
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
        help="half-open layer range to load; run needs every layer (default: every layer)",
    )
    p.add_argument(
        "--stages",
        type=int,
        default=1,
        metavar="N",
        help="run the model as N chained stages in this process, each loaded only from its own "
        "selection (default 1)",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        help="ggml (the stage runtime, the default: one stage computes as a split does), numpy "
        "(its f32 reference, slow) or llama (llama.cpp, one whole-range stage, greedy only)",
    )
    p.add_argument(
        "--n-ctx",
        type=int,
        default=DEFAULT_N_CTX,
        metavar="N",
        help=f"context in tokens (prompt + completion; default {DEFAULT_N_CTX})",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads per stage, pinned (default: auto, this machine's cores, fewer while "
        "other processes keep cores busy, as serving does)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 is greedy (default 0; the llama engine is greedy only)",
    )
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep (1.0: off)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    p.add_argument("--config", type=Path, metavar="TOML", help="node config ([speculative] ...)")
    p.add_argument(
        "--speculative-strategy",
        metavar="S",
        help="auto, mtp, disabled, or a strategy id the package declares (overrides --config)",
    )
    p.add_argument(
        "--speculative-verify",
        choices=("exact", "batched"),
        default="exact",
        help="how the stage runtime verifies a draft: exact (one-position steps, the tokens of "
        "plain decoding bit for bit; default) or batched (one multi-row graph per stage: less "
        "compute, but a near-tie may flip a token; docs/generation.md)",
    )
    add_json_flag(p)
    p.set_defaults(handler=cmd_run)


def speculative_plan(
    manifest: PackageManifest,
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
    from skippy.package.v2_view import ManifestV2

    package = parse_generation(
        manifest.speculative_block() if isinstance(manifest, ManifestV2) else manifest.generation,
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


def stage_layer_tensor_names(
    resolved: Sequence[ResolvedStage],
) -> Callable[[int], Collection[str]]:
    """Tensor names of a selected layer's (verified, local) artifact, read on demand: only the
    layers a check asks about are opened. A layer outside the selections holds nothing here."""
    from skippy.constants import ROLE_LAYER
    from skippy.gguf.reader import open_gguf

    files: dict[int, list[Path]] = {}  # a v2 layer may span several -partNN files
    for stage in (rs.stage for rs in resolved):
        for r, path in zip(stage.selection.parts, stage.part_paths, strict=True):
            if r.role == ROLE_LAYER and r.layer_index is not None:
                files.setdefault(r.layer_index, []).append(path)

    def names(index: int) -> Collection[str]:
        out: list[str] = []
        for path in files.get(index, []):
            with open_gguf(path) as g:
                out += [t.name for t in g.tensors]
        return tuple(out)

    return names


def _operator_configured(node: NodeConfig, args: argparse.Namespace) -> bool:
    """Whether the operator set anything about speculation (CLI or config file)."""
    from skippy.generation import SpeculativeSettings

    spec = node.speculative
    return bool(
        args.speculative_strategy or spec.models or spec.global_settings != SpeculativeSettings()
    )


def _sampling(args: argparse.Namespace) -> SamplingParams:
    from skippy.runtime.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )


def _check_args(args: argparse.Namespace, engine: str, sampling: SamplingParams) -> None:
    """Everything about the command line that can be refused before any I/O."""
    from skippy.runtime.boundary import StageUnsupported
    from skippy.runtime.prompt_guard import prompt_bytes

    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1", code="invalid_max_tokens")
    if args.stages < 1:
        raise UsageError("--stages must be at least 1", code="invalid_stage_count")
    if args.threads is not None and args.threads < 1:
        raise UsageError(
            f"--threads must be at least 1 (got {args.threads}); leave it out for auto",
            code="invalid_threads",
        )
    if not args.prompt:
        raise UsageError("the prompt is empty", code="empty_prompt")
    prompt_bytes(args.prompt)  # invalid Unicode (undecodable bytes) or too large
    if engine == "llama" and args.stages > 1:
        raise StageUnsupported(
            "llama.cpp runs only whole-range stages; --stages N needs the stage runtime",
            code="stages_unsupported",
            remediation="use --engine ggml (or numpy) with --stages",
        )
    if engine == "llama" and not sampling.greedy:
        raise StageUnsupported(
            "the llama engine of run decodes greedily; sampling options need the stage runtime",
            code="sampling_unsupported",
            remediation="use --engine ggml (or numpy) to sample",
        )


def _whole_range(layers: LayerRange, engine: str) -> None:
    from skippy.runtime.boundary import StageUnsupported
    from skippy.runtime.llama_cpp import require_full_range

    if engine == "llama":
        require_full_range(layers)
    elif not layers.is_full:
        raise StageUnsupported(
            f"run needs every layer to produce text; {layers} of {layers.layer_count} is a "
            "partial range",
            code="partial_range_unsupported",
            expected=f"0..{layers.layer_count}",
            actual=str(layers),
            remediation="split the model with --stages N instead",
        )


def cmd_run(args: argparse.Namespace) -> CommandResult:
    from skippy.consume.resolve import open_ref, resolve_stage
    from skippy.package.plan import even_ranges, tail_layers
    from skippy.runtime.boundary import StageLoad

    engine = args.engine or "ggml"
    sampling = _sampling(args)
    _check_args(args, engine, sampling)
    env = read_environment()
    node = load_node_config(args.config)
    runner = _Runner(engine, n_ctx=args.n_ctx, threads=args.threads)  # refuses a missing runtime
    with runner:
        # Refuse what cannot run before fetching or hashing anything: a bad config or strategy
        # (checked against the manifest alone), a partial range, a bad stage count.
        head = open_ref(args.ref, env)
        speculative_plan(head.manifest, node, args)
        n_layers = head.manifest.layer_count
        if args.layers is not None:
            _whole_range(parse_layer_range(args.layers, n_layers), engine)
        tail = tail_layers(n_layers, head.manifest.generation)
        ranges = even_ranges(n_layers, args.stages, tail)
        # Every stage comes from the commit just read: a moving hf:// ref is resolved once.
        # Text-only: no runtime here loads a projector, so none is fetched or hashed.
        pinned = head.origin if head.from_hub else args.ref
        resolved = [resolve_stage(pinned, env, layers_text=str(r), text_only=True) for r in ranges]
        prepared = resolved[0].stage
        verify = all(r.stage.verification is not None for r in resolved)
        # The final plan: native-MTP layer indices must hold NextN tensors in the verified
        # layer files (spec "Speculative Decoding"); together the stages hold every layer.
        plan = speculative_plan(
            prepared.package.manifest,
            node,
            args,
            layer_tensor_names=stage_layer_tensor_names(resolved),
        )
        loads = [
            StageLoad.from_selection(
                r.stage.selection,
                r.files(),
                manifest_sha256=r.stage.package.manifest_sha256,
                sha256_verified=r.stage.verification is not None,
                speculative=plan,
            )
            for r in resolved
        ]
        runner.load(loads, package_ref=prepared.package.display)
        prompt_ids = runner.tokenize(args.prompt)
        gen = runner.generate(
            prompt_ids,
            max_tokens=args.max_tokens,
            sampling=sampling,
            plan=plan,
            exact=args.speculative_verify == "exact",
        )
        spec_stats = runner.speculative_stats
        spec_fallback = runner.speculative_fallback
        stages = runner.describe()
        load_s = runner.load_s
    parts = sum(len(load.part_paths) for load in loads)
    data: dict[str, Any] = {
        "package": prepared.package.display,
        "model_id": loads[0].model_id,
        "manifest_sha256": loads[0].manifest_sha256,
        "layers": f"0..{n_layers}",
        "engine": engine,
        "stages": stages,
        "n_ctx": args.n_ctx,
        "threads": runner.threads,
        "adaptive_threads": runner.adaptive_threads,
        "sampling": sampling.to_dict(),
        "sha256_verified": verify,
        "parts": parts,
        "load_s": load_s,
        "prompt": args.prompt,
        # the resolved plan, plus what speculation did when this runtime executed it
        "speculative": plan.to_dict()
        | (spec_stats.to_dict() if spec_stats else {})
        | ({"fallback_reason": spec_fallback} if spec_fallback else {}),
        **gen.to_dict(),
    }
    rate = gen.decode_tokens_per_s or gen.tokens_per_s
    split = ", ".join(f"{s['layer_start']}..{s['layer_end']}" for s in stages)
    where = f"engine {engine}, {len(stages)} stage{'s' if len(stages) > 1 else ''} ({split})"
    checked = "verified" if verify else "NOT verified"
    stats = (
        f"[{len(gen.tokens)} tokens, stop: {gen.stop_reason}, {rate:.1f} tok/s, {where}, "
        f"load {load_s or 0:.2f}s, {parts} parts, sha256 {checked}]"
        if rate
        else f"[{len(gen.tokens)} tokens, stop: {gen.stop_reason}, {where}]"
    )
    if spec_stats is not None:
        stats += f"\n[{spec_stats.summary()}]"
    # Notes matter when an operator set something (a deprecated name, a bound that does not
    # apply, a model entry that matches nothing); the plain "no speculation default" of an
    # ordinary package with no speculative settings stays in the JSON plan only.
    warnings = list(plan.notes) if _operator_configured(node, args) else []
    if not verify:
        warnings.append(
            f"SHA-256 of the selected parts was not verified ({ENV_VERIFY_PACKAGE_SHA} is off)"
        )
    return CommandResult(data=data, text=f"{args.prompt}{gen.text}\n{stats}", warnings=warnings)


class _Runner:
    """One engine behind one interface for ``run``: llama.cpp on a whole range, or a chain of
    stage-runtime stages. Constructing it imports the engine's library (a missing one is
    refused before anything is fetched)."""

    def __init__(self, engine: str, *, n_ctx: int, threads: int | None) -> None:
        from skippy.runtime.contention import machine_cores, stage_threads

        self.engine = engine
        # The stages of one process's chain run one after another: each may use every core.
        self.threads = stage_threads(threads, machine_cores(), 1)
        self.adaptive_threads = False  # llama.cpp's threads are fixed
        self.load_s: float | None = None
        self.speculative_stats: SpeculativeStats | None = None  # after a speculative generate
        # why a native-mtp plan decoded plainly (the final stage runs no NextN head)
        self.speculative_fallback: str | None = None
        self._llama: LlamaStageRuntime | None = None
        self._chain: StageChain | None = None
        if engine == "llama":
            from skippy.runtime.llama_cpp import LlamaRuntimeConfig, LlamaStageRuntime

            self._llama = LlamaStageRuntime(LlamaRuntimeConfig(n_ctx=n_ctx, n_threads=self.threads))
        else:
            from skippy.runtime.llama_cpp import import_llama
            from skippy.runtime.stage import StageConfig

            # "auto" gives threads back while other processes keep cores busy, as serving does;
            # a pinned count is taken as asked.
            self._config = StageConfig(
                n_ctx=n_ctx, n_threads=self.threads, adaptive_threads=threads is None
            )
            self.adaptive_threads = self._config.adaptive_threads
            import_llama()  # the tokenizer is llama.cpp's
            if engine == "ggml":
                from skippy.gguf import ggml

                ggml.load()  # version check and self-test

    def load(self, loads: Sequence[StageLoad], *, package_ref: str) -> None:
        import time

        t0 = time.perf_counter()
        if self._llama is not None:
            self._llama.load(loads[0])
            self.load_s = self._llama.load_s
            return
        from skippy.runtime.chain import StageChain, open_stage
        from skippy.runtime.tokenizer import LlamaTokenizer

        stages: list[Stage] = []
        try:
            for i, load in enumerate(loads):
                stages.append(
                    open_stage(
                        self.engine,
                        load,
                        self._config,
                        package_ref=package_ref,
                        stage_index=i,
                        stage_count=len(loads),
                    )
                )
            tokenizer = LlamaTokenizer(loads[0].part_paths[0])
        except BaseException:
            for s in stages:
                s.close()
            raise
        self._chain = StageChain(stages, tokenizer)
        self.load_s = time.perf_counter() - t0

    def tokenize(self, text: str) -> list[int]:
        if self._llama is not None:
            return self._llama.tokenize(text)
        return self._loaded_chain().tokenize(text)

    def generate(
        self,
        tokens: Sequence[int],
        *,
        max_tokens: int,
        sampling: SamplingParams,
        plan: SpeculativePlan | None = None,
        exact: bool = True,
    ) -> Generation:
        """Plain decoding, or speculative decoding when the stage runtime executes ``plan``
        (the llama engine and other plan modes log their fallback when loaded)."""
        if self._llama is not None:
            return self._llama.generate(tokens, max_tokens=max_tokens)
        from skippy.runtime.nextn import native_mtp_unavailable
        from skippy.runtime.speculation import NATIVE_MTP
        from skippy.runtime.token_loop import generate

        chain = self._loaded_chain()
        if plan is not None and plan.mode == NATIVE_MTP:
            self.speculative_fallback = native_mtp_unavailable(chain.stages[-1])
            if self.speculative_fallback is not None:  # plain decoding: the same tokens
                log.warning(
                    "speculative decoding fallback %s",
                    json.dumps(
                        {
                            "requested": plan.requested,
                            "mode": plan.mode,
                            "selected": "disabled",
                            "code": "native_mtp_unavailable",
                            "fallback_reason": self.speculative_fallback,
                        },
                        sort_keys=True,
                    ),
                )
        gen, self.speculative_stats = generate(
            chain,
            tokens,
            max_tokens=max_tokens,
            plan=plan,
            sampling=sampling,
            exact=exact,
        )
        return gen

    def describe(self) -> list[dict[str, Any]]:
        if self._llama is not None:
            stage = self._llama.stage
            layers = stage.layers if stage is not None else None
            return [
                {
                    "stage_index": 0,
                    "stage_count": 1,
                    "layer_start": layers.start if layers else None,
                    "layer_end": layers.stop if layers else None,
                    "engine": "llama",
                    "runtime_version": "llama.cpp (llama-cpp-python)",
                    "n_ctx": self._llama.config.n_ctx,
                }
            ]
        return [s.descriptor.to_dict() for s in self._loaded_chain().stages]

    def _loaded_chain(self) -> StageChain:
        from skippy.runtime.boundary import StageNotLoaded

        if self._chain is None:
            raise StageNotLoaded("no stage is loaded")
        return self._chain

    def __enter__(self) -> _Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._llama is not None:
            self._llama.close()
        if self._chain is not None:
            self._chain.close()
