"""benchmarks.placement: where the machine's first two CPUs sit, read around each benchmark case."""

import os
import shutil

import pytest

from benchmarks import ab, placement


def test_a_reading_comes_from_its_own_process(tmp_path, monkeypatch) -> None:
    """Built into the user's cache directory (here a fresh one) and run there, not in this process, which has
    torch's and onnxruntime's threads. No reading with fewer than two CPUs or without a C compiler."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ns = placement.read()
    if len(os.sched_getaffinity(0)) < 2 or not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
                                                 or shutil.which("clang")):
        assert ns is None
        return
    if placement._program() is None:
        pytest.skip("this machine's C compiler could not build the probe (the benchmark leaves the column empty)")
    assert ns is not None and 10 < ns < 1e6
    assert [p.name.split("-")[0] for p in (tmp_path / "gradbuilder").iterdir()] == ["placement"]  # no partial left
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other"))
    assert placement.read() is None  # a compiler that fails: no reading, no error


def test_a_case_is_near_or_far_only_where_both_readings_say_so() -> None:
    near, far = placement.FAR_NS / 2, placement.FAR_NS * 2
    assert placement.state(near, near) == "near"
    assert placement.state(far, far) == "far"
    assert placement.state(near, far) == placement.state(far, near) == "mixed"
    assert placement.state(None, near) == placement.state(far, None) == ""


def test_the_lever_table_splits_the_processes_by_placement() -> None:
    results = {"mlp": {"baseline": [1.0, 1.2, 1.5], "lever": [0.9, 1.1, 1.3],
                       "baseline_cpus": ["near", "near", "far"], "lever_cpus": ["near", "mixed", "far"]}}
    row = ab.table(results).splitlines()[-1]
    assert "| 1.100 / 0.900 (2 / 1) |" in row  # near: medians of 1.0, 1.2 and of 0.9
    assert "| 1.500 / 1.300 (1 / 1) |" in row
    bare = {"mlp": {"baseline": [1.0], "lever": [0.9]}}  # results without readings: empty cells
    assert ab.table(bare).splitlines()[-1].endswith("| 0.900 |  |  |")


def test_a_setting_without_processes_in_a_state_shows_a_dash() -> None:
    r = {"baseline": [1.0], "lever": [0.9], "baseline_cpus": ["near"], "lever_cpus": ["far"]}
    assert ab._placed(r, "near") == "1.000 / - (1 / 0)"
    assert ab._placed(r, "far") == "- / 0.900 (0 / 1)"


def test_each_case_of_the_grid_records_where_the_cpus_sat() -> None:
    from benchmarks.__main__ import ratios
    from benchmarks.models import CASES

    entry = ratios({"tiny-mlp": CASES["tiny-mlp"]}, threads=2, reps=3)["tiny-mlp"]
    before, after = entry["round_trip"]
    assert entry["cpus"] == placement.state(before, after)
    if len(os.sched_getaffinity(0)) >= 2:
        assert entry["cpus"] in ("near", "far", "mixed")
