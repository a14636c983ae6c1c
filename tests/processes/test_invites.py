"""Invites: ``mesh-node invite`` prints a signed, expiring token; ``run``/``serve --join``
checks it (form, owner signature, expiry, mesh) and dials its nodes as configured peers.
The token's codec against changed bytes, other keys and clocks; then real processes: a node
joins a running one through its invite, and every refusal exits 2 with its code and writes
nothing."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from test_mesh_processes import make_keys, mesh, start, stop, wait_status, write_config

from mesh_node.errors import InviteRefused
from mesh_node.invites import join_peers, parse_ttl, read_invite
from protocol.certificates import public_bytes
from protocol.errors import ProtocolError
from protocol.invite import (
    INVITE_PREFIX,
    Invite,
    InviteAddress,
    check_validity,
    decode_invite,
    encode_invite,
    owner_fingerprint,
)

NODE = "ab" * 32
RELAY = "cd" * 32


def _invite(owner: Ed25519PrivateKey, *, iat: int = 1_000, exp: int = 2_000) -> Invite:
    addrs = (
        InviteAddress("direct", "ws://10.0.0.1:7000", NODE),
        InviteAddress("relayed", "ws://10.99.0.2:7000", NODE, via=RELAY),
    )
    return Invite(public_bytes(owner.public_key()), iat, exp, addrs)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def test_a_token_round_trips_with_its_mesh_fingerprint_and_address_kinds() -> None:
    owner = Ed25519PrivateKey.generate()
    invite = _invite(owner)
    token = encode_invite(invite, owner)
    assert token.startswith(INVITE_PREFIX) and "\n" not in token
    back = decode_invite(token)
    assert back == invite
    assert back.fingerprint == owner_fingerprint(back.owner_id) and len(back.fingerprint) == 16
    assert [a.kind for a in back.addresses] == ["direct", "relayed"]
    assert back.addresses[1].via == RELAY


def test_every_changed_byte_of_the_body_or_signature_is_refused() -> None:
    owner = Ed25519PrivateKey.generate()
    token = encode_invite(_invite(owner), owner)
    body_b64, sig_b64 = token[len(INVITE_PREFIX) :].split(".")
    body = base64.urlsafe_b64decode(body_b64 + "=" * (-len(body_b64) % 4))
    sig = base64.urlsafe_b64decode(sig_b64 + "=" * (-len(sig_b64) % 4))
    for i in range(len(body)):
        changed = bytearray(body)
        changed[i] ^= 0x01
        forged = INVITE_PREFIX + _b64(bytes(changed)) + "." + sig_b64
        with pytest.raises(ProtocolError) as err:
            decode_invite(forged)
        assert err.value.code in ("invite_signature", "malformed_invite"), i
    for i in range(len(sig)):
        changed = bytearray(sig)
        changed[i] ^= 0x80
        with pytest.raises(ProtocolError, match="invite_signature"):
            decode_invite(INVITE_PREFIX + body_b64 + "." + _b64(bytes(changed)))


def test_a_token_naming_one_owner_signed_by_another_is_refused() -> None:
    owner, thief = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    body = _invite(owner).body()  # names ``owner``'s mesh, signed by ``thief``
    from protocol import constants as c

    token = INVITE_PREFIX + _b64(body) + "." + _b64(thief.sign(c.SIG_DOMAIN_INVITE + body))
    with pytest.raises(ProtocolError, match="invite_signature"):
        decode_invite(token)
    with pytest.raises(ProtocolError, match="invite_owner_mismatch"):
        encode_invite(_invite(owner), thief)


@pytest.mark.parametrize(
    "token",
    [
        "",
        "hello",
        INVITE_PREFIX,
        INVITE_PREFIX + "a.b.c",
        INVITE_PREFIX + "!!!.AAAA",
        INVITE_PREFIX + _b64(b"not json") + "." + _b64(b"x" * 64),
        INVITE_PREFIX + _b64(b"[]") + "." + _b64(b"x" * 64),
        INVITE_PREFIX + _b64(json.dumps({"v": 2}).encode()) + "." + _b64(b"x" * 64),
        "x" * 10_000,
    ],
)
def test_what_is_not_a_token_is_malformed(token: str) -> None:
    with pytest.raises(ProtocolError, match="malformed_invite"):
        decode_invite(token)


@pytest.mark.parametrize(
    "addr",
    [
        {"kind": "carrier-pigeon", "url": "ws://a:1", "node": NODE},
        {"kind": "direct", "url": "http://a:1", "node": NODE},
        {"kind": "direct", "url": "ws://a:1", "node": "AB" * 32},
        {"kind": "direct", "url": "ws://a:1", "node": NODE, "via": RELAY},
        {"kind": "relayed", "url": "ws://a:1", "node": NODE},
        {"kind": "direct", "url": "ws://a:1", "node": NODE, "extra": 1},
    ],
)
def test_a_bad_address_is_malformed(addr: dict[str, str]) -> None:
    with pytest.raises(ProtocolError, match="malformed_invite"):
        InviteAddress.from_wire(addr)


def test_expiry_and_issue_time_are_checked_against_the_clock() -> None:
    invite = _invite(Ed25519PrivateKey.generate(), iat=10_000, exp=20_000)
    check_validity(invite, 10_000)
    check_validity(invite, 19_999)
    check_validity(invite, 9_800)  # a clock a little behind the issuer's
    with pytest.raises(ProtocolError, match="invite_expired"):
        check_validity(invite, 20_000)
    with pytest.raises(ProtocolError, match="invite_not_yet_valid"):
        check_validity(invite, 9_000)


def test_a_node_joins_only_its_own_owners_or_a_trusted_owners_mesh() -> None:
    owner, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    invite = _invite(owner)
    mesh_id, other_id = invite.owner_id.hex(), public_bytes(other.public_key()).hex()
    kw = {"trusted_owners": (), "own_node_id": "ef" * 32}
    (peer,) = join_peers(invite, own_owner_id=mesh_id, own_owner_status="verified", **kw)
    assert str(peer) == f"ws://10.0.0.1:7000#{NODE}"  # the relayed address is not dialed here
    for own, status in ((other_id, "verified"), (None, "unverified"), (mesh_id, "invalid")):
        with pytest.raises(InviteRefused) as err:
            join_peers(invite, own_owner_id=own, own_owner_status=status, **kw)
        assert err.value.code == "invite_other_mesh" and err.value.exit_code == 2
    kw["trusted_owners"] = (mesh_id,)
    assert join_peers(invite, own_owner_id=other_id, own_owner_status="verified", **kw)
    with pytest.raises(InviteRefused, match="no address"):  # only its own address
        join_peers(
            invite,
            own_owner_id=mesh_id,
            own_owner_status="verified",
            trusted_owners=(),
            own_node_id=NODE,
        )


def test_ttl_and_refusal_codes() -> None:
    assert [parse_ttl(t) for t in ("90", "30m", "24h", "7d")] == [90, 1800, 86400, 604800]
    for bad in ("0", "31d", "1w", "-5m", ""):
        with pytest.raises(Exception, match="--ttl"):
            parse_ttl(bad)
    owner = Ed25519PrivateKey.generate()
    token = encode_invite(_invite(owner, iat=1_000, exp=2_000), owner)
    with pytest.raises(InviteRefused) as err:
        read_invite(token, 3_000)
    assert err.value.code == "invite_expired" and err.value.remediation


# --- real processes ----------------------------------------------------------------------------
def _trusts(node_id: str):  # type: ignore[no-untyped-def]
    return lambda doc: any(
        p["node_id"] == node_id and p["connected"] and p["trusted"] for p in doc["peers"]
    )


def _token(cwd: Path, port: str, *extra: str) -> str:
    out = mesh(cwd, "invite", "--config", "a.toml", "--owner", "keys/owner.key",
               "--address", f"127.0.0.1:{port}", *extra)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "owner fingerprint" in out.stderr
    return out.stdout.strip()


def test_a_node_joins_a_running_node_through_its_invite(tmp_path: Path) -> None:
    ids, owner = make_keys(tmp_path, ("a", "b"))
    write_config(tmp_path / "a.toml", "a", [])
    write_config(tmp_path / "b.toml", "b", [])  # knows no peer: the invite is all it has
    a, a_url = start(tmp_path, "a.toml")
    procs = [a]
    try:
        port = a_url.split("#")[0].rsplit(":", 1)[1]
        out = mesh(tmp_path, "invite", "--config", "a.toml", "--owner", "keys/owner.key",
                   "--address", f"127.0.0.1:{port}", "--ttl", "10m", "--json")  # fmt: skip
        doc = json.loads(out.stdout)
        assert out.returncode == 0 and doc["ok"] is True
        assert doc["mesh"] == owner and doc["owner_fingerprint"] == owner_fingerprint(
            bytes.fromhex(owner)
        )
        assert doc["expires_at"] - doc["issued_at"] == 600
        assert doc["addresses"] == [
            {"kind": "direct", "url": f"ws://127.0.0.1:{port}", "node": ids["a"]}
        ]
        b, _ = start(tmp_path, "b.toml", "--join", doc["token"])
        procs.append(b)
        seen_b = wait_status(tmp_path, "b.toml", _trusts(ids["a"]))
        assert _trusts(ids["a"])(seen_b), seen_b["peers"]
        assert _trusts(ids["b"])(wait_status(tmp_path, "a.toml", _trusts(ids["b"])))
        for p in list(procs):
            assert stop(p) == 0
            procs.remove(p)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_refused_invites_exit_2_with_their_code_and_leave_nothing(tmp_path: Path) -> None:
    make_keys(tmp_path, ("a", "b"))
    write_config(tmp_path / "a.toml", "a", [])
    write_config(tmp_path / "b.toml", "b", [])
    good = _token(tmp_path, "7000")
    body, sig = good[len(INVITE_PREFIX) :].split(".")
    doc = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    doc["addrs"][0]["url"] = "ws://203.0.113.9:7000"  # an attacker's address
    tampered = INVITE_PREFIX + _b64(json.dumps(doc, separators=(",", ":")).encode()) + "." + sig
    expiring = _token(tmp_path, "7000", "--ttl", "1")
    # a node of another owner: its own keys, its own certificate
    assert mesh(tmp_path, "keygen", "keys/c.key").returncode == 0
    c_id = mesh(tmp_path, "id", "keys/c.key").stdout.strip()
    assert mesh(tmp_path, "owner", "init", "keys/other.key").returncode == 0
    assert mesh(tmp_path, "owner", "sign", "--owner", "keys/other.key", c_id,
                "--out", "keys/c.cert").returncode == 0  # fmt: skip
    write_config(tmp_path / "c.toml", "c", [])
    time.sleep(1.2)  # ``expiring`` has lived its one second
    cases = [
        ("b.toml", tampered, "invite_signature"),
        ("b.toml", expiring, "invite_expired"),
        ("b.toml", good[:-3], "invite_signature"),
        ("b.toml", "not-an-invite", "malformed_invite"),
        ("c.toml", good, "invite_other_mesh"),
    ]
    for config, token, code in cases:
        for as_json in (False, True):
            args = ["run", "--config", config, "--join", token] + (["--json"] if as_json else [])
            out = mesh(tmp_path, *args)
            assert out.returncode == 2, (code, out.stdout, out.stderr)
            assert "Traceback" not in out.stderr
            if as_json:
                assert json.loads(out.stdout)["error"]["code"] == code
            else:
                assert f"error [{code}]" in out.stderr and "hint:" in out.stderr
    assert not (tmp_path / "d-b").exists() and not (tmp_path / "d-c").exists()
    # serve without --config: a fresh data directory is not created for a refused invite
    fresh = tmp_path / "fresh"
    out = mesh(tmp_path, "serve", "--data-dir", str(fresh), "--package", "x", "--join", good)
    assert out.returncode == 2 and "error [invite_other_mesh]" in out.stderr
    assert not fresh.exists()


def test_invite_refuses_a_key_that_did_not_certify_the_node_and_an_undialable_address(
    tmp_path: Path,
) -> None:
    make_keys(tmp_path, ("a",))
    write_config(tmp_path / "a.toml", "a", [])
    assert mesh(tmp_path, "owner", "init", "keys/other.key").returncode == 0
    out = mesh(tmp_path, "invite", "--config", "a.toml", "--owner", "keys/other.key",
               "--address", "127.0.0.1:7000", "--json")  # fmt: skip
    assert out.returncode == 2
    assert json.loads(out.stdout)["error"]["code"] == "invite_owner_mismatch"
    out = mesh(tmp_path, "invite", "--config", "a.toml", "--owner", "keys/owner.key")
    assert out.returncode == 2 and "error [invite_no_address]" in out.stderr  # port 0
    out = mesh(tmp_path, "invite", "--config", "a.toml", "--owner", "keys/owner.key",
               "--address", "127.0.0.1:7000", "--ttl", "1y")  # fmt: skip
    assert out.returncode == 2 and "error [usage]" in out.stderr


def test_serve_without_config_joins_with_the_owner_key_copied_into_a_fresh_data_dir(
    tmp_path: Path,
) -> None:
    ids, owner = make_keys(tmp_path, ("a",))
    write_config(tmp_path / "a.toml", "a", [])
    token = _token(tmp_path, "7000")
    fresh = tmp_path / "fresh"
    fresh.mkdir(mode=0o700)
    (fresh / "owner.key").write_bytes((tmp_path / "keys" / "owner.key").read_bytes())
    (fresh / "owner.key").chmod(0o600)
    # the invite is accepted, the node made and certified, its address dialed; then the
    # (missing) package stops the start
    missing = str(tmp_path / "no-package")
    out = mesh(tmp_path, "serve", "--data-dir", str(fresh), "--listen", "127.0.0.1:0",
               "--http", "0", "--package", missing, "--join", token)  # fmt: skip
    assert out.returncode == 2 and "error [unreadable_input]" in out.stderr, out.stderr
    assert f"joining through the invite: dialing ws://127.0.0.1:7000#{ids['a']}" in out.stderr
    cert = json.loads((fresh / "node.cert").read_text())
    assert cert["owner_id"] == owner
