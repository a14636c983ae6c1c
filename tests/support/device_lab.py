"""A serving lab whose last node runs its stage on a device with the experts on the CPU:
``python tests/support/device_lab.py PACKAGE DIR``; the report (with ``api``) is printed as one JSON
line on stdout when the split serves, and the lab stays up until SIGINT."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import trio

from mesh_node.lab.page import run_lab_with_page
from mesh_node.lab.run import LabOptions

DEVICE_NODE = 2


def main(package: str, root: Path) -> int:
    env = {
        "GGML_VK_VISIBLE_DEVICES": "0",
        "MESA_SHADER_CACHE_DIR": os.environ.get(
            "MESA_SHADER_CACHE_DIR", str(Path(tempfile.gettempdir()) / "skippy-mesa-shader-cache")
        ),
    }
    options = LabOptions(
        nodes=3,
        package=package,
        serve=True,
        root=root,
        timeout_s=600,
        node_overrides={DEVICE_NODE: {"runtime": {"device": "Vulkan0", "cpu_moe": True}}},
        node_env={DEVICE_NODE: env},
    )

    def on_report(report: dict[str, object]) -> None:
        print(json.dumps(report), flush=True)

    try:
        trio.run(lambda: run_lab_with_page(options, "127.0.0.1:0", on_page=lambda _: None,
                                           on_report=on_report))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
