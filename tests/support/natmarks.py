"""The NAT lab tests' mark: they need root, ``ip`` and ``nft`` (mesh_node.lab.netns). In CI
(CI=true) they always run, and a missing tool fails them; elsewhere they are skipped with
what is missing."""

from __future__ import annotations

import os

import pytest

from mesh_node.lab import netns

LACKING = netns.missing()
needs_lab = pytest.mark.skipif(
    bool(LACKING) and os.environ.get("CI") != "true", reason="; ".join(LACKING) or "ok"
)
