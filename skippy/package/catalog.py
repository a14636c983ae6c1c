"""The one internal view of a package's tensors, for both schema versions: tensor name ->
(artifact, absolute offset, stored length, ggml type, dims, layer).

A v2 package's catalog comes from its metadata carrier (``skippy.package.v2_carrier``); a v1
package's from its fragments' own GGUF headers (``catalog_from_fragments``). Selection,
verification and the runtimes read the same value either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from skippy.findings import Finding
from skippy.package.ownership import owner_of


@dataclass(frozen=True)
class CatalogTensor:
    name: str
    artifact_id: str  # v1: the artifact's path (v1 has no ids)
    path: str  # package-relative path of the file holding the bytes
    offset: int  # absolute byte offset in that file
    nbytes: int  # stored length, padding excluded
    ggml_type: int
    shape: tuple[int, ...]  # GGUF order, ne0 first
    layer: int | None
    alignment: int


@dataclass(frozen=True)
class TensorCatalog:
    tensors: tuple[CatalogTensor, ...]  # sorted by name
    _by_name: dict[str, CatalogTensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tensors})

    def __iter__(self) -> Iterator[CatalogTensor]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str) -> CatalogTensor:
        return self._by_name[name]

    def names(self) -> set[str]:
        return set(self._by_name)

    def in_artifact(self, artifact_id: str) -> list[CatalogTensor]:
        return [t for t in self.tensors if t.artifact_id == artifact_id]

    def to_dict(self) -> list[dict[str, object]]:
        return [
            {
                "name": t.name,
                "artifact_id": t.artifact_id,
                "path": t.path,
                "offset": t.offset,
                "nbytes": t.nbytes,
                "ggml_type": t.ggml_type,
                "dims": list(t.shape),
                "layer": t.layer,
            }
            for t in self.tensors
        ]


def catalog_from_fragments(files: Iterable[tuple[str, Path]]) -> TensorCatalog:
    """A v1 package's catalog: (manifest path, local file) of each fragment, read through the
    bounded GGUF reader (offsets absolute, as the reader derives them)."""
    from skippy.gguf.reader import open_gguf

    out: list[CatalogTensor] = []
    for rel, path in files:
        with open_gguf(path) as g:
            for t in g.tensors:
                out.append(
                    CatalogTensor(
                        name=t.name,
                        artifact_id=rel,
                        path=rel,
                        offset=t.data_start,
                        nbytes=t.nbytes,
                        ggml_type=t.ggml_type,
                        shape=t.shape,
                        layer=owner_of(t.name).layer_index,
                        alignment=g.alignment,
                    )
                )
    return TensorCatalog(tuple(sorted(out, key=lambda c: c.name)))


def part_directory_findings(
    catalog: TensorCatalog, artifact_id: str, path: str, tensors: Iterable[object]
) -> list[Finding]:
    """A v2 payload part's own GGUF directory against the carrier's locators: the same
    tensors, each at the same absolute offset with the same length, type and dims (spec
    "v2 verify": the storage record equals the emitted directory). ``tensors``: the part's
    ``TensorInfo`` list."""
    from skippy.gguf.reader import TensorInfo

    want = {t.name: t for t in catalog.in_artifact(artifact_id)}
    out: list[Finding] = []
    seen: set[str] = set()
    for t in tensors:
        if not isinstance(t, TensorInfo):
            continue
        seen.add(t.name)
        c = want.get(t.name)
        if c is None:
            out.append(
                Finding(
                    "unexpected_tensor",
                    f"{path} holds tensor {t.name!r}, which the carrier does not place there",
                    path=path,
                )
            )
        elif (t.data_start, t.nbytes, t.ggml_type, t.shape) != (
            c.offset,
            c.nbytes,
            c.ggml_type,
            c.shape,
        ):
            out.append(
                Finding(
                    "package_storage_mismatch",
                    f"{path}: tensor {t.name!r} is at [{t.data_start}, +{t.nbytes}) type "
                    f"{t.ggml_type} dims {list(t.shape)}; the carrier says [{c.offset}, "
                    f"+{c.nbytes}) type {c.ggml_type} dims {list(c.shape)}",
                    path=path,
                )
            )
    for name in sorted(set(want) - seen):
        out.append(
            Finding(
                "missing_tensor",
                f"{path} lacks tensor {name!r}, which the carrier places there",
                path=path,
            )
        )
    return out
