"""runtime.openmp: torch's spinning OpenMP workers are seen, parked while onnxruntime runs, and let go after."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from runtime import openmp
from runtime.ort_session import Runner, SessionConfig

pytestmark = pytest.mark.skipif(os.cpu_count() is None or os.cpu_count() < 2 or not openmp._runtimes()
                                or openmp._libc() is None, reason="needs 2 cores and an OpenMP runtime in torch")

BIG = torch.randn(384, 384)


def _spin() -> None:
    """A parallel torch op: its workers spin for a while after it (unless OMP_WAIT_POLICY is passive)."""
    BIG @ BIG


def _running_others() -> set[int]:
    me = str(threading.get_native_id())
    running = set()
    for tid in os.listdir("/proc/self/task"):
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
            if openmp.on_core(stat):
                running.add(int(tid))
        except OSError:
            pass
    return running


def _wait_until(condition, seconds: float = 2.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.001)
    return condition()


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _spinners() -> set[int]:
    """torch's workers: the threads running right after a parallel op, once nothing else runs (an onnxruntime
    session of another test may still spin for a while)."""
    _wait_until(lambda: not _running_others())
    _spin()
    spinning = _running_others()
    if not spinning:
        pytest.skip("torch's OpenMP workers do not spin here (OMP_WAIT_POLICY passive?)")
    return spinning


def test_spinning_workers_are_seen_and_then_not(two_threads) -> None:
    _spinners()
    assert openmp.contended()
    # libgomp's workers sleep once their spin count is used up (~10 ms here)
    assert _wait_until(lambda: not openmp.contended())


def _cpu_ns(tids: set[int]) -> int:
    total = 0
    for tid in tids:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


def test_parked_workers_sleep_and_come_back(two_threads) -> None:
    spinning = _spinners()
    before = _cpu_ns(spinning)
    time.sleep(0.05)
    spun = _cpu_ns(spinning) - before  # what the workers burn after an op when left alone
    if spun < 2_000_000:
        pytest.skip("torch's workers spin for less than 2 ms here")
    _spin()
    with openmp.parked():
        before = _cpu_ns(spinning)
        time.sleep(0.05)
        parked = _cpu_ns(spinning) - before
        assert not openmp.contended()
    assert parked < spun / 4, (parked, spun)
    # let go: torch's next op runs on its full pool and gives the right result
    x = torch.randn(300, 300, dtype=torch.float64)
    np.testing.assert_allclose((x @ x).numpy(), x.numpy() @ x.numpy(), rtol=1e-10)


def test_parked_lets_go_when_the_body_raises(two_threads) -> None:
    _spinners()
    with pytest.raises(ValueError), openmp.parked():
        raise ValueError("in the body")
    _spin()  # would hang if a worker were left on the semaphore


def _semaphore_values() -> list[int]:
    """The calling thread's parking semaphores' counts (sem_getvalue)."""
    import ctypes

    getvalue = ctypes.CDLL(None).sem_getvalue
    getvalue.argtypes, getvalue.restype = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)], ctypes.c_int
    values = []
    for made in openmp._local.semaphores:
        if made is not None:
            value = ctypes.c_int(-1)
            assert getvalue(made[2], ctypes.byref(value)) == 0
            values.append(value.value)
    return values


@pytest.mark.parametrize("threads", [2, 3])
def test_each_park_puts_every_worker_to_sleep_on_one_semaphore(threads: int) -> None:
    """The semaphore is made once a thread: each release posts as many as the region's team has workers, so it is
    back at zero, and the next park finds every worker asleep again (a post too many would let one spin)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(30):
            _spin()
            with openmp.parked():
                pass
            assert _semaphore_values() and set(_semaphore_values()) == {0}
        # libgomp hardly spins with more threads than cores: the last check needs workers seen spinning
        spinning = _spinners() if threads <= (os.cpu_count() or 1) else set()
        _spin()
        with openmp.parked():
            assert _wait_until(lambda: not (_running_others() & spinning)), "a worker is left spinning"
    finally:
        torch.set_num_threads(before)


def _runner(config: SessionConfig) -> Runner:
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"])], "mm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, 256])])
    return Runner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), config, "test")


def _value(a: np.ndarray):
    from onnxruntime.capi import _pybind_state as C

    return C.OrtValue.ortvalue_from_numpy(a, C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0))


@pytest.fixture
def entries(monkeypatch) -> list[int]:
    """One entry per `openmp.park` made while the test runs (the machine's load unknown to the runs:
    conftest's `_machine_load_unknown`)."""
    entered: list[int] = []
    park = openmp.park

    def counting():
        entered.append(1)
        return park()

    monkeypatch.setattr(openmp, "park", counting)
    return entered


def test_runs_are_parked_only_when_torch_spins(two_threads, entries) -> None:
    runner = _runner(SessionConfig(threads=2))
    single = _runner(SessionConfig(threads=1))
    x = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    feeds = {"x": _value(x)}
    for _ in range(3):  # onnxruntime's own workers never count as spinning
        _spinners()
        y = runner.run(feeds)[0].numpy()
        np.testing.assert_allclose(y, x @ x, rtol=1e-4, atol=1e-3)
    assert len(entries) == 3
    _spinners()
    single.run(feeds)  # one thread: nothing to make room for
    assert len(entries) == 3
    assert _wait_until(lambda: not openmp.contended())
    runner.run(feeds)
    assert len(entries) == 3


def test_runs_are_parked_only_with_a_core_to_spare(two_threads, entries, monkeypatch) -> None:
    """Where other threads run on the machine, a parked worker's release waits for a core (a scheduler slice), and
    parked runs were slower: a run is parked only when what runs elsewhere fits in the cores it leaves free, and
    runs on one thread (a session of its own, the same results) when the machine is crowded."""
    runner = _runner(SessionConfig(threads=2))
    x = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    feeds = {"x": _value(x)}
    expected = runner.run(feeds)[0].numpy()
    narrowed: list[int] = []
    narrow_session = runner._narrow_session
    monkeypatch.setattr(runner, "_narrow_session", lambda: narrowed.append(1) or narrow_session())
    # running: the caller, torch's spinning worker, and what runs elsewhere
    for cores, running, parked in ((2, 2, True), (2, 3, False), (3, 3, True), (3, 4, False), (2, None, True)):
        monkeypatch.setattr(openmp, "usable_cores", lambda c=cores: c)
        monkeypatch.setattr(openmp, "_running", lambda n=running: n)
        before, crowded_before = len(entries), len(narrowed)
        _spinners()
        y = runner.run(feeds)[0].numpy()
        assert (len(entries) > before) == parked, (cores, running)
        assert (len(narrowed) > crowded_before) == (not parked), (cores, running)
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-4)
    narrow = runner._narrow_c
    assert narrow is not None and narrow is not runner._c
    monkeypatch.setattr(openmp, "_running", lambda: 3)
    runner.run(feeds)  # crowded without torch's workers spinning too
    assert len(narrowed) == 3 and runner._narrow_c is narrow  # made once


def test_the_fresh_workers_of_our_own_sessions_are_no_crowd(monkeypatch) -> None:
    """A session's intra-op workers spin from its creation until its first run ends: read as another process's
    threads, they put a module's first steps on one thread."""
    monkeypatch.setattr(openmp, "usable_cores", lambda: 2)
    monkeypatch.setattr(openmp, "contended", lambda *_: 0)  # torch's workers asleep
    monkeypatch.setattr(openmp, "_running", lambda: 2)  # the caller and one more
    monkeypatch.setattr(openmp, "_fresh", [])
    assert openmp._room(2) == (False, True)
    monkeypatch.setattr(openmp, "FRESH_SECONDS", 60.0)
    for config, made in ((SessionConfig(threads=1), 0), (SessionConfig(threads=2, spin=False), 0),
                         (SessionConfig(threads=3), 2)):
        _runner(config)
        assert sum(count for _, count in openmp._fresh) == made
    openmp._fresh[:] = []
    _runner(SessionConfig(threads=2))
    assert openmp._room(2) == (False, False)
    monkeypatch.setattr(openmp, "_running", lambda: 3)  # and one more beside: a crowd
    assert openmp._room(2) == (False, True)
    monkeypatch.setattr(openmp, "_running", lambda: 2)
    monkeypatch.setattr(openmp, "FRESH_SECONDS", 0.0)  # past the window: theirs again
    assert openmp._room(2) == (False, True) and not openmp._fresh


def test_crowded_runs_keep_a_graph_drawing_random_numbers_on_its_session(two_threads, monkeypatch) -> None:
    """A second session would draw other random numbers: a graph with onnxruntime's random ops stays on one."""
    graph = helper.make_graph([helper.make_node("RandomUniformLike", ["x"], ["r"]),
                               helper.make_node("Add", ["x", "r"], ["y"])], "random",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    runner = Runner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                    SessionConfig(threads=2), "random")
    monkeypatch.setattr(openmp, "_running", lambda: 5)
    runner.run({"x": _value(np.ones(4, np.float32))})
    assert runner._narrow is None and runner._narrow_c is None
    assert _runner(SessionConfig(threads=1))._narrow is None  # one thread already


def test_threads_running_are_counted(tmp_path, monkeypatch) -> None:
    assert openmp._running() is None  # the suite's fixture: the load unknown
    monkeypatch.setattr(openmp, "_confined", lambda: False)  # whatever container runs the suite
    monkeypatch.setattr(openmp, "_LOADAVG", "/proc/loadavg")
    assert openmp._running() >= 1  # this thread, reading
    fake = tmp_path / "loadavg"
    fake.write_text("0.48 0.29 0.66 5/345 12345\n")
    monkeypatch.setattr(openmp, "_LOADAVG", str(fake))
    assert openmp._running() == 5
    fake.write_text("garbage\n")  # read again at each call, through the kept descriptor
    assert openmp._running() is None  # then runs park as before
    monkeypatch.setattr(openmp, "_LOADAVG", str(tmp_path / "none"))
    assert openmp._running() is None


def test_a_forked_child_parks_nothing(two_threads, monkeypatch) -> None:
    """The child has the parent's pools without their threads: a parallel region there could hang. Nor does the
    parent's last decision carry over (`ROOM_SECONDS`)."""
    monkeypatch.setattr(openmp, "ROOM_SECONDS", 3600.0)
    _spinners()
    assert openmp.contended()
    assert openmp.room(2) == (True, False)  # the machine's load unknown (conftest): parked for the spinning worker
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if not openmp.contended() and openmp.room(2) == (False, False) else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.01)
    os.kill(pid, 9)
    pytest.fail("the forked child hung")


def test_a_decision_serves_the_runs_of_its_window(monkeypatch) -> None:
    """`room`'s reads of /proc cost more than parking saved when each run made them: a decision to park holds for
    `ROOM_SECONDS` on as many threads, then is made again; another thread count, or another thread, decides anew.
    One that does neither is made again at the next run (`IDLE_SECONDS`), and so is a crowded one after one that was
    not (`CROWD_SECONDS`: most crowds are a moment's); a crowd seen twice in a row holds."""
    made: list[int] = []

    def decide(threads: int) -> tuple[bool, bool]:
        made.append(threads)
        return True, False

    monkeypatch.setattr(openmp, "_room", decide)
    monkeypatch.setattr(openmp, "ROOM_SECONDS", 1.0)
    assert openmp.room(2) == (True, False)
    assert openmp.room(2) == (True, False) and made == [2]
    assert openmp.room(3) == (True, False) and made == [2, 3]  # another count: decided, and now the last
    seen: list[tuple[bool, bool]] = []
    t = threading.Thread(target=lambda: seen.append(openmp.room(3)))
    t.start()
    t.join()
    assert seen == [(True, False)] and made == [2, 3, 3]  # the other thread's pools are its own
    assert openmp.room(3) == (True, False) and made == [2, 3, 3]
    time.sleep(1.1)
    assert openmp.room(3) == (True, False) and made == [2, 3, 3, 3]
    for crowded in (False, True):  # nothing spinning, or a crowd after none: made again
        monkeypatch.setattr(openmp, "_room", lambda threads, c=crowded: made.append(threads) or (False, c))
        time.sleep(1.1)
        made.clear()
        assert openmp.room(3) == (False, crowded) and openmp.room(3) == (False, crowded)
        assert made == [3, 3]
    assert openmp.room(3) == (False, True) and made == [3, 3]  # the crowd seen twice: held


def test_each_thread_watches_its_own_pool(two_threads) -> None:
    """libgomp keeps one pool per calling thread: a thread's check reads its own pool's workers (whether they spin
    now depends on libgomp's throttling, with more of its threads than cores)."""
    _spinners()
    assert openmp.contended()
    main_workers = set(openmp._local.workers.kept)
    seen: dict[str, set[int]] = {}

    def other() -> None:
        torch.set_num_threads(2)
        _spin()
        openmp.contended()
        seen["workers"] = set(openmp._local.workers.kept)

    t = threading.Thread(target=other)
    t.start()
    t.join(30)
    assert seen["workers"] and not seen["workers"] & main_workers


def _in_region() -> bool:
    """Whether the calling thread leads an open parallel region of torch's runtime (its team is then larger than
    one)."""
    return openmp._runtimes()[0].team() > 1


def test_deferred_joins_wait_for_the_window_and_never_nest(two_threads) -> None:
    _spinners()
    openmp.defer_joins()
    try:
        openmp.release(openmp.park(), later=True)
        assert _in_region()  # posted, not yet joined: the worker takes its post when it wakes
        assert _wait_until(lambda: set(_semaphore_values()) == {0})
        entered = openmp.park()  # ends the open region first: a region inside it would get no workers
        assert _in_region() and len(entered) == 1 and entered[0][2] == 1
        openmp.release(entered)  # not `later`: joined at once
        assert not _in_region()
        openmp.release(openmp.park(), later=True)
        assert _in_region()
    finally:
        openmp.join()
    assert not _in_region() and "pending" not in openmp._local.__dict__
    openmp.release(openmp.park(), later=True)  # outside a window: joined at once
    assert not _in_region()
    x = torch.randn(300, 300, dtype=torch.float64)
    np.testing.assert_allclose((x @ x).numpy(), x.numpy() @ x.numpy(), rtol=1e-10)


@pytest.mark.parametrize("park", [True, False])
def test_ortmodule_parks_unless_told_not_to(two_threads, entries, park: bool, monkeypatch) -> None:
    from runtime import ORTModule

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    model = ORTModule(net, threads=2, park_torch_threads=park)
    x = torch.randn(512, 256)
    model(x).sum().backward()  # built on two threads (its forward work is above `workload.SMALL`)
    model(x).sum().backward()  # the second call exports again (engine's check): its trace lets the workers sleep
    entries.clear()
    deferred = []
    end = openmp._end
    monkeypatch.setattr(openmp, "_end", lambda pending: (deferred.append(len(pending)), end(pending)))
    _spinners()
    model.zero_grad(set_to_none=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(_in_region()) or t, lambda t: t):
        model(x)  # saved-tensor hooks are user code: never run inside a parked region
    assert packed and not any(packed)
    _spinners()
    loss = model(x).sum()
    assert not _in_region()  # the forward's deferred join came before the call returned
    loss.backward()
    assert not _in_region() and "pending" not in openmp._local.__dict__
    assert bool(entries) == park
    assert bool(deferred) == park  # the joins waited for the run's Python to be done
    expected = torch.autograd.grad(net(x).sum(), net[0].weight)[0]
    torch.testing.assert_close(net[0].weight.grad, expected, rtol=1e-4, atol=1e-4)


def test_a_confined_process_reads_no_load(tmp_path, monkeypatch) -> None:
    """/proc/loadavg counts the whole machine's threads, in a container too: a process held to fewer CPUs than the
    machine has (a cpuset, a quota) reads the load as unknown, so a busy host does not put its runs on one thread."""
    fake = tmp_path / "loadavg"
    fake.write_text("31.0 30.0 29.0 40/900 12345\n")  # a busy 64-core host
    monkeypatch.setattr(openmp, "_LOADAVG", str(fake))
    monkeypatch.setattr(openmp, "usable_cores", lambda: 2)  # the container's two
    monkeypatch.setattr(openmp, "_confined", lambda: False)
    assert openmp._running() == 40
    monkeypatch.setattr(openmp, "contended", lambda enough=1: 1)  # torch's worker spins
    assert openmp._room(2) == (False, True)  # crowded: one thread
    monkeypatch.setattr(openmp, "_confined", lambda: True)
    assert openmp._running() is None
    assert openmp._room(2) == (True, False)  # parked, on its threads


def test_cpu_quotas_are_found(tmp_path) -> None:
    """cgroup v2's cpu.max and v1's cpu.cfs_quota_us, at the process's cgroup path or the mount's root (where a
    container sees its own); none, or unreadable files, is no quota."""
    def case(cgroup: str, files: dict[str, str]) -> bool:
        root = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        (root / "fs").mkdir(parents=True)
        (root / "cgroup").write_text(cgroup)
        for name, text in files.items():
            (root / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
            (root / "fs" / name).write_text(text)
        return openmp.cpu_quota(str(root / "cgroup"), str(root / "fs"))

    assert case("0::/user.slice/job\n", {"user.slice/job/cpu.max": "200000 100000\n"})
    assert not case("0::/user.slice/job\n", {"user.slice/job/cpu.max": "max 100000\n"})
    assert case("0::/\n", {"cpu.max": "150000 100000\n"})
    assert case("4:cpu,cpuacct:/docker/abc\n1:memory:/docker/abc\n",
                {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n"})
    assert case("4:cpu,cpuacct:/\n", {"cpu/cpu.cfs_quota_us": "100000\n"})
    assert not case("4:cpu,cpuacct:/\n", {"cpu/cpu.cfs_quota_us": "-1\n"})
    assert not case("4:cpu,cpuacct:/\n", {})
    assert not openmp.cpu_quota(str(tmp_path / "none"), str(tmp_path))


def test_default_threads_count_the_cores_this_process_may_use(monkeypatch) -> None:
    """A container's cpuset leaves the machine's CPU count (`os.cpu_count`) above what runs can use: a session
    left to onnxruntime's default threads is parallel, and makes room for as many threads, by its affinity."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(openmp, "usable_cores", lambda: 1)
    assert not SessionConfig().parallel
    monkeypatch.setattr(openmp, "usable_cores", lambda: 2)
    assert SessionConfig().parallel
    assert _runner(SessionConfig())._threads == 2
