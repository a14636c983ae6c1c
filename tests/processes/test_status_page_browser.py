"""The status page in a real browser: Debian's headless Chromium, driven through
Debian's chromedriver by selenium, against real ``mesh-node run`` processes on loopback."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from httptools import get_json, without_volatile
from prometheus_client.registry import Collector
from test_mesh_processes import MESH, status

from mesh_node.http.app import build_app
from mesh_node.http.server import serve_http
from mesh_node.metrics import (
    SectionCollector,
    ServingMetrics,
    topology_families,
    transfer_families,
)
from mesh_node.peers import AuthenticatedPeer, PeerInfo, status_document
from mesh_node.settings import HostPort
from mesh_node.topology import ActiveTopology, StageReport
from mesh_node.transfer.records import TransferLog
from skippy.package.plan import ModelSizes
from skippy.package.topology import NodeCapacity, plan_topology

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
# What headless Chromium needs on this machine (python.md): no sandbox as root, no GPU, and no
# background networking (the closed network refuses it, many connections at a time).
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)
PAGE_TIMEOUT_S = 30.0
PHONE = (390, 844)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip(
            "needs Debian's chromium and chromium-driver (/usr/bin/chromium, "
            "/usr/bin/chromedriver); scripts/test installs them with apt-get as root in CI, "
            "or when asked (SKIPPY_INSTALL_BROWSER=1)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    # An explicit driver path: selenium never looks for (or downloads) a driver itself.
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_window_size(1280, 1000)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for_page(driver: Any, script: str, timeout_s: float = PAGE_TIMEOUT_S) -> Any:
    """Poll a JavaScript predicate in the page until it is truthy (returns its value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = driver.execute_script(script)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"page never satisfied: {script}\n{driver.page_source[:2000]}")
        time.sleep(0.1)


def updates(driver: Any) -> int:
    return int(driver.execute_script("return Number(document.body.dataset.updates || 0)"))


def check_phone_width(driver: Any, shot: Path) -> None:
    """Usable at phone width: nothing pushes the page wider than the window (wide tables
    scroll inside their own box)."""
    driver.set_window_size(*PHONE)
    seen = updates(driver)
    wait_for_page(driver, f"return Number(document.body.dataset.updates) > {seen}")
    overflow = driver.execute_script(
        "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
    )
    assert overflow <= 1, f"the page is {overflow}px wider than a phone"
    assert driver.save_screenshot(str(shot))
    driver.set_window_size(1280, 1000)


def check_theme_toggle(driver: Any) -> None:
    background = "return getComputedStyle(document.body).backgroundColor"
    before = driver.execute_script(background)
    driver.find_element("id", "theme").click()
    after = driver.execute_script(background)
    theme = driver.execute_script("return document.documentElement.dataset.theme")
    assert theme in ("dark", "light") and after != before
    driver.find_element("id", "theme").click()
    assert driver.execute_script(background) == before


def read_until(proc: subprocess.Popen[str], last: str, timeout_s: float = 120.0) -> list[str]:
    """stdout lines up to the one starting with ``last`` (the lab prints as it goes)."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not (lines and lines[-1].startswith(last)):
        line = proc.stdout.readline()
        if not line or time.monotonic() > deadline:
            err = proc.stderr.read() if proc.stderr and proc.poll() is not None else ""
            raise AssertionError(f"no {last!r} line: {lines} {err}")
        lines.append(line.rstrip("\n"))
    return lines


def test_status_page_of_a_three_node_lab_in_chromium(tmp_path, browser, hub_package):
    """"Done when": `mesh-node lab --nodes 3 ... --http` prints the coordinator's page
    address; the page shows the three nodes, the three stages and the completed transfers."""
    lab = tmp_path / "lab"
    proc = subprocess.Popen(
        [
            *MESH,
            "lab",
            "--nodes",
            "3",
            "--package",
            str(hub_package.directory),
            "--http",
            "127.0.0.1:0",
            "--dir",
            str(lab),
            "--keep",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        (first,) = read_until(proc, "status-page ")  # announced before the split starts
        page = first.split(" ", 1)[1]
        assert page.startswith("http://127.0.0.1:"), page
        report = read_until(proc, "the lab stays up")
        assert any(line.startswith("ok: every worker holds exactly") for line in report), report
        coordinator = status(lab / "n0", "node.toml")
        ids = {coordinator["node_id"], *(p["node_id"] for p in coordinator["peers"])}
        assert len(ids) == 3

        browser.get(page)
        # The live update: more than one document arrived after the page loaded.
        wait_for_page(browser, "return Number(document.body.dataset.updates) >= 2")
        wait_for_page(
            browser,
            "return document.querySelectorAll('#peers-rows tr[data-connected=true]').length == 2"
            " && document.querySelectorAll('#topology-bar .stage[data-ready=true]').length == 3",
        )
        # The three nodes: this one, and its two peers.
        node_id = browser.find_element("id", "node-id").get_attribute("data-node-id")
        assert node_id == coordinator["node_id"]
        rows = browser.find_elements("css selector", "#peers-rows tr")
        assert {r.get_attribute("data-node-id") for r in rows} == ids - {node_id}
        assert all("trusted" in r.text and "same owner" in r.text for r in rows)
        # The topology bar: three stages over the layer index, one per node, in plan order.
        stages = browser.find_elements("css selector", "#topology-bar .stage")
        planned = coordinator["topology"]["stages"]
        assert [s.get_attribute("data-node-id") for s in stages] == [s["node_id"] for s in planned]
        assert {s.get_attribute("data-node-id") for s in stages} == ids
        assert all(s.text.startswith("✓ S") and "iB" in s.text for s in stages)
        assert all(s.size["width"] > 0 for s in stages)
        # Completed transfers: artifacts this coordinator served to its workers, verified.
        # Read in one script: the live update may re-render the rows between two calls.
        done = browser.execute_script(
            "return [...document.querySelectorAll("
            "'#transfers-rows tr[data-state=done][data-direction=serve]')]"
            ".map(r => [r.innerText, r.dataset.path])"
        )
        assert done and all("✓ sha256" in text and "↑ to" in text for text, _ in done)
        served = {path for _, path in done}
        assert "model-package.json" in served
        assert "ready" in browser.find_element("id", "transfers-stage").text
        assert not browser.find_element("id", "serving").is_displayed()  # the data

        # Never on the page: private keys, local paths (the lab's folders, caches).
        html = browser.page_source
        key_pem = (lab / "n0" / "node.key").read_text()
        assert "PRIVATE KEY" not in html and key_pem.strip().splitlines()[1] not in html
        assert str(tmp_path) not in html and str(lab) not in html

        # /api/status is the status document: the CLI's, but for what moved in between.
        doc = get_json(page + "api/status")
        assert without_volatile(doc) == without_volatile(status(lab / "n0", "node.toml"))
        assert str(tmp_path) not in json.dumps(doc)

        shot = tmp_path / "status-page.png"
        assert browser.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        check_phone_width(browser, tmp_path / "status-page-phone.png")
        check_theme_toggle(browser)

        # Ctrl-C stops the lab, its page open: every node stops cleanly.
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")
        wait_for_page(browser, "return document.getElementById('live').classList.contains('stale')")
        logs = "".join(p.read_text() for p in lab.glob("n*/node.log"))
        assert logs and "Traceback" not in logs
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)


# --- what a lab cannot show on demand ---------------------------------------------------------
class StandInNode:
    """Stand-in for a node in states a real lab does not hold still long enough to look at,
    and with data no real node produces yet: a transfer in progress, a failed hub fallback, a
    failed stage, and serving figures. Everything is made by the real code: the
    document by ``status_document``, the topology by ``plan_topology`` and ``ActiveTopology``
    with ``StageReport``s, the transfers by a ``TransferLog``, serving by ``ServingMetrics``
    after ``request()`` calls. Serve it with the real app; look at it in the real browser."""

    def __init__(self) -> None:
        self.metrics = ServingMetrics()
        self.ids = ids = ["1" * 64, "2" * 64, "3" * 64]
        self.node_id = ids[0]
        sizes = ModelSizes(
            layer_bytes=(5_000_000,) * 18,
            metadata_bytes=9_000,
            embeddings_bytes=170_000_000,
            output_bytes=0,
            tied_embeddings=True,
        )
        topology = plan_topology(
            sizes,
            [NodeCapacity(i, 8 << 30) for i in ids],
            topology_id="topo-standin",
            run_id="run-standin",
            package_ref="hf://lab/gemma3@" + "0" * 40,
            manifest_sha256="ab" * 32,
        )
        self.topology = ActiveTopology(
            topology,
            b"",
            ids[0],
            "coordinator",
            "active",
            acks={ids[1]: "accepted", ids[2]: "accepted"},
            reports={
                ids[0]: StageReport("ready"),
                ids[1]: StageReport("ready"),
                ids[2]: StageReport("failed", "hub_unreachable"),
            },
            sizes=sizes,
            own_id=ids[0],
            # as the coordinator planned them by the nodes' advertised devices
            placement={
                ids[0]: {"mode": "device", "device": "CUDA0", "device_bytes": 9 << 20,
                         "host_bytes": 0},
                ids[1]: {"mode": "experts on CPU", "device": "ROCm0", "device_bytes": 3 << 20,
                         "host_bytes": 6 << 20},
            },
        )  # fmt: skip
        self.peers = [
            PeerInfo(
                AuthenticatedPeer(i, "9" * 64, "verified", True, "same owner as this node"),
                f"ws://127.0.0.1:{7001 + n}",
                {"skippy-stage/2": ("control",)},
                8 << 30,
                True,
                0.2,
                0.0004,
                bytes_received=52_000_000 * (n + 1),
                bytes_sent=90_000,
            )
            for n, i in enumerate(ids[1:])
        ]
        self.transfers = log = TransferLog()
        sending = log.start("serve", "layers/layer-00011.gguf", total=5_000_000, peer_id=ids[1])
        sending.bytes_done = 2_000_000
        fetched = log.start(
            "fetch", "layers/layer-00010.gguf", total=5_000_000, peer_id=ids[1], source="peer"
        )
        fetched.bytes_done = 5_000_000
        log.finish(fetched, verified=True)
        failed = log.start("fetch", "layers/layer-00009.gguf", total=5_000_000, source="hub")
        failed.bytes_done, failed.fallback = 5_000_000, "artifact unavailable"
        log.finish(failed, verified=False, error="artifact_sha256_mismatch")
        log.found_in_cache("model-package.json", 9_000)
        for ttft in (0.12, 0.2):
            with self.metrics.request(prompt_tokens=6) as req:
                req.first_token_s = ttft
                req.tokens(16)

    def status(self) -> dict[str, Any]:
        doc = status_document(
            node_id=self.node_id,
            listen="ws://127.0.0.1:7000",
            owner_id="9" * 64,
            owner_status="verified",
            features={"skippy-stage/2": ("control",)},
            memory_budget_bytes=8 << 30,
            artifact_transfer="trusted",
            peers=self.peers,
            uptime_s=3725,
        )
        doc["topology"] = self.topology.to_dict()  # the sections services add
        doc["devices"] = {
            "list": [
                {"name": "CUDA0", "type": "GPU", "free_bytes": 20 << 30, "total_bytes": 24 << 30},
                {"name": "CPU", "type": "CPU", "free_bytes": 60 << 30, "total_bytes": 64 << 30},
            ],
            "stage": "CUDA0",
            "experts_on_cpu": False,
        }
        doc["stage"] = {  # this node's loaded stage (the stage host's section, in part)
            "topology_id": self.topology.topology.topology_id,
            "device": "CUDA0",
            "placement": "device",
            "device_memory_bytes": 11 << 20,
        }
        doc["transfers"] = self.transfers.status()
        doc["serving"] = self.metrics.serving_status()
        return doc

    def collectors(self) -> list[Collector]:
        """As the topology, artifact transfer and serving services declare theirs."""
        return [
            SectionCollector(self.topology.to_dict, topology_families),
            SectionCollector(self.transfers.status, transfer_families),
            self.metrics,
        ]

    @asynccontextmanager
    async def subscribe(self) -> AsyncIterator[trio.MemoryReceiveChannel[Any]]:
        send, receive = trio.open_memory_channel[Any](1)
        async with send, receive:
            yield receive


async def test_in_progress_failed_and_serving_states_render(tmp_path, browser):
    node = StandInNode()
    async with trio.open_nursery() as n:
        url = await n.start(serve_http, build_app(node), HostPort("127.0.0.1", 0))

        def look() -> None:
            browser.get(url)
            wait_for_page(browser, "return Number(document.body.dataset.updates) >= 2")
            rows = browser.find_elements("css selector", "#transfers-rows tr")
            assert [r.get_attribute("data-state") for r in rows] == [
                "active",
                "done",
                "failed",
                "done",
            ]
            bar = rows[0].find_element("css selector", ".progress > span")
            assert "40%" in bar.get_attribute("style") and "↑ to 222222222222" in rows[0].text
            assert "= cache" in rows[1].text and "✓ sha256" in rows[1].text
            assert "↓ hub" in rows[2].text and "(fallback)" in rows[2].text
            assert "✗ artifact_sha256_mismatch" in rows[2].text
            assert "↓ peer 222222222222" in rows[3].text and "✓ sha256" in rows[3].text
            ready = {
                s.get_attribute("data-node-id"): s.get_attribute("data-ready")
                for s in browser.find_elements("css selector", "#topology-bar .stage")
            }
            assert ready == {node.ids[0]: "true", node.ids[1]: "true", node.ids[2]: "false"}
            assert "failed (hub_unreachable)" in browser.find_element("id", "topology").text
            assert "CUDA0 GPU 20.0 GiB free" in browser.find_element("id", "node-devices").text
            placed = {  # by the node each row's stage is on
                r.find_element("css selector", "td[title]").get_attribute("title"): r.find_element(
                    "css selector", ".placement"
                ).text
                for r in browser.find_elements("css selector", "#topology-rows tr")
            }
            own, other = placed[node.ids[0]], placed[node.ids[1]]
            assert "CUDA0: device" in own and "running on CUDA0 (device)" in own, placed
            assert "11.0 MiB in device memory" in own, placed
            assert other.startswith("ROCm0: experts on CPU") and "6.00 MiB in RAM" in other
            assert placed[node.ids[2]] == "-"
            serving = browser.find_element("id", "serving")
            assert serving.is_displayed()
            assert "160 ms" in serving.text  # the median of the two requests' TTFT
            assert browser.find_element("id", "serving-tps").text != "-"
            assert browser.save_screenshot(str(tmp_path / "status-page-states.png"))
            check_phone_width(browser, tmp_path / "status-page-states-phone.png")

        await trio.to_thread.run_sync(look)
        n.cancel_scope.cancel()


def test_the_page_of_a_node_with_an_api_key_in_chromium(tmp_path, browser):
    """A real `mesh-node run --http --api-key-file` node. The page's shell loads
    without a key and shows no data; it asks for the key once (a wrong one is refused), keeps
    it in this tab's session storage, and then renders the document and its live updates
    (read through fetch: EventSource cannot send the header); a reload does not ask again."""
    from test_http_processes import node_config
    from test_mesh_processes import start, stop

    key = "sk-page-" + "p4ge" * 6
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# page test\n{key}\n")
    keys.chmod(0o600)
    proc, _ = start(tmp_path, node_config(tmp_path, "a"), "--http", "127.0.0.1:0",
                    "--api-key-file", str(keys))
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().removeprefix("status-page ").strip()
        node_id = subprocess.run(
            [*MESH, "id", "a.key"], cwd=tmp_path, capture_output=True, text=True, check=True
        ).stdout.strip()
        browser.get(url)
        wait_for_page(browser, "return !document.getElementById('login').hidden")
        assert node_id not in browser.page_source  # nothing of the node without the key
        assert browser.find_element("id", "node").get_attribute("hidden") is not None
        field = browser.find_element("id", "api-key")
        field.send_keys("sk-wrong")
        browser.find_element("id", "login-submit").click()
        wait_for_page(
            browser, "return document.getElementById('login-error').textContent.includes('refused')"
        )
        assert node_id not in browser.page_source
        field.send_keys(key)
        browser.find_element("id", "login-submit").click()
        wait_for_page(browser, "return Number(document.body.dataset.updates) >= 3")  # live
        assert browser.find_element("id", "login").get_attribute("hidden") is not None
        assert browser.find_element("id", "node-id").text == node_id
        assert browser.execute_script("return sessionStorage.getItem('mesh-node-api-key')") == key
        assert key not in browser.find_element("tag name", "body").text  # never shown
        assert browser.save_screenshot(str(tmp_path / "status-page-with-key.png"))
        browser.refresh()  # the same tab: the key is still in session storage
        wait_for_page(browser, "return Number(document.body.dataset.updates) >= 2")
        assert browser.find_element("id", "login").get_attribute("hidden") is not None
        browser.execute_script("sessionStorage.clear()")
    finally:
        assert stop(proc) == 0
    err = proc.stderr.read() if proc.stderr else ""
    assert key not in err and "Traceback" not in err
