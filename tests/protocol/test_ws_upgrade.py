"""The WebSocket opening handshake (``protocol.ws_upgrade``): RFC 6455's own example, our
request and answer read back by wsproto (a stock implementation) and wsproto's by us, every
malformed head refused with its status, and any bytes at all refused cleanly (hypothesis)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, RejectConnection, Request

from protocol.ws_upgrade import (
    MAX_HEAD_BYTES,
    UpgradeRefused,
    UpgradeRequest,
    UpgradeResponse,
    accept_response,
    accept_value,
    client_request,
    head_end,
    new_key,
    parse_request,
    parse_response,
    reject_response,
)

KEY = "dGhlIHNhbXBsZSBub25jZQ=="  # RFC 6455 section 1.3


def test_the_accept_value_is_rfc_6455s_example() -> None:
    assert accept_value(KEY) == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
    assert new_key(b"the sample nonce") == KEY
    with pytest.raises(ValueError):
        new_key(b"short")


def test_our_request_and_answer_round_trip_with_a_subprotocol() -> None:
    head = client_request("127.0.0.1:9", "/", KEY, ["x-a", "x-b"])
    assert head_end(head + b"frames") == len(head)
    request = parse_request(head)
    assert request == UpgradeRequest("/", "127.0.0.1:9", KEY, ("x-a", "x-b"))
    answer = accept_response(request, "x-b")
    assert parse_response(answer, KEY, ["x-a", "x-b"]) == UpgradeResponse(101, "x-b")
    assert parse_response(accept_response(request, None), KEY, ["x-a"]) == UpgradeResponse(101)
    with pytest.raises(ValueError):
        accept_response(request, "x-never-offered")
    refusal = reject_response(429, b"slow down")
    end = head_end(refusal)
    assert end is not None and refusal[end:] == b"slow down"
    assert parse_response(refusal[:end], KEY, []) == UpgradeResponse(429)


def test_wsproto_reads_our_handshake_and_we_read_its() -> None:
    # our dialer, wsproto's listener
    server = WSConnection(ConnectionType.SERVER)
    server.receive_data(client_request("example:1", "/", KEY, ["x-a"]))
    (event,) = server.events()
    assert isinstance(event, Request) and event.subprotocols == ["x-a"]
    answer = server.send(AcceptConnection(subprotocol="x-a"))
    assert parse_response(answer, KEY, ["x-a"]) == UpgradeResponse(101, "x-a")
    # wsproto's dialer, our listener
    client = WSConnection(ConnectionType.CLIENT)
    head = client.send(Request(host="example:1", target="/", subprotocols=["x-b", "x-c"]))
    request = parse_request(head)
    assert request.subprotocols == ("x-b", "x-c")
    client.receive_data(accept_response(request, "x-c"))
    (event,) = client.events()
    assert isinstance(event, AcceptConnection) and event.subprotocol == "x-c"
    refused = WSConnection(ConnectionType.CLIENT)
    refused.send(Request(host="example:1", target="/"))
    refused.receive_data(reject_response(503, b"busy"))
    assert isinstance(next(iter(refused.events())), RejectConnection)


def _request(*lines: str) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


GOOD = [
    "GET / HTTP/1.1",
    "Host: h",
    "Upgrade: websocket",
    "Connection: keep-alive, Upgrade",
    f"Sec-WebSocket-Key: {KEY}",
    "Sec-WebSocket-Version: 13",
]


@pytest.mark.parametrize(
    ("lines", "status"),
    [
        (["POST / HTTP/1.1", *GOOD[1:]], 400),
        (["GET / HTTP/1.0", *GOOD[1:]], 400),
        (["GET http://h/ HTTP/1.1", *GOOD[1:]], 400),
        ([GOOD[0], *GOOD[2:]], 400),  # no Host
        ([*GOOD[:2], *GOOD[3:]], 400),  # no Upgrade
        ([*GOOD[:3], "Connection: keep-alive", *GOOD[4:]], 400),
        ([*GOOD[:4], "Sec-WebSocket-Key: c2hvcnQ=", GOOD[5]], 400),  # 5 bytes, not 16
        ([*GOOD[:4], "Sec-WebSocket-Key: !!!!", GOOD[5]], 400),
        ([*GOOD[:5], "Sec-WebSocket-Version: 8"], 426),
        ([*GOOD, "Host: again"], 400),
        ([*GOOD, "no colon here"], 400),
        ([*GOOD, " Folded: value"], 400),
        ([*GOOD, "Name\u00e9: x"], 400),  # not ASCII
    ],
)
def test_a_malformed_request_is_refused_with_its_status(lines: list[str], status: int) -> None:
    assert parse_request(_request(*GOOD)).host == "h"  # the control: the good one passes
    with pytest.raises(UpgradeRefused) as err:
        parse_request(_request(*lines))
    assert err.value.status == status and err.value.code == "ws_upgrade"


def test_the_426_answer_names_our_version() -> None:
    assert b"Sec-WebSocket-Version: 13\r\n" in reject_response(426)
    with pytest.raises(ValueError):
        reject_response(200)


@pytest.mark.parametrize(
    "lines",
    [
        ["HTTP/1.0 101 Switching Protocols"],
        ["HTTP/1.1 1x1 Nope"],
        ["HTTP/1.1 101 Switching Protocols", "Upgrade: websocket", "Connection: Upgrade"],
        [
            "HTTP/1.1 101 Switching Protocols",
            "Upgrade: websocket",
            "Connection: Upgrade",
            "Sec-WebSocket-Accept: AAAAAAAAAAAAAAAAAAAAAAAAAAA=",
        ],
        [
            "HTTP/1.1 101 Switching Protocols",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Accept: {accept_value(KEY)}",
            "Sec-WebSocket-Extensions: permessage-deflate",
        ],
        [
            "HTTP/1.1 101 Switching Protocols",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Accept: {accept_value(KEY)}",
            "Sec-WebSocket-Protocol: x-not-offered",
        ],
    ],
    ids=["http-1.0", "bad-status", "no-accept", "wrong-accept", "extension", "subprotocol"],
)
def test_an_answer_that_breaks_the_protocol_is_refused(lines: list[str]) -> None:
    with pytest.raises(UpgradeRefused):
        parse_response(_request(*lines), KEY, ["x-a"])


def test_a_head_is_bounded() -> None:
    assert head_end(b"GET / HTTP/1.1\r\nHost: h\r\n") is None  # not yet complete
    with pytest.raises(UpgradeRefused) as err:
        head_end(b"GET / HTTP/1.1\r\nX: " + b"y" * MAX_HEAD_BYTES)
    assert err.value.status == 431


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=600)
    | st.builds(
        lambda a, b: a + b,
        st.sampled_from([_request(*GOOD)[:-2], b"HTTP/1.1 101 Switching Protocols\r\n"]),
        st.binary(max_size=200),
    )
)
def test_any_bytes_are_a_head_or_a_clean_refusal(data: bytes) -> None:
    for parse in (parse_request, lambda head: parse_response(head, KEY, ["x-a"]), head_end):
        with contextlib.suppress(UpgradeRefused):
            parse(data)
