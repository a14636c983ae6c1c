"""The hub traffic policy: timeouts, bounded retries with backoff and
jitter on 429/5xx and connection errors, Retry-After, one clear error naming the endpoint.

The decision is a pure function, tested by table; the transport is tested through the real
huggingface_hub client against the local hub's fault injection, counting requests. Waits are
milliseconds, except one honoured ``Retry-After: 1``."""

from __future__ import annotations

import email.utils
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from hubfaults import Fault, FaultyHub, running_hub

from mesh_node.lab.hub_server import write_tree
from skippy.cli import main
from skippy.config import HubPolicy, read_environment
from skippy.consume.hub import HubError, download_file, resolve_revision
from skippy.consume.hub_policy import next_step, parse_retry_after
from skippy.errors import ArtifactMissing, UsageError
from skippy.package.refs import HfPackageRef

REPO = "ns/pkg"
REF = HfPackageRef(REPO)
FILE = "layers/layer-00000.gguf"
FAST = HubPolicy(attempts=3, backoff_s=0.01, backoff_max_s=0.02, read_timeout_s=0.5)
NOW = 1_800_000_000.0


# --- the decision (pure) -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("attempt", "status", "retry_after", "rand", "retry", "delay"),
    [
        (1, 503, None, 0.0, True, 0.25),  # base 0.5 s, half of it fixed
        (1, 503, None, 0.999, True, 0.49975),
        (2, 500, None, 0.0, True, 0.5),  # doubling
        (3, None, None, 0.0, True, 1.0),  # no answer: a connection error or a timeout
        (5, 502, None, 0.0, True, 4.0),  # capped at backoff_max_s = 8
        (9, 504, None, 0.0, False, 0.0),  # attempts = 9 made
        (1, 404, None, 0.0, False, 0.0),  # not transient
        (1, 401, None, 0.0, False, 0.0),
        (1, 429, "7", 0.5, True, 7.0),  # Retry-After wins
        (1, 503, "2", 0.5, True, 2.0),
        (1, 429, "61", 0.5, False, 0.0),  # asks for more than retry_after_max_s = 60
        (1, 500, "7", 0.0, True, 0.25),  # Retry-After only for 429 and 503
        (1, 429, "soon", 0.0, True, 0.25),  # unreadable: backoff
    ],
)
def test_next_step(attempt, status, retry_after, rand, retry, delay):
    policy = HubPolicy(attempts=9, backoff_s=0.5, backoff_max_s=8.0, retry_after_max_s=60)
    step = next_step(policy, attempt, status, retry_after, now_unix=NOW, rand=rand)
    assert (step.retry, step.delay_s) == (retry, pytest.approx(delay))


def test_retry_after_forms():
    future = email.utils.formatdate(NOW + 30, usegmt=True)
    past = email.utils.formatdate(NOW - 30, usegmt=True)
    assert parse_retry_after("120", NOW) == 120
    assert parse_retry_after(future, NOW) == pytest.approx(30)
    assert parse_retry_after(past, NOW) == 0
    for bad in (None, "", "soon", "１２", "-5", "1e3"):
        assert parse_retry_after(bad, NOW) is None


def test_the_policy_comes_from_the_environment():
    env = read_environment({"SKIPPY_HUB_ATTEMPTS": "7", "SKIPPY_HUB_READ_TIMEOUT_S": "2.5"})
    assert (env.hub_policy.attempts, env.hub_policy.read_timeout_s) == (7, 2.5)
    assert read_environment({}).hub_policy == HubPolicy()
    with pytest.raises(UsageError) as exc:
        read_environment({"SKIPPY_HUB_ATTEMPTS": "0"})
    assert exc.value.code == "invalid_config"


# --- the transport, through huggingface_hub, against the fault injection -------------------------
@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FaultyHub]:
    files = {"model-package.json": b"{}", FILE: b"L" * 4096}
    with running_hub({REPO: write_tree(tmp_path / "repo", files)}) as h:
        yield h


def _download(hub: FaultyHub, cache: Path, policy: HubPolicy = FAST) -> Path:
    return download_file(
        REF, hub.commit_of(REPO), FILE, endpoint=hub.url, cache_dir=cache, policy=policy
    )


@pytest.mark.parametrize("fault", [Fault.UNAVAILABLE, Fault.RATE_LIMITED, Fault.DROP])
def test_transient_failures_are_retried_until_they_pass(hub, tmp_path, fault):
    hub.inject(REPO, FILE, fault, methods=["HEAD"], times=2)
    path = _download(hub, tmp_path / "cache")
    assert path.read_bytes() == b"L" * 4096
    stats = hub.stats(REPO, FILE)
    assert (stats.head_requests, stats.get_requests) == (3, 1)


def test_a_failing_get_is_retried_too(hub, tmp_path):
    hub.inject(REPO, FILE, Fault.SERVER_ERROR, methods=["GET"], times=1)
    assert _download(hub, tmp_path / "cache").read_bytes() == b"L" * 4096
    assert hub.stats(REPO, FILE).get_requests == 2


def test_the_last_failure_names_the_endpoint_and_the_attempts(hub, tmp_path):
    hub.inject(REPO, FILE, Fault.UNAVAILABLE, methods=["HEAD"])
    with pytest.raises(HubError) as exc:
        _download(hub, tmp_path / "cache")
    err = exc.value
    assert err.code == "hub_http_error" and err.actual == 503 and err.exit_code == 2
    assert f"{hub.url}/{REPO}/resolve/" in err.message and "3 attempts" in err.message
    assert hub.stats(REPO, FILE).head_requests == FAST.attempts
    assert err.__cause__ is None and err.__suppress_context__


def test_a_permanent_error_is_not_retried(hub, tmp_path):
    hub.inject(REPO, FILE, Fault.NOT_FOUND, methods=["HEAD"])
    with pytest.raises(ArtifactMissing):
        _download(hub, tmp_path / "cache")
    assert hub.stats(REPO, FILE).head_requests == 1


def test_retry_after_is_honoured(hub, tmp_path, caplog):
    hub.inject(REPO, FILE, Fault.RATE_LIMITED, methods=["HEAD"], times=1, retry_after="1")
    with caplog.at_level(logging.WARNING, logger="skippy.consume.hub_policy"):
        _download(hub, tmp_path / "cache")
    (record,) = caplog.records
    assert "Retry-After 1 s" in record.getMessage() and "in 1.00 s" in record.getMessage()
    assert hub.stats(REPO, FILE).head_requests == 2


def test_a_retry_after_too_long_is_an_error_at_once(hub, tmp_path):
    hub.inject(REPO, FILE, Fault.RATE_LIMITED, methods=["HEAD"], retry_after="3600")
    with pytest.raises(HubError) as exc:
        _download(hub, tmp_path / "cache")
    assert "retry after 3600 s" in exc.value.message
    assert hub.stats(REPO, FILE).head_requests == 1


def test_a_stalled_hub_times_out_and_is_retried(hub, tmp_path):
    policy = HubPolicy(attempts=2, backoff_s=0.01, read_timeout_s=0.2)
    hub.inject(REPO, FILE, Fault.STALL, methods=["HEAD"], stall_s=1.0)
    with pytest.raises(HubError) as exc:
        _download(hub, tmp_path / "cache", policy)
    assert exc.value.code == "hub_unreachable" and "ReadTimeout" in exc.value.message
    assert hub.stats(REPO, FILE).head_requests == 2


def test_a_hub_that_stays_down_falls_back_to_a_cached_revision(hub, tmp_path):
    cache = tmp_path / "cache"
    commit = resolve_revision(REF, endpoint=hub.url, cache_dir=cache, policy=FAST)
    hub.reset()
    hub.inject(REPO, None, Fault.UNAVAILABLE)  # the JSON API answers 503
    assert resolve_revision(REF, endpoint=hub.url, cache_dir=cache, policy=FAST) == commit
    assert [s for _, _, s in hub.request_log()] == [503] * FAST.attempts


def test_the_cli_reports_the_endpoint_after_its_attempts(hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("SKIPPY_HUB_ATTEMPTS", "2")
    hub.inject(REPO, None, Fault.UNAVAILABLE)
    assert main(["fetch", f"hf://{REPO}", "--layers", "0..1", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"]["code"] == "hub_http_error" and hub.url in doc["error"]["message"]
    assert len(hub.request_log()) == 2
