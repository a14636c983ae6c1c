"""llama.cpp's tokenizer for a package, from its metadata part alone, behind the prompt guard.

llama.cpp tokenizes (through llama-cpp-python, from the package's ``shared/metadata.gguf``:
a vocab-only load with ``split.count`` overridden to 1, so no other part is needed), which
makes the ids llama.cpp's by construction. Every text passes ``skippy.runtime.prompt_guard``
first, and ids handed back for detokenizing are range-checked (an id outside the vocabulary
also throws inside llama.cpp).
"""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

from skippy.errors import UsageError
from skippy.runtime.boundary import RuntimeLoadError
from skippy.runtime.llama_cpp import import_llama
from skippy.runtime.prompt_guard import PROBE_LOAD_FAILED, Vocabulary, guarded_bytes


def load_vocab_only(lib: ModuleType, metadata_path: Path) -> Any:
    """A vocab-only ``llama_model*`` from the metadata part (NULL on failure). The part
    declares the whole package's ``split.count``; overriding it to 1 lets llama.cpp read the
    vocabulary from this one file."""
    params = lib.llama_model_default_params()
    params.vocab_only = True
    overrides = (lib.llama_model_kv_override * 2)()  # one override and the empty sentinel
    overrides[0].key = b"split.count"
    overrides[0].tag = lib.LLAMA_KV_OVERRIDE_TYPE_INT
    overrides[0].value.val_i64 = 1
    params.kv_overrides = overrides
    with _vocab_file(metadata_path) as path:
        return lib.llama_model_load_from_file(str(path).encode(), params)


@contextlib.contextmanager
def _vocab_file(metadata_path: Path) -> Iterator[Path]:
    """The file llama.cpp reads the vocabulary from: the metadata part itself, or for a
    package-v2 carrier (whose tensor directory points into other files, which llama.cpp
    refuses as out of bounds) a private KV-only copy without its locator keys, deleted once
    loaded (the vocabulary is copied into the model)."""
    from skippy.constants import KEY_V2_METADATA_ONLY, V2_CARRIER_KEYS
    from skippy.gguf.reader import open_gguf
    from skippy.gguf.writer import write_fragment

    with open_gguf(metadata_path, header_only=True) as g:
        if g.get(KEY_V2_METADATA_ONLY) is not True:
            yield metadata_path
            return
        records = [g.raw_field(k) for k in g.fields if k not in V2_CARRIER_KEYS]
        alignment = g.alignment
    folder = Path(tempfile.mkdtemp(prefix=".skippy-vocab-"))
    try:
        path = folder / "vocab.gguf"
        write_fragment(path, records, [], alignment)
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class LlamaTokenizer:
    """llama.cpp's tokenizer for one package, loaded vocab-only from its metadata part."""

    def __init__(self, metadata_path: Path) -> None:
        self.path = metadata_path
        self.vocabulary = Vocabulary.read(metadata_path)
        lib = self._lib = import_llama()
        model = load_vocab_only(lib, metadata_path)
        if not model:
            raise RuntimeLoadError(
                f"llama.cpp could not load the vocabulary of {metadata_path}",
                code="tokenizer_load_failed",
                path=str(metadata_path),
                remediation="rerun with -v for llama.cpp's own log",
            )
        self._model = model
        self._vocab = lib.llama_model_get_vocab(model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        self.add_bos = bool(lib.llama_vocab_get_add_bos(self._vocab))

    def _loaded(self) -> Any:
        if self._model is None:
            raise RuntimeLoadError("the tokenizer is closed", code="stage_not_loaded")
        return self._vocab

    def tokenize(
        self,
        text: str,
        *,
        add_special: bool = True,
        max_tokens: int | None = None,
        parse_special: bool = False,
    ) -> list[int]:
        """llama.cpp's ids for ``text`` (BOS added when the model adds one), guarded;
        ``max_tokens`` refuses a text that cannot fit before tokenizing it. ``parse_special``
        turns control-token text (``<|im_start|>``) into those tokens: for text a chat template
        rendered, never for a user's raw prompt."""
        vocab = self._loaded()
        data = guarded_bytes(self.vocabulary, self.path, text, max_tokens=max_tokens)
        return self._tokenize_bytes(vocab, data, add_special, parse_special)

    def _tokenize_bytes(
        self, vocab: Any, data: bytes, add_special: bool, parse_special: bool = False
    ) -> list[int]:
        lib = self._lib
        cap = len(data) + 8
        buf = (lib.llama_token * cap)()
        n = lib.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:  # more tokens than bytes + 8 cannot happen with these tokenizers; still
            cap = -n
            buf = (lib.llama_token * cap)()
            n = lib.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise RuntimeLoadError(f"llama_tokenize failed ({n})", code="tokenize_failed")
        return [int(t) for t in buf[:n]]

    def check_ids(self, tokens: Sequence[int]) -> list[int]:
        ids = [int(t) for t in tokens]
        bad = [t for t in ids if not 0 <= t < self.n_vocab]
        if bad:
            raise UsageError(
                f"token id {bad[0]} is outside the vocabulary 0..{self.n_vocab - 1}",
                code="token_out_of_range",
                actual=bad[0],
            )
        return ids

    def piece(self, token: int) -> bytes:
        vocab, lib = self._loaded(), self._lib
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = lib.llama_token_to_piece(vocab, token, buf, size, 0, False)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def detokenize(self, tokens: Sequence[int]) -> str:
        ids = self.check_ids(tokens)
        return b"".join(self.piece(t) for t in ids).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        ids = self.check_ids([token])
        return bool(self._lib.llama_vocab_is_eog(self._loaded(), ids[0]))

    def close(self) -> None:
        model, self._model = self._model, None
        if model:
            self._lib.llama_model_free(model)

    def __enter__(self) -> LlamaTokenizer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def probe_main(metadata_path: str, data: bytes) -> int:
    """The child's side of ``probe_in_child``: tokenize once (this process may abort)."""
    lib = import_llama()
    model = load_vocab_only(lib, Path(metadata_path))
    if not model:
        return PROBE_LOAD_FAILED
    vocab = lib.llama_model_get_vocab(model)
    cap = len(data) + 8
    buf = (lib.llama_token * cap)()
    lib.llama_tokenize(vocab, data, len(data), buf, cap, True, False)
    lib.llama_model_free(model)
    return 0
