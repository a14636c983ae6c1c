"""The hub traffic policy, in one place.

Every request huggingface_hub makes for us goes through ``PolicyTransport``, installed as its
HTTP client: connect and read timeouts, bounded retries of idempotent requests (GET, HEAD) on
429/408/5xx answers and on connection errors and timeouts, waits that back off exponentially
with jitter or follow the server's ``Retry-After``, and after the last try one
``HubGaveUp`` naming the endpoint, the attempts and the last answer. ``next_step`` is the pure
decision; the transport only applies it.

huggingface_hub retries on its own (~23 s on a failing HEAD, runtime-facts.md). ``HubGaveUp`` is
a ``TransportError`` but none of the kinds those loops retry (timeouts, network and protocol
errors), so after our last try nobody tries again; it still counts as "the hub cannot be
reached" where huggingface_hub falls back to a cached revision. One layer is left to it on
purpose: a download whose *body* breaks off is resumed with a Range request (at most 5
times), and each of those requests goes through this policy.
"""

from __future__ import annotations

import email.utils
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import httpx2

from skippy.config import HubPolicy

log = logging.getLogger(__name__)

RETRY_STATUSES: Final = frozenset({408, 429, 500, 502, 503, 504})
_RETRY_AFTER_STATUSES: Final = frozenset({429, 503})
_IDEMPOTENT: Final = frozenset({"GET", "HEAD"})
_SECONDS_RE: Final = re.compile(r"\A\s*(\d{1,9})\s*\Z", re.ASCII)


def parse_retry_after(value: str | None, now_unix: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delay-seconds or an HTTP-date (RFC 9110
    section 10.2.3); None when absent or unreadable."""
    if value is None:
        return None
    m = _SECONDS_RE.match(value)
    if m:
        return float(m.group(1))
    try:
        when = email.utils.parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is GMT
        return None
    return max(0.0, when.timestamp() - now_unix)


@dataclass(frozen=True)
class Step:
    retry: bool
    delay_s: float
    why: str


def next_step(
    policy: HubPolicy,
    attempt: int,
    status: int | None,
    retry_after: str | None,
    *,
    now_unix: float,
    rand: float,
) -> Step:
    """Pure: attempt number ``attempt`` (from 1) failed with HTTP ``status`` (None: no answer,
    a connection error or a timeout); try again, and after how long? ``rand`` in [0, 1) is
    the jitter: a wait of ``d`` becomes ``d/2 + rand * d/2``, so clients that failed together
    do not retry together."""
    what = "no answer" if status is None else f"HTTP {status}"
    if status is not None and status not in RETRY_STATUSES:
        return Step(False, 0.0, f"{what} is not a transient failure")
    if attempt >= policy.attempts:
        return Step(False, 0.0, f"{what} on all {attempt} attempts")
    backoff = min(policy.backoff_max_s, policy.backoff_s * 2.0 ** (attempt - 1))
    delay = backoff / 2 + backoff / 2 * rand
    if status in _RETRY_AFTER_STATUSES:
        asked = parse_retry_after(retry_after, now_unix)
        if asked is not None:
            if asked > policy.retry_after_max_s:
                return Step(
                    False,
                    0.0,
                    f"{what}; the hub asked to retry after {asked:.0f} s, more than the "
                    f"{policy.retry_after_max_s:g} s this client waits",
                )
            return Step(True, asked, f"{what}, Retry-After {asked:g} s")
    return Step(True, delay, what)


class HubGaveUp(httpx2.TransportError):
    """The policy's last attempt failed. Deliberately not a timeout, network or protocol
    error, so huggingface_hub's own retry loops let it through (module docstring)."""

    def __init__(
        self,
        message: str,
        *,
        request: httpx2.Request,
        status: int | None,
        attempts: int,
        cause: str | None,
    ) -> None:
        super().__init__(message, request=request)
        self.status = status
        self.attempts = attempts
        self.cause = cause  # the last connection error or timeout, by type name
        self.url = str(request.url)


class PolicyTransport(httpx2.BaseTransport):
    """An ``httpx2`` transport that applies a ``HubPolicy`` around the real one."""

    def __init__(
        self,
        policy: HubPolicy,
        inner: httpx2.BaseTransport | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.policy = policy
        self._inner = inner or httpx2.HTTPTransport()
        self._sleep = sleep
        self._rand = rand

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        p = self.policy
        # The policy's timeouts win over the per-call ones huggingface_hub passes.
        request.extensions["timeout"] = {
            "connect": p.connect_timeout_s,
            "read": p.read_timeout_s,
            "write": p.read_timeout_s,
            "pool": p.connect_timeout_s,
        }
        if request.method not in _IDEMPOTENT:
            return self._inner.handle_request(request)
        t0 = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            status: int | None = None
            retry_after: str | None = None
            cause: str | None = None
            try:
                response = self._inner.handle_request(request)
            except (
                httpx2.TimeoutException,
                httpx2.NetworkError,
                httpx2.RemoteProtocolError,
            ) as exc:
                cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                if response.status_code not in RETRY_STATUSES:
                    return response
                status = response.status_code
                retry_after = response.headers.get("Retry-After")
                response.close()
            step = next_step(
                p, attempt, status, retry_after, now_unix=time.time(), rand=self._rand()
            )
            if not step.retry:
                elapsed = time.monotonic() - t0
                detail = cause if status is None else step.why
                raise HubGaveUp(
                    f"{request.method} {request.url}: {detail} (gave up after {attempt} "
                    f"attempt{'s' if attempt > 1 else ''} in {elapsed:.1f} s)",
                    request=request,
                    status=status,
                    attempts=attempt,
                    cause=cause,
                )
            log.warning(
                "%s %s: %s; retry %d of %d in %.2f s",
                request.method,
                request.url,
                cause or step.why,
                attempt,
                p.attempts - 1,
                step.delay_s,
            )
            self._sleep(step.delay_s)

    def close(self) -> None:
        self._inner.close()


_lock = threading.Lock()
_installed: HubPolicy | None = None


def install(policy: HubPolicy) -> None:
    """Make huggingface_hub send every request through ``PolicyTransport(policy)`` (its client
    is process-wide: one policy at a time; installing the same one again is free)."""
    global _installed
    with _lock:
        if _installed != policy:
            _set_transport(PolicyTransport(policy))
            _installed = policy


def uninstall() -> None:
    """Give huggingface_hub a client without our policy again (tests of the raw client)."""
    global _installed
    with _lock:
        _set_transport(None)
        _installed = None


def _set_transport(transport: httpx2.BaseTransport | None) -> None:
    from huggingface_hub import close_session, get_session, set_client_factory

    # Keep huggingface_hub's own request hooks (offline mode, request ids) on the new client.
    close_session()
    hooks: dict[str, list[Callable[..., Any]]] = dict(get_session().event_hooks)
    close_session()

    def factory() -> httpx2.Client:
        return httpx2.Client(
            event_hooks=hooks, follow_redirects=True, timeout=None, transport=transport
        )

    set_client_factory(factory)
