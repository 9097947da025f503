import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# The suite runs in two xdist workers on two cores: one intra-op thread each keeps torch from
# oversubscribing the machine (timing never matters in tests; benchmarks set their own threads).
import torch

torch.set_num_threads(1)

import zlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _inputs_per_test(request):
    """A test module's shared `rng`, and torch's default generator, restart for each test from a seed of the
    test's id: the inputs then no longer depend on which tests ran before it on the same xdist worker, which
    made float32 comparisons fail now and then (a finite-difference check of MeanVarianceNormalization, one run
    in seven; a BatchNorm gradient at 3e-6 of its 9.7 once Dropout masks started drawing from torch's
    generator)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    module = request.module
    if isinstance(getattr(module, "rng", None), np.random.Generator):
        module.rng = np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _machine_load_unknown(monkeypatch):
    """Runs on 2+ threads park torch's workers or narrow to one thread by the machine's load now
    (`runtime.openmp.room`), and the suite's own xdist workers load it: tests see a machine whose load cannot be
    read (as without /proc/loadavg), so their runs do not depend on what the other worker is doing; the tests of
    that decision set the load themselves. Each run decides anew (no `ROOM_SECONDS` window), as those tests count."""
    from runtime import openmp

    monkeypatch.setattr(openmp, "_LOADAVG", "/nonexistent/loadavg")
    monkeypatch.setattr(openmp, "ROOM_SECONDS", 0.0)
    monkeypatch.setattr(openmp, "FRESH_SECONDS", 0.0)  # tests setting the load count every thread themselves
    openmp._forget()  # nor one made by an earlier test
