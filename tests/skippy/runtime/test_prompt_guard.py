"""The prompt guard: no prompt aborts the process in llama.cpp.

The tiny synthetic vocabulary has no byte-fallback tokens, so llama.cpp aborts on almost any
text it is given. The guard's SentencePiece predicate is checked against llama.cpp itself
(each text tokenized in a child process, where an abort is harmless), and hostile prompts go
through `run` with the llama and ggml engines in this process: each is a coded error, exit 1
or 2, and --json always prints JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from pkgtools import make_package

from skippy.cli import main
from skippy.runtime.prompt_guard import (
    PromptNotEncodable,
    Vocabulary,
    probe_in_child,
    spm_unmerged,
    spm_verdict,
)

pytestmark = pytest.mark.llama


@pytest.fixture(scope="module")
def pkg(synth_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("guard") / "pkg"
    make_package(synth_dir.llama, out)
    return out


@pytest.fixture(scope="module")
def vocab(pkg: Path) -> Vocabulary:
    return Vocabulary.read(pkg / "shared" / "metadata.gguf")


def test_spm_merge_replay() -> None:
    # "bc" scores higher than "ab", so b merges right first, then "abc" from a + bc.
    scores = {"ab": 1.0, "bc": 2.0, "abc": 0.5}
    assert spm_unmerged("abc", scores) == ["abc"]
    assert spm_unmerged("abd", scores) == ["ab", "d"]
    assert spm_unmerged("cab", {"ab": 1.0, "ca": 1.0}) == ["ca", "b"]  # ties: leftmost first
    assert spm_unmerged("", scores) == []


@pytest.mark.parametrize(
    "text,encodable",
    [
        ("Ω Ω", True),  # each "Ω" merges with the escaped space into the token "▁Ω"
        ("a", True),  # "▁a" is a token: the prefix space is swallowed
        ("x", False),  # no token holds "x", and there are no byte tokens
        ("the", False),  # "the" is a token, but "▁" + "the" is not: the prefix stays alone
        ("Ωx", False),
    ],
)
def test_predicate_agrees_with_llama_cpp(
    vocab: Vocabulary, pkg: Path, text: str, encodable: bool
) -> None:
    """The pure predicate says what llama.cpp does: tokenizes, or aborts (in a child)."""
    assert spm_verdict(vocab, text).encodable is encodable
    if encodable:
        probe_in_child(pkg / "shared" / "metadata.gguf", text)
    else:
        with pytest.raises(PromptNotEncodable) as e:
            probe_in_child(pkg / "shared" / "metadata.gguf", text)
        assert "-6" in e.value.message or "exit" in e.value.message  # SIGABRT in the child


HOSTILE = {
    "empty": ("", "empty_prompt"),
    "one-megabyte": ("a" * (1 << 20), "prompt_too_long"),
    "lone-surrogate": ("ab\ud800cd", "invalid_prompt_text"),
    "control-characters": ("\x01\x02\x1b[31m\x7f", "prompt_not_encodable"),
    "every-byte": ("".join(chr(b) for b in range(256)), "prompt_not_encodable"),
    "unknown-letter": ("x", "prompt_not_encodable"),
}


@pytest.mark.parametrize("engine", ["llama", "ggml"])
@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_prompts_are_coded_errors(
    pkg: Path, capsys: pytest.CaptureFixture[str], engine: str, case: str
) -> None:
    prompt, code = HOSTILE[case]
    rc = main(["run", str(pkg), "--engine", engine, "--prompt", prompt, "--json", "--threads", "1"])
    out = json.loads(capsys.readouterr().out)
    assert rc in (1, 2)
    assert out["error"]["code"] == code


@pytest.mark.parametrize("engine", ["llama", "ggml"])
def test_an_encodable_prompt_still_runs(
    pkg: Path, capsys: pytest.CaptureFixture[str], engine: str
) -> None:
    rc = main(
        [
            "run",
            str(pkg),
            "--engine",
            engine,
            "--prompt",
            "Ω Ω",
            "--max-tokens",
            "3",
            "--json",
            "--threads",
            "1",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    assert out["engine"] == engine and len(out["prompt_tokens"]) == 3  # BOS, "▁Ω", "▁Ω"


def test_undecodable_command_line_bytes_in_a_real_process(pkg: Path) -> None:
    """Bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape): refused
    with a code and JSON, in a child process that would show an abort as exit -6."""
    raw = bytes(range(0x80, 0x100)) + b"\x01abc"
    argv = [
        os.fsencode(sys.executable),
        b"-m",
        b"skippy.cli",
        b"run",
        os.fsencode(pkg),
        b"--prompt",
        raw,
        b"--json",
    ]
    proc = subprocess.run(argv, capture_output=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert json.loads(proc.stdout)["error"]["code"] == "invalid_prompt_text"
    text = subprocess.run(
        [sys.executable, "-m", "skippy.cli", "run", str(pkg), "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert text.returncode == 2
    assert "error [prompt_not_encodable]" in text.stderr and "Traceback" not in text.stderr
