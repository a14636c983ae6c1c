"""A plain HTTP client for tests of the node's HTTP surface (stdlib http.client, so a test
sees exactly the status, headers and bytes the server sent)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Mapping
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import trio

# The parts of a status document that move with the clock, with link traffic, or (a stage
# node's peak RSS) with memory.
VOLATILE_KEYS = frozenset(
    {"uptime_s", "last_seen_s", "rtt_ms", "bytes_received", "bytes_sent", "peak_rss_kib"}
    # peer memory held right now and its peak follow the links' heartbeats
    | {"held_bytes", "held_untrusted_bytes", "peak_bytes"}
)


def request(
    url: str,
    method: str = "GET",
    *,
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
    timeout_s: float = 10.0,
) -> tuple[int, dict[str, str], bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        conn.request(method, parts.path or "/", body=body, headers=dict(headers or {}))
        response = conn.getresponse()
        data = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data
    finally:
        conn.close()


async def arequest(url: str, method: str = "GET", **kw: Any) -> tuple[int, dict[str, str], bytes]:
    return await trio.to_thread.run_sync(partial(request, url, method, **kw))


def status_only(url: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    """The status code, and the body only when it is an error (a stream is not read)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        conn.request("GET", parts.path)
        response = conn.getresponse()
        return response.status, (response.read() if response.status >= 400 else b"")
    finally:
        conn.close()


def get_json(url: str) -> Any:
    status, _, body = request(url)
    assert status == 200, (status, body[:200])
    return json.loads(body)


def read_events(url: str, count: int, timeout_s: float = 20.0) -> list[Any]:
    """The first ``count`` server-sent events' data, parsed as JSON."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        conn.request("GET", parts.path)
        response = conn.getresponse()
        assert response.status == 200, response.status
        assert response.getheader("content-type", "").startswith("text/event-stream")
        events: list[Any] = []
        while len(events) < count:
            line = response.fp.readline()
            assert line, "the event stream ended"
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: ") :]))
        return events
    finally:
        conn.close()


def without_volatile(doc: Any) -> Any:
    """``doc`` with the clock- and traffic-driven values blanked, for comparing two reads."""
    if isinstance(doc, dict):
        return {k: (None if k in VOLATILE_KEYS else without_volatile(v)) for k, v in doc.items()}
    if isinstance(doc, list):
        return [without_volatile(v) for v in doc]
    return doc
