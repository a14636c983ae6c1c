"""Serving as a node service (``mesh_node.node_service``; built by ``mesh_node.composition``).

``Serving`` makes this node a serving coordinator when asked (``mesh-node serve``, or the
control operation ``serve`` the lab uses): a ``SplitServer`` (stage 0 here) and the OpenAI
routes; its ``serving`` status section and request metrics once it serves. The routes belong
to the node's one HTTP app (``mesh_node.http``): when the node already serves its
status page (``--http``), the API joins it there; otherwise the same app (page and API)
starts on the address the request names. Every start goes through the loopback gate
(``mesh_node.http.bind.check_http_bind``) with the node's ``http_public``, and loads the API
keys (``mesh_node.http.keys``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client.registry import Collector

from mesh_node.http.view import redact_paths
from mesh_node.metrics import SectionCollector, ServingMetrics, replica_families
from mesh_node.node import MeshNode
from mesh_node.node_service import FeatureBits, StreamKind
from mesh_node.serving.host import StageHost
from mesh_node.settings import HostPort
from mesh_node.topology import TopologyService
from skippy.errors import UsageError
from skippy.generation import SpeculativeOverrides, SpeculativePlan
from skippy.serving.engine_choice import EngineChoice

log = logging.getLogger("mesh_node.http")
RETRY_AFTER_STARTING_S = 5  # /health while the split forms

if TYPE_CHECKING:
    from starlette.routing import BaseRoute

    from mesh_node.serving.api import OpenAIApi
    from mesh_node.serving.pipeline import SplitServer


@dataclass(frozen=True)
class ServeOptions:
    """What to serve: the package, its stage count, the model name; ``http`` is where the
    node's HTTP app starts if it is not up yet."""

    package: str
    stages: int | None
    http: HostPort
    model_name: str | None = None
    # speculation: the config's [speculative] tables and --speculative-strategy
    speculative: SpeculativeOverrides | None = None
    speculative_strategy: str | None = None
    replicas: int | None = None  # None is [serving] replicas


def _config_speculation(path: Path | None) -> SpeculativeOverrides | None:
    """The node TOML's ``[speculative]`` tables (a ``serve`` control operation names none)."""
    from mesh_node.settings import read_node_config

    return read_node_config(path).speculative if path is not None and path.is_file() else None


def log_serving_speculation(plan: SpeculativePlan) -> None:
    """Say what serving does with the plan: execute it, or fall back to plain decoding with
    the reason (spec "Generation Defaults": one structured line)."""
    from skippy.runtime.speculation import EXECUTABLE_MODES

    if not plan.enabled:
        return
    if plan.mode in EXECUTABLE_MODES:
        log.info(
            "speculative decoding %s (%s), exact verify windows%s",
            plan.strategy_id,
            plan.mode,
            "".join(f"; {note}" for note in plan.notes),
        )
        return
    record = {
        "requested": plan.requested,
        "mode": plan.mode,
        "selected": "disabled",
        "fallback_reason": "mesh-node serve executes ngram-cache, ngram-suffix and native-mtp "
        "only; plain decoding gives the same tokens",
    }
    log.warning("speculative decoding fallback %s", json.dumps(record, sort_keys=True))


def serve_options(request: dict[str, Any]) -> ServeOptions:
    """The control operation ``serve``: ``{"op": "serve", "package": REF, "stages": N|null,
    "http": "[HOST:]PORT", "model_name": NAME|null, "speculative_strategy": S|null}``."""
    from mesh_node.settings import parse_http_bind

    package, stages = request.get("package"), request.get("stages")
    name = request.get("model_name")
    if not isinstance(package, str) or not (stages is None or isinstance(stages, int)):
        raise UsageError("serve needs package (string) and stages (int or null)")
    if stages is not None and stages < 1:
        raise UsageError("stages must be at least 1", code="usage")
    if name is not None and not isinstance(name, str):
        raise UsageError("model_name must be a string")
    replicas = request.get("replicas")
    if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int)):
        raise UsageError("replicas must be an integer or null", code="usage")
    http = parse_http_bind(request.get("http", "127.0.0.1:0"), "http")
    strategy = request.get("speculative_strategy")
    if strategy is not None and not isinstance(strategy, str):
        raise UsageError("speculative_strategy must be a string")
    return ServeOptions(
        package=package,
        stages=stages,
        http=http,
        model_name=name,
        speculative_strategy=strategy,
        replicas=replicas,
    )


class Serving:
    """This node as a serving coordinator, at most once."""

    config_table: str | None = "http"  # and [serving], through its stage host

    def __init__(
        self,
        node: MeshNode,
        host: StageHost,
        topology: TopologyService,
        *,
        extra_routes: Sequence[BaseRoute] = (),
        expected: bool = False,
    ) -> None:
        self.node = node
        self.host = host
        self.topology = topology
        self.metrics = ServingMetrics()  # requests, tokens, latencies (/metrics and the page)
        # This node is for serving (`mesh-node serve`, or ``[serving] expect_serve``): until it
        # serves, /health is not ``ok`` (a completion would be refused).
        self.expected = expected or node.settings.serving.expect_serve
        self.extra_routes = tuple(extra_routes)  # other components' routes (the one app)
        self.server: SplitServer | None = None
        self._api: OpenAIApi | None = None
        self.http_url: str | None = None  # the node's HTTP app, once it listens
        self._nursery: trio.Nursery | None = None
        self.starting = False  # start() is bringing a split up (before ``server`` exists)
        self.engine: EngineChoice | None = None  # the served package's engine, once known
        self._status: Callable[[], dict[str, Any]] | None = None  # once it serves

    # --- as a node service ------------------------------------------------------------------
    def streams(self) -> Sequence[StreamKind]:
        return []  # a coordinator's streams are its stage host's and its topology's

    def features(self, now_s: float) -> FeatureBits:
        return {}

    def status_sections(self) -> Mapping[str, Any]:
        return {} if self._status is None else {"serving": self._status()}

    def collectors(self) -> Sequence[Collector]:
        return [self.metrics, SectionCollector(self._serving_section, replica_families)]

    def _serving_section(self) -> Mapping[str, Any]:
        return {} if self._status is None else self._status()

    def routes(self) -> list[BaseRoute]:
        """Other components' routes and the OpenAI routes (503 until this node serves)."""
        from mesh_node.serving.api import OpenAIApi

        if self._api is None:
            self._api = OpenAIApi(
                lambda: self.server, self.metrics, self.node.settings.http_settings
            )
        return [*self.extra_routes, *self._api.routes()]

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def start_http(self, bind: HostPort, *, public: bool | None = None) -> str:
        """Start the node's one HTTP app (status page, /metrics and the API) on ``bind``,
        through the loopback gate (``public``: the node's ``http_public`` unless given)."""
        from mesh_node.http.app import build_app
        from mesh_node.http.bind import allowed_hosts, check_http_bind
        from mesh_node.http.guard import GuardPolicy
        from mesh_node.http.keys import check_tls_key, load_api_keys
        from mesh_node.http.server import serve_http

        if self._nursery is None:
            raise UsageError("the node is not running", code="node_not_running")
        public = self.node.settings.http_public if public is None else public
        http = self.node.settings.http_settings
        keys = await trio.to_thread.run_sync(load_api_keys, http)
        warning = check_http_bind(bind, public, authenticated=keys.required)
        if warning is not None:
            log.warning(warning)
        tls = None
        if http.tls_cert is not None and http.tls_key is not None:
            check_tls_key(http.tls_key)
            tls = (http.tls_cert, http.tls_key)
        policy = GuardPolicy(
            keys=keys, allowed_origins=frozenset(http.allowed_origins), access_log=http.access_log
        )
        app = build_app(
            self.node,
            routes=self.routes(),
            allowed_hosts=allowed_hosts(bind, public),
            policy=policy,
            health=self.health,
        )
        url: str = await self._nursery.start(partial(serve_http, app, bind, tls=tls))
        self.http_url = url
        return url

    def health(self) -> tuple[int, dict[str, Any]]:
        """``/health``: 200 when this node can serve what it is for (a plain node: it runs;
        a node for serving: a completion would be served), else 503 with the state and why."""
        code, body = self._health()
        if self.engine is not None:
            body["engine"] = self.engine.label
        return code, body

    def _health(self) -> tuple[int, dict[str, Any]]:
        if self._api is not None and self._api.closing:
            return 503, {"status": "shutting_down", "reason": "the node is shutting down"}
        server = self.server
        if server is None:
            if self.starting or self.expected:
                return 503, {
                    "status": "loading",
                    "reason": "reading the package to serve"
                    if self.starting
                    else "this node is to serve a model; its split has not started yet",
                    "retry_after_s": RETRY_AFTER_STARTING_S,
                }
            return 200, {"status": "ok"}
        replicas = server.replicas.health()  # each replica, when more than one
        if server.route is not None:
            return 200, {"status": "ok", **replicas}
        failed = server.replicas.failed  # for good (a stage's model or package): no Retry-After
        if failed is not None:
            return 503, {
                "status": "failed",
                "reason": redact_paths(failed.message),  # a stage's words may quote its paths
                "code": failed.code,
                **replicas,
            }
        waiting = server.replicas.waiting  # the split cannot be placed now (e.g. no capable peer)
        if waiting is not None:
            return 503, {
                "status": "error",
                "reason": waiting.message,
                "code": waiting.code,
                **replicas,
            }
        return 503, {
            "status": "loading",
            "reason": f"the split is not ready: {server.reason}",
            "retry_after_s": RETRY_AFTER_STARTING_S,
            **replicas,
        }

    async def _refuse_splits(self, engine: EngineChoice) -> None:
        """A model served whole is never split: each capable peer that joins is told no, in
        the log, with the code and the reason (the status document's ``engine`` says it too)."""
        from mesh_node.peers import PeerUp

        told: set[str] = set()
        async with self.node.subscribe() as events:
            async for event in events:
                if not isinstance(event, PeerUp) or event.peer.node_id in told:
                    continue
                capable = {c.node_id for c in self.topology.capable_nodes(False)}
                if event.peer.node_id in capable:
                    told.add(event.peer.node_id)
                    log.warning(
                        "peer %s joined; split placement refused [%s]: %s",
                        event.peer.node_id[:12],
                        engine.code,
                        engine.split_refused,
                    )

    async def drain(self) -> None:
        """Shutdown: the API refuses new requests and ends open streams cleanly."""
        if self._api is not None:
            await self._api.drain()

    async def start(self, options: ServeOptions) -> str:
        """Coordinate a split of the package; return the API's base URL (``.../v1``)."""
        from mesh_node.packages import package_engine, package_identity, package_speculation
        from mesh_node.serving.pipeline import SplitServer
        from mesh_node.serving.split import SplitSpec
        from skippy.serving.engine_choice import check_split

        if self.server is not None:
            raise UsageError("this node already serves a model", code="already_serving")
        if self._nursery is None:
            raise UsageError("the node is not running", code="node_not_running")
        from skippy.serving.replicas import check_replicas

        replicas = options.replicas
        if replicas is None:
            replicas = self.node.settings.serving.replicas
        check_replicas(replicas, options.stages)
        self.starting = True  # /health (of a node already serving its page): "loading"
        try:
            ref, sha, sizes, model_id = await trio.to_thread.run_sync(
                package_identity, self.node.settings, options.package
            )
            engine = await trio.to_thread.run_sync(package_engine, self.node.settings, ref)
            check_split(engine, options.stages)
            stages = 1 if engine.one_node else options.stages
            self.host.engine = engine.engine
            self.engine = engine
            (log.warning if engine.one_node else log.info)("%s", engine.label)
            plan = await trio.to_thread.run_sync(
                package_speculation,
                self.node.settings,
                ref,
                options.speculative or _config_speculation(self.node.settings.config_path),
                options.speculative_strategy,
            )
            log_serving_speculation(plan)
            if self.http_url is None:
                await self.start_http(options.http)
            spec = SplitSpec(ref, sha, sizes, stages, replicas, self.node.settings.serving)
            server = SplitServer(
                self.node,
                self.host,
                self.topology,
                spec,
                model_name=options.model_name or model_id,
                speculative=plan,
                metrics=self.metrics,
            )
            await self._nursery.start(server.run)
            self.server = server
            if engine.one_node:
                self._nursery.start_soon(self._refuse_splits, engine)
        finally:
            self.starting = False

        def status() -> dict[str, Any]:
            return {**server.status(), "engine": engine.to_dict()}

        self._status = status
        assert self.http_url is not None  # started above (typing)
        return self.http_url.rstrip("/") + "/v1"
