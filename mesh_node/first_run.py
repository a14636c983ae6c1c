"""``mesh-node serve`` without ``--config``: the node a data directory holds, made on first use.

A fresh data directory (created 0700) gets a node key and an owner key
(``mesh_node.identity``, as ``mesh-node keygen`` and ``owner init`` write them: 0600, atomic,
never over an existing file), the owner's certificate for the node (as ``owner sign``) and a
``node.toml`` naming them (``mesh_node.settings.default_node_toml``). The node then starts from
that file through the one config reader, like any other; a later start finds the same files
and reuses them, and ``mesh-node run``/``status --config DIR/node.toml`` see the same node.
Every step is one line for the terminal (``DefaultNode.notes``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from mesh_node.identity import (
    DEFAULT_CERT_DAYS,
    issue_certificate,
    load_certificate,
    load_private_key,
    node_id_of,
    short_id,
    write_certificate,
    write_private_key,
)
from mesh_node.settings import NODE_TOML_NAME, default_node_toml
from skippy.atomic import atomic_install
from skippy.errors import UsageError

NODE_KEY_NAME = "node.key"
OWNER_KEY_NAME = "owner.key"
NODE_CERT_NAME = "node.cert"


@dataclass(frozen=True)
class DefaultNode:
    config_path: Path
    node_id: str
    owner_id: str
    created: bool  # anything was created now (a first run)
    notes: tuple[str, ...]  # what was created or reused, one line each


def prepare_default_node(data_dir: Path) -> DefaultNode:
    """Create what is missing of the node in ``data_dir`` and return its config file."""
    data_dir = data_dir.expanduser().resolve()
    if data_dir.exists() and not data_dir.is_dir():
        raise UsageError(
            f"data directory {data_dir} exists and is not a directory",
            code="data_dir_not_a_directory",
            path=str(data_dir),
            remediation="point --data-dir at a folder (it is created if missing)",
        )
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"cannot create data directory {data_dir}: {exc.strerror or exc}",
            code="data_dir_unusable",
            path=str(data_dir),
            remediation="choose a writable folder with --data-dir",
        ) from None
    notes: list[str] = []
    created = False

    def key(name: str, what: str) -> str:
        nonlocal created
        path = data_dir / name
        if path.exists():
            return node_id_of(load_private_key(path))
        ident = node_id_of(write_private_key(path))
        notes.append(f"created {what} key {path} ({short_id(ident)}…, mode 0600)")
        created = True
        return ident

    node_id = key(NODE_KEY_NAME, "node")
    owner_id = key(OWNER_KEY_NAME, "owner")
    cert_path = data_dir / NODE_CERT_NAME
    renew = _certificate_problem(cert_path, node_id, owner_id)
    if renew is not None:
        cert = issue_certificate(
            load_private_key(data_dir / OWNER_KEY_NAME), node_id, days=DEFAULT_CERT_DAYS
        )
        write_certificate(cert_path, cert, replace=cert_path.exists())
        notes.append(
            f"certified this node for its owner: {cert_path} ({renew}; valid "
            f"{DEFAULT_CERT_DAYS} days, renewed by a start after that)"
        )
        created = True
    config = data_dir / NODE_TOML_NAME
    if not config.exists():
        with atomic_install(config, durable=True) as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(default_node_toml(NODE_KEY_NAME, NODE_CERT_NAME).encode())
        notes.append(f"wrote {config} (edit it to change the node's settings)")
        created = True
    if not created:
        notes.append(
            f"using the node in {data_dir} (node {short_id(node_id)}…, owner "
            f"{short_id(owner_id)}…; {NODE_TOML_NAME}, {NODE_KEY_NAME}, {NODE_CERT_NAME})"
        )
    return DefaultNode(config, node_id, owner_id, created, tuple(notes))


def _certificate_problem(path: Path, node_id: str, owner_id: str) -> str | None:
    """Why the node's certificate must be (re)issued by the owner key here, or None. One
    of another owner (an operator's own, put there on purpose) is left alone: the node's
    start reports its status like any configured certificate's."""
    if not path.exists():
        return "first run"
    cert = load_certificate(path)
    if cert.owner_id.hex() != owner_id:
        return None
    status, reason = cert.status_for(bytes.fromhex(node_id), time.time())
    return None if status == "verified" else f"renewed: {reason}"
