"""A serving coordinator's persisted run state: ``data_dir/serving/split.json``.

What a restarted coordinator needs to re-form the split it ran: the package it served (ref,
manifest SHA-256, stage count), the run id, and the last topology it signed (with the
signature, as it was sent). Written through the one atomic-install recipe
(``skippy.atomic.atomic_write_bytes``, durable) each time a topology becomes active; read once
at ``serve`` start. A file that cannot be read or parsed is reported and ignored: the
coordinator then plans afresh, which is always safe (workers accept any topology this node
signs; only the bytes already in their caches are saved).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from skippy.atomic import atomic_write_bytes
from skippy.errors import TopologyError
from skippy.package.topology import SplitTopology

log = logging.getLogger("mesh_node.serving.state")
STATE_VERSION: Final = 1
STATE_DIR: Final = "serving"
STATE_FILE: Final = "split.json"
MAX_STATE_BYTES: Final = 4 * 1024 * 1024


@dataclass(frozen=True)
class SplitState:
    coordinator_id: str
    package_ref: str
    manifest_sha256: str
    stages: int | None  # as asked (``--stages``), None: every capable peer
    topology: SplitTopology
    signature: bytes

    def to_json(self) -> bytes:
        doc = {
            "version": STATE_VERSION,
            "coordinator_id": self.coordinator_id,
            "package_ref": self.package_ref,
            "manifest_sha256": self.manifest_sha256,
            "stages": self.stages,
            "topology": self.topology.to_dict(),
            "signature": self.signature.hex(),
        }
        return json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes) -> SplitState:
        doc: Any = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
            raise ValueError(f"not a version {STATE_VERSION} serving state")
        stages = doc.get("stages")
        if not (stages is None or (isinstance(stages, int) and stages >= 1)):
            raise ValueError("stages must be a positive integer or null")
        for key in ("coordinator_id", "package_ref", "manifest_sha256", "signature"):
            if not isinstance(doc.get(key), str):
                raise ValueError(f"{key} must be a string")
        topology = SplitTopology.from_dict(doc["topology"])
        return cls(
            doc["coordinator_id"],
            doc["package_ref"],
            doc["manifest_sha256"],
            stages,
            topology,
            bytes.fromhex(doc["signature"]),
        )

    def matches(
        self, coordinator_id: str, package_ref: str, manifest: str, stages: int | None
    ) -> bool:
        """The same identity serving the same package the same way: the split can be re-formed."""
        return (
            self.coordinator_id == coordinator_id
            and self.package_ref == package_ref
            and self.manifest_sha256 == manifest
            and self.stages == stages
            and self.topology.package_ref == package_ref
            and self.topology.manifest_sha256 == manifest
        )


def state_path(data_dir: Path) -> Path:
    return data_dir / STATE_DIR / STATE_FILE


def save_state(data_dir: Path, state: SplitState) -> None:
    path = state_path(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, state.to_json(), durable=True)


def load_state(data_dir: Path) -> SplitState | None:
    """The persisted state, or ``None`` (none yet, or unreadable: logged, never trusted)."""
    path = state_path(data_dir)
    try:
        if path.stat().st_size > MAX_STATE_BYTES:
            raise ValueError(f"larger than {MAX_STATE_BYTES} bytes")
        return SplitState.from_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TopologyError) as exc:
        log.warning("ignoring the serving state %s: %s (planning afresh)", path, exc)
        return None


class RunFile:
    """The run one split of a coordinator persists (its ``run_file`` duty): read once when
    it starts, written each time a new topology of it becomes active."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._saved: str | None = None  # the topology id last written

    def load(self) -> SplitState | None:
        return load_state(self.data_dir)

    def save(self, state: SplitState) -> None:
        """Write ``state`` unless its topology is the one last written; a write that fails
        is logged (the run then re-forms from the previous file, or plans afresh)."""
        if self._saved == state.topology.topology_id:
            return
        try:
            save_state(self.data_dir, state)
            self._saved = state.topology.topology_id
        except OSError as exc:
            log.warning("could not persist the serving state: %s", exc)
