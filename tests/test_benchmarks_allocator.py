"""benchmarks.allocator: with glibc's thresholds fixed, a freed 4 MB block is reused, not faulted in anew."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import resource, sys
import numpy as np
from benchmarks import allocator
if sys.argv[1] == "steady":
    assert allocator.steady()
np.ones(1 << 20, np.float32)  # one warm-up allocation and free
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    a = np.ones(1 << 20, np.float32)  # 4 MB: above glibc's starting mmap threshold
    del a
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=ROOT, check=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_steady_allocator_keeps_freed_blocks():
    default, steady = _faults("default"), _faults("steady")
    # with glibc's defaults the loop faults hundreds of pages in (the block mapped anew, or the heap's top trimmed
    # and regrown); fixed, the heap keeps the block and the loop faults (almost) nothing
    assert steady < 50, steady
    assert default > steady + 100, (default, steady)
