"""One completion through a running split, and its report (for `mesh-node lab --prompt`).

``complete`` asks a split's API (stdlib HTTP in a thread: the lab and scripts need no client
library); ``prompt_report`` combines the answer with the nodes' status documents into what
the lab prints: the text, prefill and decode tokens/s, time to first token, and per node its
stage, layer range, artifact bytes held and peak RSS.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import trio

from mesh_node.errors import MeshError


def _post(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as exc:
        try:
            err = json.loads(exc.read())["error"]
        except (ValueError, KeyError, TypeError):
            err = {"code": "http_error", "message": f"HTTP {exc.code}"}
        raise MeshError(str(err.get("message")), code=str(err.get("code"))) from None
    except (urllib.error.URLError, OSError) as exc:
        raise MeshError(f"the API at {url} did not answer: {exc}", code="api_unreachable") from None


async def complete(
    api: str,
    prompt: str,
    *,
    max_tokens: int,
    timeout_s: float = 600.0,
    within: Callable[[Callable[[], dict[str, Any]]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A greedy completion of ``prompt`` from the API at ``api`` (``http://HOST:PORT/v1``);
    ``within`` runs the request (the NAT lab's: inside the coordinator's namespace)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    post = partial(_post, f"{api}/completions", body, timeout_s)
    return await trio.to_thread.run_sync(post if within is None else partial(within, post))


def prompt_report(
    completion: dict[str, Any], statuses: Sequence[dict[str, Any] | None]
) -> dict[str, Any]:
    timings, usage = completion.get("timings", {}), completion["usage"]
    prefill_s, decode_s = timings.get("prefill_s") or 0.0, timings.get("decode_s") or 0.0
    n = usage["completion_tokens"]
    nodes = []
    for doc in statuses:
        stage = (doc or {}).get("stage")
        if not stage:
            continue
        nodes.append(
            {
                "node_id": doc["node_id"] if doc else None,
                "stage_index": stage["stage_index"],
                "layer_start": stage["layer_start"],
                "layer_end": stage["layer_end"],
                "artifact_bytes": stage["artifact_bytes"],
                "peak_rss_bytes": (stage.get("peak_rss_kib") or 0) * 1024,
            }
        )
    return {
        "text": completion["choices"][0]["text"],
        "finish_reason": completion["choices"][0]["finish_reason"],
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": n,
        "prefill_tokens_per_s": round(usage["prompt_tokens"] / prefill_s, 2) if prefill_s else None,
        "decode_tokens_per_s": round((n - 1) / decode_s, 2) if decode_s and n > 1 else None,
        "time_to_first_token_s": timings.get("ttft_s"),
        "nodes": sorted(nodes, key=lambda x: x["stage_index"]),
    }


def render_prompt_report(doc: dict[str, Any]) -> str:
    def rate(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = [
        f"text     {doc['text']!r}",
        f"tokens   {doc['prompt_tokens']} prompt, {doc['completion_tokens']} generated "
        f"({doc['finish_reason']})",
        f"speed    prefill {rate(doc['prefill_tokens_per_s'])} tok/s, decode "
        f"{rate(doc['decode_tokens_per_s'])} tok/s, first token "
        f"{1000 * (doc['time_to_first_token_s'] or 0):.0f} ms",
    ]
    # Replicas (the lab's ``replica`` keys): which one served, and each worker's.
    several = len({n.get("replica") for n in doc["nodes"] if n.get("replica") is not None}) > 1
    if several:
        served = doc.get("replica")
        lines.append(f"replica  {'?' if served is None else served} served this completion")
    for n in doc["nodes"]:
        tag = f" (replica {n['replica']})" if several and n.get("replica") is not None else ""
        lines.append(
            f"  stage {n['stage_index']}{tag}: layers {n['layer_start']}..{n['layer_end']} on "
            f"{(n['node_id'] or '?')[:12]}, {n['artifact_bytes'] / 2**20:.1f} MiB held, peak RSS "
            f"{n['peak_rss_bytes'] / 2**20:.0f} MiB"
        )
    return "\n".join(lines)
