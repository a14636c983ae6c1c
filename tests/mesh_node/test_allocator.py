"""mesh_node.allocator: freed streaming buffers stay in the heap (no page faults to reuse them).

Measured by the page faults a fresh process takes while it allocates, fills and frees buffers
of 1..6 MiB (the sizes a link's messages and file chunks have), with and without the tuning:
a count of kernel events, not a time.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_PROBE = """
import resource, sys
if sys.argv[1] == "tuned":
    from mesh_node.allocator import tune_for_streaming
    assert tune_for_streaming()
src = b"\\x01" * (7 << 20)
sizes = [(1 << 20) * k + 4096 * j for j in range(8) for k in (1, 3, 6)]
for s in sizes[:6]:  # let glibc's dynamic thresholds settle first
    b = bytes(memoryview(src)[:s]); del b
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for s in sizes:
    b = bytes(memoryview(src)[:s])  # every page written
    del b
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, sum(sizes) // 4096)
"""

needs_glibc = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's; elsewhere nothing is tuned"
)


def _faults(mode: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], check=True, capture_output=True, text=True
    ).stdout.split()
    return int(out[0]), int(out[1])


@needs_glibc
def test_tuned_process_reuses_freed_buffers_without_page_faults():
    tuned, pages = _faults("tuned")
    default, _ = _faults("default")
    assert tuned < pages // 1000  # the freed buffers come back from the heap
    assert default > 10 * max(tuned, 1)  # and glibc's defaults do fault them in again
