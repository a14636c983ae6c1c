"""Progress bars: shown on a terminal for every long operation, never when
stderr is not a terminal and never with --json. A real pseudo-terminal, a real child process."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from pkgtools import make_package

REPO_ROOT = Path(__file__).resolve().parents[2]


def _stderr_of(argv: list[str], *, tty: bool) -> tuple[int, str]:
    """Run the CLI in a child with stderr on a pseudo-terminal (or a pipe); return its
    exit code and everything it wrote to stderr."""
    cmd = [sys.executable, "-m", "skippy.cli", *argv]
    if not tty:
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
        return done.returncode, done.stderr
    master, slave = pty.openpty()
    # A terminal of 100 columns: a pty starts at 0x0, where tqdm draws nothing.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 30)
        if not ready:
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=30), b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def pkg(synth_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("progress") / "pkg"
    make_package(synth_dir.llama, out)
    return out


def _commands(synth_dir, pkg: Path, tmp: Path) -> list[tuple[list[str], str]]:
    write = ["write-package", str(synth_dir.llama), "--out-dir", str(tmp / "w")]
    write += ["--model-id", "acme/tiny-GGUF:Q8_0", "--source-revision", "r"]
    write += ["--source-file", "m.gguf"]
    return [
        (write, "write-package"),
        (["validate-package", str(synth_dir.llama), str(pkg)], "validate-package"),
        (["preflight", str(pkg), "--verify-sha256"], "sha256"),
        (["select", str(pkg), "--layers", "0..2"], "sha256"),
        (
            ["materialize", str(pkg), "--layers", "0..2", "--out", str(tmp / "m.gguf")],
            "materialize",
        ),
    ]


def test_long_operations_draw_a_bar_on_a_terminal(synth_dir, pkg, tmp_path):
    for argv, label in _commands(synth_dir, pkg, tmp_path):
        code, err = _stderr_of(argv, tty=True)
        assert code == 0, (argv, err)
        assert label in err and "%|" in err, (argv, err)


def test_no_bar_without_a_terminal_or_with_json(synth_dir, pkg, tmp_path):
    for argv, _ in _commands(synth_dir, pkg, tmp_path / "a"):
        (tmp_path / "a").mkdir(exist_ok=True)
        code, err = _stderr_of(argv, tty=False)
        assert code == 0 and "%|" not in err, (argv, err)
    for argv, _ in _commands(synth_dir, pkg, tmp_path / "b"):
        (tmp_path / "b").mkdir(exist_ok=True)
        code, err = _stderr_of([*argv, "--json"], tty=True)
        assert code == 0 and "%|" not in err, (argv, err)
