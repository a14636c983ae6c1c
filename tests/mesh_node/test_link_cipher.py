"""The link near the machine: AES-256-GCM when both ends offer it in the WebSocket
upgrade, ChaCha20-Poly1305 with every node that does not (older nodes), over real links on
loopback; and a stream reader that takes many records per call."""

from __future__ import annotations

import os

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshtools import identity, settings, topology_node, wait_for, with_peers
from trio_websocket import WebSocketRequest, open_websocket_url, serve_websocket

from mesh_node.cipher_support import ciphers_for, has_hardware_aes
from mesh_node.link import RECEIVE_SOME_BYTES
from mesh_node.node import MeshNode
from mesh_node.peers import InboundStream
from mesh_node.settings import PeerAddress
from protocol import constants as pc
from protocol.errors import ProtocolError
from protocol.handshake import Handshake
from protocol.link_cipher import (
    LinkCipher,
    cipher_for_selected,
    offered_subprotocols,
    select_subprotocol,
)

AES, CHACHA = LinkCipher.AESGCM, LinkCipher.CHACHAPOLY
NEW = (AES, CHACHA)  # what a node with AES instructions supports, best first
TOKEN = pc.WS_SUBPROTOCOL_AESGCM


# --- pure decisions ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("proposed", "supported", "expected"),
    [
        ([TOKEN], NEW, (AES, TOKEN)),  # both new
        ([], NEW, (CHACHA, None)),  # an older dialer offers nothing
        ([TOKEN], (CHACHA,), (CHACHA, None)),  # a listener without AES instructions
        (["x-future", TOKEN], NEW, (AES, TOKEN)),  # unknown offers are ignored
        (["x-future"], NEW, (CHACHA, None)),
    ],
)
def test_the_listener_selects_aes_gcm_only_when_both_support_it(proposed, supported, expected):
    assert select_subprotocol(proposed, supported) == expected


def test_the_dialer_reads_the_listeners_answer():
    offered = offered_subprotocols(NEW)
    assert offered == [TOKEN]
    assert offered_subprotocols((CHACHA,)) == []
    assert cipher_for_selected(TOKEN, offered) is AES
    assert cipher_for_selected(None, offered) is CHACHA  # an older listener answers nothing
    with pytest.raises(ProtocolError) as err:
        cipher_for_selected("x-never-offered", offered)
    assert err.value.code == "handshake_failed"


def test_hardware_aes_is_read_from_cpuinfo_flags_or_features():
    assert has_hardware_aes("processor : 0\nflags : fpu sse2 aes avx2\n")
    assert has_hardware_aes("Features : fp asimd aes pmull sha1\n")  # Arm
    assert not has_hardware_aes("flags : fpu sse2 avx2 vaes_like\n")
    assert not has_hardware_aes("model name : aes emulator\n")  # not a flags line
    assert ciphers_for("flags : aes\n") == NEW
    assert ciphers_for("") == (CHACHA,)


def _handshake(a: Handshake, b: Handshake) -> None:
    m = b.receive(a.start())
    assert m is not None
    m = a.receive(m)
    assert m is not None
    b.receive(m)


def test_an_aes_gcm_channel_round_trips_and_detects_tampering():
    i = Handshake(initiator=True, identity=Ed25519PrivateKey.generate(), cipher=AES)
    r = Handshake(initiator=False, identity=Ed25519PrivateKey.generate(), cipher=AES)
    _handshake(i, r)
    assert i.channel is not None and r.channel is not None
    assert i.channel.cipher is AES and r.channel.cipher is AES
    assert r.channel.open(i.channel.seal([b"hi", b"there"])) == [b"hi", b"there"]
    replay = i.channel.seal([b"once"])
    assert r.channel.open(replay) == [b"once"]
    with pytest.raises(ProtocolError):
        r.channel.open(replay)  # the nonce moved on: a replayed record fails
    i2 = Handshake(initiator=True, identity=Ed25519PrivateKey.generate(), cipher=AES)
    r2 = Handshake(initiator=False, identity=Ed25519PrivateKey.generate(), cipher=AES)
    _handshake(i2, r2)
    assert i2.channel is not None and r2.channel is not None
    sealed = bytearray(i2.channel.seal([b"secret"]))
    sealed[-1] ^= 1  # one bit of the tag
    with pytest.raises(ProtocolError) as err:
        r2.channel.open(bytes(sealed))
    assert err.value.code == "decrypt_failed"


@pytest.mark.parametrize("in_place", [True, False], ids=["encrypt-into", "copied"])
@pytest.mark.parametrize("cipher", [AES, CHACHA])
def test_records_sealed_into_a_frame_buffer_open_in_order_with_sealed_ones(cipher, in_place):
    """``seal_into`` (what a link's writer frames: ciphertexts encrypted into the frame's
    buffer) is ``seal``'s message: the peer opens it, the nonces run on across both, and a
    record over the Noise maximum is refused before anything is encrypted."""
    i = Handshake(initiator=True, identity=Ed25519PrivateKey.generate(), cipher=cipher)
    r = Handshake(initiator=False, identity=Ed25519PrivateKey.generate(), cipher=cipher)
    _handshake(i, r)
    assert i.channel is not None and r.channel is not None
    ch = i.channel
    assert ch._aead is not None  # the installed cryptography has encrypt_into
    if not in_place:  # an AEAD without encrypt_into: encrypt_with_ad's output copied in
        ch._aead = ch._nonce = None
    records = [b"a" * 70, b"", os.urandom(pc.MAX_RECORD_PLAINTEXT)]
    buf = bytearray(b"HEAD") + bytearray(ch.sealed_size(records))
    assert ch.seal_into(records, buf, 4) == len(buf) and buf[:4] == b"HEAD"
    assert r.channel.open(bytes(buf[4:])) == records
    assert r.channel.open(ch.seal([b"next"])) == [b"next"]  # the nonces ran on in order
    with pytest.raises(ProtocolError) as err:
        ch.seal_into([b"x", b"y" * (pc.MAX_RECORD_PLAINTEXT + 1)], bytearray(1 << 17), 0)
    assert err.value.code == "frame_too_large"
    after = bytearray(ch.sealed_size([b"after"]))
    ch.seal_into([b"after"], after, 0)
    assert r.channel.open(bytes(after)) == [b"after"]  # the refusal used no nonce


def test_ends_that_disagree_on_the_cipher_fail_the_handshake():
    # The protocol name is hashed into the handshake: no record is ever misread.
    i = Handshake(initiator=True, identity=Ed25519PrivateKey.generate(), cipher=AES)
    r = Handshake(initiator=False, identity=Ed25519PrivateKey.generate(), cipher=CHACHA)
    with pytest.raises(ProtocolError) as err:
        _handshake(i, r)
    assert err.value.code == "handshake_failed"


# --- real links ----------------------------------------------------------------------------------
def _cipher_of(node: MeshNode, peer: MeshNode) -> str | None:
    (info,) = [p for p in node.peers() if p.node_id == peer.node_id]
    return info.link_cipher


@pytest.mark.parametrize(
    ("dialer", "listener", "expected"),
    [
        (NEW, NEW, "aes-256-gcm"),
        (NEW, (CHACHA,), "chacha20-poly1305"),  # the listener does not offer AES
        ((CHACHA,), NEW, "chacha20-poly1305"),  # the dialer does not
    ],
)
async def test_two_nodes_agree_on_the_cipher_and_carry_a_stream(
    tmp_path, dialer, listener, expected
):
    async with trio.open_nursery() as n:
        server = topology_node(settings(tmp_path, "listener"), identity(), link_ciphers=listener)
        await n.start(server.run)
        client = topology_node(
            with_peers(settings(tmp_path, "dialer"), server), identity(), link_ciphers=dialer
        )
        await n.start(client.run)
        await wait_for(lambda: len(server.peers(connected_only=True)) == 1)
        await wait_for(lambda: len(client.peers(connected_only=True)) == 1)
        assert _cipher_of(client, server) == expected
        assert _cipher_of(server, client) == expected
        stream = await client.open_stream(server.node_id, pc.KIND_CONTROL)  # records flow
        await stream.aclose()
        n.cancel_scope.cancel()


async def test_an_old_style_dialer_without_the_offer_still_links(tmp_path):
    """A dialer as nodes were before AES-GCM links: no subprotocol, the ChaCha20-Poly1305 name."""
    async with trio.open_nursery() as n:
        node = MeshNode(settings(tmp_path, "new"), identity(), link_ciphers=NEW)
        await n.start(node.run)
        assert node.listen_url is not None
        key = Ed25519PrivateKey.generate()
        async with open_websocket_url(node.listen_url) as ws:
            assert ws.subprotocol is None
            hs = Handshake(initiator=True, identity=key, expected_peer=bytes.fromhex(node.node_id))
            await ws.send_message(hs.start())
            reply = hs.receive(await ws.get_message())
            assert reply is not None and hs.channel is not None
            await ws.send_message(reply)
            peer_id = key.public_key().public_bytes_raw().hex()
            await wait_for(lambda: peer_id in node._members)
            link = node._members[peer_id].link
            assert link is not None and link.channel.cipher is CHACHA
        n.cancel_scope.cancel()


async def test_a_new_dialer_falls_back_with_an_old_style_listener(tmp_path):
    """A listener as nodes were before AES-GCM links: it ignores the offer, speaks ChaCha."""
    key = Ed25519PrivateKey.generate()
    done = trio.Event()
    seen: dict[str, object] = {}

    async def old_listener(request: WebSocketRequest) -> None:
        seen["proposed"] = request.proposed_subprotocols
        ws = await request.accept()  # selects nothing, as trio-websocket does by default
        hs = Handshake(initiator=False, identity=key)
        reply = hs.receive(await ws.get_message())
        assert reply is not None
        await ws.send_message(reply)
        assert hs.receive(await ws.get_message()) is None
        seen["dialer"] = hs.peer.node_id.hex() if hs.peer else None
        done.set()
        await trio.sleep_forever()

    async with trio.open_nursery() as n:
        server = await n.start(
            lambda task_status: serve_websocket(
                old_listener, "127.0.0.1", 0, None, task_status=task_status
            )
        )
        address = PeerAddress("127.0.0.1", server.port, key.public_key().public_bytes_raw().hex())
        node = MeshNode(settings(tmp_path, "new", peers=(address,)), identity(), link_ciphers=NEW)
        await n.start(node.run)
        with trio.fail_after(10):
            await done.wait()
        assert seen["proposed"] == (TOKEN,)  # the new node did offer AES-256-GCM
        assert seen["dialer"] == node.node_id  # and completed the ChaCha handshake
        n.cancel_scope.cancel()


async def test_receive_some_coalesces_buffered_records_within_its_limit(tmp_path):
    payload = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB: ~48 records, inside the window
    owner = Ed25519PrivateKey.generate()

    async def send_payload(inbound: InboundStream) -> None:
        await inbound.stream.send_all(payload)
        await inbound.stream.send_eof()
        await inbound.stream.receive_some()

    async with trio.open_nursery() as n:
        a = MeshNode(settings(tmp_path, "a"), identity(owner))
        await n.start(a.run)
        b = MeshNode(with_peers(settings(tmp_path, "b"), a), identity(owner))
        await n.start(b.run)
        a.register_subprotocol(pc.KIND_ARTIFACT_TRANSFER, send_payload)
        await wait_for(lambda: len(b.peers(connected_only=True)) == 1)
        stream = await b.open_stream(a.node_id, pc.KIND_ARTIFACT_TRANSFER)
        await wait_for(lambda: sum(len(c) for c in stream._chunks) == len(payload))
        got: list[bytes] = []
        limits = [None, 100_000, 1, None, 70_000]
        while data := await stream.receive_some(limits[len(got) % len(limits)]):
            limit = limits[len(got) % len(limits)]
            assert len(data) <= (RECEIVE_SOME_BYTES if limit is None else limit)
            got.append(data)
        assert b"".join(got) == payload  # in order, nothing lost or repeated
        assert len(got[0]) == RECEIVE_SOME_BYTES  # many records in one call, up to its limit
        assert len(got[1]) == 100_000  # a limit spanning records is filled exactly
        await stream.aclose()
        n.cancel_scope.cancel()
