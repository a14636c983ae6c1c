"""Split planning: contiguous layer ranges per stage, and each stage's bytes (pure).

Default split: the first ``L % N`` stages get one extra layer. ``balance="bytes"`` minimises
the largest stage's bytes instead (exact dynamic programme over contiguous partitions),
counting the boundary artifacts each stage must also hold (spec "Layer Selection"). A
package's NextN (draft head) layers, its last ones, go with the final stage: the split is
planned over the trunk and the final stage takes them too (never a stage of its own).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from skippy.errors import UsageError
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
    # The last layers that are NextN (multi-token prediction) blocks: the final stage holds
    # them beside its trunk layers (``plan_stages``).
    nextn_layers: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.nextn_layers < max(1, len(self.layer_bytes)):
            raise UsageError(
                f"{self.nextn_layers} NextN layers leave no trunk layer of "
                f"{len(self.layer_bytes)}",
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
    def trunk_count(self) -> int:
        """The layers a split can cut between (every layer but the NextN tail)."""
        return self.layer_count - self.nextn_layers

    def trunk(self) -> ModelSizes:
        """These sizes over the trunk only, the NextN tail's bytes counted in the last trunk
        layer (they travel together)."""
        t = self.trunk_count
        if t == self.layer_count:
            return self

        def fold(per_layer: tuple[int, ...]) -> tuple[int, ...]:
            return (*per_layer[: t - 1], sum(per_layer[t - 1 :])) if per_layer else ()

        return replace(
            self,
            layer_bytes=fold(self.layer_bytes),
            layer_active_bytes=fold(self.layer_active_bytes),
            layer_expert_bytes=fold(self.layer_expert_bytes),
            nextn_layers=0,
        )

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

    def stage_bytes(self, r: LayerRange) -> int:
        total = self.metadata_bytes + sum(self.layer_bytes[r.start : r.stop])
        if r.owns_input or (r.owns_output and self.tied_embeddings):
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


def check_stage_count(stages: int, layer_count: int) -> None:
    if stages < 1:
        raise UsageError(
            f"stage count must be at least 1, got {stages}", code="invalid_stage_count"
        )
    if stages > layer_count:
        raise UsageError(
            f"{stages} stages cannot split {layer_count} layers (each stage needs a layer)",
            code="stage_count_exceeds_layer_count",
        )


def even_ranges(layer_count: int, stages: int) -> list[LayerRange]:
    check_stage_count(stages, layer_count)
    base, extra = divmod(layer_count, stages)
    out, start = [], 0
    for i in range(stages):
        stop = start + base + (1 if i < extra else 0)
        out.append(LayerRange(start, stop, layer_count))
        start = stop
    return out


def byte_balanced_ranges(sizes: ModelSizes, stages: int) -> list[LayerRange]:
    """Contiguous ranges minimising the largest stage's bytes (ties: earlier cuts)."""
    n = sizes.layer_count
    check_stage_count(stages, n)
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
        if i == 0 or (j == n and sizes.tied_embeddings):
            total += sizes.embeddings_bytes
        return total + (sizes.output_bytes if j == n else 0)

    for k in range(1, stages + 1):
        for j in range(k, n + 1):
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


def with_nextn_tail(ranges: list[LayerRange], layer_count: int) -> list[LayerRange]:
    """Ranges planned over a model's trunk, as ranges of its ``layer_count`` layers: the
    final stage also takes the NextN layers after the trunk."""
    n = len(ranges)
    return [
        LayerRange(r.start, layer_count if i == n - 1 else r.stop, layer_count)
        for i, r in enumerate(ranges)
    ]


def plan_stages(sizes: ModelSizes, stages: int, balance: Balance = "layers") -> list[StagePlan]:
    trunk = sizes.trunk()
    ranges = (
        byte_balanced_ranges(trunk, stages)
        if balance == "bytes"
        else even_ranges(trunk.layer_count, stages)
    )
    ranges = with_nextn_tail(ranges, sizes.layer_count)
    return [
        StagePlan(
            i, r, sizes.stage_bytes(r), sizes.tied_embeddings, sizes.stage_active_bytes(r)
        )
        for i, r in enumerate(ranges)
    ]
