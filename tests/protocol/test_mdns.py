"""The sans-IO multicast DNS codec of LAN discovery (protocol/mdns.py): the query's bytes as
RFC 1035 lays them out, announcements that round-trip and say no more than an instance, a port
and a fingerprint, compressed names read as any responder writes them, and a stranger's bytes
(cut, looping pointers, junk) refused cleanly or read, never anything else."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import ProtocolError
from protocol.mdns import (
    SERVICE,
    TYPE_PTR,
    TYPE_SRV,
    TYPE_TXT,
    Announcement,
    announcements_in,
    asks_for,
    decode_message,
    encode_announcement,
    encode_query,
)

ANN = Announcement("0123456789abcdef", 7000, "fedcba9876543210")


def test_the_query_is_one_ptr_question_for_the_service() -> None:
    expected = (
        b"\x00\x00\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00"  # id 0, flags 0, one question
        b"\x0c_skippy-mesh\x04_tcp\x05local\x00"
        b"\x00\x0c\x00\x01"  # PTR, IN
    )
    assert encode_query() == expected
    message = decode_message(expected)
    assert asks_for(message) and not message.response and announcements_in(message) == []


def test_an_announcement_round_trips_and_carries_only_instance_port_and_fingerprint() -> None:
    data = encode_announcement(ANN)
    message = decode_message(data)
    assert message.response and not asks_for(message)
    assert announcements_in(message) == [ANN]
    assert sorted(r.rtype for r in message.records) == [TYPE_PTR, TYPE_TXT, TYPE_SRV]
    (txt,) = [r.data for r in message.records if r.rtype == TYPE_TXT]
    assert txt == (b"fp=" + ANN.fingerprint.encode(),)
    names = {r.name for r in message.records}
    assert names == {SERVICE, f"{ANN.instance}.{SERVICE}"}


def test_compressed_names_are_read_and_a_goodbye_or_partial_instance_is_no_announcement() -> None:
    # PTR data and the SRV/TXT owner names point back at earlier names, as responders write
    header = struct.pack(">HHHHHH", 0, 0x8400, 0, 3, 0, 0)
    service = b"\x0c_skippy-mesh\x04_tcp\x05local\x00"
    svc_at = len(header)
    ptr_rdata = b"\x10" + ANN.instance.encode() + struct.pack(">H", 0xC000 | svc_at)
    ptr = service + struct.pack(">HHIH", TYPE_PTR, 1, 120, len(ptr_rdata))
    inst_at = len(header) + len(ptr)
    body = header + ptr + ptr_rdata
    inst_ptr = struct.pack(">H", 0xC000 | inst_at)
    local_at = svc_at + 1 + 12 + 1 + 4  # where "local" starts in the service name
    target = b"\x01h" + struct.pack(">H", 0xC000 | local_at)
    srv_rdata = struct.pack(">HHH", 0, 0, ANN.port) + target
    body += inst_ptr + struct.pack(">HHIH", TYPE_SRV, 0x8001, 120, len(srv_rdata)) + srv_rdata
    txt = b"fp=" + ANN.fingerprint.encode()
    body += inst_ptr + struct.pack(">HHIH", TYPE_TXT, 0x8001, 120, len(txt) + 1)
    body += bytes([len(txt)]) + txt
    assert announcements_in(decode_message(body)) == [ANN]
    goodbye = body.replace(struct.pack(">HHIH", TYPE_PTR, 1, 120, len(ptr_rdata)),
                           struct.pack(">HHIH", TYPE_PTR, 1, 0, len(ptr_rdata)))  # fmt: skip
    assert announcements_in(decode_message(goodbye)) == []
    no_txt = encode_announcement(ANN).replace(b"fp=", b"xx=")
    assert announcements_in(decode_message(no_txt)) == []


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00" * 11,
        b"\x00" * 9001,
        struct.pack(">HHHHHH", 0, 0, 65, 0, 0, 0),  # more records than allowed
        struct.pack(">HHHHHH", 0, 0, 1, 0, 0, 0) + b"\xc0\x0c\x00\x0c\x00\x01",  # self pointer
        struct.pack(">HHHHHH", 0, 0, 1, 0, 0, 0) + b"\xc0\x20\x00\x0c\x00\x01",  # forward
        struct.pack(">HHHHHH", 0, 0, 1, 0, 0, 0) + b"\x40abc\x00\x00\x0c\x00\x01",  # reserved
        struct.pack(">HHHHHH", 0, 0, 1, 0, 0, 0) + b"\x05ab",  # a cut label
        struct.pack(">HHHHHH", 0, 0, 1, 0, 0, 0) + (b"\x3f" + b"a" * 63) * 5 + b"\x00\0\x0c\0\1",
    ],
)
def test_malformed_messages_are_refused_with_one_code(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed_mdns"):
        decode_message(data)


def test_every_cut_of_an_announcement_is_refused() -> None:
    data = encode_announcement(ANN)
    for n in range(len(data)):
        with pytest.raises(ProtocolError, match="malformed_mdns"):
            decode_message(data[:n])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.integers(0, 200), st.binary(max_size=8))
def test_any_bytes_are_read_or_refused_cleanly(junk: bytes, at: int, insert: bytes) -> None:
    base = encode_announcement(ANN)
    for data in (junk, base[:at] + insert + base[at:]):
        try:
            announcements_in(decode_message(data))
        except ProtocolError as exc:
            assert exc.code == "malformed_mdns"


def test_announcement_values_are_checked() -> None:
    for args in (("XYZ", 7000, ANN.fingerprint), (ANN.instance, 0, ANN.fingerprint),
                 (ANN.instance, 7000, "node-id-here")):  # fmt: skip
        with pytest.raises(ProtocolError, match="malformed_mdns"):
            Announcement(*args)  # type: ignore[arg-type]
