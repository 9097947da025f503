"""onnxruntime runs with torch's spinning OpenMP workers parked, so that they leave the cores to its threads.

After each parallel op, the workers of torch's OpenMP pool (libgomp in the Linux CPU wheels) spin, waiting for
the next op, before they sleep: ~10 ms of a core on the benchmark machine (libgomp's default spin count). An
onnxruntime run started in that window shares a core with a spinning worker, and onnxruntime splits a product
or a convolution into one part per thread, so each op waits for the part on the shared core: an MLP
784-512-256-10 at batch 256 stepped in 4.5 ms alone and 6.2 ms right after a torch step. That window is where a
training loop calls ORTModule (after the optimizer's parallel ops) and where an interleaved benchmark does.

So when one of those workers is running (`_Workers`), the run happens inside a parallel region of the
calling thread's own pool whose workers wait on a semaphore (asleep, in the kernel) until the run is over
(`GOMP_parallel_start` with `sem_wait` as the body, the run, one `sem_post` a worker, `GOMP_parallel_end`): ~25
µs, and the pool stays as it is. Inside the autograd bridge's forward and backward (`defer_joins`), the join
waits until the run's outputs are handed to torch, so that the woken workers' way back overlaps that Python.
Ending the pool instead (`omp_pause_resource_all`, 60-110 µs) was as fast in an interleaved benchmark but not in
training loops: torch's next parallel op makes a new worker, which, when the process slept in between, queued
behind its spinning parent for up to 16 ms (Adam loops with 2-3 ms pauses ran 1.4-3x slower). Nothing runs inside
the region but onnxruntime, which does not use OpenMP, and the bridge's own Python.

Only on a machine with a core to spare: letting the workers go costs a wake-up and a join (`GOMP_parallel_end`
waits for them), 20-40 µs when a core is free, a scheduler slice (3-8 ms here) when another process runs, the
woken worker then queueing for a core; and with a busy process beside, parked runs were slower even when their
release was quick. So a run is parked only when the threads running on the machine besides ours (the count
`/proc/loadavg` gives now, less the calling thread and the spinning workers) fit in the cores the run leaves
free (`room`); otherwise the spinning workers are no worse than what else runs there. Steps against
torch's (`benchmarks.ab`): with one busy process beside, MLP 0.70 this way against 1.35 always parked and 0.93
never, LeNet 1.00 against 1.37 and 1.09; with a process busy half the time and on a quiet machine level with
always parking (0.93-1.06), where never parking lost (MLP 0.89 against 0.69 half-busy, LeNet 1.05 against 0.96
quiet).

The same count tells a crowded machine (more threads running than cores, torch's spinning workers included when
they cannot be parked): `room` says so, and the run goes to a one-thread session of the same graph
(`ort_session.Runner`), since onnxruntime's threads would wait on each other for cores. A decision to park, or a
crowd seen twice in a row, serves the runs of the next `ROOM_SECONDS` on the same thread: reading /proc at every
run cost more than parking saved; one to do neither (no worker was spinning), or a first crowd (mostly a thread
our own process just made), is made again at the next run. A
process held to fewer CPUs than the machine has (a container's cpuset or CPU quota) reads the load as unknown,
since /proc/loadavg counts the whole host's threads (`_confined`).

Only torch's own runtime is touched (other packages may load copies of libgomp with pools of their own), never
in a forked child, and only on Linux (`/proc`). `SessionConfig(park_openmp=False)`, or
`ORTModule(..., park_torch_threads=False)`, leaves the workers alone.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import torch

_RUNTIME = re.compile(r"/lib(g|i|)omp[^/]*\.so[^/]*$")
"""libgomp (GNU, torch's Linux wheels; vendored copies carry a hash, `libgomp-a34b3233.so.1`), libiomp5
(Intel) and libomp (LLVM), which both implement libgomp's entry points too."""
_TASKS = "/proc/self/task"
_LOADAVG = "/proc/loadavg"
SEM_T_BYTES = 64
"""Room for a `sem_t` (32 bytes on 64-bit glibc)."""


_BODY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
"""A parallel region's body: `void fn(void *data)`."""


@dataclass(frozen=True)
class _Runtime:
    parallel: ctypes._CFuncPtr  # type: ignore[name-defined]
    start: ctypes._CFuncPtr  # type: ignore[name-defined]
    end: ctypes._CFuncPtr  # type: ignore[name-defined]
    threads: ctypes._CFuncPtr  # type: ignore[name-defined]
    team: ctypes._CFuncPtr  # type: ignore[name-defined]
    """`omp_get_num_threads`: in a region the caller leads, the threads its team got."""


@dataclass(frozen=True)
class _Libc:
    wait: int
    """`sem_wait`'s address: the body every worker runs."""
    init: ctypes._CFuncPtr  # type: ignore[name-defined]
    post: ctypes._CFuncPtr  # type: ignore[name-defined]


@functools.cache
def _runtimes() -> tuple[_Runtime, ...]:
    """torch's OpenMP runtime with libgomp's entry points: the one loaded from torch's own directories (its wheels
    ship one, and other packages may ship copies of their own, whose pools are none of our business), else every
    one loaded (a conda torch uses the environment's)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if _RUNTIME.search(path) and path not in paths:
                    paths.append(path)
    except OSError:
        return ()
    home = os.path.dirname(os.path.realpath(torch.__file__))  # torch/lib/ or, in manylinux wheels, torch.libs/
    own = [p for p in paths if os.path.realpath(p).startswith((home + os.sep, home + ".libs" + os.sep))]
    paths = own or paths
    found = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            parallel, start, end = lib.GOMP_parallel, lib.GOMP_parallel_start, lib.GOMP_parallel_end
            threads, team = lib.omp_get_max_threads, lib.omp_get_num_threads
        except (OSError, AttributeError):
            continue
        parallel.argtypes, parallel.restype = [_BODY, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint], None
        start.argtypes, start.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint], None
        end.argtypes, end.restype = [], None
        threads.argtypes, threads.restype = [], ctypes.c_int
        team.argtypes, team.restype = [], ctypes.c_int
        found.append(_Runtime(parallel, start, end, threads, team))
    return tuple(found)


@functools.cache
def _libc() -> _Libc | None:
    try:
        libc = ctypes.CDLL(None)
        wait, init, post = libc.sem_wait, libc.sem_init, libc.sem_post
    except (OSError, AttributeError):
        return None
    init.argtypes, init.restype = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint], ctypes.c_int
    post.argtypes, post.restype = [ctypes.c_void_p], ctypes.c_int
    address = ctypes.cast(wait, ctypes.c_void_p).value
    return _Libc(address, init, post) if address else None


class _Workers:
    """The workers of one thread's OpenMP pools (libgomp keeps a pool per calling thread), each with a descriptor on
    its `stat`, whose state is R while it is on a core or waiting for one (~3 µs a read; `wchan` reads in 2 but
    says "0" for every thread where the kernel hides its symbols). They are learnt by one parallel region
    whose every member records its thread id (`_probe`), again when the pools' sizes change or a worker is gone (a
    pool ended and made anew)."""

    def __init__(self) -> None:
        self.kept: dict[int, int] = {}
        self.sizes: tuple[int, ...] = ()

    def _learn(self, sizes: tuple[int, ...]) -> None:
        self._close()
        for tid in _probe() - {threading.get_native_id()}:
            with suppress(OSError):
                self.kept[tid] = os.open(f"{_TASKS}/{tid}/stat", os.O_RDONLY)
        self.sizes = sizes

    def _close(self) -> None:
        for fd in self.kept.values():
            with suppress(OSError):
                os.close(fd)
        self.kept = {}

    __del__ = _close

    def spinning(self, sizes: tuple[int, ...], enough: int = 1) -> int:
        """How many of the workers (`sizes`: each runtime's team size now) are running or runnable, counted up to
        `enough`: spinning, since their thread is not in a parallel region."""
        if sizes != self.sizes:
            self._learn(sizes)
        n = 0
        for fd in self.kept.values():
            try:
                stat = os.pread(fd, 64, 0)  # "tid (comm) S ...": comm is at most 15 bytes
            except OSError:  # gone: learnt again at the next check
                self.sizes = ()
                continue
            n += on_core(stat)
            if n >= enough:
                break
        return n


def on_core(stat: bytes) -> bool:
    """Whether a `/proc/.../stat` line ("tid (comm) S ...") says its thread is running or runnable."""
    end = stat.rfind(b")")
    return stat[end + 2:end + 3] == b"R"


def _probe() -> set[int]:
    """The thread ids of one parallel region's team on each runtime (the caller's pool, made if it was not)."""
    seen: set[int] = set()

    def body(_: int | None) -> None:
        seen.add(threading.get_native_id())  # set.add holds the GIL: no lock needed

    callback = _BODY(body)
    for r in _runtimes():
        if r.threads() > 1:
            r.parallel(callback, None, 0, 0)
    return seen


_local = threading.local()
"""Per thread: `workers`, the `_Workers` of its pools."""
_PID = os.getpid()
"""The process this module was imported in. A forked child has the parent's OpenMP pools without their threads
(a parallel region there can hang, which is why torch's DataLoader workers run on one thread): nothing is
parked in one."""


def contended(enough: int = 1) -> int:
    """How many workers of this thread's OpenMP pools are spinning now (a torch op ran in parallel within the last
    ~10 ms), counted up to `enough`: 0 when none."""
    runtimes = _runtimes()
    if not runtimes or os.getpid() != _PID:
        return 0
    sizes = tuple([r.threads() for r in runtimes])
    if max(sizes) <= 1:
        return 0
    workers = getattr(_local, "workers", None)
    if workers is None:
        workers = _local.workers = _Workers()
    return workers.spinning(sizes, enough)


@functools.cache
def _loadavg(path: str) -> int | None:
    """A descriptor on `path` kept open (`pread` on it costs ~2 µs, opening it again ~10), None where there is none."""
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None


def _running() -> int | None:
    """Threads running or runnable on the machine now, the caller included (None where /proc/loadavg cannot say,
    or says nothing about this process's cores: `_confined`)."""
    if _confined():
        return None
    fd = _loadavg(_LOADAVG)
    if fd is None:
        return None
    try:
        return int(os.pread(fd, 128, 0).split()[3].split(b"/")[0])  # "0.48 0.29 0.66 2/345 12345"
    except (OSError, IndexError, ValueError):
        return None


ROOM_SECONDS = 0.05
"""How long a `room` decision holds for the calling thread's runs on as many threads. Its reads of /proc (the
load average, one or two task stats) cost 80-120 µs a run on a machine whose caches go cold between steps
(session 25: each read 20-55 µs cold, 3-11 warm), more than parking saved on a small model: decided per run, the
MLPs stepped 3-14% slower (`benchmarks.ab`; in one process 1.01-1.15 of torch's step per run, 0.97-1.06 with
this window, 0.97-1.06 always parked without reading anything). Within the window what it reads hardly moves:
torch's workers spin for ~10 ms after a parallel region (after ours too, which lets them go at its end), and
what else runs on the machine changes over seconds; a change is seen at most this late. Not for a decision that
does not park (`IDLE_SECONDS`)."""


IDLE_SECONDS = 0.0
"""How long a decision that neither parks nor narrows (no worker of torch's was spinning) holds: none, since a
worker starts spinning at torch's next parallel op, and a run that meets it unparked shares a core with it. Held
for `ROOM_SECONDS` like the others, such decisions (made after a pause in torch's work) left 22-32 of an MLP's first
44 runs unparked while torch's workers spun, a few of them 2-10 ms instead of 0.3-0.5 (session 45, an AVX-512
EPYC); made again at each run, 3-6 were. `benchmarks.ab`, 4-5 rounds, the held form as the lever, lever /
baseline: 784-300-100-10 b64 1.122 and 1.185, 784-256-10 b128 1.092 and 1.197, mlp-b16 1.061, mlp-relu-ln 1.081,
784-512-512-10 b32 1.029, mlp 1.017; CNN 0.973 and 1.026, LeNet 1.021, transformer 1.007. The reads cost 25-45
µs when made right after torch's work, ~120 after a 30 ms sleep (the cold machine), paid by runs that find no
worker spinning (with OMP_WAIT_POLICY=PASSIVE every run: those steps read level with the held form, within this
machine's noise). Held 2 ms instead: level with none (0.84-1.03, noisy)."""


CROWD_SECONDS = 0.0
"""How long a crowded decision holds when the decision before it was not crowded: none (session 46; `ROOM_SECONDS`
before), while a crowd seen again at the next run holds `ROOM_SECONDS`. Most crowds on a quiet machine are a
moment's: the extra running thread was, each time it was caught, a thread our own process had just made
(onnxruntime's pool as a session is created: the split sessions at a fused module's second step, a trial's one-
thread session), and a crowd held 50 ms put the runs of that window on one thread: 2 to 6 of a LeNet's 36 runs at
batch 256, 16-18 ms instead of 11-12. A crowd that lasts (another process busy) cannot be read at every run: beside
a CPU burner, the reads at each run made steps slower than holding each crowd (`benchmarks.ab`, 3 rounds, held /
read at each run: MLP 0.838, CNN 0.913, LeNet 0.909)."""


def room(threads: int) -> tuple[bool, bool]:
    """`_room`'s decision, made again when the last one for `threads` is older than `ROOM_SECONDS` (`CROWD_SECONDS`
    for a crowded one after one that was not, `IDLE_SECONDS` for one that neither parks nor narrows)."""
    now = time.perf_counter()
    last = getattr(_local, "room", None)
    if last is not None and last[0] == threads and now - last[1] < last[3]:
        return last[2]
    decision = _room(threads)
    if decision[1]:  # a crowd seen twice in a row lasts
        hold = ROOM_SECONDS if last is not None and last[2][1] else CROWD_SECONDS
    else:
        hold = ROOM_SECONDS if decision[0] else IDLE_SECONDS
    _local.room = (threads, now, decision, hold)
    return decision


def _forget() -> None:
    """Drop the calling thread's last decision: a forked child parks nothing (`_PID`), whatever its parent decided."""
    _local.__dict__.pop("room", None)


os.register_at_fork(after_in_child=_forget)


FRESH_SECONDS = 0.1
"""How long the intra-op workers of a session this process just made are taken for ours when the running threads
are counted (`made_workers`). onnxruntime's workers spin from their session's creation until its first run ends
(`session.force_spinning_stop`), or ~40 ms on the AVX-512 EPYC (a million spins): the backward's session, made at
the first backward, then looked like another process's threads to the next runs. Three such crowds in a row at a
module's first steps (the forward's, the backward's, then the backward's workers still spinning: its first run had
gone to the one-thread session) held 35 of 126 runs of 784-256-10 at batch 128 on one thread in the benchmark's
60 steps (1.14 of torch's step against 1.05). Taken for ours, they make a run on more threads than the cores then
have for a moment, until its session's first run (or the spin) ends."""
_fresh: list[tuple[float, int]] = []
_fresh_lock = threading.Lock()
"""Sessions made and runs deciding in several threads: a list rebuilt while another thread appended to it lost
the new entry."""


def made_workers(count: int) -> None:
    """A session this process just made started `count` intra-op workers (`FRESH_SECONDS`)."""
    with _fresh_lock:
        _fresh.append((time.perf_counter(), count))


def _fresh_workers(now: float) -> int:
    """The workers of sessions made within `FRESH_SECONDS`."""
    if not _fresh:
        return 0
    with _fresh_lock:
        _fresh[:] = [made for made in _fresh if now - made[0] < FRESH_SECONDS]
        return sum(count for _, count in _fresh)


def _room(threads: int) -> tuple[bool, bool]:
    """For a run on `threads` intra-op threads: whether to park torch's workers (one spins, and what else runs on
    the machine fits in the cores the run leaves free: else a release waits for a core, and parked runs were
    slower), and whether the machine is crowded (more runs than fits: onnxruntime's threads would then wait on each
    other). Of the running threads, the caller and the spinning workers are ours: as many workers are read as it
    takes to tell (one on a quiet machine)."""
    spinning = contended()
    running = _running()
    if running is None:
        return bool(spinning), False
    # the running threads that must be ours: the caller, torch's spinning workers, sessions' fresh workers
    ours = running - (usable_cores() - threads) - _fresh_workers(time.perf_counter())
    if ours <= 1:
        return bool(spinning), False
    fits = bool(spinning) and (ours <= 2 or 1 + contended(ours - 1) >= ours)
    return fits, not fits


@functools.cache
def _confined() -> bool:
    """Whether this process may use fewer CPUs than the machine has: an affinity mask (a container's cpuset,
    `taskset`) or a CPU quota (a container's limit). /proc/loadavg counts the threads of the whole machine, in a
    container too: on a busy host it would call the container's own idle cores crowded and put every run on one
    thread. Confined, the load is read as unknown: runs park torch's spinning workers and keep their threads."""
    return usable_cores() < (os.cpu_count() or 1) or cpu_quota()


def cpu_quota(cgroups: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> bool:
    """Whether a CPU quota applies to this process's cgroup (v2 `cpu.max`, v1 `cpu.cfs_quota_us`), read at its
    path in /proc/self/cgroup and at the mount's root (where a container sees its own cgroup)."""
    try:
        with open(cgroups) as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    files = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        path = path.strip().lstrip("/")
        if controllers == "":  # v2: "0::/path"
            files += [os.path.join(root, path, "cpu.max"), os.path.join(root, "cpu.max")]
        elif "cpu" in controllers.split(","):  # v1: "4:cpu,cpuacct:/path"
            for mount in dict.fromkeys((controllers, "cpu", "cpu,cpuacct")):  # each mount once
                files += [os.path.join(root, mount, path, "cpu.cfs_quota_us"),
                          os.path.join(root, mount, "cpu.cfs_quota_us")]
    for name in files:
        try:
            with open(name) as f:
                limit = f.read().split()
        except OSError:
            continue
        if limit and limit[0] != "max" and limit[0].lstrip("-").isdigit() and int(limit[0]) > 0:
            return True
    return False


@functools.cache
def usable_cores() -> int:
    """The CPUs this process may run on (its affinity: a container's cpuset, `taskset`), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _semaphores() -> list[tuple[_Runtime, int]]:
    """The calling thread's parking semaphore (its address) for each of torch's runtimes that had more than one
    thread when `contended` last looked, made at the thread's first park: a region's workers take one post each,
    so it is back at zero after each."""
    made = getattr(_local, "semaphores", None)
    if made is None:
        libc = _libc()
        made = _local.semaphores = []
        for r in _runtimes() if libc is not None else ():
            sem = ctypes.create_string_buffer(SEM_T_BYTES)
            made.append((r, sem, ctypes.addressof(sem)) if libc.init(sem, 0, 0) == 0 else None)
    workers = getattr(_local, "workers", None)
    sizes = workers.sizes if workers is not None else ()
    return [(m[0], m[2]) for k, m in enumerate(made) if m is not None and (k >= len(sizes) or sizes[k] > 1)]


Parked = list[tuple[_Runtime, int, int]]
"""The regions `park` entered: runtime, semaphore address, workers waiting on it."""


def park() -> Parked:
    """Put the workers of the calling thread's OpenMP pools to sleep on a semaphore until `release`.

    Each park is a region the caller leads (`GOMP_parallel_start`, whose workers all run `sem_wait`), released by
    as many posts as its team got workers (`omp_get_num_threads` in the region: a team can be smaller than asked,
    under dynamic adjustment or a thread limit), then joined (`GOMP_parallel_end`). Four calls into C a park, each
    10-20 µs on the caches a torch step leaves cold (2-4 warm); making the semaphore anew at each park and asking
    each runtime's thread count twice had cost four more: steps 0.97-0.99 of before (MLPs, LeNet; each step right
    after a torch step, the two alternating in one process).
    """
    libc = _libc()
    entered: Parked = []
    if libc is None:
        return entered
    pending = _local.__dict__.get("pending")
    if pending:  # never a region inside one still open
        _end(pending)
    try:
        for r, sem in _semaphores():
            r.start(libc.wait, sem, 0)
            entered.append((r, sem, r.team() - 1))
    except BaseException:
        release(entered)
        raise
    return entered


def release(entered: Parked, later: bool = False) -> None:
    """Let the workers `park` put to sleep go, and join them (their regions end); with `later`, between
    `defer_joins` and `join`, the join waits for `join`."""
    libc = _libc()
    last_first = entered[::-1]
    for _, sem, workers in last_first:
        for _ in range(workers):
            libc.post(sem)  # type: ignore[union-attr]
    pending = _local.__dict__.get("pending") if later else None
    if pending is not None:
        pending.extend(last_first)
    else:
        _end(last_first)


def defer_joins() -> None:
    """Until `join`, `release` on this thread wakes the workers and leaves their join for later, so that a woken
    worker's way back (a sleeping thread woken on a VM: 10-20 µs before it reaches the region's end) overlaps the
    Python that follows the run instead of being waited for at its end. Only around code that runs no parallel
    torch op and no user code: until `join`, the calling thread is inside the parked regions, where torch's
    parallel ops would run on one thread. A window opened inside another ends with the inner one."""
    _local.__dict__.setdefault("pending", [])


def join() -> None:
    """End the regions `release` left open since `defer_joins` (in the order entered: the last first), and stop
    deferring."""
    pending = _local.__dict__.pop("pending", None)
    if pending:
        _end(pending)


def _end(regions: Parked) -> None:
    """End `regions` in their order (the last entered first), emptying the list."""
    for r, _, _ in regions:
        r.end()
    regions.clear()


@contextmanager
def parked() -> Iterator[None]:
    """Run the body with torch's workers parked (`park`), released after it however it ends."""
    entered = park()
    try:
        yield
    finally:
        release(entered)
