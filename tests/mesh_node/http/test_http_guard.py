"""The pure parts of the HTTP surface's gate: API keys, the refusal decision, the
error -> status table, bounded JSON and the ``[http]`` settings. Real requests are in
tests/processes/test_http_operator.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mesh_node.errors import KeyFilePermissions
from mesh_node.http.guard import AccessRecord, GuardPolicy, refusal, request_id_of
from mesh_node.http.keys import ApiKeyError, ApiKeys, load_api_keys, parse_key_lines
from mesh_node.serving.pipeline import GenerationFailed, ServerBusy, SplitNotReady
from mesh_node.serving.statuses import as_api_error
from mesh_node.settings import HttpSettings, http_settings, load_node_settings
from skippy.config import read_environment
from skippy.errors import SkippyError, UsageError
from skippy.serving.openai import ApiError, decode_json, parse_request

KEYS = ApiKeys((b"sk-one", b"sk-two"))
H = [(b"host", b"127.0.0.1:8080")]


def test_keys_accept_only_a_bearer_of_a_listed_key():
    assert KEYS.accepts("Bearer sk-one") and KEYS.accepts("bearer sk-two")
    for bad in (None, "", "sk-one", "Basic sk-one", "Bearer sk-on", "Bearer sk-one2", "Bearer "):
        assert not KEYS.accepts(bad), bad
    assert not ApiKeys().required and KEYS.required
    assert "sk-one" not in repr(KEYS) and "2 keys" in repr(KEYS)


def test_key_files_comments_modes_and_the_environment(tmp_path: Path):
    assert parse_key_lines("# c\n\n sk-a \nsk-b\n", "f") == ["sk-a", "sk-b"]
    with pytest.raises(ApiKeyError) as err:
        parse_key_lines("sk a b\n", "f")
    assert "line 1" in err.value.message and "sk a b" not in err.value.message
    path = tmp_path / "keys"
    path.write_text("sk-file\n")
    path.chmod(0o640)
    with pytest.raises(KeyFilePermissions) as perm:
        load_api_keys(HttpSettings(api_key_file=path))
    assert perm.value.code == "key_file_permissions" and perm.value.exit_code == 2
    path.chmod(0o600)
    keys = load_api_keys(HttpSettings(api_key_file=path, api_key="sk-env"))
    assert keys.accepts("Bearer sk-file") and keys.accepts("Bearer sk-env")
    path.write_text("# nothing\n")
    with pytest.raises(ApiKeyError, match="holds no key"):
        load_api_keys(HttpSettings(api_key_file=path))
    env = read_environment({"MESH_NODE_API_KEY": "sk-secret"})
    assert env.api_key == "sk-secret" and "sk-secret" not in repr(env)


def test_a_key_file_must_be_a_regular_file_of_its_own(tmp_path: Path):
    """A symbolic link is refused, not followed (its target's mode is not the one checked),
    from the config file as from the command line; so is a directory."""
    real = tmp_path / "real-keys"
    real.write_text("sk-file\n")
    real.chmod(0o600)
    (tmp_path / "keys.txt").symlink_to(real)
    (tmp_path / "k").write_text("")
    cfg = tmp_path / "node.toml"
    cfg.write_text('identity = "k"\n[http]\napi_key_file = "keys.txt"\n')
    settings = load_node_settings(cfg, read_environment({})).http_settings
    assert settings.api_key_file == tmp_path / "keys.txt"  # the name given, not its target
    with pytest.raises(ApiKeyError) as err:
        load_api_keys(settings)
    assert err.value.code == "invalid_api_key_file" and "symbolic link" in err.value.message
    assert err.value.remediation is not None and str(real) in err.value.remediation
    with pytest.raises(ApiKeyError, match=r"not a regular file \(a directory\)"):
        load_api_keys(HttpSettings(api_key_file=tmp_path))


@pytest.mark.parametrize(
    ("method", "path", "headers", "status", "code"),
    [
        ("POST", "/v1/completions", [(b"content-length", b"5"), (b"transfer-encoding", b"chunked")],
         400, "conflicting_framing"),
        ("POST", "/v1/completions", [(b"content-length", b"5"), (b"content-length", b"6")],
         400, "conflicting_framing"),
        ("GET", "/api/status", [(b"origin", b"http://evil.example")], 403, "origin_not_allowed"),
        ("GET", "/api/status", [(b"origin", b"null")], 403, "origin_not_allowed"),
        ("GET", "/api/status", [], 401, "invalid_api_key"),
        ("GET", "/metrics", [(b"authorization", b"Bearer nope")], 401, "invalid_api_key"),
        ("POST", "/v1/completions", [(b"authorization", b"Bearer sk-one")], 415,
         "unsupported_media_type"),
        ("POST", "/v1/completions",
         [(b"authorization", b"Bearer sk-one"), (b"content-type", b"text/plain")],
         415, "unsupported_media_type"),
    ],
)
def test_refusals(method, path, headers, status, code):
    policy = GuardPolicy(keys=KEYS, allowed_origins=frozenset({"http://app.example"}))
    refused = refusal(method, path, [*H, *headers], "http", policy)
    assert refused is not None and (refused.status, refused.code) == (status, code)
    body = json.loads(refused.body())["error"]
    assert body["code"] == code and "sk-one" not in refused.message
    if status == 401:
        assert (b"www-authenticate", b"Bearer") in refused.headers


def test_what_passes_the_gate():
    policy = GuardPolicy(keys=KEYS, allowed_origins=frozenset({"http://app.example"}))
    ok = [
        (b"authorization", b"Bearer sk-two"),
        (b"content-type", b"application/json; charset=utf-8"),
    ]
    for method, path, headers in (
        ("GET", "/health", []),  # open
        ("GET", "/", []),
        ("GET", "/static/app.js", []),
        ("POST", "/v1/completions", ok),
        ("GET", "/api/status", [ok[0], (b"origin", b"http://127.0.0.1:8080")]),  # own origin
        ("POST", "/v1/completions", [*ok, (b"origin", b"http://app.example")]),
        ("OPTIONS", "/v1/completions", [(b"origin", b"http://app.example")]),  # preflight
    ):
        assert refusal(method, path, [*H, *headers], "http", policy) is None, (method, path)
    # without keys: no authentication (loopback by default), the other rules still hold
    assert refusal("GET", "/api/status", H, "http", GuardPolicy()) is None
    assert refusal("POST", "/v1/completions", H, "http", GuardPolicy()) is not None


def test_request_ids_and_the_access_line():
    assert request_id_of([(b"x-request-id", b"abc-1.2:3")]) == "abc-1.2:3"
    for bad in (b"has space", b"x" * 65, b"quote\"", b"\xff"):
        generated = request_id_of([(b"x-request-id", bad)])
        assert len(generated) == 16 and generated != bad.decode("latin-1")
    record = AccessRecord("rid", "POST", '/v1/"x"\n', "127.0.0.1:5", 10.0, 200, 12, 34, 5, 6)
    line = record.line(10.25)
    assert line.startswith("http method=POST ") and '\\"x\\"\\n' in line and "\n" not in line
    assert "duration_ms=250.0" in line and "tokens_in=5 tokens_out=6" in line


def test_statuses_default_to_5xx_for_our_faults():
    cases: list[tuple[SkippyError, int, str]] = [
        (UsageError("x", code="something_new"), 500, "something_new"),
        (SkippyError("x"), 500, "skippy_error"),
        (UsageError("x", code="prompt_too_long"), 400, "context_length_exceeded"),
        (GenerationFailed("x", code="prompt_too_long"), 400, "context_length_exceeded"),
        (GenerationFailed("x", code="empty_prompt"), 400, "empty_prompt"),
        (UsageError("x", code="token_out_of_range"), 400, "token_out_of_range"),
        (GenerationFailed("x", code="route_failed"), 503, "route_failed"),
        (SplitNotReady("x", code="no_capable_peer"), 503, "no_capable_peer"),
        (ServerBusy("x"), 429, "server_busy"),
        (ApiError("x", code="model_not_found", status=404), 404, "model_not_found"),
    ]
    for err, status, code in cases:
        api = as_api_error(err)
        assert (api.status, api.code) == (status, code), err
    assert as_api_error(ServerBusy("x")).headers["retry-after"] == "1"
    assert int(as_api_error(SplitNotReady("x")).headers["retry-after"]) > 0
    assert "retry-after" not in as_api_error(SplitNotReady("x", code="no_capable_peer")).headers


def test_bounded_json_and_the_empty_prompt():
    assert decode_json(b'{"a": [[1]]}', 3) == {"a": [[1]]}
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"a": [[[1]]]}', b"{", b"\xff"):
        with pytest.raises(ApiError) as err:
            decode_json(body, 3)
        assert err.value.code == "invalid_json" and err.value.status == 400
    with pytest.raises(ApiError) as err:
        parse_request({"prompt": ""}, "completion", max_tokens_limit=64)
    assert err.value.code == "empty_prompt" and err.value.param == "prompt"


def test_the_http_table(tmp_path: Path):
    (tmp_path / "k").write_text("")
    cfg = tmp_path / "node.toml"
    cfg.write_text(
        'identity = "k"\n[http]\nlisten = "0.0.0.0:8080"\npublic = true\n'
        'api_key_file = "keys.txt"\naccess_log = false\n'
        'allowed_origins = ["https://App.example"]\nmax_body_bytes = "1MiB"\n'
        'max_buffered_body_bytes = "8MiB"\nbody_deadline_s = 5\nshutdown_grace_s = 0\n'
    )
    s = load_node_settings(cfg, read_environment({"MESH_NODE_API_KEY": "sk-env"}))
    assert s.http is not None and (s.http.host, s.http.port) == ("0.0.0.0", 8080)
    assert s.http_public is True
    h = s.http_settings
    assert h.api_key_file == tmp_path / "keys.txt" and h.api_key == "sk-env"
    assert h.access_log is False and h.allowed_origins == ("https://app.example",)
    assert (h.max_body_bytes, h.max_buffered_body_bytes) == (1 << 20, 8 << 20)
    assert h.body_deadline_s == 5.0 and h.shutdown_grace_s == 0.0
    assert "sk-env" not in repr(s)
    for table, key in (
        ({"nope": 1}, "http.nope"),
        ({"tls_cert": "c.pem"}, "http.tls_cert"),
        ({"allowed_origins": ["evil.example"]}, "http.allowed_origins"),
        ({"max_concurrent_bodies": 0}, "http.max_concurrent_bodies"),
        ({"max_body_bytes": "64MiB"}, "http.max_buffered_body_bytes"),
        ({"access_log": "no"}, "http.access_log"),
    ):
        with pytest.raises(UsageError) as err:
            http_settings(table, tmp_path)
        assert err.value.path == key and err.value.exit_code == 2, table



def test_outcomes_rejected_stays_and_a_cancelled_group_is_cancelled():
    import trio

    from mesh_node.metrics import ServingMetrics

    m = ServingMetrics()
    with pytest.raises(ServerBusy), m.request() as record:
        record.outcome = "rejected"
        raise ServerBusy("full")

    async def cancelled_in_a_nursery() -> None:
        with trio.CancelScope() as outer, m.request():
            async with trio.open_nursery() as n:
                n.start_soon(trio.sleep_forever)
                outer.cancel()
                await trio.sleep_forever()

    trio.run(cancelled_in_a_nursery)
    with pytest.raises(RuntimeError), m.request():
        raise RuntimeError("ours")
    assert m.requests == {"ok": 0, "rejected": 1, "cancelled": 1, "error": 1}
