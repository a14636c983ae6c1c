"""A split served across two NATs (the NAT lab, mesh_node/lab/netns.py): `mesh-node serve` on
the public segment coordinates and relays, two `mesh-node run` workers sit in two homes behind
two kernel masquerade routers. The workers cannot dial each other, so the activations from
stage 1 to stage 2 cross a circuit through the relay; the completions through the `openai`
client are the single-process reference's tokens, as on direct links. Needs root, ip and nft
(required in CI, as tests/mesh_node/lab/test_nat_lab.py) and llama-cpp-python's libggml."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from natmarks import needs_lab

pytest.importorskip("llama_cpp", reason="llama-cpp-python (and its libggml) is not installed")
pytest.importorskip("openai", reason="the openai client is a dev dependency")

import synth_gguf
from pkgtools import make_package
from servetools import Proc, _pump, node_toml
from stagetools import chain

from mesh_node.lab.netns import NatLab

pytestmark = pytest.mark.llama
IDS = [1, 5, 9, 17, 33, 65, 3, 100, 7, 12, 90, 44]
N_TOKENS = 12
PORT = 7500
# Run inside the coordinator's namespace (its API listens on its loopback there).
CLIENT = """
import json, sys, time, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=60)
ids = json.loads(sys.argv[2])
deadline = time.monotonic() + 120
while True:
    try:
        done = c.completions.create(model="tiny", prompt=ids, max_tokens=int(sys.argv[3]),
                                    temperature=0)
        break
    except openai.APIStatusError as exc:
        if exc.status_code != 503 or time.monotonic() > deadline:
            raise
        time.sleep(0.3)
print(json.dumps({"text": done.choices[0].text, "tokens": done.usage.completion_tokens}))
"""


@pytest.fixture(scope="module")
def tiny_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("relay_serve")
    src = synth_gguf.llama_like(root / "llama.gguf", n_layers=6)
    make_package(src, root / "pkg", model_id="acme/tiny-GGUF:Q8_0")
    return root / "pkg"


def _config(root: Path, name: str, listen: str, extra: str) -> str:
    text = node_toml(root, name)
    return text.replace('listen = "127.0.0.1:0"\n', f'listen = "{listen}"\n{extra}', 1)


def _start(lab: NatLab, host: str, root: Path, name: str, args: list[str], toml: str) -> Proc:
    cfg = root / f"{name}.toml"
    cfg.write_text(toml)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    popen = lab.run(
        host,
        [sys.executable, "-m", "mesh_node", *args, "--config", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    proc = Proc(name, popen)  # type: ignore[arg-type]
    threading.Thread(target=_pump, args=(popen.stdout, proc.lines), daemon=True).start()
    threading.Thread(target=_pump, args=(popen.stderr, proc.log), daemon=True).start()
    return proc


def _status(root: Path, name: str) -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mesh_node",
            "status",
            "--config",
            str(root / f"{name}.toml"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


@needs_lab
def test_a_split_across_two_nats_serves_the_reference_tokens_through_the_relay(
    tiny_pkg: Path, tmp_path: Path
) -> None:
    with chain("ggml", tiny_pkg, ["0..6"]) as ch:
        reference = list(ch.generate(IDS, max_tokens=N_TOKENS).tokens)
    with NatLab(f"rs{os.getpid() % 10000}") as lab:
        coord_host = lab.hosts["coord"].address
        # The coordinator, on the public segment, is also the relay (its [relay] table last:
        # a TOML table ends the top-level keys).
        coord_toml = _config(tmp_path, "coord", f"{coord_host}:{PORT}", "")
        coord_toml += '\n[relay]\nenable = true\nallow = "any"\n'
        serve = ["serve", "--package", str(tiny_pkg), "--stages", "3", "--http", "127.0.0.1:0"]
        coord = _start(
            lab, "coord", tmp_path, "coord", [*serve, "--model-name", "tiny"], coord_toml
        )
        coord.address = coord.wait_line("listening ")
        api = coord.wait_line("api ")
        relay = json.dumps([coord.address])
        for name, home in (("w0", "home1"), ("w1", "home2")):
            listen = f"{lab.hosts[home].address}:{PORT}"
            # relayed links stay relayed (direct upgrades: test_direct_processes.py)
            extra = f"peers = {relay}\nrelays = {relay}\ndirect_upgrade = false\n"
            toml = _config(tmp_path, name, listen, extra).replace("peers = []\n", "", 1)
            worker = _start(lab, home, tmp_path, name, ["run"], toml)
            worker.address = worker.wait_line("listening ")
        try:
            out = lab.exec(
                "coord", [sys.executable, "-c", CLIENT, api, json.dumps(IDS), str(N_TOKENS)], 240
            )
        except subprocess.CalledProcessError as exc:
            raise AssertionError(f"{exc.stderr[-2000:]}\n{''.join(coord.log[-30:])}") from None
        got = json.loads(out.strip().splitlines()[-1])
        assert got["tokens"] == N_TOKENS
        w0 = _status(tmp_path, "w0")
        coord_id = coord.address.rsplit("#", 1)[1]
        peers = {p["node_id"]: p for p in w0["peers"] if p["connected"]}
        # w0 reaches the coordinator directly (it dialled out to it) and w1 only through it
        assert peers.pop(coord_id)["link"] == "direct"
        assert [(p["link"], p["relay"]) for p in peers.values()] == [("relayed", coord_id)]
        section = _status(tmp_path, "coord")["relay"]
        assert section["circuits_open"] >= 1 and section["bytes_forwarded"] > 0
        assert got["text"] == _detok(tiny_pkg, reference)  # as on direct links


def _detok(pkg: Path, ids: list[int]) -> str:
    from skippy.runtime.tokenizer import LlamaTokenizer

    with LlamaTokenizer(pkg / "shared" / "metadata.gguf") as tok:
        return tok.detokenize(ids)
