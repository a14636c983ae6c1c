"""The coordinator of a split, as the API sees it: admission of requests over the route.

``SplitServer`` joins the two halves of the serving core and adds request admission:

- ``routes.RouteManager``: route lifecycle and admission of routes (bring-up, restore after a
  restart, healing when a stage node is lost or comes back, the 503 reasons);
- ``generator.Generator``: generation over a route with failover and exact replay, and the
  return streams from the final stage;
- here: at most ``max_sessions`` requests running and ``max_queue`` waiting (429 beyond), the
  node's request metrics and the recent requests' figures for the status document.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import trio

from mesh_node.errors import MeshError
from mesh_node.metrics import ServingMetrics
from mesh_node.node import MeshNode
from mesh_node.serving.generator import (
    MAX_FAILOVERS,
    BadGenerationRequest,
    Emit,
    GenerationFailed,
    GenerationParams,
    GenerationResult,
    Generator,
    Route,
    ServingFault,
)
from mesh_node.serving.host import StageHost, hop_summary
from mesh_node.serving.replicas import ReplicaSet
from mesh_node.serving.routes import SplitNotReady
from mesh_node.serving.split import SplitSpec
from mesh_node.topology import TopologyService
from skippy.generation import SpeculativePlan
from skippy.runtime.tokenizer import LlamaTokenizer

__all__ = [
    "MAX_FAILOVERS",
    "BadGenerationRequest",
    "Emit",
    "GenerationFailed",
    "GenerationParams",
    "GenerationResult",
    "Route",
    "ServerBusy",
    "ServingFault",
    "ServingStats",
    "SplitNotReady",
    "SplitServer",
]
RECENT: Final = 256  # requests whose figures the status keeps


class ServerBusy(MeshError):
    """Every slot and queue place is taken (HTTP 429)."""

    code = "server_busy"


@dataclass
class ServingStats:
    """What admission needs (running, queued) and the recent requests' timings. Request and
    token counts, time to first token and latencies are serving's metrics
    (``ServingMetrics``: the status page and /metrics read them)."""

    failovers_total: int = 0
    in_flight: int = 0
    queued: int = 0
    recent: deque[GenerationResult] = field(default_factory=lambda: deque(maxlen=RECENT))

    def to_dict(self) -> dict[str, Any]:
        decode_tok = sum(max(0, len(r.tokens) - 1) for r in self.recent)
        decode_s = sum(r.decode_s for r in self.recent)
        prefill_tok = sum(r.prompt_tokens for r in self.recent)
        prefill_s = sum(r.prefill_s for r in self.recent)
        return {
            "requests_queued": self.queued,
            "failovers_total": self.failovers_total,
            "decode_tokens_per_s": round(decode_tok / decode_s, 2) if decode_s > 0 else None,
            "prefill_tokens_per_s": round(prefill_tok / prefill_s, 2) if prefill_s > 0 else None,
        }


class SplitServer:
    """Stage 0 and the API's view of the split (one per serving coordinator): ``spec``'s
    replicas (``mesh_node.serving.replicas``), planned with the node's ``topology`` service
    and its siblings."""

    def __init__(
        self,
        node: MeshNode,
        host: StageHost,
        topology: TopologyService,
        spec: SplitSpec,
        *,
        model_name: str,
        speculative: SpeculativePlan | None = None,
        metrics: ServingMetrics | None = None,
    ) -> None:
        self.node = node
        self.host = host
        self.settings = settings = spec.settings
        self.model_name = model_name
        self.metrics = metrics if metrics is not None else ServingMetrics()
        self.replicas = ReplicaSet(node, host, topology, spec)
        self.generator = Generator(node, host, settings, self.replicas, speculative=speculative)
        self.stats = ServingStats()
        self._slots = trio.Semaphore(settings.max_sessions)
        self.hops = host.hops

    # --- the route manager's view (what the API reads) -----------------------------------------
    @property
    def route(self) -> Route | None:
        return self.replicas.route

    @property
    def tokenizer(self) -> LlamaTokenizer | None:
        return self.replicas.tokenizer

    @property
    def reason(self) -> str:
        return self.replicas.reason

    def _check_ready(self) -> Route:
        return self.replicas.check_ready()

    def status(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "speculative_strategy": (
                self.generator.speculative.strategy_id if self.generator.speculative else None
            ),
            **self.replicas.status(),
            **self.metrics.serving_status(),
            **self.stats.to_dict(),
            "hops": hop_summary(self.hops),
        }

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Bring every replica up and keep it up (``RouteManager.run``) until cancelled."""
        await self.replicas.run(task_status=task_status)

    # --- admission -----------------------------------------------------------------------------
    async def generate(
        self, prompt: list[int], params: GenerationParams, emit: Emit
    ) -> GenerationResult:
        """One request through the split; ``emit`` gets each new token (and may stop it).
        Counted in the node's metrics (requests by outcome, tokens, time to first token)."""
        with self.metrics.request(len(prompt)) as record:
            try:
                await self._admit()
            except (SplitNotReady, ServerBusy):
                record.outcome = "rejected"
                raise

            lease = self.replicas.lease(len(prompt) + params.max_tokens)

            async def counted(token: int) -> bool:
                record.tokens(1)
                lease.produced(1)
                return await emit(token)

            st = self.stats
            st.in_flight += 1
            try:
                result = await self.generator.generate(prompt, params, counted, routes=lease)
            finally:
                st.in_flight -= 1
                lease.release()
                self._slots.release()
            st.failovers_total += result.failovers
            if result.verify_passes:
                self.metrics.speculation(
                    result.proposed_tokens, result.accepted_tokens, result.verify_passes
                )
            st.recent.append(result)
            return result

    async def _admit(self) -> None:
        """Ready, and a slot free or a place in the queue (then wait for a slot)."""
        self.replicas.check_ready()
        st = self.stats
        if st.in_flight + st.queued >= self.settings.max_sessions + self.settings.max_queue:
            raise ServerBusy(
                f"{st.in_flight} requests running and {st.queued} queued (the limit)",
                remediation="retry later",
            )
        st.queued += 1
        try:
            with trio.fail_after(self.settings.queue_timeout_s):
                await self._slots.acquire()
        except trio.TooSlowError:
            raise ServerBusy(
                f"no slot within {self.settings.queue_timeout_s:g} s", remediation="retry later"
            ) from None
        finally:
            st.queued -= 1
