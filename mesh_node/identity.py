"""Node and owner keys on disk, owner certificates, and the trust decision.

Keys are Ed25519 (``cryptography``), stored as unencrypted PKCS#8 PEM, written 0600 through the
one atomic-install recipe and refused when group- or world-readable. The trust decision is a
pure function over plain data, for the artifact-transfer authorization to consume.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    load_pem_private_key,
)

from mesh_node.errors import IdentityError, KeyFilePermissions
from protocol.certificates import OwnerCertificate, OwnerStatus, public_bytes
from protocol.errors import ProtocolError
from skippy.atomic import atomic_install
from skippy.errors import OutputExists

MAX_KEY_FILE_BYTES = 4096
MAX_CERT_FILE_BYTES = 4096
DEFAULT_CERT_DAYS = 365


def node_id_of(key: Ed25519PrivateKey) -> str:
    """The node (or owner) id: the 32-byte public key as 64 lowercase hex characters."""
    return public_bytes(key.public_key()).hex()


def short_id(node_id: str) -> str:
    return node_id[:12]


def write_private_key(path: Path) -> Ed25519PrivateKey:
    """Generate a key and write it 0600 (never over an existing file)."""
    if path.exists():
        raise OutputExists(
            f"{path} already exists; refusing to replace a key",
            path=str(path),
            remediation="choose another path, or delete the old key if you mean to",
        )
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    with atomic_install(path, durable=True) as f:
        os.fchmod(f.fileno(), 0o600)  # before a single secret byte is written
        f.write(pem)
    return key


def check_private_mode(st: os.stat_result, path: Path, what: str = "a private key") -> None:
    """A secret's file must be readable by its owner only (node keys, HTTP API keys, the TLS
    key): ``key_file_permissions`` otherwise."""
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFilePermissions(
            f"key file {path} is accessible by group or others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); {what} must be 0600",
            path=str(path),
            remediation=f"chmod 600 {path}",
        )


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise IdentityError(
            f"key file {path} does not exist",
            path=str(path),
            remediation="create one with: mesh-node keygen PATH",
        ) from None
    except OSError as exc:
        raise IdentityError(
            f"cannot open key file {path}: {exc.strerror}", path=str(path)
        ) from None
    with os.fdopen(fd, "rb") as f:
        check_private_mode(os.fstat(f.fileno()), path)
        data = f.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise IdentityError(f"{path} is too large to be a key file", path=str(path))
    try:
        key = load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise IdentityError(f"{path} is not a PEM private key: {exc}", path=str(path)) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"{path} holds a {type(key).__name__}, not Ed25519", path=str(path))
    return key


def issue_certificate(
    owner_key: Ed25519PrivateKey, node_id: str, *, days: int, now_s: float | None = None
) -> OwnerCertificate:
    try:
        node = bytes.fromhex(node_id)
    except ValueError:
        node = b""
    if len(node) != 32 or node.hex() != node_id:
        raise IdentityError(
            f"{node_id!r} is not a node id (64 lowercase hex characters)", code="invalid_node_id"
        )
    if days < 1:
        raise IdentityError("--days must be at least 1", code="usage")
    now = int(time.time() if now_s is None else now_s)
    return OwnerCertificate.issue(owner_key, node, now - 60, now + days * 86400)


def write_certificate(path: Path, cert: OwnerCertificate, *, replace: bool = False) -> None:
    """Write ``cert`` (never over an existing file unless ``replace``: a renewal)."""
    if path.exists() and not replace:
        raise OutputExists(f"{path} already exists; refusing to replace it", path=str(path))
    with atomic_install(path, durable=True) as f:
        os.fchmod(f.fileno(), 0o600)
        f.write((json.dumps(cert.to_dict(), indent=2) + "\n").encode())


def load_certificate(path: Path) -> OwnerCertificate:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CERT_FILE_BYTES + 1)
    except OSError as exc:
        raise IdentityError(
            f"cannot read certificate {path}: {exc.strerror}", path=str(path)
        ) from None
    try:
        if len(data) > MAX_CERT_FILE_BYTES:
            raise ValueError("file too large")
        return OwnerCertificate.from_dict(json.loads(data))
    except (ValueError, ProtocolError) as exc:
        raise IdentityError(
            f"{path} is not an owner certificate: {exc}",
            path=str(path),
            code="invalid_certificate",
        ) from None


@dataclass(frozen=True)
class LocalIdentity:
    """This node: its key, its certificate and its owner's status as seen by itself."""

    key: Ed25519PrivateKey
    certificate: OwnerCertificate | None

    @property
    def node_id(self) -> str:
        return node_id_of(self.key)

    def owner(self, now_s: float) -> tuple[str | None, OwnerStatus]:
        return owner_of(self.certificate, bytes.fromhex(self.node_id), now_s)


def owner_of(
    cert: OwnerCertificate | None, node_id: bytes, now_s: float
) -> tuple[str | None, OwnerStatus]:
    """(owner id or None, owner status) for a certificate presented by ``node_id``."""
    if cert is None:
        return None, "unverified"
    status, _reason = cert.status_for(node_id, now_s)
    return cert.owner_id.hex(), status


def is_trusted(
    owner_id: str | None,
    owner_status: OwnerStatus,
    *,
    own_owner_id: str | None,
    own_owner_status: OwnerStatus,
    trusted_owners: tuple[str, ...],
) -> bool:
    """Trusted when the peer's owner is verified and is this node's own (verified)
    owner or listed in ``trusted_owners``; nothing else is."""
    return trust_decision(
        owner_id,
        owner_status,
        own_owner_id=own_owner_id,
        own_owner_status=own_owner_status,
        trusted_owners=trusted_owners,
    )[0]


def trust_decision(
    owner_id: str | None,
    owner_status: OwnerStatus,
    *,
    own_owner_id: str | None,
    own_owner_status: OwnerStatus,
    trusted_owners: tuple[str, ...],
) -> tuple[bool, str]:
    """``is_trusted`` with the reason an operator reads on the status page (one rule)."""
    if owner_status == "unverified" or owner_id is None:
        return False, "no owner certificate"
    if owner_status != "verified":
        return False, "owner certificate invalid (bad signature, expired, or not this key)"
    if owner_id == own_owner_id and own_owner_status == "verified":
        return True, "same owner as this node"
    if owner_id in trusted_owners:
        return True, "owner listed in trusted_owners"
    if owner_id == own_owner_id:
        return False, "same owner, but this node's own certificate is not verified"
    return False, "owner is not this node's and not in trusted_owners"


def load_local_identity(key_path: Path, cert_path: Path | None) -> LocalIdentity:
    key = load_private_key(key_path)
    cert = load_certificate(cert_path) if cert_path is not None else None
    if cert is not None and cert.node_id != public_bytes(key.public_key()):
        raise IdentityError(
            f"certificate {cert_path} was issued to node {cert.node_id.hex()}, not to this node "
            f"({node_id_of(key)})",
            path=str(cert_path),
            code="certificate_mismatch",
        )
    return LocalIdentity(key, cert)
