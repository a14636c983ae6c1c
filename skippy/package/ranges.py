"""The one half-open layer range type: never two loose ints, never inclusive ends."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from skippy.errors import UsageError

# ASCII digits only (re.ASCII): "１..２" is not a range. A sign is matched so that "-1..2" gets
# the real reason, not "not of the form A..B".
_RANGE_RE = re.compile(r"\A\s*([+-]?\d+)\s*\.\.\s*([+-]?\d+)\s*\Z", re.ASCII)


@dataclass(frozen=True, order=True)
class LayerRange:
    """Layers ``start`` (inclusive) to ``stop`` (exclusive) of a model with ``layer_count``."""

    start: int
    stop: int
    layer_count: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop <= self.layer_count:
            raise UsageError(
                f"layer range {self.start}..{self.stop} is empty or outside 0..{self.layer_count}",
                code="invalid_layer_range",
                remediation=f"use A..B with 0 <= A < B <= {self.layer_count}",
            )

    @property
    def owns_input(self) -> bool:
        return self.start == 0

    @property
    def owns_output(self) -> bool:
        return self.stop == self.layer_count

    @property
    def is_full(self) -> bool:
        return self.owns_input and self.owns_output

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and self.start <= index < self.stop

    def __str__(self) -> str:
        return f"{self.start}..{self.stop}"


def parse_layer_range(text: str, layer_count: int) -> LayerRange:
    """Parse ``A..B`` (half-open) at the edge; everything inside takes a ``LayerRange``."""
    m = _RANGE_RE.match(text)
    if not m or max(len(m.group(1)), len(m.group(2))) > 12:
        raise UsageError(
            f"layer range {text!r} is not of the form A..B (half-open, ASCII digits, e.g. 0..6)",
            code="invalid_layer_range",
            remediation=f"use A..B with 0 <= A < B <= {layer_count}",
        )
    start, stop = int(m.group(1)), int(m.group(2))
    if start < 0 or stop < 0:
        raise UsageError(
            f"layer range {text!r}: layer numbers are never negative",
            code="invalid_layer_range",
            remediation=f"use A..B with 0 <= A < B <= {layer_count}",
        )
    return LayerRange(start, stop, layer_count)
