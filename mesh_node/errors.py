"""The mesh node's errors: ``SkippyError`` subclasses with stable codes (the one hierarchy)."""

from __future__ import annotations

from typing import TypeVar

from skippy.errors import EXIT_USAGE, SkippyError

E = TypeVar("E", bound=BaseException)


def first_exception(exc: BaseException, kind: type[E]) -> E | None:
    """``exc`` if it is a ``kind``, else the first ``kind`` among a nursery's exception group's
    leaves; ``None`` when there is none (a bug or a cancellation: re-raise it)."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = first_exception(inner, kind)
            if found is not None:
                return found
    return None


def skippy_error_in(exc: BaseException) -> SkippyError | None:
    return first_exception(exc, SkippyError)


def surfaced(exc: BaseException) -> BaseException | None:
    """What a nursery's failure means to its caller, to be raised as itself: a Ctrl-C first
    (the user asked to stop, whatever else failed meanwhile), else our own error; ``None``
    when neither is there (a bug: re-raise the group)."""
    return first_exception(exc, KeyboardInterrupt) or skippy_error_in(exc)


class MeshError(SkippyError):
    """Something on the mesh failed (a peer, a link, a stream)."""

    code = "mesh_error"


class IdentityError(MeshError, ValueError):
    """A key or certificate file is unusable."""

    code = "invalid_identity"
    exit_code = EXIT_USAGE


class KeyFilePermissions(IdentityError, PermissionError):
    """A private key file is readable by group or others."""

    code = "key_file_permissions"


class PeerUnavailable(MeshError):
    """No authenticated link to that peer."""

    code = "peer_unavailable"


class LinkClosed(MeshError):
    """The link a stream ran on is gone (peer lost, protocol violation, shutdown)."""

    code = "link_closed"


class StreamRefused(MeshError):
    """The peer reset a stream (at open: no handler, bad envelope, too many streams)."""

    code = "stream_refused"


class StreamReset(MeshError):
    """The stream was reset (by the peer: ``actual`` holds its code) after it was open."""

    code = "stream_reset"


class RelayRefused(MeshError):
    """A relay refused a circuit (``actual``: the relay's reason code, e.g. relay_forbidden,
    relay_busy, relay_no_target)."""

    code = "relay_refused"


class StreamStalled(MeshError):
    """A send could not make progress within the idle timeout (the peer stopped reading)."""

    code = "stream_stalled"


class NodeNotRunning(MeshError):
    """``mesh-node status`` found no running node behind the config's control socket."""

    code = "node_not_running"
    exit_code = EXIT_USAGE


class TopologyRefused(MeshError):
    """A topology could not be planned, or a worker refused it."""

    code = "topology_refused"


class InviteRefused(MeshError, ValueError):
    """An invite token this node will not use (malformed, tampered, expired, for another
    mesh), or one that cannot be issued; nothing is dialed or written."""

    code = "invite_refused"
    exit_code = EXIT_USAGE
