"""onnxruntime runs with torch's spinning OpenMP workers parked, so that they leave the cores to its threads.

After each parallel op, the workers of torch's OpenMP pool (libgomp in the Linux CPU wheels) spin, waiting for
the next op, before they sleep: ~10 ms of a core on the benchmark machine (libgomp's default spin count). An
onnxruntime run started in that window shares a core with a spinning worker, and onnxruntime splits a product
or a convolution into one part per thread, so each op waits for the part on the shared core: an MLP
784-512-256-10 at batch 256 stepped in 4.5 ms alone and 6.2 ms right after a torch step. That window is where a
training loop calls ORTModule (after the optimizer's parallel ops) and where an interleaved benchmark does.

So when another thread of the process is running (`_Threads`), the run happens inside a parallel region of the
calling thread's own pool whose workers wait on a semaphore (asleep, in the kernel) until the run is over
(`GOMP_parallel_start` with `sem_wait` as the body, the run, one `sem_post` a worker, `GOMP_parallel_end`): ~25
µs, and the pool stays as it is. Ending the pool instead (`omp_pause_resource_all`, 60-110 µs) was as fast in
an interleaved benchmark but not in training loops: torch's next parallel op makes a new worker, which, when
the process slept in between, queued behind its spinning parent for up to 16 ms (Adam loops with 2-3 ms pauses
ran 1.4-3x slower). Nothing runs inside the region but onnxruntime, which does not use OpenMP.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

_RUNTIME = re.compile(r"/lib(g|i|)omp[^/]*\.so[^/]*$")
"""libgomp (GNU, torch's Linux wheels; vendored copies carry a hash, `libgomp-a34b3233.so.1`), libiomp5
(Intel) and libomp (LLVM), which both implement libgomp's entry points too."""
_TASKS = "/proc/self/task"
SEM_T_BYTES = 64
"""Room for a `sem_t` (32 bytes on 64-bit glibc)."""


@dataclass(frozen=True)
class _Runtime:
    start: ctypes._CFuncPtr  # type: ignore[name-defined]
    end: ctypes._CFuncPtr  # type: ignore[name-defined]
    threads: ctypes._CFuncPtr  # type: ignore[name-defined]


@dataclass(frozen=True)
class _Libc:
    wait: int
    """`sem_wait`'s address: the body every worker runs."""
    init: ctypes._CFuncPtr  # type: ignore[name-defined]
    post: ctypes._CFuncPtr  # type: ignore[name-defined]


@functools.cache
def _runtimes() -> tuple[_Runtime, ...]:
    """Every OpenMP runtime loaded in this process (torch's among them) with libgomp's entry points."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if _RUNTIME.search(path) and path not in paths:
                    paths.append(path)
    except OSError:
        return ()
    found = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            start, end, threads = lib.GOMP_parallel_start, lib.GOMP_parallel_end, lib.omp_get_max_threads
        except (OSError, AttributeError):
            continue
        start.argtypes, start.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint], None
        end.argtypes, end.restype = [], None
        threads.argtypes, threads.restype = [], ctypes.c_int
        found.append(_Runtime(start, end, threads))
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


class _Threads:
    """The process's threads other than onnxruntime's, with a descriptor on each one's `wchan` ("0" while it is
    on a core or waiting for one: ~2 µs a read, `stat` takes 3); listed again when the process's thread count
    changes (a pool made or grown)."""

    def __init__(self) -> None:
        self.ours: set[int] = set()
        """onnxruntime's pool threads (`onnxruntime_threads`), idle between runs (`session.force_spinning_stop`)."""
        self.kept: dict[int, int] = {}
        self.count = -1
        self.pid = os.getpid()
        """The process the descriptors were opened in (`/proc/self` of a forked child is another process)."""
        self.hot = -1
        """The thread found running last."""
        self.lock = threading.Lock()

    def relist(self) -> None:
        if self.pid != os.getpid():  # forked: the parent's threads are not ours
            self.pid = os.getpid()
            self.ours.clear()
            for fd in self.kept.values():  # inherited copies, on the parent's threads
                with suppress(OSError):
                    os.close(fd)
            self.kept.clear()
            self.hot = -1
        try:
            present = {int(t) for t in os.listdir(_TASKS)}
        except OSError:
            present = set()
        self.ours &= present  # a dead thread's id may be given to a new one
        tids = present - self.ours
        for tid in set(self.kept) - tids:
            os.close(self.kept.pop(tid))
        for tid in tids - set(self.kept):
            with suppress(OSError):
                self.kept[tid] = os.open(f"{_TASKS}/{tid}/wchan", os.O_RDONLY)
        self.count = len(present)

    def running(self, me: int) -> bool:
        """Whether a thread other than `me` and onnxruntime's is running or runnable. The one found last is
        read first: a contended check is then one read."""
        with self.lock:
            if self.pid != os.getpid():
                self.relist()
            if self.hot != me and self._on_core(self.hot):
                return True
            try:
                count = os.stat(_TASKS).st_nlink - 2  # a task directory links its threads, itself and its parent
            except OSError:
                return False
            if count != self.count:
                self.relist()
            for tid in self.kept:
                if tid != me and tid != self.hot and self._on_core(tid):
                    self.hot = tid
                    return True
        return False

    def _on_core(self, tid: int) -> bool:
        fd = self.kept.get(tid)
        if fd is None:
            return False
        try:
            return os.pread(fd, 8, 0) == b"0"
        except OSError:  # gone: the next check lists again
            self.count = -1
            return False


_threads = _Threads()


@contextmanager
def onnxruntime_threads() -> Iterator[None]:
    """Record the threads made inside (an onnxruntime session's pool) as onnxruntime's."""
    try:
        before = set(os.listdir(_TASKS))
    except OSError:
        yield
        return
    try:
        yield
    finally:
        with _threads.lock:
            _threads.ours.update(int(t) for t in set(os.listdir(_TASKS)) - before)
            _threads.relist()


def contended() -> bool:
    """Whether this thread's OpenMP pool has workers and another thread of the process runs now (a spinning
    worker, most of the time)."""
    runtimes = _runtimes()
    if not runtimes or all(r.threads() <= 1 for r in runtimes):
        return False
    return _threads.running(threading.get_native_id())


@contextmanager
def parked() -> Iterator[None]:
    """Run the body with the workers of the calling thread's OpenMP pools asleep on a semaphore."""
    libc = _libc()
    runtimes = [r for r in _runtimes() if r.threads() > 1]
    if libc is None or not runtimes:
        yield
        return
    entered: list[tuple[_Runtime, ctypes.Array[ctypes.c_char], int]] = []
    try:
        for r in runtimes:
            sem = ctypes.create_string_buffer(SEM_T_BYTES)
            if libc.init(sem, 0, 0) != 0:
                continue
            workers = r.threads() - 1
            r.start(libc.wait, ctypes.addressof(sem), 0)
            entered.append((r, sem, workers))
        yield
    finally:
        for r, sem, workers in reversed(entered):
            for _ in range(workers):
                libc.post(sem)
            r.end()
