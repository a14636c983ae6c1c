"""Generated text as it streams (pure): token pieces to UTF-8 text, and stop sequences.

A token's piece may end inside a multi-byte character; ``TextStream`` holds those bytes back
until the character is complete. Stop sequences may span tokens: text that could still be
the start of a stop sequence is held back too, so a client never sees a stop sequence (or a
part of one) that ends up cutting the completion (OpenAI's ``stop`` semantics: the returned
text does not contain the stop sequence).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextStream:
    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = tuple(s for s in stop if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._held = ""  # decoded text not yet released (may start a stop sequence)
        self.text = ""  # everything released
        self.stopped = False

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the text now safe to release ("" when held)."""
        if self.stopped:
            return ""
        self._held += self._decoder.decode(piece)
        return self._release(final=False)

    def finish(self) -> str:
        """The end of generation: release what was held (a partial stop sequence is text)."""
        if self.stopped:
            return ""
        self._held += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        held = self._held
        hits = [at for s in self.stop if (at := held.find(s)) >= 0]
        first = min(hits) if hits else len(held)
        # where the earliest stop sequence that may still complete begins (none at the end)
        pending = len(held) if final else len(held) - self._longest_stop_prefix_suffix()
        if hits and first <= pending:  # the earliest stop sequence ends the text
            out, self._held, self.stopped = held[:first], "", True
        else:  # a stop sequence that began earlier than a complete one may still complete
            cut = min(first, pending)
            out, self._held = held[:cut], held[cut:]
        self.text += out
        return out

    def _longest_stop_prefix_suffix(self) -> int:
        """Length of the longest end of the held text that begins some stop sequence."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._held)), best, -1):
                if self._held.endswith(s[:n]):
                    best = n
                    break
        return best
