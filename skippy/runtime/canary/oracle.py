"""llama.cpp as the canary's oracle: every position's logits for a list of token ids.

Through llama-cpp-python's low-level API with the settings under which our ggml engine must
equal llama.cpp bit for bit: no CPU weight repacking (``use_extra_bufts = false``: repacked
Q4_0/Q4_K weights run other kernels), flash attention off (as llama-cpp-python's ``Llama``
sets it), logits requested for every position. A fresh context per call, so no KV-cache
state is shared between runs; the model stays loaded for the oracle's lifetime.

``n_batch`` splits the prompt into ``llama_decode`` calls of that many tokens (the logical
and the physical batch both); ``prefill=k`` instead decodes the first ``k`` tokens (in
batches of ``n_batch``), keeps only their last row, then decodes the rest in calls of
``steps``' sizes in turn (``(1,)``: one token per call, as a generation does; more: as
speculative verify windows do).

``mtp_logits`` runs llama.cpp's own NextN/MTP draft head (a model loaded with ``load_mtp``) as
its MTP drafter does: an ``LLAMA_CONTEXT_TYPE_MTP`` context fed the target context's
``h_nextn`` rows through the staging API ``llama_set_embeddings_nextn`` /
``llama_get_embeddings_nextn_ith`` (C++ symbols of libllama, which llama-cpp-python does not
bind).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from skippy.errors import SkippyError, UsageError
from skippy.gguf.ggml import tensor_struct
from skippy.runtime.boundary import RuntimeLoadError
from skippy.runtime.llama_cpp import import_llama

META_BUF_BYTES = 4096
MTP_CONTEXT = 1  # LLAMA_CONTEXT_TYPE_MTP (llama.h)
TOPK_TENSOR = "ffn_moe_topk-"  # build_moe_ffn's selected experts, named per layer


class OracleFailed(SkippyError, RuntimeError):
    """llama.cpp refused to decode a batch."""

    code = "oracle_failed"


class _BuftOverride(ctypes.Structure):
    """``struct llama_model_tensor_buft_override`` (llama.h): a pattern and a buffer type."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _cpu_overrides(patterns: Sequence[str]) -> Any:
    """A NULL-terminated array of overrides placing ``patterns`` in CPU memory, or None."""
    if not patterns:
        return None
    from skippy.gguf import ggml

    cpu = ggml.load().ggml_backend_cpu_buffer_type()
    rows = [_BuftOverride(p.encode(), cpu) for p in patterns] + [_BuftOverride(None, None)]
    return (_BuftOverride * len(rows))(*rows)


class LlamaOracle:
    """One model loaded in llama.cpp; ``logits`` runs a prompt in a fresh context."""

    def __init__(
        self,
        path: Path,
        *,
        n_threads: int = 1,
        repack: bool = False,
        n_gpu_layers: int | None = None,
        cpu_patterns: Sequence[str] = (),
        load_mtp: bool = False,
    ) -> None:
        """``n_gpu_layers``: layers on the device (None: llama.cpp's default, all of them
        where it has a device; 0: the CPU alone); ``cpu_patterns``: weights whose names
        these regular expressions match stay in CPU memory (``--override-tensor
        PATTERN=CPU``); ``load_mtp``: load the NextN/MTP layers too (``mtp_logits``)."""
        if n_threads < 1:
            raise UsageError("n_threads must be at least 1", code="invalid_runtime_config")
        self.path = Path(path)
        self.n_threads = n_threads
        self._lib = import_llama()
        lib = self._lib
        mparams = lib.llama_model_default_params()
        mparams.use_extra_bufts = repack
        mparams.load_mtp = load_mtp
        if n_gpu_layers is not None:
            mparams.n_gpu_layers = n_gpu_layers
        self._overrides = _cpu_overrides(cpu_patterns)  # kept alive while the model loads
        if self._overrides is not None:
            mparams.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise RuntimeLoadError(
                f"llama.cpp could not load {self.path}",
                path=str(self.path),
                remediation="rerun with logging at DEBUG for llama.cpp's own reason",
            )
        self.n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model)))

    def __enter__(self) -> LlamaOracle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        model, self._model = self._model, None
        if model:
            self._lib.llama_model_free(model)

    def _loaded(self) -> Any:
        if not self._model:
            raise UsageError("the oracle's model is closed", code="oracle_closed")
        return self._model

    # --- what llama.cpp made of the file ----------------------------------------------------------
    def meta(self, key: str) -> str | None:
        """The metadata value llama.cpp holds for ``key`` as text, or None when it has none."""
        buf = ctypes.create_string_buffer(META_BUF_BYTES)
        n = self._lib.llama_model_meta_val_str(self._loaded(), key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    def hparams(self) -> dict[str, int]:
        """The hyperparameters llama.cpp reports after its loader ran."""
        lib, m = self._lib, self._loaded()
        return {
            "n_layer": int(lib.llama_model_n_layer(m)),
            "n_embd": int(lib.llama_model_n_embd(m)),
            "n_head": int(lib.llama_model_n_head(m)),
            "n_head_kv": int(lib.llama_model_n_head_kv(m)),
            "n_ctx_train": int(lib.llama_model_n_ctx_train(m)),
            "n_swa": int(lib.llama_model_n_swa(m)),
            "n_vocab": self.n_vocab,
        }

    # --- routing ----------------------------------------------------------------------------------
    def expert_choices(
        self, token_ids: Sequence[int], *, n_batch: int
    ) -> dict[int, npt.NDArray[np.int32]]:
        """Layer -> (tokens, experts used) ids of the experts llama.cpp routed each token to,
        read from its ``ffn_moe_topk-<layer>`` tensors through the graph's eval callback."""
        chosen: dict[int, list[npt.NDArray[np.int32]]] = {}

        def observe(tensor: int, ask: bool, _user_data: Any) -> bool:
            t = tensor_struct(tensor)
            name = t.name.decode("ascii", "replace")
            if not name.startswith(TOPK_TENSOR):
                return not ask  # ask: "do you want this one?"; otherwise: "go on?"
            if ask:
                return True
            n_used, n_tokens = int(t.ne[0]), int(t.ne[1])
            rows = [
                np.ctypeslib.as_array(
                    ctypes.cast(t.data + j * t.nb[1], ctypes.POINTER(ctypes.c_int32)),
                    shape=(n_used,),
                ).copy()
                for j in range(n_tokens)
            ]
            chosen.setdefault(int(name[len(TOPK_TENSOR) :]), []).extend(rows)
            return True

        callback = self._lib.ggml_backend_sched_eval_callback(observe)
        self.logits(token_ids, n_batch=n_batch, eval_callback=callback)
        return {layer: np.stack(rows) for layer, rows in sorted(chosen.items())}

    # --- logits -----------------------------------------------------------------------------------
    def logits(
        self,
        token_ids: Sequence[int],
        *,
        n_batch: int,
        n_ctx: int | None = None,
        prefill: int | None = None,
        steps: Sequence[int] = (1,),
        eval_callback: Any = None,
    ) -> npt.NDArray[np.float32]:
        """(positions, vocab) float32: every position's logits (see the module doc for
        ``prefill``, whose first row is the prefill's last position). ``eval_callback``: a
        ``ggml_backend_sched_eval_callback`` that sees the graph's tensors as they compute."""
        ids = [int(t) for t in token_ids]
        bad = [t for t in ids if not 0 <= t < self.n_vocab]
        if not ids or bad or n_batch < 1:
            raise UsageError(
                f"need 1+ token ids inside 0..{self.n_vocab - 1} and n_batch >= 1 "
                f"(got {len(ids)} ids, first bad {bad[:1]}, n_batch {n_batch})",
                code="invalid_oracle_prompt",
            )
        if prefill is not None and not (
            1 <= prefill <= len(ids) and steps and all(1 <= w <= n_batch for w in steps)
        ):
            raise UsageError(
                f"prefill must be 1..{len(ids)} and steps 1..n_batch", code="invalid_oracle_prompt"
            )
        with self._context(len(ids), n_batch, n_ctx, eval_callback) as (ctx, batch):
            if prefill is None:
                return np.stack(
                    [
                        row
                        for lo in range(0, len(ids), n_batch)
                        for row in self._decode(
                            ctx, batch, ids, lo, min(lo + n_batch, len(ids)), all_rows=True
                        )
                    ]
                )
            for lo in range(0, prefill, n_batch):  # in batches of n_batch, the last row kept
                rows = self._decode(
                    ctx, batch, ids, lo, min(lo + n_batch, prefill), all_rows=False
                )
            i, sizes = prefill, itertools.cycle(steps)
            while i < len(ids):
                hi = min(i + next(sizes), len(ids))
                rows += self._decode(ctx, batch, ids, i, hi, all_rows=True)
                i = hi
            return np.stack(rows)

    def greedy(self, token_ids: Sequence[int], n_new: int, *, n_batch: int) -> list[int]:
        """llama.cpp's greedy continuation: the prompt decoded in batches of ``n_batch``, then
        ``n_new`` tokens, each the first maximum of the previous position's logits, decoded
        one per call (end-of-generation tokens are not special: token ids only)."""
        ids = [int(t) for t in token_ids]
        if not ids or n_new < 1 or n_batch < 1 or not all(0 <= t < self.n_vocab for t in ids):
            raise UsageError(
                f"need 1+ token ids inside 0..{self.n_vocab - 1}, n_new >= 1 and n_batch >= 1",
                code="invalid_oracle_prompt",
            )
        out: list[int] = []
        with self._context(len(ids) + n_new, n_batch, None, None) as (ctx, batch):
            row: npt.NDArray[np.float32] | None = None
            for lo in range(0, len(ids), n_batch):
                hi = min(lo + n_batch, len(ids))
                row = self._decode(ctx, batch, ids, lo, hi, all_rows=False)[-1]
            while row is not None and len(out) < n_new:
                out.append(int(np.argmax(row)))
                if len(out) < n_new:
                    seq = ids + out
                    row = self._decode(ctx, batch, seq, len(seq) - 1, len(seq), all_rows=True)[0]
        return out

    def mtp_logits(self, token_ids: Sequence[int], pending: int) -> npt.NDArray[np.float32]:
        """llama.cpp's MTP head logits for the position after ``pending``, the token after
        the prompt ``token_ids`` (n of them), as its drafter computes them: the target
        decodes the prompt in one batch (every row's ``h_nextn``); the MTP context decodes
        the prompt's tokens in one batch, token i paired with the target's row i - 1 (zeros
        for the first), then ``pending`` at position n paired with row n - 1."""
        ids = [int(t) for t in token_ids]
        n, lib = len(ids), self._lib
        if not ids or not all(0 <= t < self.n_vocab for t in [*ids, pending]):
            raise UsageError("need 1+ token ids in the vocabulary", code="invalid_oracle_prompt")
        nextn = _NextnApi(lib)
        n_embd = int(lib.llama_model_n_embd(self._loaded()))
        with (
            self._context(n + 1, n, None, None) as (target, batch),
            self._context(n + 1, n, None, None, mtp=True) as (head, head_batch),
        ):
            nextn.set(target, True, False)  # every row's h_nextn
            self._decode(target, batch, ids, 0, n, all_rows=True)
            rows = np.stack([nextn.row(target, i, n_embd) for i in range(n)])
            shifted = np.concatenate([np.zeros((1, n_embd), np.float32), rows[:-1]])
            self._decode_paired(head, head_batch, ids, shifted, 0)
            return self._decode_paired(head, head_batch, [*ids, pending], rows[-1:], n)[-1]

    def _decode_paired(
        self,
        ctx: Any,
        batch: Any,
        ids: Sequence[int],
        hidden: npt.NDArray[np.float32],
        lo: int,
    ) -> list[npt.NDArray[np.float32]]:
        """Positions ``lo..lo+len(hidden)`` of ``ids``, each token with its ``hidden`` row
        (an MTP batch carries both), every row's logits."""
        rows = np.ascontiguousarray(hidden, dtype=np.float32)
        embd = (ctypes.c_float * rows.size)()
        ctypes.memmove(embd, rows.ctypes.data, rows.nbytes)
        batch.embd = ctypes.cast(embd, ctypes.POINTER(ctypes.c_float))
        try:
            return self._decode(ctx, batch, ids, lo, lo + rows.shape[0], all_rows=True)
        finally:  # llama_batch_free must not free our array
            batch.embd = ctypes.POINTER(ctypes.c_float)()

    @contextlib.contextmanager
    def _context(
        self,
        n_tokens: int,
        n_batch: int,
        n_ctx: int | None,
        eval_callback: Any,
        *,
        mtp: bool = False,
    ) -> Iterator[tuple[Any, Any]]:
        """A fresh llama.cpp context (an MTP one with ``mtp``) and a batch of ``n_batch``
        slots, freed afterwards."""
        lib, model = self._lib, self._loaded()
        cparams = lib.llama_context_default_params()
        if mtp:
            cparams.ctx_type = MTP_CONTEXT
        cparams.n_ctx = n_ctx or max(512, n_tokens)
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as llama-cpp-python does
        if eval_callback is not None:
            cparams.cb_eval = eval_callback
        ctx = lib.llama_init_from_model(model, cparams)
        if not ctx:
            raise OracleFailed(f"llama.cpp could not create a context for {self.path}")
        batch = lib.llama_batch_init(max(n_batch, 1), 0, 1)
        try:
            yield ctx, batch
        finally:
            lib.llama_batch_free(batch)
            lib.llama_free(ctx)

    def _decode(
        self, ctx: Any, batch: Any, ids: Sequence[int], lo: int, hi: int, *, all_rows: bool
    ) -> list[npt.NDArray[np.float32]]:
        """Decode positions ``lo..hi`` as one batch; the logits of every row (``all_rows``)
        or of the last row only."""
        lib = self._lib
        batch.n_tokens = hi - lo
        for j, i in enumerate(range(lo, hi)):
            batch.token[j] = ids[i]
            batch.pos[j] = i
            batch.n_seq_id[j] = 1
            batch.seq_id[j][0] = 0
            batch.logits[j] = all_rows or i == hi - 1
        status = lib.llama_decode(ctx, batch)
        if status != 0:
            raise OracleFailed(
                f"llama_decode returned {status} for positions {lo}..{hi} of {self.path}"
            )
        wanted = range(hi - lo) if all_rows else range(hi - lo - 1, hi - lo)
        return [
            np.ctypeslib.as_array(
                ctypes.cast(lib.llama_get_logits_ith(ctx, j), ctypes.POINTER(ctypes.c_float)),
                shape=(self.n_vocab,),
            ).copy()
            for j in wanted
        ]


class _NextnApi:
    """llama.cpp's staging API for NextN hidden states (``src/llama-ext.h``): C++ functions
    of libllama, called by their mangled names (llama-cpp-python binds none of them)."""

    def __init__(self, lib: Any) -> None:
        so = lib.llama_cpp._lib  # llama-cpp-python's CDLL of libllama
        self._set = so["_Z26llama_set_embeddings_nextnP13llama_contextbb"]
        self._set.argtypes = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool]
        self._set.restype = None
        self._ith = so["_Z30llama_get_embeddings_nextn_ithP13llama_contexti"]
        self._ith.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        self._ith.restype = ctypes.POINTER(ctypes.c_float)

    def set(self, ctx: Any, value: bool, masked: bool) -> None:
        self._set(ctx, value, masked)

    def row(self, ctx: Any, i: int, n_embd: int) -> npt.NDArray[np.float32]:
        ptr = self._ith(ctx, i)
        if not ptr:
            raise OracleFailed(f"llama.cpp has no NextN hidden state for row {i}")
        return np.ctypeslib.as_array(ptr, shape=(n_embd,)).copy()


def llama_logits(
    path: Path,
    token_ids: Sequence[int],
    *,
    n_batch: int,
    n_threads: int = 1,
    repack: bool = False,
    n_ctx: int | None = None,
    prefill: int | None = None,
    steps: Sequence[int] = (1,),
    n_gpu_layers: int | None = None,
    cpu_patterns: Sequence[str] = (),
) -> npt.NDArray[np.float32]:
    """llama.cpp's logits at every position of ``token_ids`` (one load, one context)."""
    with LlamaOracle(
        path,
        n_threads=n_threads,
        repack=repack,
        n_gpu_layers=n_gpu_layers,
        cpu_patterns=cpu_patterns,
    ) as oracle:
        return oracle.logits(token_ids, n_batch=n_batch, n_ctx=n_ctx, prefill=prefill, steps=steps)


__all__ = ["LlamaOracle", "OracleFailed", "llama_logits"]
