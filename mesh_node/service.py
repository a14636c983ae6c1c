"""``mesh-node run``: the node, its control socket and clean shutdown on SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import trio

from mesh_node.control import serve_control
from mesh_node.identity import LocalIdentity
from mesh_node.node import MeshNode
from mesh_node.transfer.service import ArtifactService
from skippy.config import NodeSettings, read_environment
from skippy.errors import SkippyError, UsageError

if TYPE_CHECKING:
    from starlette.routing import BaseRoute

log = logging.getLogger("mesh_node.service")


def control_handler(node: MeshNode) -> Any:
    async def handle(request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "status":
            return {"ok": True, "status": node.status()}
        if op == "topology":
            package = request.get("package")
            stages = request.get("stages")
            if not isinstance(package, str) or not (stages is None or isinstance(stages, int)):
                raise UsageError("topology needs package (string) and stages (int or null)")
            ref, sha, sizes = await trio.to_thread.run_sync(_package_facts, node.settings, package)
            active = await node.topology.propose(
                package_ref=ref,
                manifest_sha256=sha,
                sizes=sizes,
                include_self=bool(request.get("include_self", True)),
                stages=stages,
            )
            return {"ok": True, "topology": active.to_dict()}
        if op == "replan":
            return {"ok": True, "topology": (await node.topology.replan()).to_dict()}
        raise UsageError(f"unknown control operation {op!r}", code="bad_request")

    return handle


def _package_facts(settings: NodeSettings, text: str) -> tuple[str, str, Any]:
    """(pinned package ref, manifest SHA-256, per-artifact sizes) of a package reference."""
    from skippy.consume.resolve import open_package
    from skippy.package.refs import HfPackageRef, parse_package_ref
    from skippy.produce.inspect import sizes_from_manifest

    ref = parse_package_ref(text)
    env = replace(read_environment(), hf_cache_dir=settings.hub_cache_dir)
    pkg = open_package(ref, env)
    # A hub package is pinned to the commit resolved now (snapshots/<commit>/): every worker
    # then names exactly the same bytes; a local directory is named by its absolute path.
    pinned = (
        f"hf://{ref.repo_id}@{pkg.root.name}"
        if isinstance(ref, HfPackageRef)
        else str(pkg.root.resolve())
    )
    return pinned, pkg.manifest_sha256, sizes_from_manifest(pkg.manifest)


async def run_node(
    settings: NodeSettings, identity: LocalIdentity, *, routes: Sequence[BaseRoute] = ()
) -> None:
    """Run the node (and its HTTP surface when ``settings.http`` is set, with ``routes`` from
    other components) until SIGINT/SIGTERM. A startup refusal (data_dir in use, HTTP port
    taken) is raised as itself, not inside an exception group, so the CLI reports it."""
    try:
        await _run_node(settings, identity, routes)
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if leaves and all(isinstance(e, SkippyError) for e in leaves):
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out


async def _run_node(
    settings: NodeSettings, identity: LocalIdentity, routes: Sequence[BaseRoute]
) -> None:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    node = MeshNode(settings, identity)
    artifacts = ArtifactService(node, read_environment())
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_control, settings.control_socket, control_handler(node))
            await nursery.start(artifacts.run)
            address = await nursery.start(node.run)
            sys.stdout.write(f"listening {address}\n")
            sys.stdout.flush()
            if settings.http is not None:
                from mesh_node.http.app import build_app
                from mesh_node.http.bind import allowed_hosts
                from mesh_node.http.server import serve_http

                app = build_app(
                    node,
                    routes=routes,
                    allowed_hosts=allowed_hosts(settings.http, settings.http_public),
                )
                url = await nursery.start(serve_http, app, settings.http)
                sys.stdout.write(f"status-page {url}\n")
                sys.stdout.flush()
            async for signum in signals:
                log.info("%s: shutting down", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break
    log.info("stopped")
