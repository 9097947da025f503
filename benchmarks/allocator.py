"""glibc's allocator in its steady state for the timing runs, so that torch eager is timed at its best.

torch's CPU tensors come from malloc. glibc serves blocks above its mmap threshold (128 KB at start) with a
fresh mmap, returns them with munmap, and gives the top of its heap back to the system past a trim threshold:
every step then faults its larger tensors in again, page by page. Both thresholds rise by themselves once a
large enough block has been freed, so torch's step time depended on what ran before it in the process: LeNets'
steps took 4.9-5.2 ms alone in a fresh process and 3.2-3.5 ms once a batch-256 LeNet had run before them (or with
both thresholds raised), and the reference CNN's paired ratio against ORTModule read 0.91 or 1.08 for the same code
(onnxruntime's arena keeps its memory; its steps did not move). Fixing both thresholds high before anything is
measured puts every model in the state a long training process reaches, the one where torch is fastest. The
peak-RSS probes set their own (low) threshold.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024
"""glibc's largest mmap threshold on 64-bit (HEAP_MAX / 2): blocks up to this size come from the heap."""
TRIM_THRESHOLD = 8 * MMAP_THRESHOLD
"""Free memory at the heap's top kept rather than returned (glibc's own rule keeps twice the mmap threshold)."""


def steady() -> bool:
    """Fix glibc's mmap and trim thresholds high for this process; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
