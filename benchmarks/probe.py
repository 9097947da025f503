"""Measurements that need a fresh process: time to first step and peak-RSS growth.

`python -m benchmarks.probe first|rss MODEL ENGINE` prints one JSON object. Each runs in its own
process so that no cache (export, sessions, inductor's compiled code, allocator pools) survives
from an earlier measurement; `run` starts it.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ENGINES = ("eager", "ortmodule", "compile")
STEADY_STEPS = 5
MMAP_THRESHOLD = 64 * 1024
"""glibc returns blocks above this to the system on free (fixed, so its dynamic threshold does not keep
freed tensors resident and hide them from RSS)."""


def run(kind: str, model: str, engine: str, threads: int = 2, timeout: float = 3600) -> dict[str, float]:
    """Run one probe in a fresh interpreter and return its JSON result ({"error": ...} on failure)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), OMP_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory(prefix="bench_inductor_") as cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache  # cold compile: no cached kernels from earlier runs
        try:
            out = subprocess.run([sys.executable, "-m", "benchmarks.probe", kind, model, engine, str(threads)],
                                 capture_output=True, text=True, env=env, timeout=timeout,
                                 cwd=Path(__file__).resolve().parent.parent)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def _rss() -> tuple[int, int]:
    """(current RSS, peak RSS since the last reset) in bytes, from /proc/self/status."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _peak_growth(fn: Callable[[], object]) -> int:
    """Peak RSS while `fn` runs (its result kept alive until the peak is read) above the RSS before it."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before, _ = _rss()
    result = fn()
    _, peak = _rss()
    del result
    return peak - before


def _setup(model_name: str, engine: str, threads: int):
    import torch

    import runtime  # noqa: F401 - imported before any clock starts, like torch itself

    from .models import CASES

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    case = CASES[model_name]
    module = case.make()
    args = case.batch(torch.Generator().manual_seed(0))
    return torch, module, args


def first_step(model_name: str, engine: str, threads: int) -> dict[str, float]:
    """Seconds from the module to the end of its first forward + backward (export, gradient build and
    session creation for ORTModule; tracing and inductor's compile for torch.compile), the median of the next
    steps, and for torch.compile the bytes it saves for backward."""
    torch, module, args = _setup(model_name, engine, threads)
    t0 = time.perf_counter()
    if engine == "ortmodule":
        from runtime import ORTModule

        module = ORTModule(module, threads=threads)
    elif engine == "compile":
        module = torch.compile(module)
    module(*args).backward()
    result = {"first_step": time.perf_counter() - t0}
    params = list(module.parameters())
    times = []
    for _ in range(STEADY_STEPS):
        for p in params:
            p.grad = None
        t1 = time.perf_counter()
        module(*args).backward()
        times.append(time.perf_counter() - t1)
    result["steady_step"] = statistics.median(times)
    if engine == "compile":
        from .measure import graph_saved_bytes

        result["saved"] = graph_saved_bytes(module(*args), [*params, *module.buffers(), *args])
    return result


def rss(model_name: str, engine: str, threads: int) -> dict[str, float]:
    """Peak-RSS growth of a training forward and of a step, after two warm-up steps."""
    torch, module, args = _setup(model_name, engine, threads)
    if engine == "ortmodule":
        from runtime import ORTModule, ort_session

        options = ort_session.SessionConfig.options

        def without_arena(self: ort_session.SessionConfig):  # the arena keeps the largest step's memory mapped
            so = options(self)
            so.enable_cpu_mem_arena = False
            return so

        ort_session.SessionConfig.options = without_arena  # type: ignore[method-assign]
        module = ORTModule(module, threads=threads)
    elif engine == "compile":
        module = torch.compile(module)
    params = list(module.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        module(*args).backward()

    step()
    step()
    for p in params:
        p.grad = None
    forward = _peak_growth(lambda: module(*args))
    for p in params:
        p.grad = None
    full = _peak_growth(step)
    return {"forward_peak": forward, "step_peak": full, "growth": full - forward}


if __name__ == "__main__":
    kind, name, eng, n_threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    fn = {"first": first_step, "rss": rss}[kind]
    print(json.dumps(fn(name, eng, n_threads)))
