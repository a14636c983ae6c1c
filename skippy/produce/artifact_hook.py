"""The publisher's after-artifact hook (spec "v2 hook"), for both schema versions.

``--after-artifact-command CMD`` runs CMD (split like a shell would, but no shell) after each
artifact is written and verified, with ``SKIPPY_PACKAGE_ARTIFACT_PATH`` (absolute) and
``SKIPPY_PACKAGE_ARTIFACT_RELATIVE_PATH`` (package-relative) in its environment. A non-zero
exit aborts the write (``artifact_hook_failed``). The hook may delete the file (upload and
delete keeps local disk bounded for a model larger than the disk); a file it leaves must be
unchanged (``artifact_changed_by_hook``): the manifest records the bytes that were verified.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from skippy.constants import ENV_ARTIFACT_PATH, ENV_ARTIFACT_RELATIVE_PATH
from skippy.errors import SkippyError, UsageError


class ArtifactHookFailed(SkippyError):
    """The publisher's hook refused an artifact (exit 1: the package is not complete)."""

    code = "artifact_hook_failed"


@dataclass(frozen=True)
class ArtifactHook:
    argv: tuple[str, ...]

    @classmethod
    def parse(cls, command: str | None) -> ArtifactHook | None:
        if command is None:
            return None
        try:
            argv = shlex.split(command)
        except ValueError as exc:
            raise UsageError(
                f"--after-artifact-command {command!r} cannot be split: {exc}", code="usage"
            ) from None
        if not argv:
            raise UsageError("--after-artifact-command must name a command", code="usage")
        return cls(tuple(argv))

    def run(self, out_dir: Path, rel: str) -> None:
        """Run the hook for ``rel``; raise ``ArtifactHookFailed`` on a non-zero exit or when
        it changed (rather than removed) the file."""
        path = (out_dir / rel).absolute()
        before = _stamp(path)
        env = {**os.environ, ENV_ARTIFACT_PATH: str(path), ENV_ARTIFACT_RELATIVE_PATH: rel}
        try:
            done = subprocess.run(list(self.argv), env=env, check=False)
        except OSError as exc:
            raise ArtifactHookFailed(
                f"artifact hook {self.argv[0]!r} could not run for {rel}: {exc.strerror or exc}",
                path=rel,
                remediation="pass an executable (and its arguments) to --after-artifact-command",
            ) from None
        if done.returncode != 0:
            raise ArtifactHookFailed(
                f"artifact hook {self.argv[0]!r} failed for {rel} with status {done.returncode}; "
                "the package was not completed (no model-package.json was written)",
                path=rel,
                actual=done.returncode,
                remediation="fix the hook, then rerun with --resume-existing-artifacts to reuse "
                "the artifacts already verified",
            )
        after = _stamp(path)
        if after is not None and after != before:
            raise ArtifactHookFailed(
                f"{rel} changed after artifact hook; the manifest would name other bytes",
                code="artifact_changed_by_hook",
                path=rel,
                remediation="a hook may upload or delete an artifact, never modify it",
            )


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def run_hooks(hook: ArtifactHook | None, out_dir: Path, rels: Sequence[str]) -> None:
    if hook is not None:
        for rel in rels:
            hook.run(out_dir, rel)
