"""Fuzz the loader and builder for a bounded time: only GradBuilderError (or success) may come out.

With atheris (the dev extra installs it where a wheel exists) the harness fuzz_build.py runs in a subprocess
for GRADBUILDER_FUZZ_SECONDS (default 20), coverage-guided, half byte mutations and half structural ones.
Without it, hypothesis drives the same byte and structural mutations in process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import fuzz_models
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HERE = Path(__file__).resolve().parent
SECONDS = int(os.environ.get("GRADBUILDER_FUZZ_SECONDS", "20"))
SEEDS = [m.SerializeToString() for m in fuzz_models.seeds().values()]


def test_seeds_build():
    """The seeds are valid models that build: mutations start from the deep end of the pipeline."""
    for data in SEEDS:
        fuzz_models.check(data)


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris is not installed")
def test_atheris(tmp_path):
    corpus, artifacts = tmp_path / "corpus", tmp_path / "artifacts"
    artifacts.mkdir()
    cmd = [sys.executable, str(HERE / "fuzz_build.py"), str(corpus), f"-max_total_time={SECONDS}",
           f"-artifact_prefix={artifacts}/", "-rss_limit_mb=4096", "-timeout=20", "-print_final_stats=1"]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=SECONDS + 120)
    found = sorted(artifacts.iterdir())
    tail = "\n".join(p.stderr.splitlines()[-60:])
    assert p.returncode == 0 and not found, (
        f"the fuzzer found an input that raises something other than GradBuilderError (or hangs): {found}\n"
        f"reproduce with: gradbuilder build {found[0] if found else '<crash file>'} -o /tmp/out.onnx --debug\n{tail}")
    assert "Done" in p.stderr and " runs in " in p.stderr, tail


@pytest.mark.skipif(importlib.util.find_spec("atheris") is not None, reason="atheris fuzzes instead")
@settings(max_examples=2000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(seed=st.sampled_from(SEEDS), structural=st.lists(st.integers(0, 2**31 - 1), max_size=4),
       flips=st.lists(st.tuples(st.integers(0, 4095), st.integers(0, 255)), max_size=4),
       cut=st.none() | st.integers(0, 4095))
def test_hypothesis_mutations(seed, structural, flips, cut):
    data = seed
    for s in structural:
        data = fuzz_models.mutate_bytes(data, s) or data
    buf = bytearray(data)
    for pos, value in flips:
        if buf:
            buf[pos % len(buf)] = value
    fuzz_models.check(bytes(buf[:cut] if cut is not None else buf))
