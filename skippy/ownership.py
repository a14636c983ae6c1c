"""Which artifact owns a tensor (spec "Repository Layout": each owned tensor MUST appear in
exactly one artifact). A pure function of the tensor name; the writer and validator share it.
"""

from __future__ import annotations

from dataclasses import dataclass

from skippy.constants import (
    BLOCK_TENSOR_RE,
    EMBEDDING_TENSOR_PREFIXES,
    OUTPUT_TENSOR_PREFIXES,
    ROLE_EMBEDDINGS,
    ROLE_LAYER,
    ROLE_METADATA,
    ROLE_OUTPUT,
)


@dataclass(frozen=True)
class Owner:
    role: str
    layer_index: int | None = None


def owner_of(tensor_name: str) -> Owner:
    """``blk.N.*`` -> layer N; token embeddings -> embeddings; ``output*`` -> output; any other
    tensor (e.g. ``rope_freqs.weight``) -> the shared metadata fragment."""
    m = BLOCK_TENSOR_RE.match(tensor_name)
    if m:
        return Owner(ROLE_LAYER, int(m.group(1)))
    if tensor_name.startswith(EMBEDDING_TENSOR_PREFIXES):
        return Owner(ROLE_EMBEDDINGS)
    if tensor_name.startswith(OUTPUT_TENSOR_PREFIXES):
        return Owner(ROLE_OUTPUT)
    return Owner(ROLE_METADATA)
