"""The ``llama`` stage engine: a whole model in llama.cpp, behind the stage API, on one node.

It serves the families the stage runtime (``skippy.runtime.model``) does not cover, and any
model when ``[serving] engine = "llama"`` is chosen: llama.cpp runs every family it has a
builder for. It implements ``skippy.runtime.stage.Stage`` for a full layer range only
(``llama_cpp.require_full_range``): token ids in, logits and the sampled token out; no
activations cross it, so such a model is never split (``skippy.serving.engine_choice``
refuses split placement before any planning).

Each session is one llama.cpp sequence of one context (``n_seq_max`` = the session cap, each
sequence ``n_ctx`` positions), so concurrent requests share the weights and the context, and a
decode batch is one ``llama_decode`` over several sequences. Truncating and freeing a session
remove its positions from llama.cpp's memory (``llama_memory_seq_rm``). The model is opened
the way ``skippy.runtime.llama_cpp`` opens it (``model_file``: the package's own parts,
nothing copied).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from skippy.errors import ArtifactMissing, SkippyError
from skippy.runtime.admission import ACTIVATION_DTYPE, AdmissionDescriptor
from skippy.runtime.boundary import StageLoad, StageNotLoaded
from skippy.runtime.llama_cpp import import_llama, load_failed, model_file, require_full_range
from skippy.runtime.sampling import Sampler
from skippy.runtime.stage import (
    DecodeStep,
    StageBase,
    StageConfig,
    StageOutput,
    check_token_ids,
    context_full,
    stage_usage,
)

ENGINE: Final = "llama"


class LlamaDecodeFailed(SkippyError, RuntimeError):
    """``llama_decode`` refused a batch (no memory slot, or an internal error)."""

    code = "llama_decode_failed"


@dataclass
class _Sequence:
    seq_id: int
    length: int = 0


class LlamaStage:
    """A whole model in llama.cpp as one ``Stage`` (see the module docstring)."""

    def __init__(
        self,
        load: StageLoad,
        config: StageConfig | None = None,
        *,
        package_ref: str = "",
        stage_index: int = 0,
        stage_count: int = 1,
    ) -> None:
        require_full_range(load.layers)
        for path in load.part_paths:
            if not path.is_file():
                raise ArtifactMissing(f"stage part {path} is not a file", path=str(path))
        self.config = config = config or StageConfig()
        self.layers = load.layers
        lib = self._lib = import_llama()
        self._model: Any = None
        self._ctx: Any = None
        self._batch: Any = None
        with model_file(load) as path:
            self._model = lib.llama_model_load_from_file(
                str(path).encode(), lib.llama_model_default_params()
            )
        if not self._model:
            raise load_failed(load, "llama.cpp returned no model (rerun with -v for its log)")
        try:
            n_train = int(lib.llama_model_n_ctx_train(self._model))
            if config.n_ctx > n_train:
                raise stage_usage(
                    f"n_ctx {config.n_ctx} is more than the model's context length {n_train}",
                    "invalid_runtime_config",
                    remediation=f"set [serving] n_ctx = {n_train} or less",
                )
            self._n_batch = max(config.n_batch, config.max_sessions)
            params = lib.llama_context_default_params()
            params.n_ctx = config.n_ctx * config.max_sessions
            params.n_batch = params.n_ubatch = self._n_batch
            params.n_seq_max = config.max_sessions
            params.n_threads = params.n_threads_batch = config.n_threads
            # As skippy.runtime.llama_cpp's Llama (llama-cpp-python's default): the same
            # attention kernels, so `run --engine llama` and serving give the same tokens.
            params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
            self._ctx = lib.llama_init_from_model(self._model, params)
            if not self._ctx:
                raise load_failed(load, "llama.cpp could not create a context")
            self._memory = lib.llama_get_memory(self._ctx)
            self._batch = lib.llama_batch_init(self._n_batch, 0, 1)
            self.vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model)))
            width = int(lib.llama_model_n_embd(self._model))
        except BaseException:
            self.close()
            raise
        self._sessions: dict[str, _Sequence] = {}
        self._free_ids = list(range(config.max_sessions - 1, -1, -1))
        self.descriptor = AdmissionDescriptor(
            package_ref=package_ref,
            model_id=load.model_id,
            manifest_sha256=load.manifest_sha256,
            stage_index=stage_index,
            stage_count=stage_count,
            layers=load.layers,
            width=width,
            vocab=self.vocab,
            activation_dtype=ACTIVATION_DTYPE,
            engine=ENGINE,
            runtime_version=f"llama.cpp/llama-cpp-python {getattr(lib, '__version__', '?')}",
            n_ctx=config.n_ctx,
        )

    # --- sessions ----------------------------------------------------------------------------
    def _check(self, inputs: npt.NDArray[Any]) -> npt.NDArray[Any]:
        if self._ctx is None:
            raise StageNotLoaded("the stage is closed")
        return check_token_ids(np.asarray(inputs), self.vocab, self.layers)

    def _sequence(self, session: str, start: int, n: int) -> _Sequence:
        """The session's sequence, input at ``start..start+n`` checked (as ``StageBase``)."""
        StageBase._check_session_id(session)
        s = self._sessions.get(session)
        length = s.length if s is not None else 0
        if start != length:
            raise stage_usage(
                f"session {session!r} holds {length} positions; input must start there, "
                f"not at {start}",
                "position_mismatch",
                expected=length,
                actual=start,
            )
        if start + n > self.config.n_ctx:
            raise context_full(session, start + n, self.config.n_ctx)
        if s is None:
            if not self._free_ids:
                raise stage_usage(
                    f"the stage already holds {len(self._sessions)} sessions (the cap)",
                    "too_many_sessions",
                    remediation="free a session first",
                )
            s = self._sessions[session] = _Sequence(self._free_ids.pop())
        return s

    # --- running -----------------------------------------------------------------------------
    def _decode(self, rows: Sequence[tuple[int, int, int, bool]]) -> list[npt.NDArray[np.float32]]:
        """One ``llama_decode`` of ``(seq_id, position, token, wants_logits)`` rows; the
        logits of the rows that want them, in order."""
        lib, batch = self._lib, self._batch
        for i, (seq_id, position, token, wanted) in enumerate(rows):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = wanted
        batch.n_tokens = len(rows)
        rc = int(lib.llama_decode(self._ctx, batch))
        if rc != 0:
            raise LlamaDecodeFailed(f"llama_decode returned {rc} for {len(rows)} position(s)")
        out = []
        for i, row in enumerate(rows):
            if row[3]:
                ptr = lib.llama_get_logits_ith(self._ctx, i)
                out.append(np.ctypeslib.as_array(ptr, shape=(self.vocab,)).copy())
        return out

    def prefill(
        self,
        session: str,
        start: int,
        inputs: npt.NDArray[Any],
        *,
        all_logits: bool = False,
        sampler: Sampler | None = None,
    ) -> StageOutput:
        """``inputs`` in chunks of ``n_batch`` tokens (one ``llama_decode`` each)."""
        ids = self._check(inputs)
        n = int(ids.shape[0])
        s = self._sequence(session, start, n)
        logits: list[npt.NDArray[np.float32]] = []
        for lo in range(0, n, self._n_batch):
            chunk = ids[lo : lo + self._n_batch]
            rows = [
                (s.seq_id, start + lo + j, int(t), all_logits or lo + j == n - 1)
                for j, t in enumerate(chunk)
            ]
            logits += self._decode(rows)
            s.length = start + lo + len(chunk)
        return _output(np.stack(logits), sampler)

    def decode(
        self,
        session: str,
        position: int,
        inputs: npt.NDArray[Any],
        *,
        sampler: Sampler | None = None,
    ) -> StageOutput:
        return self.decode_batch([DecodeStep(session, position, inputs, sampler)])[0]

    def decode_batch(self, steps: Sequence[DecodeStep]) -> list[StageOutput]:
        """Several sessions' one-token steps in one ``llama_decode`` (every step checked
        before any runs)."""
        names = [s.session for s in steps]
        if len(set(names)) != len(names):
            raise stage_usage("a decode batch names a session twice", "bad_stage_input")
        ids = []
        for step in steps:
            x = self._check(step.inputs)
            if x.shape[0] != 1:
                raise stage_usage(f"decode takes one position, got {x.shape[0]}", "bad_stage_input")
            ids.append(int(x[0]))
        seqs = [self._sequence(s.session, s.position, 1) for s in steps]
        rows = self._decode(
            [(q.seq_id, s.position, t, True) for q, s, t in zip(seqs, steps, ids, strict=True)]
        )
        for q, s in zip(seqs, steps, strict=True):
            q.length = s.position + 1
        return [_output(r[None, :], s.sampler) for r, s in zip(rows, steps, strict=True)]

    def decode_steps(self, session: str, start: int, inputs: npt.NDArray[Any]) -> StageOutput:
        """Each of ``inputs`` as its own ``decode`` step; the logits stacked (a verify
        window)."""
        ids = self._check(inputs)
        self._sequence(session, start, int(ids.shape[0]))
        rows = []
        for i in range(int(ids.shape[0])):
            out = self.decode(session, start + i, ids[i : i + 1])
            assert out.logits is not None  # decode always returns logits here (typing)
            rows.append(out.logits)
        return StageOutput(logits=np.concatenate(rows))

    def session_length(self, session: str) -> int:
        s = self._sessions.get(session)
        return s.length if s is not None else 0

    def truncate(self, session: str, length: int) -> None:
        """Forget positions ``length..`` (a rejected draft's); the next input starts there."""
        StageBase._check_session_id(session)
        s = self._sessions.get(session)
        current = s.length if s is not None else 0
        if not 0 <= length <= current:
            raise stage_usage(
                f"cannot truncate session {session!r} of {current} positions to {length}",
                "invalid_truncate",
                expected=f"0..{current}",
                actual=length,
            )
        if s is None or length == current:
            return
        if not self._lib.llama_memory_seq_rm(self._memory, s.seq_id, length, -1):
            raise stage_usage(
                f"llama.cpp cannot forget positions {length}.. of session {session!r} (this "
                "model's memory keeps no positions it could go back to)",
                "truncate_unsupported",
            )
        s.length = length

    def free(self, session: str) -> None:
        """Release a session's positions; freeing an unknown session is a no-op."""
        s = self._sessions.pop(session, None)
        if s is not None:
            self._lib.llama_memory_seq_rm(self._memory, s.seq_id, -1, -1)
            self._free_ids.append(s.seq_id)

    def close(self) -> None:
        lib = self._lib
        batch, self._batch = self._batch, None
        ctx, self._ctx = self._ctx, None
        model, self._model = self._model, None
        if batch is not None:
            lib.llama_batch_free(batch)
        if ctx is not None:
            lib.llama_free(ctx)
        if model is not None:
            lib.llama_model_free(model)
        self._sessions = {}


def _output(logits: npt.NDArray[np.float32], sampler: Sampler | None) -> StageOutput:
    token = sampler.sample(logits[-1]) if sampler is not None else None
    return StageOutput(logits=logits, token=token)
