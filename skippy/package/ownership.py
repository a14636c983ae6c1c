"""Which artifact owns a tensor (spec "Repository Layout": each owned tensor MUST appear in
exactly one artifact). A pure function of the tensor name; the writer and validator share it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from skippy.constants import (
    BLOCK_TENSOR_RE,
    EMBEDDING_TENSOR_PREFIXES,
    OUTPUT_TENSOR_PREFIXES,
    OUTPUT_WEIGHT_TENSOR,
    ROLE_EMBEDDINGS,
    ROLE_LAYER,
    ROLE_METADATA,
    ROLE_OUTPUT,
    TOKEN_EMBEDDING_TENSOR,
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


def has_tied_embeddings(tensor_names: Iterable[str]) -> bool:
    """The one rule: the model projects logits through ``token_embd.weight`` because it has
    no ``output.weight`` (recorded as the additive manifest field ``tied_embeddings``)."""
    names = set(tensor_names)
    return TOKEN_EMBEDDING_TENSOR in names and OUTPUT_WEIGHT_TENSOR not in names


def highest_layer_index(tensor_names: Iterable[str]) -> int | None:
    """The largest ``blk.N`` index among the names (by the same rule as ``owner_of``)."""
    indices = [owner_of(n).layer_index for n in tensor_names]
    return max((i for i in indices if i is not None), default=None)
