"""The prompt guard: no text reaches llama.cpp's tokenizer unless it cannot abort there.

llama.cpp aborts the whole process (an uncaught ``std::out_of_range``) when a SentencePiece
vocabulary has no token for a character and no byte-fallback token for one of its bytes
(runtime-facts.md; our tiny synthetic models). A mesh node tokenizes prompts from remote users, so
every text passes ``guarded_bytes`` first:

* the text must be valid Unicode (a lone surrogate, e.g. from undecodable command-line
  bytes, cannot be UTF-8: ``invalid_prompt_text``) of at most 16 MiB (``prompt_too_large``);
* SentencePiece (``tokenizer.ggml.model = "llama"``): ``spm_verdict`` is exact and pure. It
  mirrors where llama.cpp throws (``llm_tokenizer_spm_session::resegment`` ->
  ``byte_to_token``): after llama.cpp's escaping (spaces to U+2581, the space prefix), a
  character that is not a token and whose bytes have no ``<0xXX>`` tokens aborts, unless the
  bigram merge swallows it into a longer token; the merge is replayed when that matters
  (``spm_unmerged``). A vocabulary with all 256 byte tokens (gemma3) needs no check at all;
* byte-level BPE (``"gpt2"``): llama.cpp skips what it cannot map and never throws on valid
  UTF-8, so every valid text passes;
* anything else (another tokenizer model, or a SentencePiece text holding a user-defined
  token, which llama.cpp splits out first) is tokenized once in a child process
  (``probe_in_child``); a child that dies means ``prompt_not_encodable``.

What each option costs is measured in docs/performance.md: the predicates take microseconds
to milliseconds per prompt after one read of the token list; the child process costs a
Python start and a vocabulary load (~0.4-1.4 s) per prompt.
"""

from __future__ import annotations

import heapq
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from skippy.errors import UsageError
from skippy.gguf.reader import open_gguf
from skippy.runtime.boundary import RuntimeLoadError

SPM_MODEL: Final = "llama"
BPE_MODEL: Final = "gpt2"
SPACE_ESCAPE: Final = "\u2581"  # SentencePiece's visible space
MAX_PROMPT_BYTES: Final = 16 * 1024 * 1024  # bounds what one prompt may make us allocate
PROBE_TIMEOUT_S: Final = 120.0


class PromptNotEncodable(UsageError):
    code = "prompt_not_encodable"


_USER_DEFINED = 4  # llama_token_type LLAMA_TOKEN_TYPE_USER_DEFINED


@dataclass(frozen=True)
class Vocabulary:
    """What the guard needs to know about a GGUF vocabulary (read with our bounded reader).

    For SentencePiece: ``scores`` maps a token's text to the score llama.cpp uses for it (the
    last id with that text wins, as in llama.cpp's ``token_to_id``), ``byte_fallback`` the
    bytes that have a fallback token, ``merge_chars`` every character inside a token of two
    or more characters (only those can be merged away), ``user_defined`` the texts llama.cpp
    splits out before tokenizing (even without special-token parsing).
    """

    model: str
    add_space_prefix: bool
    max_token_chars: int = 0  # the longest token (0: unknown); bounds how much text fits
    scores: Mapping[str, float] = field(default_factory=dict)
    byte_fallback: frozenset[int] = frozenset()
    merge_chars: frozenset[str] = frozenset()
    user_defined: tuple[str, ...] = ()

    @classmethod
    def read(cls, metadata_path: Path) -> Vocabulary:
        # header_only: the KV is all this reads (a v2 carrier's directory points elsewhere)
        with open_gguf(metadata_path, header_only=True) as g:
            model = g.get("tokenizer.ggml.model")
            if not isinstance(model, str):
                raise RuntimeLoadError(
                    f"{metadata_path} has no tokenizer (tokenizer.ggml.model)",
                    code="no_tokenizer",
                    path=str(metadata_path),
                )
            # llama.cpp's default: SentencePiece vocabularies prefix a space unless told not to
            prefix = bool(g.get("tokenizer.ggml.add_space_prefix", model == SPM_MODEL))
            tokens = g.get("tokenizer.ggml.tokens") if model in (SPM_MODEL, BPE_MODEL) else None
            if model != SPM_MODEL:
                # byte-level BPE spells each byte as one character: the longest token in
                # characters is the most bytes one token covers
                longest = (
                    max((len(t) for t in tokens), default=0) if isinstance(tokens, list) else 0
                )
                return cls(model=model, add_space_prefix=prefix, max_token_chars=longest)
            if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
                raise RuntimeLoadError(f"{metadata_path} has no token list", code="no_tokenizer")
            present = set(tokens)
            longest = max((len(t) for t in present), default=0)
            fallback = frozenset(
                b
                for b in range(256)
                if f"<0x{b:02X}>" in present or (b < 0x80 and chr(b) in present)
            )
            if len(fallback) == 256:  # every character can fall back to bytes: nothing to check
                return cls(
                    model=model,
                    add_space_prefix=prefix,
                    max_token_chars=longest,
                    byte_fallback=fallback,
                )
            raw_scores = g.get("tokenizer.ggml.scores") or []
            types = g.get("tokenizer.ggml.token_type") or []
        scores = {
            t: float(raw_scores[i]) if i < len(raw_scores) else 0.0 for i, t in enumerate(tokens)
        }
        user = tuple(
            t for i, t in enumerate(tokens) if i < len(types) and types[i] == _USER_DEFINED and t
        )
        merge_chars = frozenset(c for t in present if len(t) > 1 for c in t)
        return cls(
            model=model,
            add_space_prefix=prefix,
            max_token_chars=longest,
            scores=scores,
            byte_fallback=fallback,
            merge_chars=merge_chars,
            user_defined=user,
        )


def prompt_bytes(text: str) -> bytes:
    """The UTF-8 bytes of ``text``, or ``invalid_prompt_text`` (lone surrogates, e.g. from
    undecodable command-line bytes) and ``prompt_too_large``."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise UsageError(
            f"the prompt is not valid Unicode text (character {exc.start} is "
            f"{bad.encode('unicode_escape').decode()}, a lone surrogate: undecodable bytes?)",
            code="invalid_prompt_text",
            actual=exc.start,
            remediation="pass the prompt as UTF-8 text",
        ) from None
    if len(data) > MAX_PROMPT_BYTES:
        raise UsageError(
            f"the prompt is {len(data)} bytes; at most {MAX_PROMPT_BYTES} are accepted",
            code="prompt_too_large",
            actual=len(data),
        )
    return data


def _falls_back(vocab: Vocabulary, ch: str) -> bool:
    return ch in vocab.scores or all(b in vocab.byte_fallback for b in ch.encode("utf-8"))


def spm_unmerged(text: str, scores: Mapping[str, float]) -> list[str]:
    """The symbols llama.cpp's SentencePiece session ends with for ``text`` (already escaped):
    its bigram merge, replayed (``llm_tokenizer_spm_session::tokenize``). Start from single
    characters; repeatedly merge the adjacent pair whose concatenation is a token with the
    highest score (ties: the leftmost), skipping pairs that went stale."""
    sym = list(text)
    n = len(sym)
    prev = list(range(-1, n - 1))
    nxt = [*range(1, n), -1]
    heap: list[tuple[float, int, int, int]] = []

    def try_add(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        score = scores.get(sym[left] + sym[right])
        if score is not None:
            heapq.heappush(heap, (-score, left, right, len(sym[left]) + len(sym[right])))

    for i in range(1, n):
        try_add(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
            continue  # one side already merged elsewhere
        sym[left] += sym[right]
        sym[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        try_add(prev[left], left)
        try_add(left, nxt[left])
    out, i = [], 0 if n else -1
    while i >= 0:
        out.append(sym[i])
        i = nxt[i]
    return out


@dataclass(frozen=True)
class Verdict:
    """``encodable``: True / False (``character`` is the first that would abort) / None (the
    text holds a user-defined token, which splits it the way only llama.cpp knows exactly:
    ask a child process)."""

    encodable: bool | None
    character: str | None = None


def spm_verdict(vocab: Vocabulary, text: str) -> Verdict:
    """Whether llama.cpp's SentencePiece tokenizer can encode ``text`` without aborting. Pure
    and exact: a character that is neither a token nor byte-encodable aborts unless the merge
    swallows it into a longer token, which ``spm_unmerged`` replays."""
    if vocab.model != SPM_MODEL or not text or len(vocab.byte_fallback) == 256:
        return Verdict(True)
    escaped = (" " + text if vocab.add_space_prefix else text).replace(" ", SPACE_ESCAPE)
    problems = {c for c in set(escaped) if not _falls_back(vocab, c)}
    if not problems:
        return Verdict(True)
    if any(u in text for u in vocab.user_defined):
        return Verdict(None)
    hopeless = [c for c in escaped if c in problems and c not in vocab.merge_chars]
    if hopeless:  # no token contains it: no merge can rescue it
        return Verdict(False, hopeless[0])
    for symbol in spm_unmerged(escaped, vocab.scores):
        if symbol in problems:
            return Verdict(False, symbol)
    return Verdict(True)


def not_encodable(ch: str) -> PromptNotEncodable:
    shown = repr(ch) if ch.isprintable() else f"U+{ord(ch):04X}"
    if ch == SPACE_ESCAPE:  # also what llama.cpp puts before the text
        shown = "a space (SentencePiece's U+2581, which llama.cpp also prefixes)"
    return PromptNotEncodable(
        f"the model's vocabulary cannot encode {shown}: no token covers it and it has no "
        "byte-fallback tokens (llama.cpp would abort on this prompt)",
        actual=f"U+{ord(ch):04X}",
        remediation="use only text the model's vocabulary covers",
    )


# --- the child-process guard, for tokenizer models without a predicate ------------------------
_PROBE = (
    "import sys; from skippy.runtime.tokenizer import probe_main; "
    "sys.exit(probe_main(sys.argv[1], sys.stdin.buffer.read()))"
)
PROBE_LOAD_FAILED: Final = 3


def probe_in_child(metadata_path: Path, text: str) -> None:
    """Tokenize ``text`` in a throwaway child process; if llama.cpp aborts there, refuse the
    prompt here (``prompt_not_encodable``) instead of aborting this process."""
    data = prompt_bytes(text)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(metadata_path)],
        input=data,
        capture_output=True,
        timeout=PROBE_TIMEOUT_S,
    )
    if proc.returncode == PROBE_LOAD_FAILED:
        raise RuntimeLoadError(
            f"llama.cpp could not load the vocabulary of {metadata_path}",
            code="tokenizer_load_failed",
        )
    if proc.returncode != 0:
        raise PromptNotEncodable(
            "llama.cpp cannot tokenize this prompt with the model's vocabulary (its "
            f"tokenizer died in a guarded child process, exit {proc.returncode})",
            actual=proc.returncode,
        )


def guarded_bytes(
    vocab: Vocabulary, metadata_path: Path, text: str, *, max_tokens: int | None = None
) -> bytes:
    """The prompt's UTF-8 bytes once it is known not to abort llama.cpp's tokenizer: the
    predicate of its tokenizer model, else one tokenization in a child process.

    With ``max_tokens`` (the context), a text that cannot fit (more characters than that many
    of the vocabulary's longest tokens hold) is refused first, so a huge prompt costs no
    tokenizing: ``prompt_too_long``."""
    data = prompt_bytes(text)
    if max_tokens is not None and vocab.max_token_chars:
        # SentencePiece tokens are counted in characters, byte-level BPE ones in bytes
        size = len(data) if vocab.model == BPE_MODEL else len(text)
        least = -(-size // vocab.max_token_chars)
        if least > max_tokens:
            raise UsageError(
                f"the prompt needs at least {least} tokens; the context holds {max_tokens}",
                code="prompt_too_long",
                expected=max_tokens,
                actual=least,
                remediation="shorten the prompt or raise the context with --n-ctx",
            )
    if vocab.model == BPE_MODEL:
        return data
    if vocab.model == SPM_MODEL:
        verdict = spm_verdict(vocab, text)
        if verdict.encodable:
            return data
        if verdict.encodable is False and verdict.character is not None:
            raise not_encodable(verdict.character)
    probe_in_child(metadata_path, text)
    return data
