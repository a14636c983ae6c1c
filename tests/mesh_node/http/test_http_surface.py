"""The node's HTTP surface: real nodes on loopback, the real starlette app on
hypercorn's trio worker, read over real HTTP connections."""

from __future__ import annotations

import contextlib
import http.client
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from httptools import arequest, get_json, read_events, status_only, without_volatile
from meshtools import identity, settings, topology_node, topology_of, wait_for, with_peers
from meshxfer import import_into, propose, start_member, wait_connected
from prometheus_client.parser import text_string_to_metric_families

from mesh_node.http import app as http_app
from mesh_node.http.app import build_app
from mesh_node.http.bind import allowed_hosts, check_http_bind
from mesh_node.http.server import serve_http
from mesh_node.http.view import public_status
from mesh_node.node import MeshNode
from mesh_node.serving.split_service import Serving
from mesh_node.settings import HostPort
from skippy.errors import UsageError
from skippy.package.plan import ModelSizes

LOOPBACK = HostPort("127.0.0.1", 0)
SIZES = ModelSizes(layer_bytes=(100,) * 6, metadata_bytes=10, embeddings_bytes=50, output_bytes=50)
REF = "hf://lab/pkg@" + "0" * 40
# Every metric the node documents (prometheus_client's text parser reports a counter family
# without ``_total``; an info metric is a gauge in the text format).
REQUIRED_METRICS = {
    "mesh_node_info": "gauge",
    "mesh_node_uptime_seconds": "gauge",
    "mesh_node_peers": "gauge",
    "mesh_node_link_received_bytes": "counter",
    "mesh_node_link_sent_bytes": "counter",
    "mesh_node_artifact_served_bytes": "counter",
    "mesh_node_artifact_fetched_bytes": "counter",
    "mesh_node_artifact_verification_failures": "counter",
    "mesh_node_artifact_transfer_refusals": "counter",
    "mesh_node_topology_stages": "gauge",
    "mesh_node_topology_stages_ready": "gauge",
    "mesh_node_requests": "counter",
    "mesh_node_requests_in_flight": "gauge",
    "mesh_node_tokens": "counter",
    "mesh_node_time_to_first_token_seconds": "histogram",
    "mesh_node_request_duration_seconds": "histogram",
    "mesh_node_artifact_transfer_duration_seconds": "histogram",
    "mesh_node_artifact_transfers_in_progress": "gauge",
    "mesh_node_stage_ready": "gauge",
}


@asynccontextmanager
async def served(node: MeshNode, **kw: object) -> AsyncIterator[str]:
    """The node's app on a free loopback port; yields the page URL."""
    async with trio.open_nursery() as n:
        app = build_app(node, allowed_hosts=allowed_hosts(LOOPBACK, False), **kw)  # type: ignore[arg-type]
        url = await n.start(serve_http, app, LOOPBACK)
        yield url
        n.cancel_scope.cancel()


async def three_nodes(n: trio.Nursery, tmp_path) -> list[MeshNode]:
    owner = Ed25519PrivateKey.generate()
    a = topology_node(settings(tmp_path, "a"), identity(owner))
    await n.start(a.run)
    nodes = [a]
    for name in ("b", "c"):
        node = topology_node(with_peers(settings(tmp_path, name), a), identity(owner))
        await n.start(node.run)
        nodes.append(node)
    await wait_for(lambda: all(len(x.peers(connected_only=True)) == 2 for x in nodes))
    return nodes


async def test_api_status_is_the_status_document(tmp_path):
    owner = Ed25519PrivateKey.generate()
    quiet = topology_node(settings(tmp_path, "q"), identity(owner))  # not running: nothing moves
    async with served(quiet) as url:
        status, headers, body = await arequest(url + "api/status")
        assert status == 200 and headers["content-type"] == "application/json"
        assert json.loads(body) == quiet.status()
    async with trio.open_nursery() as n:
        a, b, c = await three_nodes(n, tmp_path)
        await topology_of(a).propose(package_ref=REF, manifest_sha256="ab" * 32, sizes=SIZES)
        async with served(a) as url:
            doc = await trio.to_thread.run_sync(get_json, url + "api/status")
            # The same document, but for values that moved between the two reads.
            assert without_volatile(doc) == without_volatile(a.status())
            assert {p["node_id"] for p in doc["peers"]} == {b.node_id, c.node_id}
            assert len(doc["topology"]["stages"]) == 3
        n.cancel_scope.cancel()


def metric_families(body: bytes) -> dict[str, Any]:
    """Parsed with prometheus_client's own text parser; every metric of the issue present."""
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for name, kind in REQUIRED_METRICS.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
    return families


def metric(families: dict[str, Any], name: str, suffix: str = "", **labels: str) -> float:
    (v,) = [
        s.value
        for s in families[name].samples
        if s.name == name + suffix and all(s.labels.get(k) == x for k, x in labels.items())
    ]
    return float(v)


async def test_metrics_of_a_real_split_with_transfers_parse_and_name_every_metric(
    tmp_path, hub_package
):
    """A coordinator (trusted mode) serving a worker of its owner, and refusing a worker of
    another owner, which falls back to the hub: real transfers, real counters."""
    owner, stranger = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    hp = hub_package
    async with trio.open_nursery() as n:
        coord = await start_member(
            n, tmp_path, "coord", owner, hub=hp.hub, artifact_transfer="trusted"
        )
        pkg = import_into(coord, hp)
        ours = await start_member(n, tmp_path, "ours", owner, hub=hp.hub, peers=(coord.node,))
        theirs = await start_member(
            n, tmp_path, "theirs", stranger, hub=hp.hub, peers=(coord.node,)
        )
        await wait_connected([coord, ours, theirs])
        await propose(coord, pkg)
        await wait_for(
            lambda: all(w.service.records.stage.report == "accepted" for w in (ours, theirs)), 30
        )
        # the seam: a served request, counted where it happens
        with coord.node.service(Serving).metrics.request(prompt_tokens=7) as req:
            req.tokens(1)
            req.tokens(3)
        bodies = {}
        for m in (coord, ours, theirs):
            async with served(m.node) as url:
                status, headers, bodies[m.node.node_id] = await arequest(url + "metrics")
                assert status == 200 and headers["content-type"].startswith("text/plain")
        n.cancel_scope.cancel()
    c = metric_families(bodies[coord.node.node_id])
    assert (
        metric(c, "mesh_node_peers", trust="trusted", owner_status="verified", connected="true")
        == 1
    )
    assert (
        metric(c, "mesh_node_peers", trust="untrusted", owner_status="verified", connected="true")
        == 1
    )
    assert metric(c, "mesh_node_topology_stages") == 3
    assert metric(c, "mesh_node_topology_stages_ready") == 3  # every stage reported ready
    for w in (ours, theirs):
        assert metric(c, "mesh_node_link_received_bytes", "_total", peer=w.node.node_id) > 0
    sent_to_ours = metric(c, "mesh_node_link_sent_bytes", "_total", peer=ours.node.node_id)
    served_bytes = metric(c, "mesh_node_artifact_served_bytes", "_total")
    assert served_bytes == ours.service.records.counters.fetched_bytes["peer"] > 0
    assert sent_to_ours > served_bytes  # the artifacts crossed that link, plus framing
    assert (
        metric(c, "mesh_node_artifact_transfer_refusals", "_total", reason="peer_owner_untrusted")
        > 0
    )
    assert (
        metric(c, "mesh_node_artifact_transfer_duration_seconds", "_count", direction="serve") > 0
    )
    assert metric(c, "mesh_node_requests", "_total", outcome="ok") == 1
    assert metric(c, "mesh_node_tokens", "_total", kind="prompt") == 7
    assert metric(c, "mesh_node_tokens", "_total", kind="completion") == 4
    assert metric(c, "mesh_node_time_to_first_token_seconds", "_count") == 1
    assert c["mesh_node_info"].samples[0].labels["node_id"] == coord.node.node_id
    o = metric_families(bodies[ours.node.node_id])
    assert metric(o, "mesh_node_artifact_fetched_bytes", "_total", source="peer") == served_bytes
    assert metric(o, "mesh_node_artifact_fetched_bytes", "_total", source="hub") == 0
    assert metric(o, "mesh_node_stage_ready") == 1
    fetches = metric(o, "mesh_node_artifact_transfer_duration_seconds", "_count", direction="fetch")
    assert fetches == len(
        [r for r in ours.node.status()["transfers"]["recent"] if r["source"] == "peer"]
    )
    t = metric_families(bodies[theirs.node.node_id])
    assert metric(t, "mesh_node_artifact_fetched_bytes", "_total", source="hub") > 0
    assert metric(t, "mesh_node_artifact_fetched_bytes", "_total", source="peer") == 0
    assert sum(s.value for s in t["mesh_node_artifact_refusals_received"].samples) > 0
    assert metric(t, "mesh_node_artifact_verification_failures", "_total") == 0


async def test_only_get_reaches_the_node(tmp_path):
    """Nothing under / or /api changes the node: every other method is refused (405) before
    any handler runs, and the node's state is the same afterwards."""
    async with trio.open_nursery() as n:
        a, _, _ = await three_nodes(n, tmp_path)
        before = without_volatile(a.status())
        async with served(a) as url:
            for path in ("", "api/status", "api/events", "metrics", "static/app.js", "nope/x"):
                for method in ("POST", "PUT", "PATCH", "DELETE", "OPTIONS"):
                    status, _, _ = await arequest(url + path, method, body=b'{"op":"topology"}')
                    assert status == (404 if path == "nope/x" else 405), (method, path)
            status, _, body = await arequest(url + "api/status", "HEAD")
            assert status == 200 and body == b""
        assert without_volatile(a.status()) == before
        n.cancel_scope.cancel()


async def test_security_headers_and_host_check(tmp_path):
    node = topology_node(settings(tmp_path, "a"), identity())
    async with served(node) as url:
        status, headers, body = await arequest(url)
        assert status == 200 and headers["content-type"].startswith("text/html")
        csp = headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp
        assert headers["x-content-type-options"] == "nosniff"
        # The page pulls nothing from elsewhere: every script and stylesheet is ours.
        html = body.decode()
        assert 'src="/static/app.js"' in html and 'href="/static/style.css"' in html
        assert "http://" not in html and "https://" not in html
        for asset in ("static/app.js", "static/style.css"):
            status, _, text = await arequest(url + asset)
            assert status == 200 and b"http://" not in text and b"https://" not in text
        # DNS rebinding: a page elsewhere that resolves its own name to 127.0.0.1 is refused.
        status, _, _ = await arequest(url + "api/status", headers={"Host": "evil.example:80"})
        assert status == 400
        status, _, _ = await arequest(url + "api/status", headers={"Host": "localhost"})
        assert status == 200


async def test_event_stream_pushes_the_document_and_follows_the_node(tmp_path):
    owner = Ed25519PrivateKey.generate()
    async with trio.open_nursery() as n:
        a = topology_node(settings(tmp_path, "a"), identity(owner))
        await n.start(a.run)
        async with served(a) as url:
            (first,) = await trio.to_thread.run_sync(read_events, url + "api/events", 1)
            assert first["node_id"] == a.node_id and first["peers"] == []
            b = topology_node(with_peers(settings(tmp_path, "b"), a), identity(owner))
            await n.start(b.run)
            await wait_for(lambda: len(a.peers()) == 1)
            events = await trio.to_thread.run_sync(read_events, url + "api/events", 2)
            assert [p["node_id"] for p in events[-1]["peers"]] == [b.node_id]
            assert without_volatile(events[-1]) == without_volatile(public_status(a.status()))
        n.cancel_scope.cancel()


async def test_open_event_streams_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(http_app, "MAX_EVENT_STREAMS", 1)
    node = topology_node(settings(tmp_path, "a"), identity())
    holding = trio.Event()

    def hold_a_page_open(url: str) -> None:
        with contextlib.closing(http.client.HTTPConnection("127.0.0.1", urlsplit(url).port)) as c:
            c.request("GET", "/api/events")
            response = c.getresponse()
            assert response.status == 200
            while not response.fp.readline().startswith(b"data: "):
                pass
            trio.from_thread.run_sync(holding.set)
            while response.fp.readline():  # until the server goes away
                pass

    async with served(node) as url, trio.open_nursery() as n:
        n.start_soon(
            partial(trio.to_thread.run_sync, abandon_on_cancel=True), hold_a_page_open, url
        )
        await holding.wait()
        status, body = await trio.to_thread.run_sync(status_only, url + "api/events")
        assert status == 503 and b"poll /api/status" in body
        status, _, _ = await arequest(url + "api/status")  # polling still works
        assert status == 200
        n.cancel_scope.cancel()


async def test_components_add_routes_to_the_same_app(tmp_path):
    """How the OpenAI API joins: its routes (any method, on its own paths)."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"got": (await request.json())["prompt"]})

    node = topology_node(settings(tmp_path, "a"), identity())
    async with served(node, routes=[Route("/v1/echo", echo, methods=["POST"])]) as url:
        status, _, body = await arequest(
            url + "v1/echo",
            "POST",
            body=b'{"prompt": "hi"}',
            headers={"Content-Type": "application/json"},
        )
        assert status == 200 and json.loads(body) == {"got": "hi"}
        status, _, _ = await arequest(url + "api/status")
        assert status == 200
    for path in ("/", "/api/status", "/metrics", "/static/x.js"):
        with pytest.raises(UsageError):
            build_app(node, routes=[Route(path, echo)])


def test_public_status_reduces_local_paths_and_nothing_else():
    doc = {
        "listen": "ws://127.0.0.1:7000",
        "topology": {"package_ref": "/tmp/pytest-of-x/test/pkg", "stages": []},
        "transfers": {
            "recent": [
                {"path": "layers/layer-00001.gguf", "error": "cannot open /home/u/.cache/b/x"}
            ]
        },
        "peers": [{"address": "ws://[::1]:7001", "n": 3, "ok": True, "none": None}],
        "ref": "hf://lab/pkg@" + "0" * 40,
    }
    out = public_status(doc)
    assert out["topology"]["package_ref"] == "…/pkg"
    assert out["transfers"]["recent"][0] == {
        "path": "layers/layer-00001.gguf",
        "error": "cannot open …/x",
    }
    assert out["peers"] == doc["peers"] and out["listen"] == doc["listen"]
    assert out["ref"] == doc["ref"]


@pytest.mark.parametrize(
    ("host", "public", "outcome"),
    [
        ("127.0.0.1", False, None),
        ("127.0.0.5", False, None),
        ("::1", False, None),
        ("localhost", False, None),
        ("0.0.0.0", False, "error"),
        ("::", False, "error"),
        ("192.168.1.10", False, "error"),
        ("node.example", False, "error"),
        ("0.0.0.0", True, "warning"),
        ("127.0.0.1", True, None),
    ],
)
def test_loopback_by_default_and_anything_else_only_when_public(host, public, outcome):
    bind = HostPort(host, 8080)
    if outcome == "error":
        with pytest.raises(UsageError) as exc:
            check_http_bind(bind, public)
        assert exc.value.code == "http_not_loopback" and exc.value.exit_code == 2
        assert "--http-public" in (exc.value.remediation or "")
    elif outcome == "warning":
        warning = check_http_bind(bind, public)
        assert warning is not None and "reachable from other machines" in warning
        assert allowed_hosts(bind, public) == ["*"]
    else:
        assert check_http_bind(bind, public) is None
        assert "evil.example" not in allowed_hosts(bind, public)
