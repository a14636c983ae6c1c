"""Fault injection for the lab hub: test tooling, not part of the installed package.

``FaultyHub`` is the plain lab hub (``mesh_node.lab.hub_server.FakeHub``) plus rules that make
requests misbehave: flip a byte, truncate, 404, 500, 503 or 429 with an optional Retry-After,
a dropped connection, a stall. Rules are thread-safe and can be changed while the server runs;
``times=N`` makes a fault transient (the first N requests), which is how retry policies are
tested. It plugs into the plain hub's two hooks (``_Handler._intercept``, ``_presented``).
"""

from __future__ import annotations

import contextlib
import enum
import socket
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from mesh_node.lab.hub_server import FakeHub, HubFile, _Handler
from mesh_node.lab.hub_server import running_hub as _running_hub


class Fault(enum.Enum):
    """What to do instead of serving a file normally."""

    FLIP_BYTE = "flip_byte"  # XOR 0xFF into the middle byte of the body (size unchanged)
    TRUNCATE = "truncate"  # serve only the first half, with an honest Content-Length
    NOT_FOUND = "not_found"  # 404 EntryNotFound (RepoNotFound for repo-level API faults)
    SERVER_ERROR = "server_error"  # 500
    UNAVAILABLE = "unavailable"  # 503 (with Retry-After when the rule carries one)
    RATE_LIMITED = "rate_limited"  # 429 (with Retry-After when the rule carries one)
    DROP = "drop"  # close the connection without answering
    STALL = "stall"  # wait ``stall_s`` seconds, then answer normally


# Which methods a fault hits when the caller does not say. SERVER_ERROR defaults to GET only:
# huggingface_hub answers a 5xx on its metadata HEAD by retrying with 1+2+4+8+8 s of backoff
# (~23 s) before giving up, whereas a 5xx on the GET fails at once.
_DEFAULT_METHODS: Final[dict[Fault, frozenset[str]]] = {
    Fault.FLIP_BYTE: frozenset({"GET"}),
    Fault.TRUNCATE: frozenset({"GET"}),
    Fault.NOT_FOUND: frozenset({"HEAD", "GET"}),
    Fault.SERVER_ERROR: frozenset({"GET"}),
    Fault.UNAVAILABLE: frozenset({"HEAD", "GET"}),
    Fault.RATE_LIMITED: frozenset({"HEAD", "GET"}),
    Fault.DROP: frozenset({"HEAD", "GET"}),
    Fault.STALL: frozenset({"HEAD", "GET"}),
}


@dataclass
class _FaultRule:
    fault: Fault
    methods: frozenset[str]
    remaining: int | None  # None: until cleared
    retry_after: str | None = None  # the Retry-After header of a 429/503
    stall_s: float = 0.0


class _FaultyHandler(_Handler):
    hub: FaultyHub
    _rule: _FaultRule | None = None  # the rule this request took (requests on a connection
    # are sequential, so one slot per handler is enough)

    def _intercept(
        self, method: str, repo_id: str, path: str | None, commit: str | None
    ) -> bool:
        rule = self._rule = self.hub._take_fault(repo_id, path, method)
        if rule is None:
            return False
        fault = rule.fault
        if fault is Fault.STALL:
            time.sleep(rule.stall_s)
            return False
        if fault is Fault.DROP:
            self.hub._record(self.command, self.path, 0)
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return True
        if fault in (Fault.UNAVAILABLE, Fault.RATE_LIMITED):
            status = 503 if fault is Fault.UNAVAILABLE else 429
            headers = {"X-Error-Message": f"injected {status}"}
            if rule.retry_after is not None:
                headers["Retry-After"] = rule.retry_after
            self._json(status, {"error": f"injected {status}"}, headers)
            return True
        if fault is Fault.SERVER_ERROR:
            self._error(500, None, "injected server error")
            return True
        if fault is Fault.NOT_FOUND:
            if path is None:
                self._error(404, "RepoNotFound", "Repository not found")
            else:
                self._error(404, "EntryNotFound", f"{path} does not exist", commit)
            return True
        return False

    def _presented(
        self, method: str, repo_id: str, path: str, entry: HubFile
    ) -> tuple[int, int | None]:
        # The representation a faulty server would send: same size for FLIP, half for TRUNCATE.
        fault = self._rule.fault if self._rule is not None else None
        size = entry.size // 2 if fault is Fault.TRUNCATE else entry.size
        flip_at = entry.size // 2 if fault is Fault.FLIP_BYTE and entry.size else None
        return size, flip_at


class FaultyHub(FakeHub):
    """The lab hub with fault injection (see the module docstring)."""

    handler_class = _FaultyHandler

    def __init__(
        self, *, host: str = "127.0.0.1", port: int = 0, tree_page_size: int = 1000
    ) -> None:
        super().__init__(host=host, port=port, tree_page_size=tree_page_size)
        self._faults: dict[tuple[str, str | None], _FaultRule] = {}

    def inject(
        self,
        repo_id: str,
        path: str | None,
        fault: Fault,
        *,
        methods: Iterable[str] | None = None,
        times: int | None = None,
        retry_after: str | None = None,
        stall_s: float = 0.0,
    ) -> None:
        """Make requests for ``path`` misbehave (``path=None``: the repo's JSON API endpoints).

        ``methods`` defaults per fault (SERVER_ERROR hits only GET, see ``_DEFAULT_METHODS``);
        ``times`` limits how many requests the fault hits before it clears itself;
        ``retry_after`` is sent as the Retry-After header of a 429/503; ``stall_s`` is how long
        a STALL waits before answering.
        """
        if times is not None and times < 1:
            raise ValueError(f"times must be >= 1 (or None for a persistent fault), got {times}")
        chosen = (
            _DEFAULT_METHODS[fault] if methods is None else frozenset(m.upper() for m in methods)
        )
        with self._lock:
            self._faults[(repo_id, path)] = _FaultRule(fault, chosen, times, retry_after, stall_s)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def reset(self) -> None:
        """Forget faults, counters and the request log (content and refs stay)."""
        self.clear_faults()
        super().reset()

    def _take_fault(self, repo_id: str, path: str | None, method: str) -> _FaultRule | None:
        with self._lock:
            rule = self._faults.get((repo_id, path))
            if rule is None or method not in rule.methods:
                return None
            if rule.remaining is not None:
                rule.remaining -= 1
                if rule.remaining <= 0:
                    del self._faults[(repo_id, path)]
            return rule


@contextlib.contextmanager
def running_hub(
    repos: Mapping[str, Path | Sequence[Path]] | None = None, *, tree_page_size: int = 1000
) -> Iterator[FaultyHub]:
    """``mesh_node.lab.hub_server.running_hub`` with a ``FaultyHub``."""
    with _running_hub(repos, tree_page_size=tree_page_size, hub_class=FaultyHub) as hub:
        assert isinstance(hub, FaultyHub)
        yield hub


__all__ = ["Fault", "FaultyHub", "running_hub"]
