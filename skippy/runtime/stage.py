"""The stage API: one partial (or whole) layer range, driven per session.

What a later mesh link carries between stages is exactly what crosses this API: a stage
takes, for one session, a start position and either token ids (stage 0) or f32 activations
``[tokens x width]`` (every other stage), and returns activations (non-final stages) or logits
and, with a sampler, the chosen token (the final stage). Sessions hold the KV cache of the
stage's own layers, bounded by ``StageConfig.n_ctx``; they can be truncated (a later issue
replays committed tokens after a failover) and freed. ``AdmissionDescriptor``
(``skippy.runtime.admission``) says what a stage is, so a peer can check two stages fit
together before sending anything.

``StageBase`` holds everything engine-independent (input checks, session bookkeeping,
chunked prefill, sampling); the ggml engine (``skippy.runtime.ggml_engine``) and the numpy
reference (``skippy.runtime.numpy_engine``) implement ``_new_session``, ``_forward`` and
``_release``. Every input is checked here before an engine sees it.
"""

from __future__ import annotations

import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Generic, Literal, Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt

from skippy.config import PlacementRule
from skippy.errors import UsageError
from skippy.package.ranges import LayerRange
from skippy.runtime.admission import ACTIVATION_DTYPE, AdmissionDescriptor
from skippy.runtime.boundary import StageLoad, StageNotLoaded, log_speculation_fallback
from skippy.runtime.sampling import Sampler
from skippy.runtime.speculation import EXECUTABLE_MODES
from skippy.runtime.weights import StageWeights

log = logging.getLogger(__name__)

STAGE_API_VERSION: Final = 1
Engine = Literal["ggml", "numpy"]
MAX_SESSION_ID_CHARS: Final = 128
_SESSION_ID_RE = re.compile(r"\A[\x21-\x7e]{1,128}\Z")  # printable ASCII, no spaces


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    """How a stage runs: context per session, CPU threads, prefill chunk, session cap."""

    n_ctx: int = 512
    n_threads: int = 2
    n_batch: int = 512  # tokens per prefill chunk (one graph)
    max_sessions: int = 8
    # n_threads is a cap, lowered while other processes keep cores busy (ggml engine;
    # skippy.runtime.contention)
    adaptive_threads: bool = False
    # Copy the weights llama.cpp would repack (Q4_0, Q4_K, ...) into the CPU backend's
    # interleaved layout (ggml engine): faster matmuls and logits bit-identical to llama.cpp's
    # default, but those weights leave the zero-copy mapping (docs/performance.md). Off: the
    # same bits as llama.cpp with repacking off.
    repack: bool = False
    # Where the stage runs (ggml engine; skippy.runtime.devices): "auto" (the best device
    # whose free memory fits the stage, else the CPU), "CPU", or a device's ggml name
    # (`mesh-node devices`). On a device the weights are copied into its memory and repack
    # does not apply.
    device: str = "auto"
    # Per-weight placement rules, first match wins (llama.cpp's --override-tensor exps=CPU)
    placement: tuple[PlacementRule, ...] = ()
    # Keep the routed experts of a MoE in system memory (llama.cpp's --cpu-moe)
    cpu_moe: bool = False
    # A device that lacks the memory: run on the CPU (logged, and shown as the stage's
    # device_fallback) instead of refusing to load
    device_fallback: bool = False

    def __post_init__(self) -> None:
        for name in ("repack", "cpu_moe", "device_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(
                    f"{name} must be true or false, got {getattr(self, name)!r}",
                    code="invalid_runtime_config",
                )
        if not isinstance(self.device, str) or not self.device.strip():
            raise UsageError(
                f'device must be "auto", "CPU" or a device name, got {self.device!r}',
                code="invalid_runtime_config",
            )
        for name, hi in (
            ("n_ctx", 1 << 20),
            ("n_threads", 512),
            ("n_batch", 1 << 16),
            ("max_sessions", 1 << 12),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
                raise UsageError(
                    f"{name} must be an integer in 1..{hi}, got {value!r}",
                    code="invalid_runtime_config",
                )


@dataclass(frozen=True)
class StageOutput:
    """``activations`` ``[tokens x width]`` f32 from a non-final stage; ``logits``
    ``[rows x vocab]`` f32 from the final stage (the last position, or every position with
    ``all_logits``), and ``token`` when a sampler chose one. A plain greedy ``decode`` (no
    bias, penalties or typical-p) may return the token alone (logits None: the engine took the
    argmax); decode without a sampler for logits."""

    activations: npt.NDArray[np.float32] | None = None
    logits: npt.NDArray[np.float32] | None = None
    token: int | None = None


@dataclass(frozen=True)
class DecodeStep:
    """One session's one-position decode step inside ``decode_batch``: as the arguments of
    ``decode`` (``inputs``: one token id, or one activation row)."""

    session: str
    position: int
    inputs: npt.NDArray[Any]
    sampler: Sampler | None = None


@runtime_checkable
class Stage(Protocol):
    """What a pipeline (in one process, or across a mesh link) calls on a stage."""

    descriptor: AdmissionDescriptor

    def prefill(
        self,
        session: str,
        start: int,
        inputs: npt.NDArray[Any],
        *,
        all_logits: bool = False,
        sampler: Sampler | None = None,
    ) -> StageOutput: ...

    def decode(
        self,
        session: str,
        position: int,
        inputs: npt.NDArray[Any],
        *,
        sampler: Sampler | None = None,
    ) -> StageOutput: ...

    def decode_steps(self, session: str, start: int, inputs: npt.NDArray[Any]) -> StageOutput: ...

    def decode_batch(self, steps: Sequence[DecodeStep]) -> list[StageOutput]: ...

    def session_length(self, session: str) -> int: ...

    def truncate(self, session: str, length: int) -> None: ...

    def free(self, session: str) -> None: ...

    def close(self) -> None: ...


# --- the shared implementation -------------------------------------------------------------------
S = TypeVar("S")  # an engine's per-session state (its KV cache)


@dataclass
class _Session(Generic[S]):
    state: S
    length: int = 0


def stage_usage(message: str, code: str, **kw: Any) -> UsageError:
    return UsageError(message, code=code, **kw)


def context_full(session: str, reach: int, n_ctx: int) -> UsageError:
    """The refusal of input that would take ``session`` to ``reach`` positions, past the
    context's ``n_ctx``."""
    return stage_usage(
        f"session {session!r} would reach {reach} positions; the context holds {n_ctx}",
        "context_full",
        expected=n_ctx,
        actual=reach,
        remediation="raise the context with --n-ctx, or free the session",
    )


def check_token_ids(arr: npt.NDArray[Any], vocab: int, layers: LayerRange) -> npt.NDArray[Any]:
    """A stage 0's input: a non-empty 1-D array of ids inside the vocabulary, as int32."""
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise stage_usage(
            f"stage {layers} takes a 1-D array of token ids, got {arr.dtype} {arr.shape}",
            "bad_stage_input",
        )
    if arr.size == 0:
        raise stage_usage("no tokens to process", "empty_prompt")
    bad = (arr < 0) | (arr >= vocab)
    if bad.any():
        raise stage_usage(
            f"token id {int(arr[bad][0])} is outside the vocabulary 0..{vocab - 1}",
            "token_out_of_range",
            actual=int(arr[bad][0]),
        )
    return np.ascontiguousarray(arr, dtype=np.int32)


class StageBase(ABC, Generic[S]):
    """Input checks, sessions and chunking shared by the engines."""

    engine: Engine
    runtime_version: str

    def __init__(
        self,
        stage: StageLoad,
        config: StageConfig | None = None,
        *,
        package_ref: str = "",
        stage_index: int = 0,
        stage_count: int = 1,
    ) -> None:
        """Open and check the stage's parts, then let the engine set up (``_setup``); a
        failure anywhere releases what was taken."""
        config = config or StageConfig()
        self.config = config
        self._prepare()
        self.weights: StageWeights | None = StageWeights.open(stage)
        spec = self.weights.spec
        if config.n_ctx > spec.context_length:
            self.weights.close()
            raise stage_usage(
                f"n_ctx {config.n_ctx} is more than the model's context length "
                f"{spec.context_length}",
                "invalid_runtime_config",
                remediation=f"use --n-ctx {spec.context_length} or less",
            )
        self.spec = spec
        self.layers = stage.layers
        log_speculation_fallback(
            stage, log, f"the {self.engine} stage runtime", executable=EXECUTABLE_MODES
        )
        self.vocab = self.weights.vocab
        self._sessions: dict[str, _Session[S]] = {}
        self.descriptor = AdmissionDescriptor(
            package_ref=package_ref,
            model_id=stage.model_id,
            manifest_sha256=stage.manifest_sha256,
            stage_index=stage_index,
            stage_count=stage_count,
            layers=stage.layers,
            width=spec.width,
            vocab=self.vocab,
            activation_dtype=ACTIVATION_DTYPE,
            engine=self.engine,
            runtime_version=self.runtime_version,
            n_ctx=config.n_ctx,
        )
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    # --- engine hooks ------------------------------------------------------------------------
    def _prepare(self) -> None:
        """Before any file is opened (e.g. load and check the engine's library)."""

    @abstractmethod
    def _setup(self) -> None:
        """After the weights are checked and mapped: the engine's own state."""

    @abstractmethod
    def _new_session(self) -> S: ...

    @abstractmethod
    def _forward(
        self,
        state: S,
        start: int,
        inputs: npt.NDArray[Any],
        out_rows: int,
        *,
        rows: int | None = None,
    ) -> npt.NDArray[np.float32]:
        """Run ``inputs`` (checked: int32 ids or f32 activations) at positions
        ``start..start+n``, writing the session's KV cache, as a graph of ``rows`` rows
        (``_chunk_rows``; None: n): the first ``rows - n`` are copies of the first input
        that write no KV. Returns activations ``[n x width]`` for a non-final stage, or
        logits of the last ``out_rows`` computed rows (``0 <= out_rows <= rows``; with 0 the
        final stage only writes its KV cache)."""

    def _chunk_rows(self, n: int, end: int) -> int:
        """The rows ``_forward`` computes for a prefill chunk of ``n`` rows of a call that
        ends at position ``end`` (an engine whose results depend on the row count pads)."""
        return n

    def _decode_one(
        self, state: S, position: int, inputs: npt.NDArray[Any], *, greedy: bool
    ) -> tuple[npt.NDArray[np.float32] | None, int | None]:
        """One position (decode): ``(output, None)``, or ``(None, token)`` when ``greedy``
        and the engine took the argmax itself (the first maximum, as ``Sampler``). The
        default runs ``_forward`` and leaves sampling to the caller."""
        return self._forward(state, position, inputs, 1), None

    def _decode_many(
        self,
        states: list[S],
        positions: list[int],
        inputs: list[npt.NDArray[Any]],
        greedy: list[bool],
    ) -> list[tuple[npt.NDArray[np.float32] | None, int | None]]:
        """Several sessions' one-position steps (distinct sessions, checked): what
        ``_decode_one`` returns for each, in order. The default runs them one by one; an
        engine may run them in one graph if each result equals its ``_decode_one``."""
        return [
            self._decode_one(s, p, x, greedy=g)
            for s, p, x, g in zip(states, positions, inputs, greedy, strict=True)
        ]

    @abstractmethod
    def _release(self, state: S) -> None: ...

    @abstractmethod
    def _close_engine(self) -> None: ...

    # --- checks ----------------------------------------------------------------------------------
    def _loaded(self) -> StageWeights:
        if self.weights is None:
            raise StageNotLoaded("the stage is closed")
        return self.weights

    def check_inputs(self, inputs: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Token ids (stage 0) or f32 activations (other stages), as the engine wants them."""
        arr = np.asarray(inputs)
        if self.layers.owns_input:
            return check_token_ids(arr, self.vocab or 0, self.layers)
        width = self.spec.width
        if arr.dtype != np.float32 or arr.ndim != 2 or arr.shape[1] != width:
            raise stage_usage(
                f"stage {self.layers} takes f32 activations [tokens x {width}], got "
                f"{arr.dtype} {arr.shape}",
                "bad_stage_input",
            )
        if arr.shape[0] == 0:
            raise stage_usage("no activations to process", "empty_prompt")
        if not np.isfinite(arr).all():
            raise stage_usage("activations hold NaN or infinity", "non_finite_activations")
        return np.ascontiguousarray(arr)

    @staticmethod
    def _check_session_id(session: str) -> None:
        if not isinstance(session, str) or not _SESSION_ID_RE.match(session):
            raise stage_usage(
                f"session id {session!r} must be 1..{MAX_SESSION_ID_CHARS} printable ASCII "
                "characters without spaces",
                "invalid_session_id",
            )

    def _session_for(self, session: str, start: int, n: int) -> _Session[S]:
        self._check_session_id(session)
        s = self._sessions.get(session)
        length = s.length if s is not None else 0
        if start != length:
            raise stage_usage(
                f"session {session!r} holds {length} positions; input must start there, "
                f"not at {start}",
                "position_mismatch",
                expected=length,
                actual=start,
                remediation="truncate the session first to rewrite positions",
            )
        if start + n > self.config.n_ctx:
            raise context_full(session, start + n, self.config.n_ctx)
        if s is None:
            if len(self._sessions) >= self.config.max_sessions:
                raise stage_usage(
                    f"the stage already holds {len(self._sessions)} sessions (the cap)",
                    "too_many_sessions",
                    remediation="free a session first",
                )
            s = _Session(self._new_session())
            self._sessions[session] = s
        return s

    # --- the API -----------------------------------------------------------------------------
    def prefill(
        self,
        session: str,
        start: int,
        inputs: npt.NDArray[Any],
        *,
        all_logits: bool = False,
        sampler: Sampler | None = None,
    ) -> StageOutput:
        """Process ``inputs`` in chunks of ``n_batch`` tokens (one graph each)."""
        self._loaded()
        x = self.check_inputs(inputs)
        n = int(x.shape[0])
        s = self._session_for(session, start, n)
        outs: list[npt.NDArray[np.float32]] = []
        step = self.config.n_batch
        for lo in range(0, n, step):
            chunk = x[lo : lo + step]
            last = lo + step >= n
            rows = self._chunk_rows(len(chunk), start + n)
            # logits rows wanted from this chunk (0: only its KV cache matters); with every
            # row's, the padding rows' too, as a chunk of that many real rows computes them
            out_rows = rows if all_logits else (1 if last else 0)
            out = self._forward(s.state, start + lo, chunk, out_rows, rows=rows)
            if all_logits and self.layers.owns_output:
                out = out[rows - len(chunk) :]
            s.length = start + lo + len(chunk)
            if not self.layers.owns_output or out_rows > 0:
                outs.append(out)
        result = np.concatenate(outs) if len(outs) > 1 else outs[0]
        return self._output(result, sampler)

    def decode(
        self,
        session: str,
        position: int,
        inputs: npt.NDArray[Any],
        *,
        sampler: Sampler | None = None,
    ) -> StageOutput:
        """One token (or one activation row) at ``position``."""
        self._loaded()
        x = self.check_inputs(inputs)
        if x.shape[0] != 1:
            raise stage_usage(f"decode takes one position, got {x.shape[0]}", "bad_stage_input")
        s = self._session_for(session, position, 1)
        greedy = sampler is not None and sampler.params.plain_greedy and self.layers.owns_output
        out, token = self._decode_one(s.state, position, x, greedy=greedy)
        s.length = position + 1
        if out is None:  # the engine chose the token: no logits crossed into Python
            return StageOutput(token=token)
        return self._output(out, sampler)

    def decode_batch(self, steps: Sequence[DecodeStep]) -> list[StageOutput]:
        """Several sessions' ``decode`` steps at once (continuous batching):
        the outputs, in order, equal each step's own ``decode`` bit for bit (the ggml engine
        runs them in one graph: one pass over the weights for the whole batch). Every step is
        checked before any runs; a refusal of one refuses the call (the caller may then run
        the steps alone to tell whose it was)."""
        self._loaded()
        if len(steps) == 1:  # alone: exactly decode
            one = steps[0]
            return [self.decode(one.session, one.position, one.inputs, sampler=one.sampler)]
        names = [s.session for s in steps]
        if len(set(names)) != len(names):
            raise stage_usage("a decode batch names a session twice", "bad_stage_input")
        xs = []
        for step in steps:
            x = self.check_inputs(step.inputs)
            if x.shape[0] != 1:
                raise stage_usage(f"decode takes one position, got {x.shape[0]}", "bad_stage_input")
            self._check_session_id(step.session)
            xs.append(x)
        sessions = [self._session_for(s.session, s.position, 1) for s in steps]
        greedy = [
            s.sampler is not None and s.sampler.params.plain_greedy and self.layers.owns_output
            for s in steps
        ]
        results = self._decode_many(
            [s.state for s in sessions], [s.position for s in steps], xs, greedy
        )
        outs = []
        for step, sess, (out, token) in zip(steps, sessions, results, strict=True):
            sess.length = step.position + 1
            alone = StageOutput(token=token) if out is None else self._output(out, step.sampler)
            outs.append(alone)
        return outs

    def decode_steps(self, session: str, start: int, inputs: npt.NDArray[Any]) -> StageOutput:
        """Each of ``inputs`` as its own one-position ``decode`` step, from ``start`` on, and
        every step's output stacked (activations, or logits ``[n x vocab]``). The graphs are
        exactly those of ``decode``, so the outputs equal n ``decode`` calls bit for bit: an
        exact verify window (``skippy.runtime.speculation``). A multi-row ``prefill`` is
        cheaper but not batch-invariant (different matmul shapes sum in another order)."""
        self._loaded()
        x = self.check_inputs(inputs)
        n = int(x.shape[0])
        self._session_for(session, start, n)  # the whole window fits, before any step runs
        outs: list[npt.NDArray[np.float32]] = []
        for i in range(n):  # through decode itself, so the steps follow whatever it runs
            step = self.decode(session, start + i, x[i : i + 1])
            row = step.logits if self.layers.owns_output else step.activations
            if row is None:
                raise stage_usage("a decode step returned no output", "stage_mismatch")
            outs.append(row)
        out = np.concatenate(outs)
        return (
            StageOutput(activations=out) if not self.layers.owns_output else StageOutput(logits=out)
        )

    def _output(self, out: npt.NDArray[np.float32], sampler: Sampler | None) -> StageOutput:
        if not self.layers.owns_output:
            return StageOutput(activations=out)
        token = sampler.sample(out[-1]) if sampler is not None else None
        return StageOutput(logits=out, token=token)

    def session_length(self, session: str) -> int:
        s = self._sessions.get(session)
        return s.length if s is not None else 0

    @property
    def sessions(self) -> tuple[str, ...]:
        return tuple(self._sessions)

    def truncate(self, session: str, length: int) -> None:
        """Forget positions ``length..``; the next input starts at ``length``."""
        self._check_session_id(session)
        s = self._sessions.get(session)
        current = s.length if s is not None else 0
        if not 0 <= length <= current:
            raise stage_usage(
                f"cannot truncate session {session!r} of {current} positions to {length}",
                "invalid_truncate",
                expected=f"0..{current}",
                actual=length,
            )
        if s is not None:
            s.length = length

    def free(self, session: str) -> None:
        """Release a session's KV cache; freeing an unknown session is a no-op."""
        s = self._sessions.pop(session, None)
        if s is not None:
            self._release(s.state)

    def close(self) -> None:
        for sid in list(self._sessions):
            self.free(sid)
        if self.weights is not None:
            self._close_engine()
            self.weights.close()
            self.weights = None

    def __enter__(self) -> StageBase[S]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
