"""protocol.handshake, certificates and messages: identities bound to Noise static keys, owner
status, tamper/replay/reorder detection, strict msgpack schemas (sans-IO)."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import constants as c
from protocol import messages as m
from protocol.certificates import OwnerCertificate, public_bytes
from protocol.errors import ProtocolError
from protocol.handshake import Handshake


def key_id(key: Ed25519PrivateKey) -> bytes:
    return public_bytes(key.public_key())


def run(i: Handshake, r: Handshake) -> None:
    m2 = r.receive(i.start())
    assert m2 is not None
    m3 = i.receive(m2)
    assert m3 is not None and r.receive(m3) is None


def test_both_sides_learn_the_proven_identity_and_certificate():
    a, b, owner = (Ed25519PrivateKey.generate() for _ in range(3))
    cert = OwnerCertificate.issue(owner, key_id(a), 0, 2**40)
    i = Handshake(initiator=True, identity=a, certificate=cert, expected_peer=key_id(b))
    r = Handshake(initiator=False, identity=b)
    run(i, r)
    assert i.peer is not None and i.peer.node_id == key_id(b) and i.peer.certificate is None
    assert r.peer is not None and r.peer.node_id == key_id(a) and r.peer.certificate == cert
    assert i.channel is not None and r.channel is not None
    assert r.channel.open(i.channel.seal([b"hi", b"there"])) == [b"hi", b"there"]


def test_impostor_fails_closed_before_the_initiator_reveals_itself():
    a, b, expected = (Ed25519PrivateKey.generate() for _ in range(3))
    i = Handshake(initiator=True, identity=a, expected_peer=key_id(expected))
    r = Handshake(initiator=False, identity=b)
    m2 = r.receive(i.start())
    assert m2 is not None
    with pytest.raises(ProtocolError) as exc:
        i.receive(m2)
    assert exc.value.code == "identity_mismatch"
    assert i.peer is not None and i.peer.node_id == key_id(b)
    assert not i.complete  # message 3 (our identity) was never produced


def test_an_identity_that_did_not_sign_the_static_key_is_rejected():
    a, b, thief = (Ed25519PrivateKey.generate() for _ in range(3))
    r = Handshake(initiator=False, identity=b)
    # The responder claims the thief's public key but signs with its own: the signature over
    # its Noise static key does not verify under the claimed key.
    payload = msgpack.unpackb(r._payload)
    payload["key"] = key_id(thief)
    r._payload = msgpack.packb(payload)
    i = Handshake(initiator=True, identity=a)
    m2 = r.receive(i.start())
    assert m2 is not None
    with pytest.raises(ProtocolError) as exc:
        i.receive(m2)
    assert exc.value.code == "identity_signature"


@pytest.mark.parametrize("index", [0, 40, 100, -1])
def test_a_tampered_handshake_message_fails(index):
    a, b = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    i, r = Handshake(initiator=True, identity=a), Handshake(initiator=False, identity=b)
    m2 = bytearray(r.receive(i.start()) or b"")
    m2[index] ^= 0x01
    with pytest.raises(ProtocolError) as exc:
        i.receive(bytes(m2))
    assert exc.value.code in ("handshake_failed", "identity_signature")


def test_handshake_message_size_limit():
    r = Handshake(initiator=False, identity=Ed25519PrivateKey.generate())
    with pytest.raises(ProtocolError, match="handshake_too_large"):
        r.receive(b"\x00" * (c.DEFAULT_LIMITS.max_handshake_message_bytes + 1))


@given(st.lists(st.binary(max_size=300), min_size=1, max_size=3))
@settings(max_examples=200, deadline=None)
def test_arbitrary_handshake_bytes_raise_only_the_protocol_error(messages):
    for initiator in (True, False):
        hs = Handshake(initiator=initiator, identity=_KEY)
        if initiator:
            hs.start()
        try:
            for message in messages:
                hs.receive(message)
        except ProtocolError:
            continue


_KEY = Ed25519PrivateKey.generate()


def channels():
    a, b = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    i, r = Handshake(initiator=True, identity=a), Handshake(initiator=False, identity=b)
    run(i, r)
    assert i.channel is not None and r.channel is not None
    return i.channel, r.channel


def test_tampered_replayed_and_reordered_records_fail_authentication():
    send, recv = channels()
    first, second = send.seal([b"one"]), send.seal([b"two"])
    tampered = bytearray(first)
    tampered[5] ^= 0x80
    with pytest.raises(ProtocolError, match="decrypt_failed"):
        recv.open(bytes(tampered))
    assert recv.open(first) == [b"one"]
    with pytest.raises(ProtocolError, match="decrypt_failed"):
        recv.open(first)  # replay
    send2, recv2 = channels()
    x, y = send2.seal([b"x"]), send2.seal([b"y"])
    with pytest.raises(ProtocolError, match="decrypt_failed"):
        recv2.open(y)  # reordered
    del second, x


# --- certificates ------------------------------------------------------------------------------
def test_owner_status_verified_only_for_the_named_key_in_time():
    node, other, owner = (Ed25519PrivateKey.generate() for _ in range(3))
    cert = OwnerCertificate.issue(owner, key_id(node), 1000, 2000)
    assert cert.status_for(key_id(node), 1500)[0] == "verified"
    assert cert.status_for(key_id(other), 1500) == ("invalid", "the certificate names another node")
    assert cert.status_for(key_id(node), 2000)[0] == "invalid"  # expired
    assert cert.status_for(key_id(node), 999)[0] == "invalid"  # not yet valid
    forged = OwnerCertificate(cert.node_id, cert.owner_id, 1000, 3000, cert.signature)
    assert forged.status_for(key_id(node), 2500)[0] == "invalid"  # extended without signing
    assert OwnerCertificate.from_dict(cert.to_dict()) == cert
    assert OwnerCertificate.from_wire(cert.to_wire()) == cert


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(version=2),
        lambda d: d.update(node_id="zz"),
        lambda d: d.update(signature="00"),
        lambda d: d.update(not_after=-1),
        lambda d: d.pop("owner_id"),
        lambda d: d.update(extra=1),
    ],
)
def test_malformed_certificates_are_refused(edit):
    owner = Ed25519PrivateKey.generate()
    data = OwnerCertificate.issue(owner, b"\x01" * 32, 0, 10).to_dict()
    edit(data)
    with pytest.raises(ProtocolError, match="malformed_certificate"):
        OwnerCertificate.from_dict(data)


# --- messages ---------------------------------------------------------------------------------
def test_link_and_control_messages_round_trip():
    hello = m.Hello("ws://127.0.0.1:7000", {"skippy-stage/2": ("control",)}, 8 << 30)
    assert m.decode_link_message(hello.encode()) == hello
    peers = m.Peers((m.PeerRecord(b"\x02" * 32, "ws://h:1"),))
    assert m.decode_link_message(peers.encode()) == peers
    offer = m.TopologyOffer({"topology_id": "t"}, b"\x03" * 64)
    assert m.decode_control_message(offer.encode()) == offer
    ack = m.TopologyAck("t", False, "topology_signature", "bad")
    assert m.decode_control_message(ack.encode()) == ack


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never-used msgpack byte
        b"\x92\x01",  # truncated array
        msgpack.packb({"t": "hello", "gen": 1}),  # missing fields
        msgpack.packb({"t": "nope", "gen": 1}),
        msgpack.packb(
            {
                "t": "hello",
                "gen": 1,
                "listen": None,
                "features": {},
                "memory_budget_bytes": 1,
                "inventory": ["model.gguf"],
            }
        ),  # extra field
        msgpack.packb(
            {"t": "peers", "gen": 1, "peers": [{"node_id": b"x" * 32, "address": "ws://a:1"}] * 200}
        ),  # over max_gossip_peers
        msgpack.packb({"t": "peers", "gen": 1, "peers": [{"node_id": b"x", "address": "a"}]}),
    ],
)
def test_malformed_link_messages_raise_the_protocol_error(payload):
    with pytest.raises(ProtocolError) as exc:
        m.decode_link_message(payload)
    assert exc.value.code == "malformed_message"


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_arbitrary_message_bytes_raise_only_the_protocol_error(data):
    for decode in (m.decode_link_message, m.decode_control_message, m.MessageReader().feed):
        with contextlib.suppress(ProtocolError):
            decode(data)


def test_stream_message_size_limit():
    limits = c.Limits(max_stream_message_bytes=100)
    reader = m.MessageReader(limits)
    assert reader.feed(m.frame_message(b"a" * 100, limits)) == [b"a" * 100]
    with pytest.raises(ProtocolError, match="message_too_large"):
        reader.feed((101).to_bytes(4, "big"))
    with pytest.raises(ProtocolError, match="message_too_large"):
        m.frame_message(b"a" * 101, limits)


@pytest.mark.parametrize(
    "hello",
    [
        {"features": {f"f{i}": [] for i in range(c.DEFAULT_LIMITS.max_features + 1)}},
        {"features": {"skippy-stage/2": ["x" * (c.DEFAULT_LIMITS.max_feature_chars + 1)]}},
        {"listen": "ws://" + "h" * c.DEFAULT_LIMITS.max_address_chars},
        {"memory_budget_bytes": -1},
    ],
)
def test_advertisement_limits(hello):
    raw = {"t": "hello", "gen": 1, "listen": None, "features": {}, "memory_budget_bytes": 0}
    raw.update(hello)
    with pytest.raises(ProtocolError, match="malformed_message"):
        m.decode_link_message(msgpack.packb(raw))


def test_a_hello_from_a_newer_node_with_unknown_keys_is_accepted_and_they_are_ignored():
    raw = {"t": "hello", "gen": 1, "listen": None, "features": {}, "memory_budget_bytes": 7}
    newer = dict(raw, calibration={"ms_per_layer": 1.5}, cipher="aes")
    decoded = m.decode_link_message(msgpack.packb(newer))
    assert decoded == m.Hello(None, {}, 7)


@pytest.mark.parametrize(
    "extra",
    [
        {f"x{i}": 1 for i in range(c.DEFAULT_LIMITS.max_hello_extensions + 1)},
        {"k" * (c.DEFAULT_LIMITS.max_feature_chars + 1): 1},
    ],
)
def test_hello_extension_keys_are_bounded(extra):
    raw = {"t": "hello", "gen": 1, "listen": None, "features": {}, "memory_budget_bytes": 0}
    with pytest.raises(ProtocolError, match="malformed_message"):
        m.decode_link_message(msgpack.packb(dict(raw, **extra)))


def test_a_hello_missing_a_required_field_is_refused():
    raw = {"t": "hello", "gen": 1, "listen": None, "features": {}}
    with pytest.raises(ProtocolError, match="malformed_message"):
        m.decode_link_message(msgpack.packb(raw))
