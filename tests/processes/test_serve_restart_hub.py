"""A restarted coordinator serves again with zero bytes re-transferred, with
real `mesh-node` processes on loopback and a hub package: `mesh-node serve` coordinates
``hf://lab/...@<commit>`` published on the lab hub (``mesh_node.lab.hub_server``), the workers fetch
their stages from the coordinator over the mesh (peer transfer), then the coordinator is
SIGKILLed and started again with the same identity, config and `serve` arguments. It must serve
the same greedy text again, and no artifact byte may move again: the workers' fetch counters
(peer and hub) stay put, the restarted coordinator serves no byte to a peer, and the hub sends
no byte to anyone. The time from the restarted process's start to its first served request is
printed (not asserted: a loaded machine)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")

import synth_gguf
from pkgtools import make_package
from servetools import Cluster, http, node_toml, wait_ready

from mesh_node.lab.hub_server import FakeHub, running_hub
from mesh_node.lab.package import import_package, publish_directory
from skippy.consume.verify import VerifyCache

pytestmark = pytest.mark.llama
IDS = [1, 5, 9, 17, 33, 65, 3, 100, 7, 12, 90, 44]


@pytest.fixture(scope="module")
def hub_pkg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeHub, str]]:
    """The tiny synthetic llama (6 layers) published on a lab hub: (hub, pinned hf:// ref)."""
    root = tmp_path_factory.mktemp("serve_restart_hub")
    src = synth_gguf.llama_like(root / "llama.gguf", n_layers=6)
    make_package(src, root / "tiny-layers", model_id="acme/tiny-GGUF:Q8_0")
    with running_hub() as hub:
        yield hub, publish_directory(hub, root / "tiny-layers")


def _env(root: Path, name: str, hub: FakeHub) -> dict[str, str]:
    """A node's own caches (hub cache under its data_dir; its verification cache under
    XDG_CACHE_HOME) and the lab hub as its endpoint; no telemetry."""
    return {
        "HF_ENDPOINT": hub.url,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "XDG_CACHE_HOME": str(root / f"{name}-xdg"),
        "HF_HOME": str(root / f"{name}-hf"),
        "HF_HUB_CACHE": str(root / f"{name}-hf" / "hub"),
    }


def _complete(api: str, n: int = 16) -> str:
    status, doc = http(
        "POST", f"{api}/completions", {"prompt": IDS, "max_tokens": n, "temperature": 0}
    )
    assert status == 200, doc
    return str(doc["choices"][0]["text"])


def _hub_bytes(hub: FakeHub, repo_id: str) -> int:
    return sum(hub.bytes_served(repo_id, p) for p in hub.downloaded_paths(repo_id))


def _fetches(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in status["transfers"]["recent"] if r["direction"] == "fetch"]


def test_a_restarted_coordinator_serves_a_hub_package_again_with_zero_bytes_moved(
    hub_pkg: tuple[FakeHub, str], tmp_path: Path
) -> None:
    hub, ref = hub_pkg
    repo_id = ref.removeprefix("hf://").split("@")[0]
    cluster = Cluster(tmp_path)
    serve = ["serve", "--package", ref, "--stages", "3", "--http", "127.0.0.1:0",
             "--model-name", "tiny"]
    coord_toml = node_toml(tmp_path, "coord")
    # peer transfer needs the coordinator to serve artifacts; no certificates here: "open".
    coord_toml = 'artifact_transfer = "open"\n' + coord_toml
    coord_env = _env(tmp_path, "coord", hub)
    # As `mesh-node lab` does: the coordinator holds the whole package (verified, recorded in
    # its verification cache), so it can feed every stage; `serve` alone fetches its own stage.
    import_package(
        ref,
        tmp_path / "coord-data" / "hub",
        endpoint=hub.url,
        verify_cache=VerifyCache.under(Path(coord_env["XDG_CACHE_HOME"]) / "skippy"),
    )
    hub.reset()  # from here on, count every byte anyone asks of the hub
    try:
        coord = cluster.start("coord", serve, coord_toml, coord_env)
        listening = coord.wait_line("listening ")
        cluster.coordinator_address = coord.address = listening
        cluster.api = coord.wait_line("api ")
        # pin the coordinator's port and HTTP port: the restart must be where the workers dial
        host_port = listening.removeprefix("ws://").split("#", 1)[0]
        api_port = cluster.api.split("://", 1)[1].split("/", 1)[0]
        coord_toml = coord_toml.replace('listen = "127.0.0.1:0"', f'listen = "{host_port}"')
        serve_again = [a if a != "127.0.0.1:0" else api_port for a in serve]
        workers = ("w0", "w1")
        for name in workers:
            toml = node_toml(tmp_path, name, peers=(cluster.coordinator_address,))
            worker = cluster.start(name, ["run"], toml, _env(tmp_path, name, hub))
            worker.address = worker.wait_line("listening ")
        wait_ready(cluster.api)
        want = _complete(cluster.api)
        # every worker's stage came from the coordinator over the mesh, none from the hub
        before: dict[str, dict[str, int]] = {}
        for name in workers:
            status = cluster.status(name)
            fetched = status["transfers"]["counters"]["fetched_bytes"]
            recs = _fetches(status)
            assert fetched["peer"] > 0 and fetched["hub"] == 0, recs
            # from the peer; a stage planned again before the split was ready finds the
            # parts it already fetched in its own cache ("cache"), never the hub's
            sources = {r["source"] for r in recs}
            assert "peer" in sources and sources <= {"peer", "cache"}, recs
            assert all(r["verified"] for r in recs)
            before[name] = dict(fetched)
        assert _hub_bytes(hub, repo_id) == 0
        topo = cluster.status()["topology"]

        # the coordinator dies (SIGKILL, by its PID) and starts again: same identity, config,
        # `serve` arguments (its listen and HTTP ports pinned to the ones it had)
        os.kill(coord.popen.pid, signal.SIGKILL)
        coord.popen.wait()
        t0 = time.monotonic()
        again = cluster.start("coord", serve_again, coord_toml, coord_env)
        assert again.wait_line("listening ") == listening
        assert again.wait_line("api ") == cluster.api
        wait_ready(cluster.api)
        took = time.monotonic() - t0
        # (a) it serves again, the same greedy text, over the same split
        assert _complete(cluster.api) == want
        after = cluster.status()
        assert after["serving"]["restored_run"] == topo["run_id"]
        assert [s["node_id"] for s in after["topology"]["stages"]] == [
            s["node_id"] for s in topo["stages"]
        ]
        # (b) no artifact byte moved again: not from the peer, not from the hub
        assert after["transfers"]["counters"]["served_bytes"] == 0
        own = after["transfers"]["counters"]["fetched_bytes"]
        assert (own["peer"], own["hub"]) == (0, 0), own  # its own stage: from its cache too
        assert _hub_bytes(hub, repo_id) == 0
        for name in workers:
            status = cluster.status(name)
            now = status["transfers"]["counters"]["fetched_bytes"]
            assert (now["peer"], now["hub"]) == (before[name]["peer"], before[name]["hub"]), now
            assert now["cache"] > before[name]["cache"]  # it found its verified parts in place
            assert status["transfers"]["stage"]["topology_id"] == after["topology"]["topology_id"]
        print(f"\ncoordinator restart (hub package): first request served {took:.2f} s after "
              "the restarted process started (loaded machine)")
    finally:
        cluster.stop()
