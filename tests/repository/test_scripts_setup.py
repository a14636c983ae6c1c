"""What the entry scripts install outside the checkout: ``scripts/_setup.sh`` (sourced by
scripts/demo, scripts/test and scripts/bench) installs nothing system-wide, and only
scripts/test's ``scripts/_machine.sh`` runs apt-get, for the machine packages some tests need
(the page's browser test's chromium, the NAT lab's nftables): in CI without asking, elsewhere
after saying what it would install and asking.

The scripts run for real in bash, on a PATH that holds only what they need and stand-ins
for the machine's ``apt-get``, ``sudo`` and ``id`` that write each call to a log (nothing
is installed, and the scripts cannot see a browser the machine may have)."""

from __future__ import annotations

import hashlib
import os
import pty
import select
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash") or "/bin/bash"
INSTALL = "apt-get install -y -qq chromium chromium-driver"


@dataclass(frozen=True)
class Machine:
    bin: Path  # the only folder on PATH
    log: Path  # the stand-ins' calls and the scripts' stderr, in order

    def env(self, **extra: str) -> dict[str, str]:
        return {"PATH": str(self.bin), "HOME": str(self.bin.parent), "STUB_LOG": str(self.log),
                "VENV": str(self.bin.parent), **extra}  # fmt: skip

    def calls(self, tool: str) -> list[str]:
        text = self.log.read_text() if self.log.exists() else ""
        return [line for line in text.splitlines() if line.startswith(f"{tool} ")]


def _stub(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    """A root user's machine with no browser: what made the old setup run apt-get."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("cat", "dirname", "mkdir", "stat", "head"):
        found = shutil.which(tool)
        assert found is not None, tool
        os.symlink(found, bin_dir / tool)
    _stub(bin_dir / "apt-get", 'echo "apt-get $*" >> "$STUB_LOG"')
    _stub(bin_dir / "sudo", 'echo "sudo $*" >> "$STUB_LOG"; exit 1')
    _stub(bin_dir / "id", 'echo "id $*" >> "$STUB_LOG"; echo "${STUB_UID:-0}"')
    return Machine(bin_dir, tmp_path / "calls.log")


def test_the_setup_every_script_sources_never_runs_apt_get(tmp_path: Path, machine: Machine):
    """scripts/demo's setup (the same _setup.sh as scripts/test's) on an up-to-date venv: no
    apt-get, no sudo, even as root on a machine without chromium."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    for name in ("scripts/_setup.sh", "pyproject.toml"):
        shutil.copyfile(REPO / name, root / name)
    for package in ("skippy", "mesh_node", "protocol"):
        (root / package).mkdir()  # what it byte-compiles: nothing to compile here
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    digest = hashlib.sha256(
        (root / "pyproject.toml").read_bytes() + (root / "scripts/_setup.sh").read_bytes()
    ).hexdigest()
    (venv / ".skippy-installed").write_text(digest + "\n")  # installed: pip is not run
    with machine.log.open("ab") as err:
        done = subprocess.run(
            [BASH, "-c", 'source "$1"; echo "work=$WORK"', "_", str(root / "scripts/_setup.sh")],
            env=machine.env(SKIPPY_VENV=str(venv), SKIPPY_WORK=str(tmp_path / "work")),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True,
            timeout=120,
        )  # fmt: skip
    assert done.returncode == 0, machine.log.read_text()
    assert done.stdout.strip() == f"work={tmp_path / 'work'}"  # it ran to its end
    assert machine.calls("apt-get") == [] and machine.calls("sudo") == []
    assert "chromium" not in machine.log.read_text()


def _ensure_browser(machine: Machine, **env: str) -> subprocess.CompletedProcess[str]:
    with machine.log.open("ab") as err:
        return subprocess.run(
            [BASH, "-c", 'set -euo pipefail; source "$1"; ensure_test_browser; echo done', "_",
             str(REPO / "scripts/_machine.sh")],
            env=machine.env(**env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=err, text=True, timeout=60,
        )  # fmt: skip


def test_ci_installs_the_browser_after_saying_what_it_installs(machine: Machine):
    done = _ensure_browser(machine, CI="true")
    assert done.returncode == 0 and done.stdout == "done\n"
    lines = machine.log.read_text().splitlines()
    assert machine.calls("apt-get") == ["apt-get update -qq", INSTALL]
    said = next(i for i, line in enumerate(lines) if "chromium chromium-driver" in line)
    assert said < lines.index("apt-get update -qq")  # told first
    assert "system-wide" in lines[said]


@pytest.mark.parametrize(
    ("env", "installs"),
    [
        ({}, False),  # a developer's scripts/test with no terminal: told how, nothing run
        ({"CI": "false"}, False),
        ({"SKIPPY_INSTALL_BROWSER": "1"}, True),
        ({"CI": "true", "SKIPPY_INSTALL_BROWSER": "0"}, False),
    ],
)
def test_outside_ci_apt_get_runs_only_when_asked(
    machine: Machine, env: dict[str, str], installs: bool
):
    done = _ensure_browser(machine, **env)
    assert done.returncode == 0 and done.stdout == "done\n"
    assert machine.calls("apt-get") == (["apt-get update -qq", INSTALL] if installs else [])
    text = machine.log.read_text()
    assert "chromium chromium-driver" in text
    if not installs:
        assert "the browser test will skip" in text


@pytest.mark.parametrize(("answer", "installs"), [("y", True), ("n", False), ("", False)])
def test_on_a_terminal_it_asks_first(machine: Machine, answer: str, installs: bool):
    parent, child = pty.openpty()
    proc = subprocess.Popen(
        [BASH, "-c", 'source "$1"; ensure_test_browser', "_", str(REPO / "scripts/_machine.sh")],
        env=machine.env(), stdin=child, stdout=child, stderr=child, close_fds=True,
    )  # fmt: skip
    os.close(child)
    seen = b""
    try:
        while b"[y/N]" not in seen:
            ready, _, _ = select.select([parent], [], [], 30)
            assert ready, f"no question within 30 s: {seen!r}"
            seen += os.read(parent, 4096)
        assert machine.calls("apt-get") == []  # nothing before the answer
        os.write(parent, answer.encode() + b"\n")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(parent)
    assert b"chromium chromium-driver" in seen
    assert machine.calls("apt-get") == (["apt-get update -qq", INSTALL] if installs else [])


def test_without_root_or_sudo_nothing_is_tried(machine: Machine):
    done = _ensure_browser(machine, CI="true", STUB_UID="1000")
    assert done.returncode == 0
    assert machine.calls("apt-get") == [] and machine.calls("sudo") == ["sudo -n true"]
    assert "no root to install them" in machine.log.read_text()


def test_ci_installs_nftables_for_the_nat_lab(machine: Machine):
    with machine.log.open("ab") as err:
        done = subprocess.run(
            [BASH, "-c", 'set -euo pipefail; source "$1"; ensure_nftables; echo done', "_",
             str(REPO / "scripts/_machine.sh")],
            env=machine.env(CI="true"), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=err, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 0 and done.stdout == "done\n"
    assert machine.calls("apt-get") == ["apt-get update -qq", "apt-get install -y -qq nftables"]
    assert "the NAT lab tests: needs Debian's nftables" in machine.log.read_text()


def test_a_machine_with_the_browser_is_left_alone(machine: Machine):
    for tool in ("chromium", "chromedriver"):
        _stub(machine.bin / tool, "exit 0")
    done = _ensure_browser(machine, CI="true")
    assert done.returncode == 0 and machine.calls("apt-get") == []
    assert not machine.log.exists() or "chromium" not in machine.log.read_text()
