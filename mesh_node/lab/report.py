"""The lab's report, built from plain data and rendered (pure).

Per node: id, owner, stage and layer range, its stage state and the coordinator's answer to
its ready report; per artifact: path, bytes, source (``peer``, ``hub`` or ``cache``), whether it
is verified (the node proved it, and for a worker the lab hashed it again), and why it did not
come from the peer when it did not; totals of peer and hub bytes, time and throughput.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from skippy.constants import MANIFEST_NAME, ROLE_LAYER
from skippy.package.artifact_ref import ArtifactRef

if TYPE_CHECKING:
    from skippy.generation import SpeculativePlan


@dataclass(frozen=True)
class CacheCheck:
    """What the lab found in a worker's hub cache for its stage, checked independently."""

    required: tuple[str, ...]  # the stage's required set plus the manifest
    verified: frozenset[str]  # present with the declared SHA-256 (hashed by the lab)
    missing: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()  # package files it should not hold
    partials: tuple[str, ...] = ()  # leftover partial or incomplete files

    @property
    def exact(self) -> bool:
        return (
            not self.missing
            and not self.extra
            and not self.partials
            and set(self.required) <= self.verified
        )


@dataclass(frozen=True)
class NodeFacts:
    index: int
    node_id: str
    role: str  # coordinator | worker
    owner: str  # the lab's owner label: primary | foreign
    owner_id: str
    stage: Mapping[str, Any] | None  # the topology's stage entry for this node
    status: Mapping[str, Any] | None  # its status document at the end (None: not answering)
    check: CacheCheck | None = None  # workers only
    problems: list[str] = field(default_factory=list)
    replica: int | None = None  # serving replicas: the one whose stage it holds
    peer_bytes_before: int = 0  # its peer-fetched counter when the split was sent


def peer_bytes_fetched(status: Mapping[str, Any] | None) -> int:
    """Every byte a node received from peers since it started, kept or not (its counter)."""
    counters = ((status or {}).get("transfers") or {}).get("counters") or {}
    return int((counters.get("fetched_bytes") or {}).get("peer") or 0)


def replica_of(node_id: str, replicas: Sequence[Mapping[str, Any]]) -> int | None:
    """The replica whose worker ``node_id`` is (``None``: the coordinator, which holds stage
    0 of every replica, a spare, or a lab that serves no replicas)."""
    for r in replicas:
        if node_id in list(r.get("nodes") or [])[1:]:
            return int(r["replica"])
    return None


def serving_replica(
    before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]
) -> int | None:
    """The replica that took one request, from each replica's ``requests_total`` before and
    after it (``None`` unless exactly one grew: a request replayed on a second replica)."""
    counts = {int(r["replica"]): int(r.get("requests_total") or 0) for r in before}
    grew = [
        int(r["replica"])
        for r in after
        if int(r.get("requests_total") or 0) > counts.get(int(r["replica"]), 0)
    ]
    return grew[0] if len(grew) == 1 else None


def _latest_fetches(status: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    if status is None or not status.get("transfers"):
        return {}
    out: dict[str, Mapping[str, Any]] = {}
    for rec in reversed(status["transfers"]["recent"]):  # oldest first: the latest wins
        if rec["direction"] == "fetch":
            out[rec["path"]] = rec
    return out


def node_report(facts: NodeFacts, topology_id: str) -> dict[str, Any]:
    status = facts.status
    transfers = (status or {}).get("transfers") or {}
    stage_state = transfers.get("stage") or {}
    # A replica's worker is judged against its own replica's topology.
    topology_id = (facts.stage or {}).get("topology_id") or topology_id
    current = stage_state.get("topology_id") == topology_id
    fetches = _latest_fetches(status)
    required = list(stage_state.get("required", [])) if current else []
    paths = [MANIFEST_NAME, *required] if required else []
    artifacts = []
    totals = {"peer": 0, "hub": 0, "cache": 0}
    for path in paths:
        rec = fetches.get(path, {})
        source = rec.get("source")
        size = rec.get("total") or rec.get("bytes_done") or 0
        verified = bool(rec.get("verified"))
        if facts.check is not None:
            verified = verified and path in facts.check.verified
        if source in totals and rec.get("verified"):
            totals[source] += size
        artifacts.append(
            {
                "path": path,
                "bytes": size,
                "source": source,
                "verified": verified,
                "fallback": rec.get("fallback"),
                "revision": rec.get("revision"),
                "mb_per_s": rec.get("mb_per_s"),
                # every node that served part of it, with its bytes
                "served_by": [dict(s) for s in rec.get("served_by", [])],
                "dropped_sources": [dict(s) for s in rec.get("dropped_sources", [])],
            }
        )
    out: dict[str, Any] = {
        "index": facts.index,
        "node_id": facts.node_id,
        "role": facts.role,
        "owner": facts.owner,
        "owner_id": facts.owner_id,
        "stage_index": None if facts.stage is None else facts.stage["stage_index"],
        "layer_start": None if facts.stage is None else facts.stage["layer_start"],
        "layer_end": None if facts.stage is None else facts.stage["layer_end"],
        "state": stage_state.get("state") if current else ("down" if status is None else None),
        "error": stage_state.get("error") if current else None,
        "report": stage_state.get("report") if current else None,
        "bytes": totals,
        "artifacts": artifacts,
        # what this node sent to its peers (a swarm spreads it over the holders)
        "served_bytes": ((transfers.get("counters") or {}).get("served_bytes") or 0),
        # every byte it received from peers for this split, also those it did not keep (a
        # transfer a dropped link cut short and the hub then sent whole, duplicate chunks)
        "peer_bytes_received": max(0, peer_bytes_fetched(status) - facts.peer_bytes_before),
        "replica": facts.replica,
    }
    if facts.check is not None:
        out.update(
            exact=facts.check.exact,
            missing=list(facts.check.missing),
            extra=list(facts.check.extra),
            partials=list(facts.check.partials),
        )
    return out


def build_report(
    *,
    package_ref: str,
    transfer: str,
    foreign_owners: int,
    topology: Mapping[str, Any] | None,
    nodes: Sequence[NodeFacts],
    seconds: float,
    problems: Sequence[str] = (),
) -> dict[str, Any]:
    """The whole report; ``ok`` only when every stage node is ready with its report accepted
    and every worker holds exactly its required set, verified."""
    topology_id = "" if topology is None else str(topology["topology_id"])
    rows = [node_report(n, topology_id) for n in nodes]
    found = list(problems)
    for row, facts in zip(rows, nodes, strict=True):
        found += facts.problems
        if facts.stage is None:
            continue
        who = f"{facts.role} {facts.node_id[:12]}"
        if row["state"] != "ready":
            found.append(f"{who}: stage {row['state'] or 'not started'} ({row['error'] or '-'})")
        elif row["report"] != "accepted":
            found.append(f"{who}: ready report {row['report'] or 'not answered'}")
        if facts.check is not None and not facts.check.exact:
            found.append(f"{who}: its cache does not hold exactly its stage, verified")
    totals = {
        source: sum(r["bytes"][source] for r in rows if r["role"] == "worker")
        for source in ("peer", "hub", "cache")
    }
    moved = totals["peer"] + totals["hub"]
    received = sum(r["peer_bytes_received"] for r in rows if r["role"] == "worker")
    coordinator = next((n for n in nodes if n.role == "coordinator"), None)
    counters = (
        ((coordinator.status or {}).get("transfers") or {}).get("counters", {})
        if coordinator is not None
        else {}
    )
    return {
        "ok": not found and topology is not None,
        "package": package_ref,
        "transfer": transfer,
        "nodes_total": len(nodes),
        "foreign_owners": foreign_owners,
        "topology_id": topology_id or None,
        "seconds": round(seconds, 3),
        "totals": {
            "peer_bytes": totals["peer"],
            "hub_bytes": totals["hub"],
            "cache_bytes": totals["cache"],
            # received from peers but not kept: the links carried it, the files did not
            "peer_bytes_discarded": max(0, received - totals["peer"]),
            "mb_per_s": round(moved / seconds / 1e6, 1) if seconds > 0 and moved else None,
        },
        "coordinator": {
            "served_bytes": counters.get("served_bytes", 0),
            "refusals": counters.get("refusals", {}),
        },
        "nodes": rows,
        "problems": found,
        # The coordinator's planner record (cost or memory, predicted ms/token, why).
        "plan": None if topology is None else topology.get("prediction"),
    }


def revision_change(
    doc: Mapping[str, Any], artifacts: Iterable[ArtifactRef], layer: int
) -> dict[str, Any]:
    """What a second revision changing ``layer`` moved to the workers (pure):
    ``moved_bytes`` (peer and hub, the manifest aside) must equal ``changed_bytes`` times
    the workers whose stage holds that layer; every other artifact came from the cache."""
    changed = next(
        (r for r in artifacts if r.role == ROLE_LAYER and r.layer_index == layer),
        None,
    )
    path = changed.path if changed is not None else None
    size = changed.artifact.artifact_bytes if changed is not None else 0
    moved = holders = 0
    revisions: set[str] = set()
    for row in doc["nodes"]:
        if row["role"] != "worker":
            continue
        for a in row["artifacts"]:
            if a["path"] == MANIFEST_NAME:
                continue
            if a["source"] in ("peer", "hub"):
                moved += a["bytes"] or 0
            if a["path"] == path:
                holders += 1
            if a["source"] == "cache" and a.get("revision"):
                revisions.add(a["revision"])
    return {
        "layer": layer,
        "path": path,
        "changed_bytes": size,
        "workers_holding_it": holders,
        "moved_bytes": moved,
        "only_the_change_moved": moved == size * holders,
        "cached_from_revisions": sorted(revisions),
    }


def render_revision_change(
    change: Mapping[str, Any] | None, first: Mapping[str, Any] | None = None
) -> list[str]:
    if not change:
        return []
    verdict = "only that layer moved" if change["only_the_change_moved"] else "MORE MOVED"
    lines = []
    if first:
        t = first["totals"]
        lines.append(
            f"first revision {first['package']}: workers received peer "
            f"{human_bytes(t['peer_bytes'])}, hub {human_bytes(t['hub_bytes'])} "
            f"({'ok' if first['ok'] else 'FAILED'})"
        )
    return [
        *lines,
        f"revision change: layer {change['layer']} ({change['path']}), "
        f"{human_bytes(change['changed_bytes'])} on {change['workers_holding_it']} worker(s); "
        f"workers received {human_bytes(change['moved_bytes'])} besides the manifest: {verdict}"
    ]


def predicted_vs_measured(
    plan: Mapping[str, Any] | None, prompt: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The plan's predicted decode ms/token beside the one measured while serving
    (``prompt``: ``mesh_node.serving.completion_report.prompt_report``); ``None`` without a
    prompt."""
    if prompt is None:
        return None
    predicted = None if plan is None else plan.get("predicted_ms_per_token")
    rate = prompt.get("decode_tokens_per_s")
    measured = round(1000 / rate, 3) if rate else None
    return {
        "predicted_ms_per_token": predicted,
        "measured_decode_ms_per_token": measured,
        "measured_over_predicted": (
            round(measured / predicted, 2) if measured and predicted else None
        ),
        "planner": None if plan is None else plan.get("planner"),
    }


def speculative_report(plan: SpeculativePlan, serving: Mapping[str, Any] | None) -> dict[str, Any]:
    """The speculation a serving lab runs: the resolved plan (what was asked and where, the
    strategy, its N-gram bounds and window, the resolver's notes), whether the coordinator
    executes it (``speculative_strategy`` in its serving status: other plans decode plainly),
    and its acceptance so far from the coordinator's counters: drafted tokens, accepted ones,
    their rate and the verify windows that carried them."""
    serving = serving or {}
    counters = serving.get("speculative") or {}
    drafted, accepted = int(counters.get("proposed", 0)), int(counters.get("accepted", 0))
    doc = plan.to_dict()
    return {
        "requested": plan.requested,
        "source": plan.requested_source,
        "strategy": plan.strategy_id,
        "mode": plan.mode,
        "executed": serving.get("speculative_strategy") is not None,
        "ngram": doc["ngram"],
        "window": doc["window"],
        "notes": doc["notes"],
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": round(accepted / drafted, 4) if drafted else None,
        "verify_windows": int(counters.get("verify_passes", 0)),
    }


def render_speculative(sp: Mapping[str, Any] | None) -> list[str]:
    """One line for the lab's speculation (``speculative_report``), then the plan's notes."""
    if not sp:
        return []
    asked = f"{sp['source']}: {sp['requested']}"
    if sp["mode"] == "disabled":
        return [f"speculative: disabled ({asked})"]
    parts = []
    if sp["ngram"]:
        g = sp["ngram"]
        parts.append(
            f"n-gram {g['ngram_min']}..{g['ngram_max']}, up to {g['max_proposal_tokens']} drafts"
        )
    if sp["window"]:
        w = sp["window"]
        parts.append(
            f"{w['default']} window {w['initial_window']} ({w['min_window']}..{w['max_window']})"
        )
    head = f"speculative: {sp['strategy']} ({asked}; {', '.join(parts)})"
    if not sp["executed"]:
        line = f"{head}: not executed here, plain decoding"
    elif sp["drafted"]:
        line = (
            f"{head}: {sp['accepted']} of {sp['drafted']} drafted tokens accepted "
            f"({sp['acceptance']:.0%}) in {sp['verify_windows']} verify windows"
        )
    else:
        line = f"{head}: no drafted tokens yet"
    return [line, *(f"  note: {n}" for n in sp["notes"])]


def render_plan(doc: Mapping[str, Any]) -> list[str]:
    """Which planner placed the split, its prediction and why it won; after a
    prompt, predicted beside measured."""
    plan = doc.get("plan")
    if not plan:
        return []
    lines = []
    if plan.get("planner") == "cost" and plan.get("chosen"):
        c = plan["chosen"]
        lines.append(
            f"plan: cost planner, predicted {c['predicted_ms_per_token']:.2f} ms/token (compute "
            f"{c['compute_ms']:.2f} + hops {c['hops_ms']:.2f}) over {len(c['nodes'])} stage(s); "
            f"{plan['why']} ({plan.get('candidates_fit', '?')} of "
            f"{plan.get('candidates_total', '?')} candidates fit)"
        )
        if plan.get("runner_up"):
            r = plan["runner_up"]
            why = plan.get("runner_up_why")
            lines.append(
                f"  runner-up: {r['predicted_ms_per_token']:.2f} ms/token over "
                f"{len(r['nodes'])} stage(s)" + (f" ({why})" if why else "")
            )
        lines += [f"  {k}: {v}" for k, v in (plan.get("assumptions") or {}).items()]
    else:
        lines.append(f"plan: {plan.get('planner', '?')} planner; {plan.get('why', '')}")
    pvm = doc.get("predicted_vs_measured")
    if pvm:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f} ms"

        ratio = pvm["measured_over_predicted"]
        lines.append(
            f"decode per token: predicted {ms(pvm['predicted_ms_per_token'])}, measured "
            f"{ms(pvm['measured_decode_ms_per_token'])}"
            + (f" ({ratio:.2f}x the prediction)" if ratio else "")
        )
    return lines


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"  # unreachable


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _by_stage(nodes: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted(nodes, key=lambda n: (n["stage_index"] is None, n["stage_index"] or 0))


_LAYER = re.compile(r"\Alayers/layer-\d{5}\.gguf\Z")


def _runs(artifacts: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """Consecutive layer files that arrived alike, as one table row (the text stays short)."""
    out: list[list[Mapping[str, Any]]] = []
    for a in artifacts:
        last = out[-1][-1] if out else None
        if (
            last is not None
            and _LAYER.match(a["path"])
            and _LAYER.match(last["path"])
            and all(a.get(k) == last.get(k) for k in ("source", "verified", "fallback", "revision"))
        ):
            out[-1].append(a)
        else:
            out.append([a])
    return out


def source_text(artifact: Mapping[str, Any]) -> str:
    """``peer``, ``hub``, ``cache``; ``cache (revision <short>)`` for a delta link; ``peer x3``
    when three nodes served parts of it."""
    source = artifact.get("source") or "-"
    revision = artifact.get("revision")
    if source == "cache" and revision:
        return f"{source} (revision {revision})"
    servers = len(artifact.get("served_by") or ())
    return f"{source} x{servers}" if servers > 1 else source


def render_links(links: Mapping[str, Any] | None) -> list[str]:
    """The emulated links (``mesh_node.lab.netem``) and their fault counters."""
    if not links:
        return []
    rows = [("link", "emulated", "bytes relayed")]
    rows += [(f"{x['a']} - {x['b']}", x["text"], human_bytes(x["bytes"])) for x in links["links"]]
    counts = links.get("counts", {})
    faults = ", ".join(
        f"{k} {counts[k]}" for k in ("drop", "stall", "partition", "refuse") if counts.get(k)
    )
    return [*_table(rows), f"link faults: {faults or 'none'}"]


def render_nat(nat: Mapping[str, Any]) -> list[str]:
    """The NAT lab's section: where each node runs, what it learnt of its public address,
    and how each pair is linked."""
    kinds = ", ".join(f"{h} {k}" for h, k in nat["kinds"].items())
    rate = nat.get("home_rate_bytes_per_s")
    if rate:  # the homes' lines shaped (--home-rate)
        kinds += f"; each home's line {rate * 8 / 1e6:g} Mbit/s both ways"
    lines = [f"NAT lab ({kinds})"]
    rows: list[tuple[str, ...]] = [("node", "namespace", "listen", "observed", "upgrades")]
    for n in nat["nodes"]:
        rows.append(
            (
                n["name"],
                n["netns"] or "-",
                n["listen"],
                ", ".join(n["observed"]) or "-",
                f"{n['upgraded']} ok, {n['failed']} failed",
            )
        )
    lines += _table(rows)
    for link in nat["links"]:
        how = link["link"] if link["link"] == "direct" else f"relayed via {link['relay']}"
        if link.get("fallback_relay"):
            how += f" (fallback: relay {link['fallback_relay']})"
        lines.append(f"  {link['a']} - {link['b']}: {how}")
    return [*lines, ""]


def render_report(doc: Mapping[str, Any]) -> str:
    foreign = f", {doc['foreign_owners']} foreign" if doc["foreign_owners"] else ""
    lines = [
        f"mesh-node lab: {doc['nodes_total']} nodes, {doc['package']}, transfer "
        f"{doc['transfer']}{foreign}",
        "",
    ]
    # With replicas, a column says whose stage each node holds (the coordinator's
    # stage 0 is every replica's).
    replicas = bool(doc.get("replicas"))
    head = ("node", "role", "owner", "replica") if replicas else ("node", "role", "owner")
    nodes: list[tuple[str, ...]] = [(*head, "stage", "layers", "state", "report")]
    for n in _by_stage(doc["nodes"]):
        layers = "-" if n["layer_start"] is None else f"{n['layer_start']}..{n['layer_end']}"
        replica = n.get("replica")
        if replica is None:
            replica = "all" if n["role"] == "coordinator" else "-"
        nodes.append(
            (
                n["node_id"][:12],
                n["role"],
                n["owner"],
                *((str(replica),) if replicas else ()),
                "-" if n["stage_index"] is None else str(n["stage_index"]),
                layers,
                n["state"] or "-",
                n["report"] or "-",
            )
        )
    lines += [*_table(nodes), ""]
    if doc.get("nat"):
        lines += render_nat(doc["nat"])
    for r in doc.get("replicas") or []:
        workers = ", ".join(n[:12] for n in r["nodes"][1:]) or "-"
        served = r.get("requests_total")
        lines.append(
            f"replica {r['replica']}: {r['state']}, workers {workers}"
            + ("" if served is None else f", {served} request(s)")
        )
    if doc.get("replicas"):
        lines.append("")
    arts = [("node", "artifact", "bytes", "source", "verified", "why not from the peer")]
    for n in _by_stage(doc["nodes"]):
        for group in _runs(n["artifacts"]):
            a = group[0]
            path = a["path"]
            if len(group) > 1:
                path = f"{path[: -len('.gguf')]}..{group[-1]['path'][-len('00000.gguf'):]}"
                path += f" ({len(group)})"
            arts.append(
                (
                    n["node_id"][:12],
                    path,
                    human_bytes(sum(g["bytes"] for g in group)),
                    source_text(a),
                    "yes" if a["verified"] else "NO",
                    a["fallback"] or "",
                )
            )
    if len(arts) > 1:
        lines += [*_table(arts), ""]
    t = doc["totals"]
    rate = f" ({t['mb_per_s']} MB/s)" if t["mb_per_s"] else ""
    lines.append(
        f"workers received: peer {human_bytes(t['peer_bytes'])}, hub {human_bytes(t['hub_bytes'])}"
        f", already cached {human_bytes(t['cache_bytes'])}; {doc['seconds']:.2f} s{rate}"
    )
    if t.get("peer_bytes_discarded"):
        lines.append(
            f"  and {human_bytes(t['peer_bytes_discarded'])} from peers that were not kept "
            "(transfers cut short, then fetched again; chunks received twice)"
        )
    lines += render_links(doc.get("links"))
    lines += render_revision_change(doc.get("revision_change"), doc.get("first_revision"))
    lines += render_plan(doc)
    lines += render_speculative(doc.get("speculative"))
    refusals = doc["coordinator"]["refusals"]
    lines.append(
        "coordinator refusals: "
        + (", ".join(f"{k} {v}" for k, v in refusals.items()) if refusals else "none")
    )
    if doc["ok"]:
        lines.append("ok: every worker holds exactly its stage's artifacts, verified")
    else:
        lines += ["FAILED:"] + [f"  {p}" for p in doc["problems"]]
    return "\n".join(lines)
