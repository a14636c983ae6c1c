"""The NAT lab (``mesh_node.lab.netns``: network namespaces behind nftables NAT), called by
scripts/bench.py (section "nat"). Needs root, ``ip`` and ``nft``; skipped (one row saying why)
without them.

- Direct upgrades: two nodes that name a relay on the public segment, linked through it, in
  a fresh lab per try, for each pair of NAT kinds (and one node public): how often the link
  goes direct within ``UPGRADE_WAIT_S``, and how long after the relayed link it took.
- Serving: gemma3-270m on a 3-stage ``mesh-node lab --nat`` split (n0 public: coordinator,
  stage 0 and relay; n1, n2 in two homes), greedy completions through its OpenAI API from the
  coordinator's namespace (the request the ``openai`` client sends, over urllib): decode
  ms/token with the workers' link relayed (both homes masquerade) vs direct (home1
  full-cone), labs alternating; the difference is the relayed hop's overhead per token.
- Transfer: a 201 MB layer from a coordinator in home1 to a worker in home2, through the relay
  on the public segment vs over their direct link (home1 full-cone), the worker's own
  verified transfer record (target: relayed >= 0.8x direct); twice: over unshaped lines (the
  relay's per-circuit cap off), where this host's CPU is the bound, and with each home's line
  shaped to 100 Mbit/s both ways (the relay as shipped), where the line is.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
import urllib.request
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import trio
from bench_transfer_mesh import BIG_LAYER, _package  # type: ignore[import-not-found]
from benchlib import BenchContext, Row, random_file, spread  # type: ignore[import-not-found]

from mesh_node.lab import netns
from mesh_node.lab.cluster import LabCluster, NodeSpec
from mesh_node.lab.run import LabOptions, open_lab, place_in_nat

MODEL = "gemma3-270m"
DECODE_TOKENS = 32
UPGRADE_WAIT_S = 20.0  # after both nodes started: the upgrade's tries end ~5 s after linking
# (label, NatLab kinds, where n1 and n2 run)
UPGRADE_CASES: tuple[tuple[str, dict[str, str], tuple[str, str]], ...] = (
    ("masquerade / masquerade", {}, ("home1", "home2")),
    ("stealth / stealth", {"home1": "stealth", "home2": "stealth"}, ("home1", "home2")),
    ("stealth / masquerade", {"home1": "stealth"}, ("home1", "home2")),
    ("full-cone / masquerade", {"home1": "full-cone"}, ("home1", "home2")),
    ("public / masquerade", {}, ("coord", "home2")),
)
TRANSFER_BYTES = 3 * 64 << 20  # 201 MB (benchlib.random_file's 64 MiB blocks)
HOME_LINE_BYTES_PER_S = 100_000_000 // 8  # 100 Mbit/s each way: a good home line
NODE_CONFIG: dict[str, Any] = {
    "calibration": "off",
    "heartbeat_interval_s": 0.5,
    "peer_loss_timeout_s": 5.0,
    "handshake_timeout_s": 3.0,
}


def _how(doc: dict[str, Any] | None, node_id: str) -> str | None:
    link = _peer(doc, node_id)
    return None if link is None else str(link["link"])


def _peer(doc: dict[str, Any] | None, node_id: str) -> dict[str, Any] | None:
    for p in (doc or {}).get("peers", []):
        if p["node_id"] == node_id and p["connected"]:
            return dict(p)
    return None


async def _upgrade_try(
    work: Path, nat: dict[str, str], places: tuple[str, str], i: int
) -> float | None:
    """One fresh lab: a relay (n0) and two relayed nodes; seconds from both nodes' start to
    their direct link, None if it stayed relayed."""
    root = work / "nat-upgrade"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    specs = [NodeSpec(name=f"n{k}", config=dict(NODE_CONFIG)) for k in range(3)]
    lab = netns.NatLab(f"bu{i % 1000}", nat)
    await trio.to_thread.run_sync(lab.build)
    cluster = LabCluster(root, specs)
    try:
        place_in_nat(lab, cluster, ("relay", *places))
        relay = cluster.nodes[0]
        relay.spec = replace(
            relay.spec, config={**relay.spec.config, "relay": {"enable": True, "allow": "any"}}
        )
        await cluster.start_all()
        started = trio.current_time()
        a, b = cluster.nodes[1], cluster.nodes[2]
        while trio.current_time() - started < UPGRADE_WAIT_S:
            if _how(await a.status(), b.node_id) == "direct":
                return trio.current_time() - started
            await trio.sleep(0.05)
        if _how(await a.status(), b.node_id) is None:
            raise SystemExit(f"bench nat: n1 and n2 never linked ({nat}, {places})")
        return None
    finally:
        await cluster.aclose()
        await trio.to_thread.run_sync(lab.close)


def _upgrade_rows(ctx: BenchContext) -> list[Row]:
    out: list[Row] = []
    for label, nat, places in UPGRADE_CASES:
        got = [trio.run(_upgrade_try, ctx.work, nat, places, i) for i in range(ctx.runs)]
        ok = [t for t in got if t is not None]
        when = f"; direct {spread(ok, fmt='{:.1f}')} s after the nodes started" if ok else ""
        out.append(
            (
                "-",
                f"nat: relayed link goes direct, {label}",
                f"{len(ok)}/{len(got)}",
                f"fresh lab per try, within {UPGRADE_WAIT_S:g} s{when}",
            )
        )
    return out


def _complete(api: str, max_tokens: int) -> dict[str, Any]:
    # what the openai client's completions.create sends (the model named by the server)
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(
        f"{api}/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": "Bearer unused"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(json.loads(r.read()))


async def _serve_once(
    ctx: BenchContext, pkg: Path, nat: dict[str, str]
) -> tuple[list[float], str]:
    root = ctx.work / "nat-serve-lab"
    shutil.rmtree(root, ignore_errors=True)
    options = LabOptions(
        nodes=3, package=str(pkg), transfer="open", root=root, nat=nat, serve=True, timeout_s=600
    )
    ms: list[float] = []
    async with open_lab(options) as lab:
        api, _, _ = await lab.start_serving()
        assert lab.nat is not None
        call = partial(lab.nat.call_in, "coord")
        await trio.to_thread.run_sync(call, partial(_complete, api, 2))  # warm-up
        for _ in range(ctx.runs):
            d = await trio.to_thread.run_sync(call, partial(_complete, api, DECODE_TOKENS))
            n = d["usage"]["completion_tokens"]
            ms.append(1000 * d["timings"]["decode_s"] / (n - 1))
        w1, w2 = lab.cluster.nodes[1], lab.cluster.nodes[2]
        link = _peer(await w1.status(), w2.node_id)
        how = "?" if link is None else link["link"]
    return ms, how


def _serve_rows(ctx: BenchContext) -> list[Row]:
    from bench_stage import _package as stage_package  # type: ignore[import-not-found]

    pkg = Path(stage_package(ctx))
    relayed: list[float] = []
    direct: list[float] = []
    hows = set()
    for _ in range(2):  # labs alternate: the machine's load drifts
        for nat, into in (({}, relayed), ({"home1": "full-cone"}, direct)):
            ms, how = trio.run(_serve_once, ctx, pkg, nat)
            into += ms
            hows.add((bool(nat), how))
    r, d = statistics.median(relayed), statistics.median(direct)
    floor = min(relayed) - min(direct)  # the least loaded tokens: less of the machine's noise
    return [
        (
            MODEL,
            "nat: decode ms/token, 3-stage split, workers relayed / direct",
            f"{spread(relayed, fmt='{:.1f}')} / {spread(direct, fmt='{:.1f}')}",
            f"the relayed hop adds {r - d:+.1f} ms/token (medians; {floor:+.1f} between the "
            "fastest requests; one hop per token crosses the relay "
            f"on the coordinator; links seen: {sorted(hows)}); greedy, {DECODE_TOKENS} tokens, "
            "the API asked from the coordinator's namespace",
        )
    ]


async def _transfer_runs(
    package: Path, work: Path, nat: dict[str, str], runs: int, home_bytes_per_s: int | None
) -> tuple[list[float], str]:
    """MB/s of ``runs`` verified fetches of the big layer, coordinator (home1) to worker
    (home2), after one warm-up; and how they were linked. Over unshaped lines the relay's
    per-circuit cap is off (it would bound the relayed rate); over shaped ones it is as
    shipped."""
    root = work / "nat-xfer-lab"
    shutil.rmtree(root, ignore_errors=True)
    circuit = {"circuit_bytes_per_s": 0} if home_bytes_per_s is None else {}
    relay = {"memory_budget": "64MiB", "relay": {"enable": True, **circuit}}
    options = LabOptions(
        nodes=3,
        package=str(package),
        transfer="open",
        root=root,
        timeout_s=300,
        nat=nat,
        nat_places=("home1", "home2", "relay"),
        nat_home_bytes_per_s=home_bytes_per_s,
        node_config={**NODE_CONFIG},
        node_overrides={0: {"memory_budget": "1GiB"}, 1: {"memory_budget": "16GiB"}, 2: relay},
    )
    rates: list[float] = []
    async with open_lab(options) as lab:
        coord, worker, _ = lab.cluster.nodes
        for i in range(runs + 1):
            await lab.cluster.stop(1)
            shutil.rmtree(worker.data_dir / "hub", ignore_errors=True)
            shutil.rmtree(worker.root / "cache", ignore_errors=True)
            await lab.cluster.start(1)
            await lab.cluster.wait_meshed(60)
            if nat:  # wait for the direct upgrade (the fetch must not start on the relay)
                with trio.fail_after(30):
                    while _how(await coord.status(), worker.node_id) != "direct":
                        await trio.sleep(0.1)
            response = await coord.request(
                {"op": "topology", "package": lab.package.ref, "stages": 2, "include_self": True},
                timeout_s=120,
            )
            assert response["topology"]["topology_id"]
            record = await _fetch_record(worker)
            if i:
                rates.append(record["mb_per_s"])
        link = _peer(await coord.status(), worker.node_id)
        how = "?" if link is None else link["link"]
        await lab.cluster.stop(1)
    return rates, how


async def _fetch_record(worker: Any) -> dict[str, Any]:
    """The worker's record of its verified fetch of the big layer (it was restarted with an
    empty cache: its only one). Whether the stage then loads does not matter here (the
    random layer is no model's)."""
    with trio.fail_after(600):
        while True:
            status = await worker.status()
            for rec in status["transfers"]["recent"]:
                if rec["path"] == BIG_LAYER and rec["direction"] == "fetch" and rec["finished"]:
                    if rec["source"] != "peer" or not rec["verified"]:
                        raise SystemExit(f"{BIG_LAYER} did not come from the peer: {rec}")
                    return dict(rec)
            await trio.sleep(0.05)


def _transfer_rows(ctx: BenchContext) -> list[Row]:
    big, sha = random_file(ctx, TRANSFER_BYTES, name="nat-transfer.gguf", layer=1)
    package = _package(ctx.work, "nat", big, sha, link=False)
    out: list[Row] = []
    for line in (None, HOME_LINE_BYTES_PER_S):
        relayed, how_r = trio.run(_transfer_runs, package, ctx.work, {}, ctx.runs, line)
        direct, how_d = trio.run(
            _transfer_runs, package, ctx.work, {"home1": "full-cone"}, ctx.runs, line
        )
        ratio = statistics.median(relayed) / statistics.median(direct)
        if line is None:
            where = (
                "unshaped lines (this host's CPU, which runs both ends and the relay, is the "
                "bound); the relay's per-circuit cap off (its default, 16 MiB/s, would bound "
                "the relayed one)"
            )
        else:
            where = (
                f"each home's line shaped to {line * 8 / 1e6:.0f} Mbit/s both ways (a home "
                "line: the kernel's token bucket on its router); the relay as shipped"
            )
        out.append(
            (
                "-",
                f"nat: verified transfer {TRANSFER_BYTES / 1e6:.0f} MB, relayed / direct (MB/s)",
                f"{spread(relayed, fmt='{:.1f}')} / {spread(direct, fmt='{:.1f}')}",
                f"{ratio:.2f}x (target >= 0.8x); home1 -> home2, links {how_r} / {how_d}; "
                + where,
            )
        )
    return out


def rows(ctx: BenchContext) -> list[Row]:
    lacking = netns.missing()
    if lacking:
        return [("-", "nat: skipped", "-", "needs " + "; ".join(lacking))]
    started = time.monotonic()
    out = _upgrade_rows(ctx)
    out += _transfer_rows(ctx)
    out += _serve_rows(ctx)
    print(f"bench nat: {time.monotonic() - started:.0f} s", flush=True)
    return out
