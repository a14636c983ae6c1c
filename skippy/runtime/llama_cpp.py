"""The llama.cpp stage runtime (through llama-cpp-python) for a stage that owns every layer.

How the parts are loaded: every package fragment is one split of a llama.cpp split set
(``split.no`` in each, ``split.count``/``split.tensors.count`` in the metadata split), so a
full-range selection (metadata, embeddings, every layer, output) *is* a complete split set.
llama.cpp opens a split set through its file-naming scheme: open
``PREFIX-00001-of-0000N.gguf`` and it derives the names of the other N-1 parts. We create a
private temporary folder of symbolic links with exactly those names, each pointing at one
selected part in ``split.no`` order, open the first through the high-level
``llama_cpp.Llama(model_path=...)``, then delete the links. llama.cpp mmaps the files the
links resolve to, so the model bytes are the package's own files: nothing is copied and no
derived GGUF is written (spec "Layer Selection": runtimes SHOULD load selected parts
directly). Deleting the links right after the load is safe: the mappings keep the files
open, and no folder is left behind even if the process dies later.

Why links rather than ``llama_cpp.llama_model_load_from_splits(paths, n)``: that low-level
call takes explicit paths, but returns a bare ``llama_model*``; the high-level ``Llama``
object (tokenizer, batch, context, sampler, KV-cache bookkeeping) can only be built from a
``model_path``. Wrapping a raw model pointer would mean re-implementing or monkeypatching
those internals, which breaks with every llama-cpp-python release. The naming scheme is a
documented, stable llama.cpp contract (``llama_model_load_from_file``: "If the file is split
into multiple parts, the file name must follow this pattern: <name>-%05d-of-%05d.gguf"),
so the links give a complete, supported ``Llama`` object with no private API.

Only full ranges are accepted: the metadata split of a package declares the *whole*
package's ``split.count``, so a partial selection is not a split set llama.cpp accepts, and
a partial stage needs to exchange activations rather than tokens. A later runtime handles
partial stages; this one refuses them with ``partial_range_unsupported``.

``llama_cpp`` is imported lazily (inside ``LlamaStageRuntime``), so ``import skippy`` never
needs it; without it the runtime raises ``RuntimeUnavailable`` (``runtime_unavailable``,
exit 2). llama.cpp's own log lines are forwarded to the ``skippy.llama_cpp`` logger
(its warnings at INFO, shown with ``-v``; its errors at ERROR) instead of being printed on stderr.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from skippy.errors import ArtifactMissing, UsageError
from skippy.gguf.ggml import configure_openmp
from skippy.package.ranges import LayerRange
from skippy.runtime.boundary import (
    Generation,
    RuntimeLoadError,
    RuntimeUnavailable,
    StageLoad,
    StageNotLoaded,
    StageUnsupported,
    log_speculation_fallback,
)
from skippy.runtime.prompt_guard import Vocabulary, guarded_bytes
from skippy.runtime.token_loop import TokenLoop, check_generation_request

log = logging.getLogger(__name__)
_llama_log = logging.getLogger("skippy.llama_cpp")

SPLIT_LINK_PREFIX = "stage"


@dataclass(frozen=True, kw_only=True)
class LlamaRuntimeConfig:
    """Context and threading for one loaded stage."""

    n_ctx: int = 512
    n_threads: int = 2
    n_batch: int = 512
    link_parent: Path | None = None  # where the short-lived link folder goes (default: $TMPDIR)

    def __post_init__(self) -> None:
        for name in ("n_ctx", "n_threads", "n_batch"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be at least 1", code="invalid_runtime_config")


def split_part_name(index: int, count: int, prefix: str = SPLIT_LINK_PREFIX) -> str:
    """llama.cpp's split file name for 0-based ``index`` of ``count`` (``llama_split_path``)."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"


def link_split_set(part_paths: Sequence[Path], directory: Path) -> Path:
    """Create one symbolic link per part in ``directory``, named in split order; return the
    first link (the one to open). Only links are created: no model byte is copied."""
    n = len(part_paths)
    first: Path | None = None
    for i, part in enumerate(part_paths):
        link = directory / split_part_name(i, n)
        os.symlink(os.path.realpath(part), link)
        first = first or link
    if first is None:
        raise UsageError("a split set needs at least one part", code="invalid_stage_load")
    return first


def require_full_range(layers: LayerRange) -> None:
    if not layers.is_full:
        raise StageUnsupported(
            f"layers {layers} of {layers.layer_count} is a partial stage; the llama.cpp "
            "full-model runtime only runs a stage that owns every layer "
            f"(0..{layers.layer_count}). "
            "A later runtime handles partial stages by exchanging activations.",
            code="partial_range_unsupported",
            expected=f"0..{layers.layer_count}",
            actual=str(layers),
            remediation=f"run the whole model with --layers 0..{layers.layer_count}",
        )


@contextlib.contextmanager
def model_file(stage: StageLoad, link_parent: Path | None = None) -> Iterator[Path]:
    """The path llama.cpp opens for a whole-range stage, valid inside the block: the first
    link of a split set (package v1) or one composed file (package v2, ``v2_parts``), in a
    private folder removed afterwards (llama.cpp's mappings keep the files open)."""
    link_dir = Path(tempfile.mkdtemp(prefix=".skippy-split-", dir=link_parent))
    try:
        if stage.schema_version == 2:  # not a split set: one derived file (v2_parts)
            from skippy.runtime.v2_parts import compose_parts

            first = link_dir / "model.gguf"
            compose_parts(stage.part_paths, first)
        else:
            first = link_split_set(stage.part_paths, link_dir)
        yield first
    finally:
        for link in link_dir.iterdir():
            link.unlink()
        link_dir.rmdir()


def load_failed(stage: StageLoad, why: str) -> RuntimeLoadError:
    return RuntimeLoadError(
        f"llama.cpp could not load the {len(stage.part_paths)}-part split set of "
        f"{stage.model_id} layers {stage.layers}: {why}",
        remediation="run validate-package on the package; rerun with -v for "
        "llama.cpp's own log",
    )


# --- llama.cpp import and log forwarding ----------------------------------------------------------
# ggml_log_level: 1 DEBUG, 2 INFO, 3 WARN, 4 ERROR, 5 CONT (continues the previous line).
# llama.cpp warnings are about its own choices (e.g. "using full-size SWA cache"): shown with -v.
_GGML_LOG_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.INFO, 4: logging.ERROR}
_log_state = {"last": logging.DEBUG}
_log_callback: Any = None  # the ctypes callback must stay referenced while installed


def _forward_log(level: int, text: bytes, _user_data: Any) -> None:
    py_level = _log_state["last"] if level == 5 else _GGML_LOG_LEVELS.get(level, logging.DEBUG)
    _log_state["last"] = py_level
    message = text.decode("utf-8", "replace").rstrip()
    if message:
        _llama_log.log(py_level, "%s", message)


def import_llama() -> ModuleType:
    """``llama_cpp``, with llama.cpp's log forwarded to logging (once per process)."""
    global _log_callback
    configure_openmp()  # llama_cpp loads ggml, and with it libgomp
    try:
        import llama_cpp
        import llama_cpp.llama  # installs llama-cpp-python's own log callback; ours replaces it
    except ImportError as exc:
        raise RuntimeUnavailable(
            f"the llama.cpp runtime needs llama-cpp-python, which cannot be imported: {exc}",
            remediation="install it with `pip install 'skippy-mesh[llama]'` "
            "(it builds llama.cpp from source; ~8 minutes on 2 cores)",
        ) from exc
    if _log_callback is None:
        _log_callback = llama_cpp.llama_log_callback(_forward_log)
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
    return llama_cpp


# --- the runtime ----------------------------------------------------------------------------------
class LlamaStageRuntime:
    """``StageRuntime`` over llama-cpp-python for full-range stages (see the module doc)."""

    def __init__(self, config: LlamaRuntimeConfig | None = None) -> None:
        self.config = config or LlamaRuntimeConfig()
        self._lib = import_llama()
        self._llm: Any = None
        self._vocabulary: Vocabulary | None = None
        self.stage: StageLoad | None = None
        self.load_s: float | None = None

    def __enter__(self) -> LlamaStageRuntime:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def require_supported(self, layers: LayerRange) -> None:
        require_full_range(layers)

    def load(self, stage: StageLoad) -> None:
        self.require_supported(stage.layers)
        for path in stage.part_paths:
            if not path.is_file():
                raise ArtifactMissing(f"stage part {path} is not a file", path=str(path))
        if stage.projector_path is not None:
            log.warning(
                "projector %s is not loaded: this runtime is text-only", stage.projector_path
            )
        log_speculation_fallback(stage, log, "the llama-cpp-python runtime")
        self.close()
        t0 = time.perf_counter()
        with model_file(stage, self.config.link_parent) as first:
            try:
                self._llm = self._lib.llama.Llama(
                    model_path=str(first),
                    n_ctx=self.config.n_ctx,
                    n_batch=self.config.n_batch,
                    n_threads=self.config.n_threads,
                    n_threads_batch=self.config.n_threads,
                    use_mmap=True,
                    verbose=False,
                )
            except ValueError as exc:
                raise load_failed(stage, str(exc)) from exc
        self.load_s = time.perf_counter() - t0
        self.stage = stage
        log.info(
            "loaded %s layers %s from %d parts in %.2fs",
            stage.model_id,
            stage.layers,
            len(stage.part_paths),
            self.load_s,
        )

    def _loaded(self) -> Any:
        if self._llm is None:
            raise StageNotLoaded("no stage is loaded: call load() first")
        return self._llm

    @property
    def n_vocab(self) -> int:
        return int(self._loaded().n_vocab())

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """llama.cpp's ids, after the prompt guard (``skippy.runtime.prompt_guard``): a text
        the vocabulary cannot encode is a coded error, never a native abort."""
        llm = self._loaded()
        if self.stage is None:
            raise StageNotLoaded("no stage is loaded: call load() first")
        if self._vocabulary is None:  # read on first use: load_s stays llama.cpp's own load
            self._vocabulary = Vocabulary.read(self.stage.part_paths[0])
        data = guarded_bytes(
            self._vocabulary, self.stage.part_paths[0], text, max_tokens=self.config.n_ctx
        )
        return [int(t) for t in llm.tokenize(data, add_bos=add_special)]

    def detokenize(self, tokens: Sequence[int]) -> str:
        llm = self._loaded()
        ids = [int(t) for t in tokens]
        n_vocab = int(llm.n_vocab())
        bad = [t for t in ids if not 0 <= t < n_vocab]
        if bad:  # llama.cpp throws (and aborts the process) on an id outside its vocabulary
            raise UsageError(
                f"token id {bad[0]} is outside the vocabulary 0..{n_vocab - 1}",
                code="token_out_of_range",
                actual=bad[0],
            )
        raw: bytes = llm.detokenize(ids)
        return raw.decode("utf-8", "replace")

    def _check_prompt(self, tokens: Sequence[int], max_tokens: int = 1) -> list[int]:
        return check_generation_request(tokens, max_tokens, self.config.n_ctx)

    def logits_for_prompt(self, tokens: Sequence[int]) -> npt.NDArray[np.float32]:
        llm = self._loaded()
        ids = self._check_prompt(tokens)
        llm.reset()
        llm.eval(ids)
        row = self._lib.llama_get_logits_ith(llm.ctx, -1)
        out: npt.NDArray[np.float32] = np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy()
        return out

    def generate(self, tokens: Sequence[int], *, max_tokens: int) -> Generation:
        llm = self._loaded()
        ids = self._check_prompt(tokens, max_tokens)
        vocab = self._lib.llama_model_get_vocab(llm.model)
        # llama.cpp samples; the one generation loop decides what is committed and when to stop
        loop = TokenLoop(
            ids,
            max_tokens=max_tokens,
            n_ctx=self.config.n_ctx,
            is_eog=lambda token: bool(self._lib.llama_vocab_is_eog(vocab, token)),
        )
        llm.reset()  # a fresh state: no prefix reuse, so the result depends on the prompt only
        t0 = time.perf_counter()
        t_first: float | None = None
        for tok in llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
            if t_first is None:
                t_first = time.perf_counter()
            if loop.commit([int(tok)]) or loop.next_pass() is None:
                break
        t_end = time.perf_counter()
        t_first = t_end if t_first is None else t_first
        return Generation(
            prompt_tokens=tuple(ids),
            tokens=tuple(loop.tokens),
            text=self.detokenize(loop.tokens),
            stop_reason=loop.stop_reason or "length",
            prefill_s=t_first - t0,
            decode_s=t_end - t_first,
        )

    def close(self) -> None:
        llm, self._llm, self.stage, self._vocabulary = self._llm, None, None, None
        if llm is not None:
            llm.close()
