"""A package's chat template (``tokenizer.chat_template`` in ``shared/metadata.gguf``),
rendered in a sandbox.

The template is Jinja, as in Hugging Face's tokenizers; it comes from a package, so it is
untrusted: it runs in jinja2's ``ImmutableSandboxedEnvironment`` (no attribute access to
Python internals, no mutation of the messages), with the helpers chat templates expect
(``raise_exception``, ``bos_token``/``eos_token``, ``add_generation_prompt``). A model
without a template (gemma3-270m is a base model) has none: chat requests are refused with
``chat_template_missing`` (use ``/v1/completions``), never formatted by a guess.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from skippy.errors import UsageError
from skippy.gguf.reader import open_gguf

TEMPLATE_KEY: Final = "tokenizer.chat_template"
MAX_TEMPLATE_CHARS: Final = 256 * 1024
MAX_RENDERED_CHARS: Final = 16 * 1024 * 1024


class ChatTemplateError(UsageError):
    code = "chat_template_error"


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str
    eos_token: str

    @classmethod
    def from_metadata(cls, metadata_path: Path) -> ChatTemplate | None:
        """The template of a package's metadata part, or ``None`` when it has none."""
        with open_gguf(metadata_path) as g:
            source = g.get(TEMPLATE_KEY)
            if not isinstance(source, str) or not source.strip():
                return None
            tokens = g.get("tokenizer.ggml.tokens")

            def token(key: str) -> str:
                i = g.get(key)
                if isinstance(i, int) and isinstance(tokens, list) and 0 <= i < len(tokens):
                    return str(tokens[i])
                return ""

            bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(
                f"the chat template is longer than {MAX_TEMPLATE_CHARS} characters"
            )
        return cls(source, bos, eos)

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt text for ``messages`` followed by the assistant's turn."""
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(f"the chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            text = env.from_string(self.source).render(
                messages=[dict(m) for m in messages],
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=True,
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from None
        if len(text) > MAX_RENDERED_CHARS:
            raise ChatTemplateError("the rendered chat prompt is too large")
        return text
