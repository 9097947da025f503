"""benchmarks.ab: a lever measured one module a process, alternating with the baseline's processes."""

import re

import pytest

from benchmarks import ab
from runtime import workload


def test_settings_parse_and_apply_in_their_module(monkeypatch) -> None:
    monkeypatch.setattr(workload, "SMALL", workload.SMALL)  # restored after the test
    s = ab.Setting.parse(" runtime.workload : SMALL = SMALL * 2 + GEMM_WEIGHT ")
    assert (s.module, s.attr, s.expr) == ("runtime.workload", "SMALL", "SMALL * 2 + GEMM_WEIGHT")
    expected = workload.SMALL * 2 + workload.GEMM_WEIGHT
    s.apply()
    assert expected == workload.SMALL
    for bad in ("runtime.workload:SMALL", "SMALL=1", "runtime.workload:=1", ":SMALL=1", "runtime.workload:SMALL="):
        with pytest.raises(ValueError, match="MODULE:ATTR=EXPR"):
            ab.Setting.parse(bad)
    with pytest.raises(AttributeError, match="no attribute 'SMAL'"):
        ab.Setting.parse("runtime.workload:SMAL=1").apply()


def test_the_lever_reaches_its_processes() -> None:
    """The lever's process measures with its settings in place until the end (each one's value read back there),
    the baseline's without them; `compare` alternates one process of each and tabulates their ratios. (The ratios
    themselves are the benchmark's business: a timed assertion here failed on a crowded machine.)"""
    lever = [ab.Setting.parse("runtime.workload:SMALL=0"), ab.Setting.parse("runtime.openmp:_LOADAVG='/nonexistent'")]
    assert ab._child("tiny-mlp", lever, 5, 2)["applied"] == {str(lever[0]): "0",
                                                              str(lever[1]): "'/nonexistent'"}
    assert ab._child("tiny-mlp", [], 5, 2)["applied"] == {}
    results = ab.compare(["tiny-mlp"], lever, rounds=1, reps=5, threads=2)
    ratios = results["tiny-mlp"]
    assert len(ratios["baseline"]) == len(ratios["lever"]) == 1 and all(r > 0 for r in ratios["lever"])
    assert all(c in ("near", "far", "mixed", "") for c in ratios["baseline_cpus"] + ratios["lever_cpus"])
    assert "| tiny-mlp |" in ab.table(results)


def test_a_failing_process_names_its_setting() -> None:
    with pytest.raises(RuntimeError, match=re.escape("runtime.workload:SMALL=no_such_name")):
        ab.compare(["tiny-mlp"], [ab.Setting.parse("runtime.workload:SMALL=no_such_name")], rounds=1, reps=5,
                   threads=2)


def test_paired_mode_alternates_the_settings_after_torch_steps(monkeypatch) -> None:
    """`--paired`: each ORTModule step comes right after a torch step, under the lever's value or the baseline's,
    which goes first alternating by round (a fixed rotation made one of them follow torch's step two times in
    three); the baseline's value is back afterwards, and the ratio pairs the two by round."""
    from benchmarks import allocator, measure

    calls: list[str] = []

    def fake_stepper(model, args):
        def step() -> float:
            if model == "torch":
                calls.append("torch")
                return 1.0
            calls.append(f"ort={workload.SMALL}")
            return 3.0 if workload.SMALL == -1 else 2.0

        return step

    monkeypatch.setattr(allocator, "steady", lambda: None)
    monkeypatch.setattr(measure, "_pair", lambda case, threads, seed: ("ort", "torch", ()))
    monkeypatch.setattr(measure, "stepper", fake_stepper)
    monkeypatch.setattr(workload, "SMALL", workload.SMALL)
    base = workload.SMALL
    result = ab.paired_here("tiny-mlp", [ab.Setting.parse("runtime.workload:SMALL=-1")], reps=4, threads=2)
    assert base == workload.SMALL
    assert calls[0::2] == ["torch"] * (len(calls) // 2)  # every ORTModule step follows a torch step
    firsts = calls[1::4]
    assert firsts == [f"ort={base}" if r % 2 == 0 else "ort=-1" for r in range(len(firsts))]
    assert sorted(set(calls[1::2])) == sorted({f"ort={base}", "ort=-1"})
    assert result["ratio"] == 1.5 and result["lever"] == 3.0 and result["baseline"] == 2.0
    assert len(calls) == 4 * (ab.PAIRED_WARMUP + 4)


def test_paired_mode_reaches_its_processes() -> None:
    lever = [ab.Setting.parse("runtime.workload:SMALL=0")]
    results = ab.compare_paired(["tiny-mlp"], lever, rounds=1, reps=3, threads=2)
    assert len(results["tiny-mlp"]) == 1 and results["tiny-mlp"][0] > 0
    assert "| tiny-mlp |" in ab.paired_table(results)
