"""The HTTP surface, operator-grade, against real `mesh-node serve` processes on
loopback: the official `openai` client for the happy paths (with a key, and without one),
raw sockets for slow bodies, request smuggling and cross-site requests.

The coordinator serves a tiny synthetic package alone (``--stages 1``): the API in front of a
real split of one stage, real llama.cpp tokenizer, real ggml. Prompts are token ids (the
synthetic vocabulary cannot encode most text, tests/processes/test_serve_processes.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")
pytest.importorskip("openai", reason="the openai client is a dev dependency")

import openai
import synth_gguf
from pkgtools import make_package
from prometheus_client.parser import text_string_to_metric_families
from servetools import Cluster, Proc, node_toml, wait_ready

pytestmark = pytest.mark.llama

IDS = [1, 5, 9, 17, 33, 65, 3, 100, 7, 12, 90, 44]
KEY = "sk-test-" + "k3y" * 8
OTHER_KEY = "sk-other-" + "x" * 20
ALLOWED_ORIGIN = "http://app.example:3000"
HTTP_TOML = f"""
[http]
api_key_file = "keys.txt"
allowed_origins = ["{ALLOWED_ORIGIN}"]
max_concurrent_bodies = 4
body_read_timeout_s = 2
body_deadline_s = 4
"""


@pytest.fixture(scope="module")
def tiny_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("http_tiny")
    src = synth_gguf.llama_like(root / "llama.gguf", n_layers=6)
    make_package(src, root / "pkg", model_id="acme/tiny-GGUF:Q8_0")
    return root / "pkg"


def write_keys(path: Path, *keys: str, mode: int = 0o600) -> Path:
    path.write_text("# the node's API keys\n\n" + "".join(f"{k}\n" for k in keys))
    path.chmod(mode)
    return path


def serve_alone(
    root: Path, pkg: Path, extra_toml: str = "", args: tuple[str, ...] = (), **kw: Any
) -> tuple[Cluster, Proc]:
    """One `mesh-node serve --stages 1` node; returns once it printed its API address."""
    cluster = Cluster(root)
    proc = cluster.start(
        "coord",
        ["serve", "--package", str(pkg), "--stages", "1", "--http", "127.0.0.1:0",
         "--model-name", "tiny", *args],
        node_toml(root, "coord", **kw) + extra_toml,
    )
    proc.address = proc.wait_line("listening ")
    cluster.api = proc.wait_line("api ")
    return cluster, proc


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, tiny_pkg: Path) -> Iterator[Cluster]:
    """A serving node with API keys (a file with two keys), one allowed browser origin and
    short body timeouts; max_sessions 1 and max_queue 1 so a burst meets the 429."""
    root = tmp_path_factory.mktemp("keyed")
    write_keys(root / "keys.txt", KEY, OTHER_KEY)
    cluster, _ = serve_alone(root, tiny_pkg, HTTP_TOML, sessions=1, queue=1, n_ctx=2048)
    try:
        wait_ready_with_key(cluster.api)
        yield cluster
    finally:
        cluster.stop()


def client(api: str, key: str = KEY, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=api, api_key=key, max_retries=0, timeout=60, **kw)


def wait_ready_with_key(api: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client(api).completions.create(model="tiny", prompt=[1], max_tokens=1)
            return
        except openai.APIStatusError as err:
            if err.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def host_port(api: str) -> tuple[str, int]:
    parts = urlsplit(api)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def raw(api: str, data: bytes, *, timeout_s: float = 15.0) -> tuple[bytes, bool]:
    """Send ``data`` on a fresh connection; everything the server sent until it closed (or
    went quiet for ``timeout_s``), and whether it closed the connection."""
    with socket.create_connection(host_port(api), timeout=timeout_s) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            return out, False
        return out, True


def http_request(
    method: str,
    path: str,
    api: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> bytes:
    host, port = host_port(api)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def headers_of(response: bytes) -> dict[str, str]:
    head = response.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in head)}


def json_of(response: bytes) -> Any:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


def bearer(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def page(api: str) -> str:
    return api.removesuffix("/v1")


def metrics(api: str) -> dict[str, float]:
    response, _ = raw(api, http_request("GET", "/metrics", api, headers=bearer()))
    assert status_of(response) == 200
    body = response.split(b"\r\n\r\n", 1)[1].decode()
    out = {}
    for family in text_string_to_metric_families(body):
        if family.name == "mesh_node_requests":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels["outcome"]] = s.value
    return out


# --- 1. API keys ---------------------------------------------------------------------------------
def test_keys_the_openai_client_and_what_stays_open(keyed: Cluster) -> None:
    api = keyed.api
    c = client(api)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    assert c.models.retrieve("tiny").id == "tiny"  # GET /v1/models/{id}
    done = c.completions.create(model="tiny", prompt=IDS, max_tokens=8, temperature=0)
    streamed = client(api, OTHER_KEY).completions.create(  # the file's second key works too
        model="tiny", prompt=IDS, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == done.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    for bad in ("", "sk-wrong", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as err:
            client(api, bad or "none").models.list()
        assert err.value.status_code == 401
        assert err.value.body["code"] == "invalid_api_key"
    # raw: 401 with WWW-Authenticate and OpenAI's error body, for every protected path
    for path in ("/v1/models", "/api/status", "/api/events", "/metrics", "/v1/nothing"):
        response, _ = raw(api, http_request("GET", path, api))
        assert status_of(response) == 401, path
        assert headers_of(response)["www-authenticate"] == "Bearer"
        assert json_of(response)["error"]["code"] == "invalid_api_key"
        if path != "/api/events":  # an event stream does not end
            response, _ = raw(api, http_request("GET", path, api, headers=bearer()))
            assert status_of(response) in (200, 404), (path, response[:200])
    # /health stays open (a load balancer has no key); so does the page's static shell
    response, _ = raw(api, http_request("GET", "/health", api))
    # the open answer says only that it serves, and on which engine: nothing else leaks
    assert status_of(response) == 200
    assert json_of(response) == {"status": "ok", "engine": "engine: ggml"}
    for path in ("/", "/static/app.js", "/static/style.css"):
        response, closed = raw(api, http_request("GET", path, api))
        assert status_of(response) == 200, path
        assert b'"node_id"' not in response  # the shell holds no data
        assert closed, f"{path}: answered, then held open despite Connection: close"


def test_a_key_file_others_can_read_is_refused(tmp_path: Path, tiny_pkg: Path) -> None:
    keys = write_keys(tmp_path / "keys.txt", KEY, mode=0o644)
    (tmp_path / "n.toml").write_text(node_toml(tmp_path, "n"))
    out = subprocess.run(
        [sys.executable, "-m", "mesh_node", "run", "--config", str(tmp_path / "n.toml"),
         "--http", "127.0.0.1:0", "--api-key-file", str(keys)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2 and "error [key_file_permissions]" in out.stderr, out.stderr
    assert "chmod 600" in out.stderr and "Traceback" not in out.stderr and KEY not in out.stderr
    assert out.stdout == ""  # refused before the node started


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_key_file_that_is_a_link_or_a_fifo_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    """`--api-key-file` naming a symbolic link (to a good 0600 file) or a FIFO: exit 2 with
    the key file's error before the node starts. Before, the link was resolved and followed,
    and the FIFO's open waited for a writer: start-up hung without a word."""
    keys = tmp_path / "keys.txt"
    if kind == "symlink":
        os.symlink(write_keys(tmp_path / "real-keys.txt", KEY), keys)
    else:
        os.mkfifo(keys, 0o600)
    (tmp_path / "n.toml").write_text(node_toml(tmp_path, "n"))
    out = subprocess.run(
        [sys.executable, "-m", "mesh_node", "run", "--config", str(tmp_path / "n.toml"),
         "--http", "127.0.0.1:0", "--api-key-file", str(keys)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "error [invalid_api_key_file]" in out.stderr, out.stderr
    said = "is a symbolic link" if kind == "symlink" else "is not a regular file (a FIFO)"
    assert said in out.stderr and "hint: " in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and KEY not in out.stderr
    assert out.stdout == ""  # refused before the node started


def test_tls_with_a_self_signed_certificate_and_the_environment_key(
    tmp_path: Path, tiny_pkg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTPS through hypercorn's own TLS on the same listener; MESH_NODE_API_KEY as the key."""
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("MESH_NODE_API_KEY", KEY)
    cluster, _ = serve_alone(
        tmp_path, tiny_pkg, f'[http]\ntls_cert = "{cert.name}"\ntls_key = "{key.name}"\n'
    )
    try:
        assert cluster.api.startswith("https://127.0.0.1:")
        trusted = ssl.create_default_context(cafile=str(cert))
        with openai.DefaultHttpxClient(verify=trusted) as http:
            c = client(cluster.api, http_client=http)
            deadline = time.monotonic() + 90
            while True:
                try:
                    # greedy: a sampled token may be the end of text, ending it early
                    done = c.completions.create(
                        model="tiny", prompt=IDS, max_tokens=4, temperature=0
                    )
                    break
                except openai.APIStatusError as err:
                    assert err.status_code == 503 and time.monotonic() < deadline
                    time.sleep(0.2)
            assert done.usage is not None and done.usage.completion_tokens == 4
            with pytest.raises(openai.AuthenticationError):
                client(cluster.api, "nope", http_client=http).models.list()
            health = http.get(page(cluster.api) + "/health")
            assert health.status_code == 200
            assert health.json() == {"status": "ok", "engine": "engine: ggml"}
        # plain HTTP on the TLS port gets no answer from the app
        response, _ = raw(cluster.api, http_request("GET", "/health", cluster.api), timeout_s=5)
        assert b'"status"' not in response
    finally:
        cluster.stop()


def self_signed(root: Path) -> tuple[Path, Path]:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = root / "tls.crt", root / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


# --- 2. health, models, OpenAI-shaped 404/405 ----------------------------------------------------
def test_health_tells_the_truth_while_the_split_forms(tmp_path: Path, tiny_pkg: Path) -> None:
    """A coordinator waiting for a second stage that never comes: /health is 503 with the
    reason and Retry-After, a completion is 503 split_not_ready with Retry-After, counted
    as rejected; no key configured on loopback: the API answers without one."""
    cluster, _ = serve_alone(tmp_path, tiny_pkg, args=("--stages", "2"))
    api = cluster.api
    try:
        response, _ = raw(api, http_request("GET", "/health", api))
        assert status_of(response) == 503, response
        doc = json_of(response)
        assert doc["status"] == "loading" and "not ready" in doc["reason"]
        assert int(headers_of(response)["retry-after"]) > 0
        with pytest.raises(openai.APIStatusError) as err:
            client(api, "unused").completions.create(model="tiny", prompt=IDS, max_tokens=1)
        assert err.value.status_code == 503
        assert err.value.body["code"] == "split_not_ready"
        assert int(err.value.response.headers["retry-after"]) > 0
        response, _ = raw(api, http_request("GET", "/metrics", api))
        assert status_of(response) == 200  # no key configured: open (loopback)
        assert b'mesh_node_requests_total{outcome="rejected"} 1.0' in response
        assert b'mesh_node_requests_total{outcome="error"} 0.0' in response
    finally:
        cluster.stop()


def test_unknown_paths_and_methods_answer_in_openai_shape(keyed: Cluster) -> None:
    api = keyed.api
    for method, path, status, code in (
        ("GET", "/v1/embeddings", 404, "not_found"),
        ("POST", "/v1/embeddings", 404, "not_found"),
        ("GET", "/v1/completions", 405, "method_not_allowed"),
        ("DELETE", "/v1/models", 405, "method_not_allowed"),
        ("GET", "/v1/models/other-model", 404, "model_not_found"),
    ):
        headers = {**bearer(), "Content-Type": "application/json"}
        response, _ = raw(api, http_request(method, path, api, b"{}", headers))
        assert status_of(response) == status, (method, path, response[:300])
        assert json_of(response)["error"]["code"] == code
    with pytest.raises(openai.NotFoundError):
        client(api).models.retrieve("other-model")


# --- 5. no cross-site requests -------------------------------------------------------------------
def test_cross_site_requests_are_refused_and_allowed_origins_get_cors(keyed: Cluster) -> None:
    api = keyed.api
    body = json.dumps({"prompt": IDS, "max_tokens": 1}).encode()
    before = metrics(api)
    # the "simple request" a page elsewhere can make: text/plain, no preflight
    simple = {"Content-Type": "text/plain", **bearer()}
    response, _ = raw(api, http_request("POST", "/v1/completions", api, body, simple))
    assert status_of(response) == 415
    assert json_of(response)["error"]["code"] == "unsupported_media_type"
    evil = {"Origin": "http://evil.example", "Content-Type": "application/json", **bearer()}
    response, _ = raw(api, http_request("POST", "/v1/completions", api, body, evil))
    assert status_of(response) == 403
    assert json_of(response)["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in headers_of(response)
    # GETs too: a page elsewhere reads nothing (not even a status) from the node
    response, _ = raw(api, http_request("GET", "/api/status", api, headers=evil))
    assert status_of(response) == 403
    # neither reached the split
    assert metrics(api).get("ok") == before.get("ok")
    # the node's own origin (the status page's fetches) passes
    host, port = host_port(api)
    own = {"Origin": f"http://{host}:{port}", **bearer()}
    response, _ = raw(api, http_request("GET", "/api/status", api, headers=own))
    assert status_of(response) == 200
    # an allowed browser client: preflight answered without a key, then the real request
    preflight = {
        "Origin": ALLOWED_ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    response, _ = raw(api, http_request("OPTIONS", "/v1/completions", api, headers=preflight))
    assert status_of(response) == 204
    h = headers_of(response)
    assert h["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "authorization" in h["access-control-allow-headers"]
    allowed = {"Origin": ALLOWED_ORIGIN, "Content-Type": "application/json", **bearer()}
    response, _ = raw(api, http_request("POST", "/v1/completions", api, body, allowed))
    assert status_of(response) == 200, response[:300]
    assert headers_of(response)["access-control-allow-origin"] == ALLOWED_ORIGIN


# --- 6. protocol hygiene -------------------------------------------------------------------------
def test_content_length_with_transfer_encoding_closes_the_connection(keyed: Cluster) -> None:
    api = keyed.api
    host, port = host_port(api)
    smuggled = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        f"GET /v1/models HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {KEY}\r\n\r\n"
    ).encode()
    response, closed = raw(api, smuggled)
    assert response.startswith(b"HTTP/1.1 400") and closed, (response, keyed.proc("coord").log[-8:])
    assert json_of(response)["error"]["code"] == "conflicting_framing"
    assert response.count(b"HTTP/1.1 ") == 1  # the pipelined GET was never answered


def test_the_serve_control_operation_goes_through_the_loopback_gate(
    tmp_path: Path, tiny_pkg: Path
) -> None:
    import trio

    from mesh_node import control
    from mesh_node.errors import MeshError

    cluster = Cluster(tmp_path)
    proc = cluster.start("n", ["run"], node_toml(tmp_path, "n"))
    try:
        proc.wait_line("listening ")
        sock = tmp_path / "n-data" / "mesh-node.sock"
        request = {"op": "serve", "package": str(tiny_pkg), "stages": 1, "http": "0.0.0.0:0"}
        with pytest.raises(MeshError) as err:  # the node's answer, raised by the client
            trio.run(control.request, sock, request, 30.0)
        assert err.value.code == "http_not_loopback" and err.value.exit_code == 2
        assert proc.popen.poll() is None  # the node refused the operation and runs on
    finally:
        cluster.stop()


# --- 4. bounded bodies ---------------------------------------------------------------------------
def test_slow_and_stalled_bodies_get_408_and_deep_json_400(keyed: Cluster) -> None:
    api = keyed.api
    host, port = host_port(api)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n"
    ).encode()
    # dribbled: one byte every 0.5 s (each within the 2 s read timeout) -> the 4 s deadline
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(head)
        response = b""
        start = time.monotonic()
        s.settimeout(0.5)
        while not response and time.monotonic() - start < 30:
            try:
                s.sendall(b" ")
                response = s.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        s.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):  # the rest of the answer, until the node closes
                response += chunk
    assert status_of(response) == 408, response
    assert b"request_timeout" in response and b"within 4 s" in response
    # stalled: half a body, then silence -> the read timeout
    response, closed = raw(api, head + b'{"prompt": ')
    assert status_of(response) == 408 and closed and b"no body bytes for 2 s" in response
    # 100,000 nested arrays: 400 invalid_json, no traceback on the node's log
    deep = b"[" * 100_000 + b"]" * 100_000
    headers = {**bearer(), "Content-Type": "application/json"}
    response, _ = raw(api, http_request("POST", "/v1/completions", api, deep, headers))
    assert status_of(response) == 400 and json_of(response)["error"]["code"] == "invalid_json"
    deep_object = json.dumps({"prompt": IDS, "x": json.loads("[" * 40 + "]" * 40)}).encode()
    response, _ = raw(api, http_request("POST", "/v1/completions", api, deep_object, headers))
    assert status_of(response) == 400 and b"deeper than 32" in response
    assert not any("Traceback" in line for line in keyed.proc("coord").log)


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    assert m is not None
    return int(m.group(1)) * 1024


FLOOD_BODIES = 24
FLOOD_BODY_BYTES = 16 * 1024 * 1024


def test_a_slow_body_flood_is_bounded_and_rss_returns(keyed: Cluster) -> None:
    """The issue's flood: 24 POSTs of 16 MiB, each 10 bytes short of its Content-Length.
    At most max_concurrent_bodies are read at once (the rest get 503 with Retry-After before
    a byte is read), the deadline ends the ones read, and RSS comes back within 50 MB."""
    api = keyed.api
    pid = keyed.proc("coord").popen.pid
    host, port = host_port(api)
    wait_ready_with_key(api)
    start_rss = rss_bytes(pid)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {FLOOD_BODY_BYTES}\r\n\r\n"
    ).encode()
    payload = b" " * (FLOOD_BODY_BYTES - 10)
    answers: list[bytes] = []
    peak = [start_rss]

    def one() -> None:
        with socket.create_connection((host, port), timeout=30) as s:
            # refused before its body was read: the node may close it under the send
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                s.sendall(head + payload)
            try:
                answers.append(s.recv(65536))
            except (ConnectionResetError, TimeoutError):
                answers.append(b"")

    threads = [threading.Thread(target=one) for _ in range(FLOOD_BODIES)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak.append(rss_bytes(pid))
        time.sleep(0.1)
    statuses = sorted(status_of(a) for a in answers if a)
    assert statuses and set(statuses) <= {408, 503}, statuses
    assert statuses.count(408) <= 4  # max_concurrent_bodies: the only ones read
    assert any(b"retry-after: 1" in a.lower() for a in answers if a.startswith(b"HTTP/1.1 503"))
    time.sleep(1.0)
    end_rss = rss_bytes(pid)
    print(
        f"slow-body flood: RSS start {start_rss / 1e6:.0f} MB, peak {max(peak) / 1e6:.0f} MB, "
        f"after {end_rss / 1e6:.0f} MB; statuses {statuses}"
    )
    assert end_rss - start_rss < 50_000_000
    # and the node still serves
    assert client(api).completions.create(model="tiny", prompt=IDS, max_tokens=2).usage


# --- 7. right answers, and /metrics outcomes -----------------------------------------------------
def test_statuses_retry_after_and_metrics_outcomes(keyed: Cluster) -> None:
    api = keyed.api
    c = client(api)
    before = metrics(api)
    # empty prompt: 400 empty_prompt (was 503)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="tiny", prompt="", max_tokens=1)
    assert err.value.body["code"] == "empty_prompt"
    # too long for the context: one code
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="tiny", prompt=[5] * 3000, max_tokens=1)
    assert err.value.body["code"] == "context_length_exceeded"
    # a burst past max_sessions 1 + max_queue 1: 429 with Retry-After
    results: list[Any] = []

    def one() -> None:
        try:
            results.append(
                c.completions.create(model="tiny", prompt=IDS, max_tokens=200, temperature=0)
            )
        except openai.APIStatusError as e:
            results.append(e)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    busy = [r for r in results if isinstance(r, openai.RateLimitError)]
    ok = [r for r in results if not isinstance(r, Exception)]
    assert busy and ok and len(busy) + len(ok) == 8, results
    assert all(int(r.response.headers["retry-after"]) >= 1 for r in busy)
    assert all(r.body["code"] == "server_busy" for r in busy)
    # a client that leaves mid-stream: cancelled, not error
    stream = c.completions.create(
        model="tiny", prompt=IDS, max_tokens=2000, temperature=0, stream=True
    )
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while (after := metrics(api)).get("cancelled", 0) == before.get("cancelled", 0):
        if time.monotonic() > deadline:
            Path("/tmp/keyed.log").write_text("\n".join(keyed.proc("coord").log))
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    assert after["cancelled"] - before.get("cancelled", 0) == 1
    assert after["ok"] - before.get("ok", 0) == len(ok)
    assert after["rejected"] - before.get("rejected", 0) == len(busy) + 2  # + the two 400s
    assert after["error"] == before.get("error", 0) == 0


# --- 3. the access log ---------------------------------------------------------------------------
def test_access_log_lines_with_request_ids_and_no_secrets(keyed: Cluster) -> None:
    api = keyed.api
    secret_prompt = "the-secret-prompt-text-42"
    headers = {**bearer(), "Content-Type": "application/json", "X-Request-Id": "req-abc.123"}
    body = json.dumps({"prompt": IDS, "max_tokens": 3, "temperature": 0}).encode()
    response, _ = raw(api, http_request("POST", "/v1/completions?key=" + KEY, api, body, headers))
    assert status_of(response) == 200 and headers_of(response)["x-request-id"] == "req-abc.123"
    response, _ = raw(api, http_request("GET", "/v1/models", api, headers=bearer()))
    generated = headers_of(response)["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{16}", generated)
    text = json.dumps({"prompt": secret_prompt, "max_tokens": 1}).encode()
    raw(api, http_request("POST", "/v1/completions", api, text, {**bearer(), "Content-Type":
                                                                "application/json"}))
    log = keyed.proc("coord").log
    deadline = time.monotonic() + 10
    while not any(generated in line for line in log):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    (line,) = [line for line in log if "req-abc.123" in line]
    assert "logger=mesh_node.http.access" in line
    for field in ("method=POST", 'path=\\"/v1/completions\\"', "status=200", "tokens_in=12",
                  "tokens_out=3", "client=127.0.0.1:", "duration_ms=", "bytes_out="):
        assert field in line, (field, line)
    joined = "\n".join(log)
    assert KEY not in joined and OTHER_KEY not in joined and secret_prompt not in joined


# --- SIGTERM during a stream ----------------------------------------------------------------------
def test_sigterm_ends_open_streams_with_an_error_event(tmp_path: Path, tiny_pkg: Path) -> None:
    """No grace (``shutdown_grace_s = 0``): the open stream is ended at once, with a final
    SSE error event and [DONE], not a bare connection error; the node exits 0."""
    cluster, proc = serve_alone(
        tmp_path, tiny_pkg, "[http]\nshutdown_grace_s = 0\n", n_ctx=2048
    )
    try:
        wait_ready(cluster.api)
        host, port = host_port(cluster.api)
        body = json.dumps(
            {"prompt": IDS, "max_tokens": 2000, "temperature": 0, "stream": True}
        ).encode()
        with socket.create_connection((host, port), timeout=30) as s:
            s.sendall(
                http_request("POST", "/v1/completions", cluster.api, body,
                             {"Content-Type": "application/json"})
            )
            received = s.recv(65536)
            assert received.startswith(b"HTTP/1.1 200")
            os.kill(proc.popen.pid, signal.SIGTERM)
            while chunk := s.recv(65536):
                received += chunk
        events = [line[6:] for line in received.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        final = json.loads(events[-2])
        assert final["error"]["code"] == "shutting_down", events[-3:]
        assert received.endswith(b"0\r\n\r\n")  # the chunked body was ended properly
        assert proc.popen.wait(timeout=30) == 0
    finally:
        cluster.stop()


def test_a_failure_of_ours_is_an_error_outcome_and_a_final_sse_event(
    tmp_path: Path, tiny_pkg: Path
) -> None:
    """Two stages, no spare: SIGKILL the worker mid-stream. The stream ends with an SSE error
    event (no capable peer) and [DONE], not a bare connection error; /metrics counts it as
    ``error`` (a failure of ours), not ``cancelled``."""
    cluster, _ = serve_alone(tmp_path, tiny_pkg, args=("--stages", "2"), n_ctx=2048)
    try:
        coord = cluster.proc("coord")
        toml = node_toml(tmp_path, "w0", peers=(coord.address,), n_ctx=2048)
        worker = cluster.start("w0", ["run"], toml)
        worker.address = worker.wait_line("listening ")
        wait_ready(cluster.api)
        host, port = host_port(cluster.api)
        body = json.dumps(
            {"prompt": IDS, "max_tokens": 2000, "temperature": 0, "stream": True}
        ).encode()
        with socket.create_connection((host, port), timeout=60) as s:
            s.sendall(
                http_request("POST", "/v1/completions", cluster.api, body,
                             {"Content-Type": "application/json"})
            )
            received = s.recv(65536)
            while received.count(b"data: ") < 2:
                received += s.recv(65536)
            os.kill(worker.popen.pid, signal.SIGKILL)
            while chunk := s.recv(65536):
                received += chunk
        events = [line[6:] for line in received.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        final = json.loads(events[-2])
        assert "error" in final and final["error"]["type"] == "service_unavailable", final
        outcomes = {}
        response, _ = raw(cluster.api, http_request("GET", "/metrics", cluster.api))
        for family in text_string_to_metric_families(
            response.split(b"\r\n\r\n", 1)[1].decode()
        ):
            if family.name == "mesh_node_requests":
                outcomes = {
                    s.labels["outcome"]: s.value for s in family.samples
                    if s.name.endswith("_total")
                }
        assert outcomes["error"] == 1 and outcomes["cancelled"] == 0, outcomes
    finally:
        cluster.stop()
