"""A package-v2 stage as one GGUF for stock llama.cpp.

Upstream's patched llama.cpp loads a metadata carrier plus ordered payload parts directly
(spec "v2 fetching"); stock llama.cpp (llama-cpp-python 0.3.36) cannot: v2 parts carry no
``split.*`` keys, so they are not a split set. ``compose_parts`` therefore writes one derived
GGUF from the parts, the way upstream's loader resolves them: metadata from the carrier (minus
its seven ``skippy.package.*`` locator keys), each tensor of the carrier's directory taken by
name from the payload part whose own header holds it, bytes copied verbatim. The file is
derived cache (spec "Layer Selection"): it lives in the runtime's private temporary folder and
is deleted as soon as llama.cpp has mapped it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

from skippy.constants import V2_CARRIER_KEYS
from skippy.errors import ModelError
from skippy.gguf.reader import GGUFFile, open_gguf
from skippy.gguf.writer import TensorSource, WrittenFragment, write_fragment


def compose_parts(part_paths: Sequence[Path], dest: Path) -> WrittenFragment:
    """``part_paths``: the carrier first, then payload parts. Every carrier tensor must be in
    exactly one payload part (``fragment_missing_tensor`` / ``fragment_duplicate_tensor``)."""
    with contextlib.ExitStack() as stack:
        carrier = stack.enter_context(open_gguf(part_paths[0], header_only=True))
        parts: list[GGUFFile] = [stack.enter_context(open_gguf(p)) for p in part_paths[1:]]
        where: dict[str, TensorSource] = {}
        for g in parts:
            for t in g.tensors:
                if t.name in where:
                    raise ModelError(
                        f"tensor {t.name!r} is in two payload parts ({g.path})",
                        code="fragment_duplicate_tensor",
                        path=str(g.path),
                    )
                where[t.name] = TensorSource(t, g.fileno())
        tensors = []
        for t in carrier.tensors:
            src = where.get(t.name)
            if src is None:
                raise ModelError(
                    f"admitted resident tensor {t.name!r} is absent from model payloads",
                    code="fragment_missing_tensor",
                    actual=t.name,
                )
            if (src.info.shape, src.info.ggml_type) != (t.shape, t.ggml_type):
                raise ModelError(
                    f"tensor {t.name!r}: the payload part and the carrier disagree on its type "
                    "or dims",
                    code="package_storage_mismatch",
                    actual=t.name,
                )
            tensors.append(src)
        records = [carrier.raw_field(k) for k in carrier.fields if k not in V2_CARRIER_KEYS]
        return write_fragment(dest, records, tensors, carrier.alignment)
