"""Fragment planning: which tensors and KV records go into which package artifact (pure).

Spec "Repository Layout" fixes the names; the ownership rule is ours (see
``skippy.package.ownership``). Every fragment is also one split of a llama.cpp split set so stock
llama.cpp can load any contiguous selection straight from the parts: ``split.no`` in every
fragment, ``split.count`` / ``split.tensors.count`` in ``shared/metadata.gguf`` (split 0),
which alone carries the full KV section and the tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from skippy.constants import (
    EMBEDDINGS_PATH,
    FRAGMENT_KEEP_KEYS,
    KEY_FRAGMENT_LAYER_START,
    KEY_FRAGMENT_LAYER_STOP,
    KEY_FRAGMENT_ROLE,
    KEY_SPLIT_COUNT,
    KEY_SPLIT_NO,
    KEY_SPLIT_TENSORS_COUNT,
    MAX_LAYER_COUNT,
    METADATA_PATH,
    OUTPUT_PATH,
    ROLE_EMBEDDINGS,
    ROLE_LAYER,
    ROLE_METADATA,
    ROLE_OUTPUT,
    layer_path,
)
from skippy.errors import ModelError
from skippy.gguf.constants import ValueType
from skippy.gguf.writer import encode_kv
from skippy.package.ownership import owner_of
from skippy.produce.source import SourceTensor


@dataclass(frozen=True)
class FragmentPlan:
    role: str
    layer_index: int | None
    path: str
    split_no: int
    kv_records: tuple[bytes, ...]
    tensors: tuple[SourceTensor, ...]

    @property
    def tensor_bytes(self) -> int:
        return sum(t.info.nbytes for t in self.tensors)


def _role_keys(role: str, start: int, stop: int) -> list[bytes]:
    return [
        encode_kv(KEY_FRAGMENT_ROLE, ValueType.STRING, role),
        encode_kv(KEY_FRAGMENT_LAYER_START, ValueType.UINT32, start),
        encode_kv(KEY_FRAGMENT_LAYER_STOP, ValueType.UINT32, stop),
    ]


def plan_fragments(
    *,
    kv_records: Sequence[tuple[str, bytes]],
    tensors: Sequence[SourceTensor],
    layer_count: int,
) -> list[FragmentPlan]:
    """Assign every tensor to exactly one fragment, in split order: metadata (split 0),
    embeddings, layers 0..L-1, output. ``kv_records`` are (key, raw record) from the source
    without its own ``split.*`` keys."""
    if not 1 <= layer_count <= MAX_LAYER_COUNT:
        raise ModelError(
            f"block count {layer_count} is outside 1..{MAX_LAYER_COUNT}: llama.cpp counts a "
            "split set's files in 16 bits",
            code="invalid_block_count",
        )
    groups: dict[tuple[str, int | None], list[SourceTensor]] = {}
    for t in tensors:
        owner = owner_of(t.info.name)
        if owner.layer_index is not None and owner.layer_index >= layer_count:
            raise ModelError(
                f"tensor {t.info.name} belongs to layer {owner.layer_index}, but the model "
                f"declares {layer_count} layers",
                code="layer_count_mismatch",
            )
        groups.setdefault((owner.role, owner.layer_index), []).append(t)

    order: list[tuple[str, int | None, str, int, int]] = [
        (ROLE_METADATA, None, METADATA_PATH, 0, layer_count),
        (ROLE_EMBEDDINGS, None, EMBEDDINGS_PATH, 0, 0),
    ]
    order += [(ROLE_LAYER, i, layer_path(i), i, i + 1) for i in range(layer_count)]
    order.append((ROLE_OUTPUT, None, OUTPUT_PATH, layer_count, layer_count))
    n_splits = len(order)

    keep = [rec for key, rec in kv_records if key in FRAGMENT_KEEP_KEYS]
    plans = []
    for split_no, (role, index, path, start, stop) in enumerate(order):
        split = [encode_kv(KEY_SPLIT_NO, ValueType.UINT16, split_no)]
        if role == ROLE_METADATA:
            records = [rec for _, rec in kv_records]
            split += [
                encode_kv(KEY_SPLIT_COUNT, ValueType.UINT16, n_splits),
                encode_kv(KEY_SPLIT_TENSORS_COUNT, ValueType.INT32, len(tensors)),
            ]
        else:
            records = list(keep)
        plans.append(
            FragmentPlan(
                role=role,
                layer_index=index,
                path=path,
                split_no=split_no,
                kv_records=tuple(records + split + _role_keys(role, start, stop)),
                tensors=tuple(groups.get((role, index), ())),
            )
        )
    return plans
