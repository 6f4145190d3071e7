"""perf.tune_allocator: a process that allocates and frees the same buffers every step reuses them instead of
faulting fresh pages in (glibc only)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="tunes glibc's malloc"
)

# Ten "steps", each touching buffers of 1.2-36 MB and freeing them; prints the minor page faults they cost.
PROBE = """
import resource, sys
import torch
if sys.argv[1] == "tuned":
    from llmkit.machine.perf import tune_allocator
    assert tune_allocator()
def step():
    buffers = [torch.empty(n).fill_(1.0) for n in (300_000, 1_200_000, 700_000, 2_500_000, 9_000_000)]
    return torch.cat([b[:1000] for b in buffers])
step(), step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=300)
    return int(out.stdout.strip().splitlines()[-1])


def test_tuned_processes_reuse_freed_buffers():
    touched = (300_000 + 1_200_000 + 700_000 + 2_500_000 + 9_000_000) * 4 // 4096 * 10  # pages the steps write
    assert _faults("default") > touched // 2  # glibc maps large buffers afresh and unmaps them when freed
    assert _faults("tuned") < touched // 10
