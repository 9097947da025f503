"""runtime.ort_session.Trial: where the forward's work leaves the thread count open, runs time both sessions and
keep the faster, with the same results either way."""

from __future__ import annotations

import copy
import types

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from runtime import ORTModule, exchange, ort_session, workload
from runtime.engine import Options
from runtime.export import ExportOptions
from runtime.ort_session import Runner, SessionConfig, Trial, TrialSettings


def _schedule(trial: Trial, wide: float, narrow: float) -> tuple[list[int | None], int]:
    """Run a trial to its verdict with constant times per arm: the arm of each run (None while not due), and the
    verdict."""
    arms: list[int | None] = []
    while True:
        if not trial.due():
            arms.append(None)
            continue
        arm = trial.arm
        arms.append(arm)
        verdict = trial.record(arm, narrow if arm else wide)
        if verdict is not None:
            return arms, verdict


@pytest.mark.parametrize(("wide", "narrow", "expected", "visits"),
                         [(1.1, 1.0, 1, 2), (1.04, 1.0, 0, 2), (1.0, 1.1, 0, 1), (1.0, 1.02, 0, 1)])
def test_a_trial_keeps_the_faster_arm_after_visits_to_both(wide: float, narrow: float, expected: int,
                                                           visits: int) -> None:
    """One thread only where it is `margin` times faster (1.04 against 1.0: the configured threads). Where the
    one-thread session's fastest run is no faster than the configured threads' median, one visit to each decides,
    as where they are `apart` (1.02 against 1.0: it could not win)."""
    trial = Trial(TrialSettings.now(delay=3, warmup=1, runs=4, review=5, visit=3, apart=1.2, margin=1.05))
    arms, verdict = _schedule(trial, wide, narrow)
    assert verdict == expected and trial.chosen == expected
    # the delay, then visits of three runs (the first untimed; the one-thread session's first visit one longer)
    first = [0, 0, 0, 1, 1, 1, 1]
    assert arms == [None] * 3 + first + [0, 0, 0, 1, 1, 1] * (visits - 1)
    again, verdict = _schedule(trial, wide, narrow)  # reviewed after `review` runs, both sessions warm
    assert verdict == expected
    assert again == [None] * 5 + [0, 0, 0, 1, 1, 1] * visits


@pytest.mark.parametrize(("wide", "narrow", "expected"), [(1.2, 1.0, 1), (1.0, 1.2, 0)])
def test_sessions_far_apart_are_told_apart_by_half_the_runs(wide: float, narrow: float, expected: int) -> None:
    """Every timed run of one session `apart` times faster than the other's: one visit to each decides."""
    trial = Trial(TrialSettings.now(delay=3, warmup=1, runs=4, review=5, visit=3, apart=1.2))
    arms, verdict = _schedule(trial, wide, narrow)
    assert verdict == expected
    assert arms == [None] * 3 + [0, 0, 0, 1, 1, 1, 1]


def test_the_median_of_the_timed_runs_decides() -> None:
    """One slow outlier does not sink an arm, and the first run of each visit is not counted (here the one-thread
    session's first runs are fast: counted, they would win it the trial)."""
    trial = Trial(TrialSettings.now(delay=0, warmup=0, runs=3, review=0, visit=2))
    times = {0: iter([9.0, 1.0, 9.0, 50.0, 9.0, 1.0]), 1: iter([0.1, 1.5, 0.1, 1.5, 0.1, 1.5])}
    verdict = None
    while verdict is None:
        arm = trial.arm
        verdict = trial.record(arm, next(times[arm]))
    assert verdict == 0  # medians 1.0 against 1.5 (means 17.3 against 1.5)


def _runs_until_due(trial: Trial) -> int:
    n = 0
    while not trial.due():
        n += 1
    return n


def test_a_one_thread_verdict_is_tried_again_soon_and_less_often_while_it_holds() -> None:
    """One thread's runs cannot show that two threads became faster: its verdict is tried again after `recheck`
    runs, doubling while trials keep it, up to `review`; a verdict for two threads waits `review` runs and starts
    the doubling over."""
    trial = Trial(TrialSettings.now(delay=0, warmup=0, runs=2, review=50, visit=2, recheck=5))
    waits = []
    for wide, narrow in [(2.0, 1.0)] * 5 + [(1.0, 2.0), (2.0, 1.0)]:
        _schedule(trial, wide, narrow)
        waits.append(_runs_until_due(trial))
    assert waits == [5, 10, 20, 40, 50, 50, 5]


def test_the_chosen_sessions_runs_slowing_down_start_a_trial_at_once() -> None:
    """After a verdict, every `watched` runs of the chosen session: a median within `drift` of its trial median
    leaves the next trial `review` runs away; above it, the next run is a trial's. A trial a drift started that
    keeps the verdict doubles the runs watched."""
    trial = Trial(TrialSettings.now(delay=0, warmup=0, runs=2, review=1000, visit=2, drift=1.5, watch=3))
    assert _schedule(trial, 1.0, 2.0)[1] == 0
    for seconds in (1.4, 1.0, 9.0, 1.4, 1.2, 1.45):  # medians 1.4 and 1.4
        trial.watch(seconds)
    assert not trial.due()
    for seconds in (1.6, 1.0, 1.6):  # median 1.6
        trial.watch(seconds)
    assert trial.due()
    assert _schedule(trial, 1.0, 2.0)[1] == 0  # a trial that keeps two threads: drifts are judged over 6 runs now
    for seconds in (9.0,) * 5:
        trial.watch(seconds)
    assert not trial.due()
    trial.watch(9.0)
    assert trial.due()
    assert _schedule(trial, 3.0, 2.0)[1] == 1  # and this trial moves the runs to one thread: back to 3 runs
    assert trial.watched.runs == 3


def _runner(config: SessionConfig) -> Runner:
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"])], "mm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [128, 128])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [128, 128])])
    return Runner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), config, "test")


def _clocked(monkeypatch, runner: Runner, seconds: dict[str, float]) -> None:
    """Each run of the runner's wide or narrow session takes `seconds[...]` on a clock the test advances (the
    product still runs), and the machine reads as free: a busy machine cannot change what the trials see."""
    clock = [0.0]
    run = runner._run

    def timed(session, park, feeds, names):
        clock[0] += seconds["wide" if session is runner._wide else "narrow"]
        return run(session, park, feeds, names)

    monkeypatch.setattr(ort_session, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(ort_session.openmp, "room", lambda threads: (False, False))
    monkeypatch.setattr(runner, "_run", timed)


@pytest.mark.parametrize("slow", ["wide", "narrow"])
def test_runs_take_the_session_their_trial_found_faster(monkeypatch, slow: str) -> None:
    """Each session made slower in turn: the trial keeps the other, and every run, on either session, during the
    trial and after, gives the same product."""
    monkeypatch.setattr(ort_session, "TRIAL_DELAY", 2)
    monkeypatch.setattr(ort_session, "TRIAL_REVIEW", 4)
    runner = _runner(SessionConfig(threads=2, choose_threads=True))
    _clocked(monkeypatch, runner, {"wide": 0.001, "narrow": 0.001, slow: 0.003})
    x = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
    feeds = {"x": exchange.to_ortvalue(x)}
    expected = x.astype(np.float64) @ x
    used = []
    for _ in range(60):
        y = runner.run(feeds)[0].numpy()
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-3)
        used.append(runner._c is runner._wide)
    assert runner.chosen_threads == (1 if slow == "wide" else 2)
    assert runner._parallel == (slow == "narrow")  # one thread reads no load, parks nothing
    assert used[-1] == (slow == "narrow")
    assert runner._narrow_c is not None  # made for the trial


def test_runs_follow_a_change_in_which_session_is_faster(monkeypatch) -> None:
    """Two threads fast, then slow (as when the VM's two CPUs move apart on the host: `TRIAL_DRIFT`), then fast
    again: the two-thread session's slower runs start a trial that moves the runs to one thread, and the one-thread
    verdict's recheck moves them back."""
    monkeypatch.setattr(ort_session, "TRIAL_DELAY", 2)
    monkeypatch.setattr(ort_session, "TRIAL_REVIEW", 10_000)
    monkeypatch.setattr(ort_session, "TRIAL_RECHECK", 20)
    runner = _runner(SessionConfig(threads=2, choose_threads=True))
    seconds = {"wide": 0.001, "narrow": 0.002}
    _clocked(monkeypatch, runner, seconds)
    feeds = {"x": exchange.to_ortvalue(np.ones((128, 128), np.float32))}
    chosen = []
    for wide in (0.001, 0.004, 0.001):
        seconds["wide"] = wide
        for _ in range(60):
            np.testing.assert_array_equal(runner.run(feeds)[0].numpy(), np.full((128, 128), 128, np.float32))
        chosen.append(runner.chosen_threads)
    assert chosen == [2, 1, 2]


def test_without_choose_threads_or_with_one_thread_there_is_no_trial() -> None:
    assert _runner(SessionConfig(threads=2))._trial is None
    assert _runner(SessionConfig(threads=1, choose_threads=True))._trial is None
    assert _runner(SessionConfig(threads=2, choose_threads=True))._trial is not None


def test_the_forward_work_picks_one_thread_a_trial_or_the_configured_threads() -> None:
    """Below `SMALL / TRIAL_BOTTOM` one thread; within the band a trial; from its top, the configured threads."""
    options = Options(ExportOptions(), threads=2, specialise=True, fallback=True, save_dir=None)
    low, high = workload.SMALL / workload.TRIAL_BOTTOM, workload.SMALL * workload.TRIAL_TOP
    for work, threads, choose in ((low * 0.99, 1, False), (low, 2, True), (workload.SMALL, 2, True),
                                  (high * 0.99, 2, True), (high, 2, False)):
        config = options.config_for(work)
        assert (config.threads, config.choose_threads) == (threads, choose), work


def test_a_module_in_the_band_trains_through_its_trial_as_torch_does(monkeypatch) -> None:
    """An MLP whose forward work is within the band (on an AVX2 machine: on AVX-512 MLPs split their threads by
    their work, `workload.DENSE_SPLIT`): its runners try one thread against two and keep one, and its gradients are
    torch's on either session."""
    monkeypatch.setattr(ort_session, "TRIAL_DELAY", 1)
    monkeypatch.setattr(workload, "mac_weight", lambda: workload.AVX2_WEIGHT)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    model = ORTModule(copy.deepcopy(net), threads=2)
    x = torch.randn(256, 128)
    for _ in range(40):
        model.zero_grad()
        model(x).square().mean().backward()
    net(x).square().mean().backward()
    for p, q in zip(model.parameters(), net.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    (schema,) = model._engine.schemas.values()
    assert schema.config.threads == 2 and schema.config.choose_threads
    (session,) = model.training_sessions()
    runners = [session._fwd, *(b.runner for b in session._backwards.values())]
    if session._fused is not None:
        runners.append(session._fused.runner)
    chosen = [r.chosen_threads for r in runners if isinstance(r, Runner) and r._trial is not None]
    assert chosen and all(c in (1, 2) for c in chosen)


@pytest.mark.parametrize("narrow_when_crowded", [True, False])
def test_crowded_runs_during_a_trial_are_not_timed(monkeypatch, narrow_when_crowded: bool) -> None:
    """On a crowded machine neither session runs as it would on a free one: such runs go where crowded runs go
    (the one-thread session, unless `narrow_when_crowded` is off) and the trial waits for runs it can time."""
    from runtime import openmp

    monkeypatch.setattr(ort_session, "TRIAL_DELAY", 0)
    runner = _runner(SessionConfig(threads=2, choose_threads=True, narrow_when_crowded=narrow_when_crowded))
    monkeypatch.setattr(openmp, "room", lambda threads: (False, True))
    taken = []
    run = runner._run
    monkeypatch.setattr(runner, "_run", lambda session, *a: taken.append(session is runner._wide) or run(session, *a))
    x = np.ones((128, 128), np.float32)
    feeds = {"x": exchange.to_ortvalue(x)}
    for _ in range(40):
        runner.run(feeds)
    assert taken == [not narrow_when_crowded] * 40
    assert runner._trial is not None and runner._trial._times == ([], []) and runner.chosen_threads is None
