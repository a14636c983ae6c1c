"""The status page in a real browser (issue #12 §3): Debian's headless Chromium, driven through
Debian's chromedriver by selenium, against real ``mesh-node run`` processes on loopback."""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from httptools import get_json, without_volatile
from pkgtools import make_package
from test_mesh_processes import make_keys, mesh, start, status, stop, wait_status, write_config

from mesh_node.http.app import build_app
from mesh_node.http.server import serve_http
from mesh_node.metrics import NodeMetrics
from mesh_node.peers import AuthenticatedPeer, PeerInfo, status_document
from mesh_node.topology import ActiveTopology
from skippy.config import HostPort
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
            "/usr/bin/chromedriver); scripts/_setup.sh installs them with apt-get as root"
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


def test_status_page_of_three_real_nodes_in_chromium(tmp_path, browser, synth_dir):
    pkg = tmp_path / "pkg"
    make_package(synth_dir.llama, pkg)
    ids, _owner = make_keys(tmp_path, ("a", "b", "c"))
    write_config(tmp_path / "a.toml", "a", [])
    a, a_url = start(tmp_path, "a.toml", "--http", "127.0.0.1:0")
    procs = [a]
    try:
        assert a.stdout is not None
        line = a.stdout.readline()  # the page address, one line after `listening ...`
        assert line.startswith("status-page http://127.0.0.1:"), line
        page = line.split(" ", 1)[1].strip()
        for name in ("b", "c"):
            write_config(tmp_path / f"{name}.toml", name, [a_url])
            procs.append(start(tmp_path, f"{name}.toml")[0])
        wait_status(
            tmp_path,
            "a.toml",
            lambda d: sum(p["connected"] and p["trusted"] for p in d["peers"]) == 2,
        )
        out = mesh(tmp_path, "topology", "--config", "a.toml", "--package", str(pkg), "--json")
        assert out.returncode == 0, out.stderr + out.stdout
        topo = json.loads(out.stdout)
        assert len(topo["stages"]) == 3

        browser.get(page)
        # The live update: more than one document arrived after the page loaded.
        wait_for_page(browser, "return Number(document.body.dataset.updates) >= 2")
        wait_for_page(
            browser,
            "return document.querySelectorAll('#peers-rows tr[data-connected=true]').length == 2"
            " && document.querySelectorAll('#topology-bar .stage[data-ready=true]').length == 3",
        )
        # The three nodes: this one, and its two peers.
        assert browser.find_element("id", "node-id").get_attribute("data-node-id") == ids["a"]
        rows = browser.find_elements("css selector", "#peers-rows tr")
        assert {r.get_attribute("data-node-id") for r in rows} == {ids["b"], ids["c"]}
        assert all("trusted" in r.text and "same owner" in r.text for r in rows)
        # The topology bar: three stages over the layer index, one per node, in order.
        stages = browser.find_elements("css selector", "#topology-bar .stage")
        assert [s.get_attribute("data-node-id") for s in stages] == [
            s["node_id"] for s in topo["stages"]
        ]
        assert {s.get_attribute("data-node-id") for s in stages} == set(ids.values())
        assert all(s.text.startswith("✓ S") and "KiB" in s.text for s in stages)
        widths = [s.size["width"] for s in stages]
        assert all(w > 0 for w in widths)
        # Transfers and serving appear only with their data (neither exists on this branch).
        assert not browser.find_element("id", "transfers").is_displayed()
        assert not browser.find_element("id", "serving").is_displayed()

        # Never on the page: private keys, local paths (the package dir, keys, data dirs).
        html = browser.page_source
        key_pem = (tmp_path / "keys" / "a.key").read_text()
        assert "PRIVATE KEY" not in html and key_pem.strip().splitlines()[1] not in html
        assert str(tmp_path) not in html and "…/pkg" in html

        # /api/status is the status document (the CLI's), local paths reduced.
        doc = get_json(page + "api/status")
        cli = status(tmp_path, "a.toml")
        assert cli["topology"]["package_ref"] == str(pkg.resolve())
        assert doc["topology"]["package_ref"] == "…/pkg"
        cli["topology"]["package_ref"] = doc["topology"]["package_ref"]
        assert without_volatile(doc) == without_volatile(cli)
        assert str(tmp_path) not in json.dumps(doc)

        shot = tmp_path / "status-page.png"
        assert browser.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        check_phone_width(browser, tmp_path / "status-page-phone.png")
        check_theme_toggle(browser)

        # A node with its page open still stops cleanly.
        assert stop(a, signal.SIGTERM) == 0
        procs.remove(a)
        assert "Traceback" not in (a.stderr.read() if a.stderr else "")
        wait_for_page(browser, "return document.getElementById('live').classList.contains('stale')")
    finally:
        for p in procs:
            p.kill()
            p.wait()


# --- sections whose producers are not on this branch yet --------------------------------------
class StandInNode:
    """Stand-in for a node that has transfer and serving data, which no real node on this
    branch produces yet (transfers: issue #8's mesh half; serving: issue #10). The document is
    built by the real ``status_document`` and ``ActiveTopology``; the ``transfers`` records
    follow the schema issue #8 announced; ``serving`` is the real ``NodeMetrics`` output after
    real ``request()`` calls. Replace with a real lab once those land."""

    def __init__(self) -> None:
        self.metrics = NodeMetrics()
        ids = ["1" * 64, "2" * 64, "3" * 64]
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
            sizes=sizes,
            own_id=ids[0],
        )
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
            topology=self.topology.to_dict(),
            uptime_s=3725,
        )
        record = {"source": "peer", "peer": "2" * 64, "started": 0.0, "error": None}
        doc["transfers"] = {
            "in_progress": [
                {
                    **record,
                    "path": "layers/layer-00011.gguf",
                    "bytes": 2_000_000,
                    "total": 5_000_000,
                    "finished": None,
                    "verified": None,
                    "mb_s": 41.5,
                },
            ],
            "recent": [
                {
                    **record,
                    "path": "model-package.json",
                    "bytes": 9_000,
                    "total": 9_000,
                    "finished": 0.1,
                    "verified": True,
                    "mb_s": 12.0,
                },
                {
                    **record,
                    "path": "layers/layer-00010.gguf",
                    "bytes": 5_000_000,
                    "total": 5_000_000,
                    "finished": 0.3,
                    "verified": True,
                    "mb_s": 88.0,
                },
                {
                    **record,
                    "source": "hub",
                    "peer": None,
                    "path": "layers/layer-00009.gguf",
                    "bytes": 5_000_000,
                    "total": 5_000_000,
                    "finished": 0.5,
                    "verified": False,
                    "mb_s": 30.0,
                    "error": "artifact_sha256_mismatch",
                },
            ],
            "counters": self.metrics.transfer_counters(),
        }
        doc["serving"] = self.metrics.serving_status()
        return doc

    @asynccontextmanager
    async def subscribe(self) -> AsyncIterator[trio.MemoryReceiveChannel[Any]]:
        send, receive = trio.open_memory_channel[Any](1)
        async with send, receive:
            yield receive


async def test_transfer_and_serving_sections_render_from_their_data(tmp_path, browser):
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
                "done",
                "failed",
            ]
            assert "40%" in rows[0].find_element("css selector", ".progress > span").get_attribute(
                "style"
            )
            assert "✓" in rows[2].text and "88.0" in rows[2].text and "peer 222222" in rows[2].text
            assert "artifact_sha256_mismatch" in rows[3].text and "hub" in rows[3].text
            serving = browser.find_element("id", "serving")
            assert serving.is_displayed()
            assert "160 ms" in serving.text  # the median of the two requests' TTFT
            assert browser.find_element("id", "serving-tps").text != "-"
            stages = browser.find_elements("css selector", "#topology-bar .stage")
            assert len(stages) == 3 and all(s.get_attribute("data-ready") == "true" for s in stages)
            assert browser.save_screenshot(str(tmp_path / "status-page-sections.png"))
            check_phone_width(browser, tmp_path / "status-page-sections-phone.png")

        await trio.to_thread.run_sync(look)
        n.cancel_scope.cancel()
