"""``mesh-node run``: the node, its control socket and clean shutdown on SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from mesh_node import lifeline
from mesh_node.calibration import measure_node
from mesh_node.composition import ComposedNode, compose
from mesh_node.compute import run_compute
from mesh_node.control import serve_control
from mesh_node.gc_pauses import freeze_startup_heap
from mesh_node.identity import LocalIdentity
from mesh_node.packages import package_identity
from mesh_node.serving.split_service import ServeOptions, serve_options
from mesh_node.settings import NodeSettings
from skippy.config import read_environment
from skippy.errors import SkippyError, UsageError

if TYPE_CHECKING:
    from starlette.routing import BaseRoute

log = logging.getLogger("mesh_node.node_process")


def control_handler(parts: ComposedNode) -> Any:
    node, serving, topology = parts.node, parts.serving, parts.topology

    async def handle(request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "status":
            return {"ok": True, "status": node.status()}
        if op == "serve":
            return {"ok": True, "api": await serving.start(serve_options(request))}
        if op in ("topology", "replan") and serving.server is not None:
            # The split of a serving coordinator is its route manager's: a hand-made plan
            # could move stage 0 away from the API and break every request.
            raise UsageError(
                "this node serves a model: its split is kept by `mesh-node serve` (it heals "
                "and re-plans on its own)",
                code="node_is_serving",
                remediation="watch `mesh-node status`; to change the split, restart serve",
            )
        if op == "topology":
            package = request.get("package")
            stages = request.get("stages")
            if not isinstance(package, str) or not (stages is None or isinstance(stages, int)):
                raise UsageError("topology needs package (string) and stages (int or null)")
            ref, sha, sizes = await trio.to_thread.run_sync(_package_facts, node.settings, package)
            if request.get("dry_run"):  # rank the candidates, send nothing
                from mesh_node.cost_inputs import dry_run

                include = bool(request.get("include_self", True))
                plan = dry_run(
                    node.node_id,
                    node.compute,
                    node.peers(connected_only=True),
                    topology.capable_nodes(include),
                    sizes,
                    include_self=include,
                    stages=stages,
                    own_devices=node.devices,
                )
                return {"ok": True, "plan": plan}
            active = await topology.propose(
                package_ref=ref,
                manifest_sha256=sha,
                sizes=sizes,
                include_self=bool(request.get("include_self", True)),
                stages=stages,
            )
            return {"ok": True, "topology": active.to_dict()}
        if op == "replan":
            return {"ok": True, "topology": (await topology.replan()).to_dict()}
        raise UsageError(f"unknown control operation {op!r}", code="bad_request")

    return handle


def _package_facts(settings: NodeSettings, text: str) -> tuple[str, str, Any]:
    """(pinned package ref, manifest SHA-256, per-artifact sizes) of a package reference."""
    ref, sha, sizes, _model = package_identity(settings, text)
    return ref, sha, sizes


async def run_node(
    settings: NodeSettings,
    identity: LocalIdentity,
    *,
    routes: Sequence[BaseRoute] = (),
    serve: ServeOptions | None = None,
) -> None:
    """Run the node (and its HTTP surface when ``settings.http`` is set, with ``routes`` from
    other components and the OpenAI API) until SIGINT/SIGTERM; with ``serve``, as a serving
    coordinator (``mesh-node serve``). A startup refusal (data_dir in use, HTTP port taken)
    is raised as itself, not inside an exception group, so the CLI reports it."""
    try:
        await _run_node(settings, identity, routes, serve)
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if leaves and all(isinstance(e, SkippyError) for e in leaves):
            raise leaves[0] from None
        raise


def make_data_dir(path: Path) -> None:
    """Create ``data_dir`` (and its parents); a path that exists and is not a folder is its
    own error, not ``File exists``."""
    if path.exists() and not path.is_dir():
        raise UsageError(
            f"data_dir {path} exists and is not a directory",
            code="data_dir_not_a_directory",
            path=str(path),
            remediation="point data_dir at a folder (it is created if missing)",
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"cannot create data_dir {path}: {exc.strerror or exc}",
            code="data_dir_unusable",
            path=str(path),
        ) from None


async def _stop_reason(signals: AsyncIterator[int], settings: NodeSettings) -> str:
    """What ends the node: a signal's name, or why it stops by itself (its data_dir removed,
    its lab gone: ``mesh_node.lifeline``)."""
    reason = ""
    async with trio.open_nursery() as nursery:

        async def on_signal() -> None:
            nonlocal reason
            async for signum in signals:
                reason = signal.Signals(signum).name
                break
            nursery.cancel_scope.cancel()

        async def on_lifeline() -> None:
            nonlocal reason
            reason = await lifeline.wait_for_reason(settings.data_dir, settings.lab_lock)
            nursery.cancel_scope.cancel()

        nursery.start_soon(on_signal)
        nursery.start_soon(on_lifeline)
    return reason


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out


async def _run_node(
    settings: NodeSettings,
    identity: LocalIdentity,
    routes: Sequence[BaseRoute],
    serve: ServeOptions | None,
) -> None:
    make_data_dir(settings.data_dir)
    parts = compose(
        settings, identity, read_environment(), routes=routes, expect_serve=serve is not None
    )
    node, serving = parts.node, parts.serving
    # Measured (or read from data_dir's cache) before the first link, so every
    # hello carries it, with the devices; on the compute thread (every later stage call's
    # thread too: skippy.runtime.compute_thread), since it runs the stage runtime a moment.
    node.compute, node.devices = await run_compute(lambda: measure_node(settings))
    # SIGHUP (the terminal went away) shuts down as cleanly as SIGTERM: no reload exists.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:
            handler = control_handler(parts)
            await nursery.start(serve_control, settings.control_socket, handler)
            address = await nursery.start(node.run)  # and its services
            lines = []
            if settings.http is not None:
                url = await serving.start_http(settings.http)
                lines.append(f"status-page {url}")
            if serve is not None:
                lines.append(f"api {await serving.start(serve)}")
            freeze_startup_heap()  # no full GC walks the start-up heap again
            # `listening` only once every check passed (package, HTTP port): a wrapper that
            # waits for it knows the node started.
            sys.stdout.write("".join(f"{line}\n" for line in [f"listening {address}", *lines]))
            sys.stdout.flush()
            log.info("%s: shutting down", await _stop_reason(signals, settings))
            # open API requests drain briefly; streams end with a final error event
            # (a second signal during it is not waited for: the drain is bounded)
            await serving.drain()
            await node.close_links()
            nursery.cancel_scope.cancel()
    await parts.host.close()
    log.info("stopped")
