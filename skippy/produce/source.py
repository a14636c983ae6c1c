"""A source model opened for packaging: one GGUF, or every shard of a llama.cpp split set.

Shards are named ``PREFIX-0000k-of-0000N.gguf``; giving the first one reads all N. The merged
view exposes shard 0's KV section (minus the ``split.*`` keys, which describe the old split)
and every tensor with the file descriptor that holds its bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from skippy.constants import (
    KEY_ARCHITECTURE,
    KEY_SPLIT_COUNT,
    KEY_SPLIT_NO,
    SPLIT_KEYS,
    SPLIT_SHARD_RE,
    arch_key,
)
from skippy.errors import InputUnreadable, ModelError
from skippy.gguf.reader import GGUFFile, KVField, TensorInfo, open_gguf

if TYPE_CHECKING:  # the writer (and its hashing, atomic installs) is not needed to read
    from skippy.gguf.writer import TensorSource


def shard_paths(first: Path) -> list[Path]:
    """All shards of a split set given its first shard, or ``[first]`` for a plain GGUF."""
    m = SPLIT_SHARD_RE.match(first.name)
    if not m:
        return [first]
    no, count = int(m.group("no")), int(m.group("count"))
    if no != 1:
        raise InputUnreadable(
            f"{first.name} is shard {no} of a split set; pass the first shard "
            f"({m.group('prefix')}-00001-of-{count:05d}.gguf)",
            code="not_first_shard",
            path=str(first),
        )
    paths = [
        first.with_name(f"{m.group('prefix')}-{k:05d}-of-{count:05d}.gguf")
        for k in range(1, count + 1)
    ]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise InputUnreadable(
            f"split set {first.name} is incomplete: missing {', '.join(missing)}",
            code="missing_split_shard",
            path=str(first.parent / missing[0]),
        )
    return paths


@dataclass(frozen=True)
class SourceTensor:
    info: TensorInfo
    shard: int


class SourceModelFiles:
    """Open shards of one source model. Close it (or use ``with``) when done."""

    def __init__(self, path: Path, *, shards: Sequence[Path] | None = None) -> None:
        """``shards``: the parts in ``split.no`` order when their names do not say it (a layer
        package's fragments, re-read by skippy-quantize); ``path`` is then the first."""
        if not path.is_file():
            raise InputUnreadable(
                f"source model {path} does not exist or is not a file", path=str(path)
            )
        self.paths = list(shards) if shards else shard_paths(path)
        self.shards: list[GGUFFile] = []
        try:  # every failure below must close the shards opened so far (fds and mmaps)
            for p in self.paths:
                self.shards.append(open_gguf(p))
            self._check_split_keys()
            self.tensors: list[SourceTensor] = [
                SourceTensor(t, i) for i, g in enumerate(self.shards) for t in g.tensors
            ]
            seen: set[str] = set()
            for t in self.tensors:
                if t.info.name in seen:
                    raise ModelError(
                        f"the split set's shards repeat the tensor {t.info.name!r} (again in "
                        f"{self.paths[t.shard].name}); a tensor must live in exactly one shard",
                        code="duplicate_source_tensor",
                        path=str(self.paths[t.shard]),
                    )
                seen.add(t.info.name)
        except BaseException:
            self.close()
            raise

    def _check_split_keys(self) -> None:
        if len(self.shards) == 1:
            return
        for i, g in enumerate(self.shards):
            no = g.get(KEY_SPLIT_NO)
            if no != i:
                raise ModelError(
                    f"{g.path.name}: {KEY_SPLIT_NO} is {no}, expected {i}",
                    code="bad_split_shard",
                    path=str(g.path),
                )
        count = self.head.get(KEY_SPLIT_COUNT)
        if count != len(self.shards):
            raise ModelError(
                f"{self.head.path.name}: {KEY_SPLIT_COUNT} is {count}, but "
                f"{len(self.shards)} shards are named",
                code="bad_split_shard",
            )

    @property
    def head(self) -> GGUFFile:
        return self.shards[0]

    @property
    def alignment(self) -> int:
        return self.head.alignment

    def kv_fields(self) -> Iterator[KVField]:
        """Shard 0's KV records minus the split bookkeeping of the source's own split set."""
        return (f for k, f in self.head.fields.items() if k not in SPLIT_KEYS)

    def tensor_source(self, t: SourceTensor) -> TensorSource:
        from skippy.gguf.writer import TensorSource

        return TensorSource(t.info, self.shards[t.shard].fileno())

    @property
    def architecture(self) -> str:
        arch = self.head.get(KEY_ARCHITECTURE)
        if not isinstance(arch, str) or not arch:
            raise ModelError(
                f"{self.head.path.name} has no {KEY_ARCHITECTURE}; cannot tell its layer count",
                code="missing_model_key",
            )
        return arch

    def arch_value(self, name: str) -> Any:
        return self.head.get(arch_key(self.architecture, name))

    def metadata(self) -> dict[str, Any]:
        """Decoded KV values, skipping large arrays (the tokenizer) nobody here needs."""
        out: dict[str, Any] = {}
        for f in self.kv_fields():
            if f.count <= 4096:
                out[f.key] = self.head.value(f.key)
        return out

    def close(self) -> None:
        for g in self.shards:
            with contextlib.suppress(Exception):
                g.close()

    def __enter__(self) -> SourceModelFiles:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
