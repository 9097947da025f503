"""Where the machine's first two CPUs sit relative to each other: the round trip of a cache line between two
threads pinned one to each (`placement.c`, built once with the system's C compiler and run in its own process).

On the AVX-512 EPYC VM of sessions 45-47 this round trip reads one of two levels: 55-70 ns (near) or 330-370 ns
(far), and the level changes every 10-70 s. Two-thread runs slow down by up to 2.4x while the CPUs sit far apart:
each op's data, written by both threads, moves between the CPUs' caches. torch's steps slow by less. A case's
ratio therefore depends on the placement during its few seconds, so the benchmark reads it before and after each
case, and `benchmarks.ab` around each process.

Not in Python: two Python loops over shared memory read 220-400 ns near and 410-750 far, the levels drifting with
the machine's speed, so they overlapped. Not in the benchmark's own process: there, torch's spinning OpenMP
workers would hold the CPUs (session 46's readings from inside a benchmark were meaningless). Without a C compiler,
or with fewer than two CPUs, there is no reading (None) and the tables leave the column empty.

`python -m benchmarks.placement` prints one reading in ns.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

FAR_NS = 200.0
"""A round trip above this reads as the CPUs far apart (near 55-70 ns, at most ~160 under load; far 320+)."""
TIMEOUT = 10.0
SOURCE = Path(__file__).with_name("placement.c")


def _program() -> Path | None:
    """The probe, built on first use into this user's cache directory (not a shared temp directory, where another
    user could leave a program under its name), under a name that changes with its source."""
    source = SOURCE.read_bytes()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gradbuilder"
    path = cache / f"placement-{hashlib.sha256(source).hexdigest()[:16]}"
    if path.exists():
        return path
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return None
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([compiler, "-O2", "-pthread", "-o", str(partial), str(SOURCE)], check=True,
                       capture_output=True, timeout=60)
        os.replace(partial, path)  # atomic: a concurrent build's reader never sees half a file
    except (subprocess.SubprocessError, OSError):
        partial.unlink(missing_ok=True)
        return None
    return path


def read(timeout: float = TIMEOUT) -> float | None:
    """The round trip in ns; None where fewer than two CPUs are allowed, no C compiler is found, or the probe
    fails or times out."""
    if len(os.sched_getaffinity(0)) < 2:
        return None
    program = _program()
    if program is None:
        return None
    try:
        out = subprocess.run([str(program)], capture_output=True, text=True, timeout=timeout)
        return float(out.stdout.split()[-1]) if out.returncode == 0 and out.stdout.strip() else None
    except (subprocess.TimeoutExpired, ValueError, OSError):
        return None


def around(run: Callable[[], T]) -> tuple[T, dict[str, Any]]:
    """`run()`'s result, and the placement read before and after it: its round trips and what they say (`state`),
    as the benchmark's cases and `benchmarks.ab`'s processes record them."""
    before = read()
    result = run()
    after = read()
    return result, {"round_trip": [before, after], "cpus": state(before, after)}


def state(before: float | None, after: float | None) -> str:
    """'near' or 'far' where both readings say so, 'mixed' where they differ, '' without readings."""
    if before is None or after is None:
        return ""
    far = (before > FAR_NS, after > FAR_NS)
    return "far" if all(far) else "near" if not any(far) else "mixed"


if __name__ == "__main__":
    ns = read()
    print("no reading (fewer than two CPUs, or no C compiler)" if ns is None else f"{ns:.1f}")
