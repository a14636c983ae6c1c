"""What a package writer declares about N-gram speculation (``write-package --speculative``).

Spec "Speculative Decoding": packages that expose the product menu use the stable strategy
ids ``ngram-cache`` / ``ngram-suffix``; each names a reusable proposer of the same id with
its bounds (``history_scope`` always ``"request"``) and, optionally, a window policy. One
declaration is text ``TYPE:key=value,...``, e.g.
``ngram-suffix:ngram_min=3,ngram_max=16,max_proposal_tokens=8,window=adaptive,max_window=8``
(keys: ``ngram_min``, ``ngram_max``, ``max_proposal_tokens`` required; ``window``
``fixed``/``adaptive``, ``initial_window``, ``min_window``, ``max_window`` optional).
``default`` is set only when asked. The merged ``generation`` object is checked with
``parse_generation`` like any manifest's, so a bad bound is refused before anything is
written.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Final

from skippy.errors import UsageError
from skippy.generation import vocab as v
from skippy.generation.errors import GenerationManifestError
from skippy.generation.schema import parse_generation

_BOUNDS: Final = (v.NGRAM_MIN, v.NGRAM_MAX, v.MAX_PROPOSAL_TOKENS)
_WINDOW_SIZES: Final = (v.WP_INITIAL, v.WP_MIN, v.WP_MAX)
_WINDOW: Final = "window"
C_BAD_DECLARATION: Final = "invalid_speculative_declaration"


def _bad(message: str, text: str) -> UsageError:
    return UsageError(
        message,
        code=C_BAD_DECLARATION,
        actual=text,
        remediation="e.g. --speculative ngram-suffix:ngram_min=3,ngram_max=16,"
        "max_proposal_tokens=8[,window=adaptive,initial_window=2,min_window=1,max_window=8]",
    )


def parse_declaration(text: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(strategy id, proposer, strategy)`` JSON objects for one ``--speculative`` value."""
    kind, sep, rest = text.partition(":")
    kind = kind.strip()
    if kind not in v.NGRAM_TYPES:
        raise _bad(
            f"--speculative {text!r}: the type must be ngram-cache or ngram-suffix "
            "(native MTP is inferred from the source's NextN tensors)",
            text,
        )
    values: dict[str, Any] = {}
    for item in rest.split(",") if sep and rest.strip() else []:
        key, eq, raw = (s.strip() for s in item.partition("="))
        if not eq or key in values:
            raise _bad(f"--speculative {text!r}: {item!r} is not a new key=value", text)
        if key == _WINDOW:
            if raw not in v.WINDOW_MODES:
                raise _bad(f"--speculative {text!r}: window must be fixed or adaptive", text)
            values[key] = raw
        elif key in _BOUNDS or key in _WINDOW_SIZES:
            if not raw.isdigit() or int(raw) < 1:
                raise _bad(f"--speculative {text!r}: {key} must be a positive integer", text)
            values[key] = int(raw)
        else:
            known = ", ".join((*_BOUNDS, _WINDOW, *_WINDOW_SIZES))
            raise _bad(f"--speculative {text!r}: unknown key {key!r} (known: {known})", text)
    missing = [k for k in _BOUNDS if k not in values]
    if missing:
        raise _bad(f"--speculative {text!r}: missing {', '.join(missing)}", text)
    proposer = {v.TYPE: kind, **{k: values[k] for k in _BOUNDS}}
    proposer[v.HISTORY_SCOPE] = v.HISTORY_SCOPE_REQUEST
    strategy: dict[str, Any] = {v.TYPE: kind, v.PROPOSER: kind}
    sizes = {k: values[k] for k in _WINDOW_SIZES if k in values}
    if _WINDOW in values or sizes:
        hi = sizes.get(v.WP_MAX, max(sizes.values(), default=1))
        lo = sizes.get(v.WP_MIN, 1)
        strategy[v.WINDOW_POLICY] = {
            v.WP_DEFAULT: values.get(_WINDOW, v.WINDOW_FIXED),
            v.WP_INITIAL: sizes.get(v.WP_INITIAL, hi),
            v.WP_MIN: lo,
            v.WP_MAX: hi,
        }
    return kind, proposer, strategy


def declare_speculation(
    generation: Mapping[str, Any] | None,
    declarations: Sequence[str],
    *,
    default: str | None,
    layer_count: int,
) -> dict[str, Any] | None:
    """``generation`` (the writer's inferred object, or None) with the declared N-gram
    strategies added, checked as a manifest's would be. Raises ``UsageError`` (exit 2)."""
    if not declarations and default is None:
        return dict(generation) if generation is not None else None
    out: dict[str, Any] = copy.deepcopy(dict(generation)) if generation else {}
    sd = out.setdefault(v.SPECULATIVE, {})
    proposers = sd.setdefault(v.SD_PROPOSERS, {})
    strategies = sd.setdefault(v.SD_STRATEGIES, {})
    for text in declarations:
        sid, proposer, strategy = parse_declaration(text)
        if sid in strategies:
            raise _bad(f"--speculative declares strategy {sid!r} twice", text)
        proposers[sid], strategies[sid] = proposer, strategy
    if default is not None:
        if default not in strategies:
            raise UsageError(
                f"--speculative-default {default!r} is not a declared strategy "
                f"(declared: {', '.join(sorted(strategies)) or 'none'})",
                code=C_BAD_DECLARATION,
            )
        sd[v.SD_DEFAULT] = default
    elif v.SD_DEFAULT not in sd:
        # the schema wants a default; without one asked for, "disabled" is no package
        # strategy, so leave the inferred default (if any) and require one only when absent
        raise UsageError(
            "a speculative_decoding block needs a default strategy; pass --speculative-default "
            "with one of the declared strategies",
            code=C_BAD_DECLARATION,
        )
    try:
        parse_generation(out, layer_count=layer_count)
    except GenerationManifestError as err:
        raise UsageError(str(err), code=C_BAD_DECLARATION) from err
    return out
