"""Where the HTTP surface may listen (pure): loopback by default; anything else only when the
operator says so (``--http-public`` / ``http_public = true``), with a warning, louder when no
API key is configured. The one gate: every path that starts the HTTP server (``run --http``,
``serve``, the control operation ``serve``) goes through ``check_http_bind``."""

from __future__ import annotations

import ipaddress

from mesh_node.settings import HostPort
from skippy.errors import UsageError

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name we cannot vouch for: treat it as reachable from elsewhere


def check_http_bind(bind: HostPort, public: bool, *, authenticated: bool = False) -> str | None:
    """``None`` for a loopback bind; the warning to print for a permitted non-loopback bind;
    ``UsageError`` (exit 2) for a non-loopback bind without ``public``."""
    if is_loopback(bind.host):
        return None
    if not public:
        raise UsageError(
            f"the status page would listen on {bind}, which is not a loopback address",
            code="http_not_loopback",
            actual=str(bind),
            remediation="use 127.0.0.1:PORT, or allow it with --http-public "
            "(http_public = true in the node TOML)",
        )
    if authenticated:
        return (
            f"the status page, /metrics and the API listen on {bind}, reachable from other "
            "machines; every request but /health (and the page's static files) needs an API "
            "key; without TLS ([http] tls_cert/tls_key) keys cross the network in clear"
        )
    return (
        f"the status page and /metrics listen on {bind}, reachable from other machines, and "
        "NO API KEY is configured: anyone who can connect can read this node's id, peers, "
        "topology and transfers (read-only, no keys or paths) and, on a serving node, run "
        "generations; set --api-key-file / MESH_NODE_API_KEY, or put it behind a firewall "
        "or a reverse proxy with auth"
    )


def allowed_hosts(bind: HostPort, public: bool) -> list[str]:
    """Host headers the app answers (against DNS rebinding: a web page elsewhere must not read
    a loopback node through a name it controls). Any host once the operator made it public."""
    if public and not is_loopback(bind.host):
        return ["*"]
    host = f"[{bind.host}]" if ":" in bind.host else bind.host
    return sorted({"127.0.0.1", "localhost", "[::1]", host.lower()})
