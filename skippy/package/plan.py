"""Split planning: contiguous layer ranges per stage, and each stage's bytes (pure).

Default split: the first ``L % N`` stages get one extra layer. ``balance="bytes"`` minimises
the largest stage's bytes instead (exact dynamic programme over contiguous partitions),
counting the boundary artifacts each stage must also hold (spec "Layer Selection"). A model's
NextN/MTP layers after its trunk (``tail_layers``) are never cut from the final stage: the
stage runtime runs the trunk's last layer and its head where they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from skippy.errors import UsageError
from skippy.generation import vocab as gv
from skippy.package.ranges import LayerRange

Balance = Literal["layers", "bytes"]


@dataclass(frozen=True)
class ModelSizes:
    """Exact bytes per part, from a manifest (artifact bytes) or a GGUF (tensor bytes)."""

    layer_bytes: tuple[int, ...]
    metadata_bytes: int
    embeddings_bytes: int
    output_bytes: int
    tied_embeddings: bool = False
    # Bytes a token reads per layer: less than ``layer_bytes`` where a mixture of experts
    # routes each token to some experts (``skippy.package.experts``); empty: every byte.
    layer_active_bytes: tuple[int, ...] = ()
    # Routed experts' bytes per layer (``ffn_*_exps``): what a GPU node may keep in RAM;
    # empty: none (a dense model, or unknown).
    layer_expert_bytes: tuple[int, ...] = ()
    # The last layers that go with the final stage whatever the split (NextN/MTP layers
    # after the trunk: ``tail_layers``); 0: a cut may fall anywhere.
    tail_layers: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.tail_layers < max(1, len(self.layer_bytes)):
            raise UsageError(
                f"{self.tail_layers} tail layers leave no trunk in {len(self.layer_bytes)}",
                code="invalid_model_sizes",
            )
        for name, per_layer in (
            ("active", self.layer_active_bytes),
            ("routed expert", self.layer_expert_bytes),
        ):
            if per_layer and (
                len(per_layer) != len(self.layer_bytes)
                or any(not 0 <= a <= b for a, b in zip(per_layer, self.layer_bytes, strict=True))
            ):
                raise UsageError(
                    f"each layer's {name} bytes must be within 0..its bytes",
                    code="invalid_model_sizes",
                )

    @property
    def layer_count(self) -> int:
        return len(self.layer_bytes)

    @property
    def active_bytes(self) -> tuple[int, ...]:
        return self.layer_active_bytes or self.layer_bytes

    @property
    def expert_bytes(self) -> tuple[int, ...]:
        return self.layer_expert_bytes or (0,) * len(self.layer_bytes)

    @property
    def moe(self) -> bool:
        return self.active_bytes != self.layer_bytes

    def stage_active_bytes(self, r: LayerRange) -> int:
        """``stage_bytes`` with each layer counted by what a token reads of it."""
        layers = self.layer_bytes[r.start : r.stop]
        return self.stage_bytes(r) - sum(layers) + sum(self.active_bytes[r.start : r.stop])

    def layer_weight(self, r: LayerRange) -> float:
        """``r``'s decode work in mean layers: its active bytes over the mean layer's (its
        layer count when every layer reads the same bytes)."""
        active = self.active_bytes
        mean = sum(active) / max(1, len(active))
        return sum(active[r.start : r.stop]) / mean if mean > 0 else float(len(r))

    @property
    def final_embeddings(self) -> bool:
        """The final stage holds the token embeddings: its head is tied to them, or its NextN
        draft head embeds tokens with them (``skippy.package.select.head_embeddings``)."""
        return self.tied_embeddings or self.tail_layers > 0

    def stage_bytes(self, r: LayerRange) -> int:
        total = self.metadata_bytes + sum(self.layer_bytes[r.start : r.stop])
        if r.owns_input or (r.owns_output and self.final_embeddings):
            total += self.embeddings_bytes
        if r.owns_output:
            total += self.output_bytes
        return total


@dataclass(frozen=True)
class StagePlan:
    index: int
    layers: LayerRange
    bytes: int
    tied_embeddings: bool = False
    active_bytes: int | None = None  # what a token reads (None: every byte)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.index,
            "layer_start": self.layers.start,
            "layer_end": self.layers.stop,
            "layer_count": len(self.layers),
            "owns_embeddings": self.layers.owns_input,
            "owns_output": self.layers.owns_output,
            # A tied final stage projects logits through the embedding matrix, so holds it too.
            "holds_embeddings": self.layers.owns_input
            or (self.layers.owns_output and self.tied_embeddings),
            "total_bytes": self.bytes,
            # Decode reads this much per token: less than total_bytes for a mixture of experts.
            "active_bytes": self.bytes if self.active_bytes is None else self.active_bytes,
        }


def tail_layers(layer_count: int, generation: Mapping[str, Any] | None) -> int:
    """The NextN/MTP layers at the end of a package, from its ``generation`` object: the
    native-MTP proposers' ``layer_indices`` when they are the package's last layers (the
    writer records them so, ``skippy.generation.infer``); 0 otherwise."""
    sd = (generation or {}).get(gv.SPECULATIVE)
    proposers = sd.get(gv.SD_PROPOSERS) if isinstance(sd, Mapping) else None
    found: set[int] = set()
    for p in (proposers or {}).values() if isinstance(proposers, Mapping) else ():
        if isinstance(p, Mapping) and p.get(gv.TYPE) == gv.NATIVE_MTP:
            found |= {i for i in p.get(gv.LAYER_INDICES) or () if isinstance(i, int)}
    if not found or found != set(range(layer_count - len(found), layer_count)):
        return 0
    return len(found) if len(found) < layer_count else 0


def check_stage_count(stages: int, layer_count: int, tail: int = 0) -> None:
    if stages < 1:
        raise UsageError(
            f"stage count must be at least 1, got {stages}", code="invalid_stage_count"
        )
    if stages > layer_count - tail:
        also = f" ({tail} NextN layer(s) go with the last)" if tail else ""
        raise UsageError(
            f"{stages} stages cannot split {layer_count} layers (each stage needs a layer"
            f"{also})",
            code="stage_count_exceeds_layer_count",
        )


def even_ranges(layer_count: int, stages: int, tail: int = 0) -> list[LayerRange]:
    """The trunk (all but the ``tail`` layers) split as evenly as it goes, the final stage
    also holding the tail."""
    check_stage_count(stages, layer_count, tail)
    base, extra = divmod(layer_count - tail, stages)
    out, start = [], 0
    for i in range(stages):
        stop = start + base + (1 if i < extra else 0)
        out.append(LayerRange(start, layer_count if i == stages - 1 else stop, layer_count))
        start = stop
    return out


def byte_balanced_ranges(sizes: ModelSizes, stages: int) -> list[LayerRange]:
    """Contiguous ranges minimising the largest stage's bytes (ties: earlier cuts)."""
    n, tail = sizes.layer_count, sizes.tail_layers
    check_stage_count(stages, n, tail)
    inf = float("inf")
    # best[k][j]: minimal max-bytes splitting layers [0, j) into k stages; cut[k][j] the start
    # of the k-th stage. O(stages * n^2), fine for real layer counts (a few hundred).
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    prefix = [0]
    for b in sizes.layer_bytes:
        prefix.append(prefix[-1] + b)

    def stage_cost(i: int, j: int) -> int:  # == sizes.stage_bytes(LayerRange(i, j, n))
        total = sizes.metadata_bytes + prefix[j] - prefix[i]
        if i == 0 or (j == n and sizes.final_embeddings):
            total += sizes.embeddings_bytes
        return total + (sizes.output_bytes if j == n else 0)

    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            if n - tail <= j < n:  # a cut there would part the tail from the trunk's end
                continue
            for i in range(k - 1, j):
                if best[k - 1][i] == inf:
                    continue
                cost = max(best[k - 1][i], stage_cost(i, j))
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    ranges, j = [], n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        ranges.append(LayerRange(i, j, n))
        j = i
    return ranges[::-1]


def plan_stages(sizes: ModelSizes, stages: int, balance: Balance = "layers") -> list[StagePlan]:
    ranges = (
        byte_balanced_ranges(sizes, stages)
        if balance == "bytes"
        else even_ranges(sizes.layer_count, stages, sizes.tail_layers)
    )
    return [
        StagePlan(
            i, r, sizes.stage_bytes(r), sizes.final_embeddings, sizes.stage_active_bytes(r)
        )
        for i, r in enumerate(ranges)
    ]
