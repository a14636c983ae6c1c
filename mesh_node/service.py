"""``mesh-node run``: the node, its control socket and clean shutdown on SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import dataclass, replace
from typing import Any

import trio

from mesh_node.control import serve_control
from mesh_node.identity import LocalIdentity
from mesh_node.node import MeshNode
from mesh_node.serving.host import StageHost
from mesh_node.transfer.service import ArtifactService
from skippy.config import Environment, HostPort, NodeSettings, read_environment
from skippy.errors import UsageError

log = logging.getLogger("mesh_node.service")


def control_handler(node: MeshNode, serving: Serving | None = None) -> Any:
    async def handle(request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "status":
            return {"ok": True, "status": node.status()}
        if op == "serve" and serving is not None:
            return {"ok": True, "api": await serving.start(serve_options(request))}
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
    ref, sha, sizes, _model = package_identity(settings, text)
    return ref, sha, sizes


def package_identity(settings: NodeSettings, text: str) -> tuple[str, str, Any, str]:
    """(pinned package ref, manifest SHA-256, per-artifact sizes, model id)."""
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
    return pinned, pkg.manifest_sha256, sizes_from_manifest(pkg.manifest), pkg.manifest.model_id


@dataclass(frozen=True)
class ServeOptions:
    """``mesh-node serve``: the package to serve, its stage count, the API's address."""

    package: str
    stages: int | None
    http: HostPort
    model_name: str | None = None


def serve_options(request: dict[str, Any]) -> ServeOptions:
    """The control operation ``serve``: ``{"op": "serve", "package": REF, "stages": N|null,
    "http": "HOST:PORT", "model_name": NAME|null}``."""
    from skippy.config import parse_host_port

    package, stages = request.get("package"), request.get("stages")
    name = request.get("model_name")
    if not isinstance(package, str) or not (stages is None or isinstance(stages, int)):
        raise UsageError("serve needs package (string) and stages (int or null)")
    if stages is not None and stages < 1:
        raise UsageError("stages must be at least 1", code="bad_usage")
    if name is not None and not isinstance(name, str):
        raise UsageError("model_name must be a string")
    http = parse_host_port(request.get("http", "127.0.0.1:0"), "http")
    return ServeOptions(package=package, stages=stages, http=http, model_name=name)


class Serving:
    """Turns this running node into a serving coordinator on request (``mesh-node serve``,
    or the control operation ``serve``, which the lab uses); at most once per node."""

    def __init__(self, node: MeshNode, host: StageHost) -> None:
        self.node = node
        self.host = host
        self.api: str | None = None
        self._nursery: trio.Nursery | None = None

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def start(self, options: ServeOptions) -> str:
        """Start serving; return the API's base URL (``http://HOST:PORT/v1``)."""
        if self.api is not None:
            raise UsageError(f"this node already serves {self.api}", code="already_serving")
        if self._nursery is None:
            raise UsageError("the node is not running", code="node_not_running")
        url: str = await self._nursery.start(start_serving, self.node, self.host, options)
        self.api = f"{url}/v1"
        return self.api


async def start_serving(
    node: MeshNode,
    host: StageHost,
    options: ServeOptions,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Coordinate a split of the package (stage 0 here) and serve the API until cancelled."""
    from mesh_node.serving.api import OpenAIApi
    from mesh_node.serving.http import build_app, serve_http
    from mesh_node.serving.pipeline import SplitServer

    ref, sha, sizes, model_id = await trio.to_thread.run_sync(
        package_identity, node.settings, options.package
    )
    server = SplitServer(
        node,
        host,
        node.settings.serving,
        package_ref=ref,
        manifest_sha256=sha,
        sizes=sizes,
        model_name=options.model_name or model_id,
        stages=options.stages,
    )
    node.status_sections["serving"] = server.status
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_http, build_app(OpenAIApi(server).routes()), options.http)
        await nursery.start(server.run)
        task_status.started(url)


def stage_services(node: MeshNode, env: Environment) -> tuple[StageHost, ArtifactService]:
    """What every node runs for splits: artifact transfer (issue #8: serve, fetch this node's
    stage, report it) and the stage host (issue #10: load the fetched stage in the runtime,
    extend the report into the admission descriptor, serve the transport streams)."""
    from mesh_node.serving.bringup import stage_ready
    from mesh_node.transfer.fetch import StageResult
    from skippy.stage.descriptor import StageDescriptor

    host = StageHost(node, node.settings.serving)
    node.status_sections["stage"] = host.status
    artifacts = ArtifactService(node, env)

    async def ready(result: StageResult) -> StageDescriptor:
        return await stage_ready(
            host, result.topology, result.stage, result.load, result.descriptor
        )

    artifacts.ready_hook = ready
    return host, artifacts


async def run_node(
    settings: NodeSettings, identity: LocalIdentity, serve: ServeOptions | None = None
) -> None:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    node = MeshNode(settings, identity)
    host, artifacts = stage_services(node, read_environment())
    serving = Serving(node, host)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            handler = control_handler(node, serving)
            await nursery.start(serve_control, settings.control_socket, handler)
            await nursery.start(artifacts.run)
            address = await nursery.start(node.run)
            sys.stdout.write(f"listening {address}\n")
            sys.stdout.flush()
            await nursery.start(serving.run)
            if serve is not None:
                sys.stdout.write(f"api {await serving.start(serve)}\n")
                sys.stdout.flush()
            async for signum in signals:
                log.info("%s: shutting down", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break
    await host.close()
    log.info("stopped")
