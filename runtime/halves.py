"""A training step run as two halves of the batch at once, each on one-thread sessions of its own.

Where the forward computes sample by sample (`samples`), a batch's step is its halves' combined: outputs holding the
batch joined, a loss weighed by each half's share of the rows it counts (labels not ignored) for a mean, added for a
sum, and the gradients alike (an input's gradient: each half's rows, so weighed, joined). Two halves on one thread
each beat the whole batch on two threads on this 2-core class of machine (session 47, fused LeNet runs: 2.05 against
2.75 ms with the VM's two CPUs near each other, 2.08 against 7.0 far apart; LeNet 3-32-64 at batch 32, far, 8.1
against 17.2): a kernel split over two threads makes each op's data move between the CPUs' caches, while each half's
data stays on its own CPU. Each half has a session of its own (one session run from two threads lost the gain: 4.5
ms far); they allocate from the process-wide arena (`OWN_ARENAS`). Dropouts whose masks the host draws get the whole
batch's masks cut at each half's rows, so the step is the whole batch's, draw for draw.

`Halves` runs a fused step (`fused`: forward and backward in one run) so; `SplitHalves` a split one (a forward, then
its backward, each half's stash kept for its own backward) where the forward has convolutions (`SPLIT_OPS`: MLPs
lost). Whether it pays is the machine's to say: `Trial` times the halves (arm 0, the runs before its verdict too)
against the whole batch (arm 1, on the threads the session chooses), which takes over only where 1.1x faster, and is
tried again sooner (`TRIAL_RECHECK`). Halves first, since they were faster in every case of these kinds measured,
near and far (session 48, in one process, paired with torch's steps: LeNet 0.83 of torch's step against 0.95 whole;
LeNet at batch 128 0.63 / 1.00; 3x3 convs 0.81 / 1.36 far; LeNet 32-64 0.76 / 0.80 near, 0.83 / 1.39 far; LeNet on
RGB 0.95 / 1.07; the reference encoder 0.72 / 0.76 near, 0.61 / 0.84 far), and a benchmark's first ~30 steps are a
trial's. The first halves' run is compared with the whole batch's run of the same call, as the fused run is with
the split ones: a difference warns and the halves stop.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from onnxruntime.capi import _pybind_state as C

from . import checks, exchange, host_dropout, lowering, openmp
from .export import pin_dims
from .host_dropout import MaskedRunner
from .ort_session import BACKWARD_DISABLED_OPTIMIZERS, Runner, SessionConfig, Trial, TrialSettings
from .passes import Nodes, names_in_use
from .samples import Rows

MIN_ROWS = 8
"""Batches below this run whole: halves of a few rows leave each thread too little work to gain."""
SPLIT_MIN_ROWS = 32
"""The same for split steps, whose halves pay twice for the handing over (forward and backward) and once for adding
the weight gradients: LeNet at batch 16 ran 2-3% slower with them (0.952 of torch's step against 0.931 without,
3 processes each)."""
SPLIT_OPS = frozenset({"Conv", "ConvTranspose"})
"""Split steps run as halves only where the forward has one of these: onnxruntime's convolutions gain from a
thread each on half the batch, its matrix products at MLP sizes do not (one process, halves against the whole
batch: 784-512-512-10 at batch 64 2.60 against 1.93 ms far, 784-1024-1024-10 at batch 128 8.14 / 7.19 near,
784-512-256-10 at batch 256 4.52 / 4.28 far; 3 processes each against torch's step, halves in the trial / none:
0.915 / 0.831 far and 1.010 / 0.994 near), while Caffe's LeNet (20 and 50 channels, dense 500) took 14.8 against
25.7 ms far and 12.0 / 13.7 near (0.735 / 0.780 of torch's step, 3 processes each)."""

OWN_ARENAS = False
"""Each half's session allocating from an arena of its own instead of the process-wide one the whole run uses
(`SessionConfig.shared_arena`): off. Own arenas keep a second copy of the activations' memory (each holds its half's
peak, the shared one the whole run's from trials) for as long as the process lives, and bought little (session 48,
3 processes each: LeNet near 0.860 of torch's step with them against 0.853 without; on RGB 1.029 / 1.014; at batch
128, far, 0.552 / 0.586)."""

Values = C.OrtValueVector | list[C.OrtValue] | list[torch.Tensor]
"""A run's outputs: onnxruntime's vector, a list of OrtValues (a runner that assembles its outputs), or torch
tensors (the halves' outputs combined on the host, handed on as they are)."""


class Worker:
    """A thread that runs the calls handed to it, one at a time, made again in a forked child (threads do not
    survive a fork)."""

    def __init__(self) -> None:
        self._pid = -1
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]]] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

    def start(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the thread; `result` waits for it."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._jobs, self._done = queue.SimpleQueue(), queue.SimpleQueue()
            threading.Thread(target=self._loop, args=(self._jobs, self._done), name="gradbuilder-half",
                             daemon=True).start()
        self._jobs.put((fn, args))

    def result(self) -> Any:
        """The last call's result; what it raised is raised here."""
        ok, value = self._done.get()
        if not ok:
            raise value
        return value

    @staticmethod
    def _loop(jobs: queue.SimpleQueue, done: queue.SimpleQueue) -> None:
        while True:
            fn, args = jobs.get()
            try:
                done.put((True, fn(*args)))
            except BaseException as e:  # handed to the caller, which raises it
                done.put((False, e))


WORKER = Worker()
"""The process's one worker thread for second halves: a thread each would outlive its session (it waits on its queue
for good), one for every input size and reconfiguration a process meets."""
BUSY = threading.Lock()
"""Held while halves run: a second caller thread (two threads stepping modules at once) runs its batch whole rather
than hand the worker a second job whose result the first could take. A forked child gets a free one (the thread
that held it does not exist there)."""


def _free_in_child() -> None:
    global BUSY
    BUSY = threading.Lock()


os.register_at_fork(after_in_child=_free_in_child)


@dataclass(frozen=True)
class Cut:
    """A batch cut in two: each half's feeds (parameters whole in both), the first half's samples, and the weights
    of each half's loss and gradients in the batch's."""

    feeds: tuple[dict[str, C.OrtValue], dict[str, C.OrtValue]]
    first: int
    weights: tuple[float, float] | None
    """None where the halves' runs count their labels themselves (`Halves.counted`)."""
    rows: int
    """The batch's."""


def halved_rows(n: int) -> tuple[int, int]:
    """The rows of each half of a batch of `n`: the first half the smaller."""
    return n // 2, n - n // 2


def cut(feeds: Mapping[str, C.OrtValue], rows: Rows, min_rows: int | None = None, counted: bool = False
        ) -> Cut | None:
    """`feeds` cut in halves along the batch, weighed by each half's rows the loss counts (labels not ignored) for a
    mean, 1 each for a sum or without a loss; None where the batch runs whole (too few rows, inputs of other batch
    sizes, a half whose labels are all ignored). `counted`: the halves' runs count their labels (no weights)."""
    n = feeds[rows.batched[0]].shape()[0]
    if n < (MIN_ROWS if min_rows is None else min_rows):
        return None
    h = halved_rows(n)[0]
    parts: tuple[dict[str, C.OrtValue], dict[str, C.OrtValue]] = (dict(feeds), dict(feeds))
    for name in rows.batched:
        t = exchange.to_torch(feeds[name])
        if t.shape[0] != n:
            return None
        parts[0][name], parts[1][name] = exchange.to_ortvalue(t[:h]), exchange.to_ortvalue(t[h:])
    loss = rows.loss
    if loss is None or not loss.mean:
        return Cut(parts, h, (1.0, 1.0), n)
    if counted:
        return Cut(parts, h, None, n)
    labels = exchange.to_numpy(feeds[loss.labels])  # numpy counts a few labels in ~1 µs, torch in ~5
    if loss.ignore_index is None:
        counts = (labels[:h].size, labels[h:].size)
    else:
        counts = (int(np.count_nonzero(labels[:h] != loss.ignore_index)),
                  int(np.count_nonzero(labels[h:] != loss.ignore_index)))
    if 0 in counts:
        return None
    total = counts[0] + counts[1]
    return Cut(parts, h, (counts[0] / total, counts[1] / total), n)


@dataclass(frozen=True)
class Ready:
    """What one run of the halves takes (`_Halving._ready`)."""

    cut: Cut
    park: bool
    drawn: dict[str, C.OrtValue]
    """The whole batch's Dropout masks ({} without)."""
    masks: tuple[dict[str, C.OrtValue], dict[str, C.OrtValue]]
    """Each half's masks, cut from `drawn` at its rows."""


def _pinned_runner(model: onnx.ModelProto, backward: onnx.ModelProto, config: SessionConfig,
                   like: Runner | MaskedRunner, shapes: dict[str, tuple[int, ...]] | None = None
                   ) -> Runner | MaskedRunner:
    """A half's session of the fused graph, its inputs in `shapes` pinned to those sizes (batch included)."""
    return lowering.fused_runner(pin_dims(model, shapes, batch=True) if shapes else model, backward, config, like)


def _run_half(runner: Runner | MaskedRunner, feeds: dict[str, C.OrtValue], masks: dict[str, C.OrtValue],
              names: Sequence[str]) -> Values:
    """One half's run: with its masks where its Dropouts take the host's."""
    if isinstance(runner, MaskedRunner):
        return runner.run_drawn(feeds, masks, names)
    return runner.run_vector(feeds, names)


def combined(x: Sequence[torch.Tensor], y: Sequence[torch.Tensor], weights: tuple[float, float],
             joined: Collection[int] = ()) -> list[torch.Tensor]:
    """The halves' losses or gradients combined: weighed (a mean's) or added (a sum's); those at `joined` (the
    gradients of inputs holding the batch: each half's rows) weighed alike and joined along the batch. torch's
    foreach ops take the lists in one call each (on the CPU the same kernel per tensor as `p.mul(a).add_(q,
    alpha=b)`, so the same values): two calls from Python instead of two a tensor, each slow on the caches the
    halves' runs leave (LeNet's eleven outputs: ~150 µs in the step against ~60 warm)."""
    a, b = weights
    if joined:
        rest = iter(combined([t for i, t in enumerate(x) if i not in joined],
                             [t for i, t in enumerate(y) if i not in joined], weights))
        return [(torch.cat([x[i], y[i]]) if a == b == 1.0 else torch.cat([x[i] * a, y[i] * b])) if i in joined
                else next(rest) for i in range(len(x))]
    if a == b == 1.0:
        return list(torch._foreach_add(x, y))
    out = list(torch._foreach_mul(x, a))
    torch._foreach_add_(out, y, alpha=b)
    return out


class FlatOutputs:
    """One half's fused runs writing all their outputs into one buffer (onnxruntime's IOBinding), so that the halves'
    outputs combine in one or three numpy ops over the two buffers and come out as numpy's views taken by torch
    (`views`), instead of two torch ops and an OrtValue conversion a tensor (LeNet at batch 64, eleven outputs: ~170 µs
    of Python on the caches the runs leave, a torch op ~8 µs there); and onnxruntime allocates no outputs (a LeNet
    half's run 1-2% faster). Laid out from a run's outputs (`lay_out`); a run whose outputs have other sizes fails
    onnxruntime's check of the bound buffers and lays them out again (`Halves._run`). Each run reuses the buffer: the
    combination makes a new one. Inputs stay bound from run to run (only those fed another OrtValue are bound
    again), so a run's inputs live until the next."""

    DTYPES = (torch.float32, torch.float64, torch.float16)
    """Buffers numpy computes on (not bfloat16)."""

    def __init__(self, runner: Runner | MaskedRunner, names: Sequence[str]):
        self.runner = runner
        self.names = list(names)
        self._bound: Runner | None = None
        """The runner whose session runs (`runner`, or for a MaskedRunner the one its drawn runs take)."""
        self.binding: C.SessionIOBinding | None = None
        self.buffer: np.ndarray | None = None
        self.spans: list[tuple[int, int, tuple[int, ...]]] = []
        """Each output's place in the buffer (start, end) and sizes, for `views`."""
        self.checked = False
        """Whether a bound run was seen writing where its outputs are bound (onnxruntime may copy an output it
        cannot write in place: then not bound)."""
        self._fed: dict[str, C.OrtValue] = {}

    def lay_out(self, outputs: Sequence[torch.Tensor]) -> None:
        """Bind the outputs to one buffer laid out as `outputs` (a run's); none where they do not share a dtype
        numpy computes on, or the runner's runs cannot be bound (`Runner.binding`)."""
        self.buffer = None
        dtypes = {t.dtype for t in outputs}
        if len(dtypes) != 1 or outputs[0].dtype not in self.DTYPES:
            return
        runner = self.runner if isinstance(self.runner, Runner) else self.runner.drawn_runner(self.names)
        if runner is not self._bound:
            self._bound, self.binding, self._fed = runner, runner.binding() if runner else None, {}
        if self.binding is None:
            return
        ends = np.cumsum([t.numel() for t in outputs]).tolist()
        self.spans = [(end - t.numel(), end, tuple(t.shape)) for t, end in zip(outputs, ends)]
        buffer = torch.empty(ends[-1], dtype=outputs[0].dtype).numpy()
        self.binding.clear_binding_outputs()
        for name, view in zip(self.names, self.views(buffer)):
            self.binding.bind_ortvalue_output(name, exchange.to_ortvalue(view))
        self.buffer, self.checked = buffer, False

    def run(self, feeds: Mapping[str, C.OrtValue], masks: Mapping[str, C.OrtValue]) -> np.ndarray:
        """The buffer, after a run of `feeds` (with the host's Dropout `masks` for a MaskedRunner)."""
        fed, binding = self._fed, self.binding
        assert binding is not None and self._bound is not None and self.buffer is not None
        for name, v in (*feeds.items(), *masks.items()):
            if fed.get(name) is not v:
                binding.bind_ortvalue_input(name, v)
                fed[name] = v
        self._bound.run_bound(binding)
        if not self.checked:
            got = binding.get_outputs()
            views = self.views(self.buffer)
            if any(got[i].data_ptr() != v.ctypes.data for i, v in enumerate(views)):
                raise _NotInPlace()
            self.checked = True
        return self.buffer

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        """Arrays over a buffer laid out as this one, one an output: numpy's views, which torch takes with
        `from_numpy` at about half the cost of its own views (LeNet's eleven outputs after the halves' runs: 44-69
        µs against 88-141 for `unflatten_dense_tensors`, DDP's one C++ call for its buckets)."""
        return [flat[start:end].reshape(shape) for start, end, shape in self.spans]


def _weights(mine: float, theirs: float) -> tuple[float, float]:
    """A mean's halves weighed by the labels each keeps (counted by their runs); without any, the first half's
    outputs (a nan loss, no gradient), as the whole batch's run gives."""
    total = mine + theirs
    return (mine / total, theirs / total) if total else (1.0, 0.0)


def _standing(weights: tuple[float, float]) -> int | None:
    """The half whose module outputs (the loss) stand for the batch's where the other keeps no label (its loss nan,
    0 / 0, weighed by 0); None where both keep some."""
    a, b = weights
    return 1 if a == 0.0 else 0 if b == 0.0 else None


def _counting(model: onnx.ModelProto, loss: str, labels: str, ignore_index: int
              ) -> tuple[onnx.ModelProto, str] | None:
    """A copy of `model` with one more output (named as returned): how many of `labels` are not `ignore_index`, in
    the type of the `loss` output (None unless float or double: a float count is exact up to 2^24 labels a half, and
    past that off by float's rounding, as the loss is; zero stays exactly zero). The halves' runs count their labels
    so, where the host counted them before the runs (~80 µs of numpy a step on the caches a torch step leaves, ~8
    warm)."""
    loss_type = next(o for o in model.graph.output if o.name == loss).type.tensor_type.elem_type
    if loss_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE):
        return None
    counting = onnx.ModelProto()
    counting.CopyFrom(model)
    g = counting.graph
    label_type = next(i for i in g.input if i.name == labels).type.tensor_type.elem_type
    e = Nodes(f"{labels}/kept", names_in_use(g))
    index = e("Constant", value=numpy_helper.from_array(
        np.array(ignore_index, dtype=helper.tensor_dtype_to_np_dtype(label_type)), "v"))
    count = e("ReduceSum", e("Cast", e("Not", e("Equal", labels, index)), to=loss_type), keepdims=0)
    g.node.extend(e.nodes)
    g.output.append(helper.make_tensor_value_info(count, loss_type, []))
    return counting, count


class _NotInPlace(RuntimeError):
    """onnxruntime did not write every output where it was bound."""


def _half_config(config: SessionConfig) -> SessionConfig:
    """A half's sessions: one thread, nothing of the whole run's thread management."""
    return dataclasses.replace(config, threads=1, shared_arena=config.shared_arena and not OWN_ARENAS,
                               choose_threads=False, narrow_when_crowded=False, park_openmp=False)


class _Halving:
    """What both kinds of halves share: the worker, the lock that keeps it to one caller, the trial, the first
    run's check and its verdict."""

    def __init__(self, rows: Rows, masked: MaskedRunner | None, min_rows: int | None = None):
        self.rows = rows
        self.masked = masked
        """The whole batch's runner where it feeds the host's Dropout masks: the halves get theirs cut from its."""
        self.min_rows = min_rows
        """Batches below this run whole (None: `MIN_ROWS`, read at each cut)."""
        self.worker = WORKER
        self.trial = Trial(TrialSettings.now(warmup=0))
        """The halves (arm 0) against the whole batch, whose runner ran already (the first halves' check): no
        warm-up runs for it."""
        self.halves_arm = 0
        """The trial's arm of the halves: the first, run until a verdict (they were faster in every case measured)."""
        self.checked = False
        """Whether a halves' run was compared with the whole run of the same call (at the first)."""
        self.off = False
        """The halves differed from the whole run: whole runs only."""
        self.runs = 0
        """Runs made as halves."""
        self.counted = False
        """Whether the halves' runs count the labels their loss keeps (`Halves`), instead of the host before them."""

    @property
    def _busy(self) -> threading.Lock:
        return BUSY

    def pin(self, halves: bool) -> None:
        """Run the halves (or the whole batch) from now on, never tried again."""
        self.trial.pin(self.halves_arm if halves else 1 - self.halves_arm)

    def _arm(self) -> tuple[int, bool]:
        """The arm this run takes (the halves' at the first chance, to check them) and whether it is a trial's."""
        trial = self.trial
        if not self.checked:
            return self.halves_arm, False
        tried = trial.due()
        return (trial.arm if tried else trial.chosen if trial.chosen is not None else 0), tried

    def _ready(self, feeds: Mapping[str, C.OrtValue]) -> Ready | None:
        """What the halves need to run now: the cut, whether to park torch's workers, and the host's Dropout masks
        of the whole batch (drawn as the whole run would draw them, from torch's generator) with each half's cut
        from them; None where the batch cannot be weighed, the masks' shapes are not known yet (the whole run
        learns them), or the machine is crowded (the second thread would wait for a core)."""
        halves = cut(feeds, self.rows, self.min_rows, self.counted)
        shapes = self.masked.mask_shapes(feeds) if self.masked is not None else {}
        if halves is None or shapes is None:
            return None
        n = feeds[self.rows.batched[0]].shape()[0]
        if any(shape[0] % n for shape in shapes.values()):  # not the batch's rows (the proof says they are): whole
            return None
        park, crowded = openmp.room(2)
        if crowded:
            return None
        drawn = self.masked.fresh(shapes) if self.masked is not None and shapes else None  # the call's draws, taken
        if not drawn:
            return Ready(halves, park, {}, ({}, {}))
        parts: tuple[dict[str, C.OrtValue], dict[str, C.OrtValue]] = ({}, {})
        for name, mask in drawn.items():
            t = exchange.to_torch(mask)
            rows = halves.first * (t.shape[0] // n)
            parts[0][name], parts[1][name] = exchange.to_ortvalue(t[:rows]), exchange.to_ortvalue(t[rows:])
        return Ready(halves, park, drawn, parts)

    def _record(self, arm: int, tried: bool, seconds: float) -> None:
        if tried:
            self.trial.record(arm, seconds)
        elif self.trial.chosen is not None:
            self.trial.watch(seconds)

    def _both(self, run: Callable[[int], Any], park: bool, later: bool = False) -> tuple[Any, Any]:
        """`run(0)` here and `run(1)` on the worker, at once (torch's workers parked meanwhile where `park`; with
        `later`, joined at `openmp.join`, for callers whose next torch ops are not parallel: `openmp.defer_joins`)."""
        entered = openmp.park() if park else None
        try:
            self.worker.start(run, 1)
            try:
                mine = run(0)
            finally:
                theirs = self.worker.result()
        finally:
            if entered is not None:
                openmp.release(entered, later)
        return mine, theirs

    def _verdict(self, problem: str | None) -> None:
        if problem is not None:
            self.off = True
            warnings.warn(f"the halves of the batch, run at once, differ from the whole batch's run ({problem}), so "
                          "the batch runs whole from now on; please report it with the module.", RuntimeWarning,
                          stacklevel=5)


class Halves(_Halving):
    """The halves of a fused graph's runs: two one-thread sessions of it, the second run on the worker."""

    def __init__(self, model: onnx.ModelProto, backward: onnx.ModelProto, config: SessionConfig,
                 whole: Runner | MaskedRunner, like: Runner | MaskedRunner, rows: Rows, names: Sequence[str],
                 first: int, joined: Collection[int] = (), batch: Mapping[str, tuple[int, ...]] | None = None):
        super().__init__(rows, masked=whole if isinstance(whole, MaskedRunner) else None)
        half = _half_config(config)
        self.names = list(names)
        run_names = list(names)
        loss = rows.loss
        counting = (_counting(model, loss.output, loss.labels, loss.ignore_index)
                    if loss is not None and loss.mean and loss.ignore_index is not None else None)
        if counting is not None:
            model, count = counting
            run_names.append(count)
            self.counted = True
        self._runner = functools.partial(_pinned_runner, model, backward, half, like)
        shapes = {k: v for k, v in (batch or {}).items() if k in rows.batched} if convolutional(model) else {}
        n = next(iter(shapes.values()))[0] if shapes else 0
        self.sizes = halved_rows(n) if n >= 2 and all(v[0] == n for v in shapes.values()) else None
        """The rows each half's session is pinned to, in a convolutional graph (the halves of the batch `batch` gives:
        onnxruntime then folds the shape arithmetic the pools' and convolutions' gradients write for a symbolic batch,
        a LeNet half's 160 nodes to 134; an encoder's 406 to 393, measured level or slower); halves of other sizes run
        on `others`."""
        self.runners = ([self._runner({k: (r, *v[1:]) for k, v in shapes.items()}) for r in self.sizes]
                        if self.sizes is not None else [self._runner() for _ in range(2)])
        self._others: list[Runner | MaskedRunner] | None = None
        self.run_names = run_names
        """`names`, then (`counted`) the labels each half's loss keeps."""
        self.first = first
        """The module's outputs come first in `names`, the gradients after."""
        self.joined = frozenset(joined)
        """Positions in `names` of the gradients of inputs holding the batch: the halves' rows, joined."""
        self.flats = None if self.joined else [FlatOutputs(r, run_names) for r in self.runners]
        """Each half's outputs in one buffer (`FlatOutputs`); None where not (an input's gradient: its rows)."""

    def run(self, feeds: Mapping[str, C.OrtValue], whole: Callable[[Mapping[str, C.OrtValue]], Values]) -> Values:
        """The fused graph's outputs for `feeds`: from the halves where they are chosen (or tried, or checked: the
        first time they can), else `whole`. A trial's run is timed and recorded; the batch is cut only where the
        halves run."""
        if self.off or not self._busy.acquire(blocking=False):
            return whole(feeds)
        try:
            arm, tried = self._arm()
            ready = self._ready(feeds) if arm == self.halves_arm else None
            if arm == self.halves_arm and ready is None:
                return whole(feeds)
            if ready is not None and not self.checked:
                self.checked = True
                return self._checked(feeds, whole, ready)
            start = time.perf_counter()
            out = self._run(ready) if ready is not None else whole(feeds)
            self._record(arm, tried, time.perf_counter() - start)
            return out
        finally:
            self._busy.release()

    def _run(self, ready: Ready) -> list[torch.Tensor]:
        """Both halves at once, their outputs combined (torch tensors: not made OrtValues only to be made tensors
        again for autograd): from their buffers where laid out (`flats`), else from their output vectors, which
        then lay the buffers out."""
        self.runs += 1
        halves = ready.cut
        runners, flats = self.runners, self.flats
        if self.sizes is not None and halved_rows(halves.rows) != self.sizes:
            runners, flats = self.others(), None
        if flats is not None and flats[0].buffer is not None and flats[1].buffer is not None:
            try:
                mine, theirs = self._both(lambda i: flats[i].run(halves.feeds[i], ready.masks[i]), ready.park,
                                          later=True)
            except _NotInPlace:
                self.flats = None
            except RuntimeError:  # other sizes than the buffers': laid out again below
                pass
            else:
                weights = _weights(float(mine[-1]), float(theirs[-1])) if self.counted else halves.weights
                return self._flat_combined(flats[0], mine, theirs, weights)
        got = self._both(lambda i: exchange.vector_to_torch(
            _run_half(runners[i], halves.feeds[i], ready.masks[i], self.run_names)), ready.park)
        if flats is not None:
            for flat, outputs in zip(flats, got):
                flat.lay_out(outputs)
        weights = halves.weights
        if self.counted:
            weights = _weights(float(got[0].pop()), float(got[1].pop()))
        assert weights is not None
        out = combined(got[0], got[1], weights, self.joined)
        standing = _standing(weights)
        if standing is not None:
            out[:self.first] = got[standing][:self.first]
        return out

    def others(self) -> list[Runner | MaskedRunner]:
        """The halves' sessions for batches of other sizes than `sizes` (symbolic, made at the first such batch)."""
        if self._others is None:
            self._others = self.runners if self.sizes is None else [self._runner() for _ in range(2)]
        return self._others

    def _flat_combined(self, flat: FlatOutputs, mine: np.ndarray, theirs: np.ndarray, weights: tuple[float, float]
                       ) -> list[torch.Tensor]:
        """The halves' buffers combined as `combined` combines their outputs, in views of one new buffer; the
        module's outputs (the loss) copied out of it, so that a loss kept (logged) keeps no gradients' memory. numpy's
        ops run on this thread (a torch op over the buffers would wake torch's workers) and cost no dispatch."""
        a, b = weights
        if a == b:  # equal counts (0.5) or a sum's (1.0): scaling by a power of two, exact either way round
            together = np.add(mine, theirs)
            if a != 1.0:
                together *= a
        else:
            together = np.add(np.multiply(mine, a, out=mine), np.multiply(theirs, b, out=theirs))
        first = self.first
        standing = _standing(weights)
        if standing is not None:
            ahead = flat.spans[first - 1][1] if first else 0
            together[:ahead] = (mine, theirs)[standing][:ahead]
        return [torch.from_numpy(v.copy() if i < first else v)
                for i, v in enumerate(flat.views(together)[:len(self.names)])]

    def _checked(self, feeds: Mapping[str, C.OrtValue], whole: Callable[[Mapping[str, C.OrtValue]], Values],
                 ready: Ready) -> Values:
        """The whole run (with the masks the halves cut theirs from), and the halves' against it: the same math
        unless a rewrite of the graph reads the batch's size (`samples` proved the exported graph). A difference
        warns and the halves stop."""
        masked = self.masked
        out = masked.run_drawn(feeds, ready.drawn, self.names) if masked is not None else whole(feeds)
        try:
            got = exchange.vector_to_torch(self._run(ready))
        except RuntimeError as e:
            problem: str | None = f"they failed: {e}"
        else:
            want = exchange.vector_to_torch(out)
            problem = checks.mismatch(got[:1], want[:1]) or checks.gradients_mismatch(got[1:], want[1:])
        self._verdict(problem)
        return out


@dataclass
class Halved:
    """A split forward run as halves: each half's values for its backward, the first half's samples, and the
    halves' weights."""

    values: tuple[dict[str, C.OrtValue], dict[str, C.OrtValue]]
    first: int
    weights: tuple[float, float]


def convolutional(model: onnx.ModelProto) -> bool:
    """Whether a graph has convolutions (`SPLIT_OPS`): where a forward's split steps may run as halves, and where the
    halves' sessions are pinned to their rows (`Halves.sizes`)."""
    return any(n.op_type in SPLIT_OPS for n in model.graph.node)


class SplitHalves(_Halving):
    """The halves of a split step (a forward, then its backward): one-thread sessions of the forward and of the full
    backward for each half, the second half's runs on the worker; each half's forward values kept for its own
    backward. Only for convolutional forwards (`SPLIT_OPS`) at 32 rows or more (`SPLIT_MIN_ROWS`); first in the trial,
    as fused halves are: those convolutional steps gained in every case measured (session 48, one process, halves /
    whole batch against torch's step, the loss outside the module: LeNet 0.63 / 0.83 at batch 64 (CPUs moving), 0.49
    / 0.76 at 128, LeNet 16-32 0.94 / 1.00 near; Caffe's LeNet, the loss inside, 12.0 / 13.7 ms near, 14.8 / 25.7
    far)."""

    def __init__(self, forward: onnx.ModelProto, backward: onnx.ModelProto, config: SessionConfig, rows: Rows,
                 whole: Runner | MaskedRunner, forward_names: Sequence[str], output_names: Sequence[str],
                 backward_names: Sequence[str], joined: Collection[int] = ()):
        super().__init__(rows, masked=whole if isinstance(whole, MaskedRunner) else None, min_rows=SPLIT_MIN_ROWS)
        self._graphs = (forward, backward, _half_config(config))
        self._sessions: tuple[list[Runner | MaskedRunner], list[Runner]] | None = None
        self.forward_names = list(forward_names)
        self.output_names = list(output_names)
        self.backward_names = list(backward_names)
        self.per_sample = dict(rows.outputs)
        """The outputs holding the batch, each with its rows a sample."""
        self.joined = frozenset(joined)
        """Positions in `backward_names` of the gradients of inputs holding the batch: the halves' rows, joined."""

    def forward(self, feeds: Mapping[str, C.OrtValue],
                whole: Callable[[dict[str, C.OrtValue] | None], tuple[list[C.OrtValue], Any]],
                check: Callable[[list[C.OrtValue], Any, list[C.OrtValue], Halved], str | None]
                ) -> tuple[list[C.OrtValue], Any, Halved | None, tuple[int, bool, float] | None]:
        """The module outputs, the whole forward's state (None where the halves ran), the halves' values (None
        where the whole ran), and the timing the backward completes (`timed`: the arm, whether a trial's, the
        forward's seconds; None outside trials and verdicts). `whole(masks)`: the whole batch's forward (with these
        Dropout masks, or its own draws for None); `check(outputs, state, half outputs, halved)`: the first halves
        against the whole forward and backward, a problem or None."""
        if self.off or not self._busy.acquire(blocking=False):
            outs, state = whole(None)
            return outs, state, None, None
        try:
            arm, tried = self._arm()
            ready = self._ready(feeds) if arm == self.halves_arm else None
            if ready is None:
                start = time.perf_counter()
                outs, state = whole(None)
                timed = self._timed(arm, tried, start) if arm != self.halves_arm else None
                return outs, state, None, timed
            if not self.checked:
                self.checked = True
                outs, state = whole(ready.drawn if self.masked is not None else None)
                try:
                    half_outs, halved = self._forward(ready)
                    problem = check(outs, state, half_outs, halved)
                except RuntimeError as e:
                    problem = f"they failed: {e}"
                self._verdict(problem)
                return outs, state, None, None
            start = time.perf_counter()
            half_outs, halved = self._forward(ready)
            return half_outs, None, halved, self._timed(arm, tried, start)
        finally:
            self._busy.release()

    @property
    def forwards(self) -> list[Runner | MaskedRunner]:
        """The halves' forward sessions, made at their first run (a batch below `SPLIT_MIN_ROWS` never makes them)."""
        return self._made()[0]

    @property
    def backwards(self) -> list[Runner]:
        return self._made()[1]

    def _made(self) -> tuple[list[Runner | MaskedRunner], list[Runner]]:
        if self._sessions is None:
            forward, backward, half = self._graphs
            lowered = lowering.forward(forward, half)  # once for both halves
            self._sessions = ([host_dropout.forward_runner(lowered, half, "half of the forward") for _ in range(2)],
                              [Runner(backward, half, "half of the backward", BACKWARD_DISABLED_OPTIMIZERS)
                               for _ in range(2)])
        return self._sessions

    def _forward(self, ready: Ready) -> tuple[list[C.OrtValue], Halved]:
        self.runs += 1
        halves = ready.cut
        forwards = self.forwards  # made here, not by both threads at once

        def run(i: int) -> dict[str, C.OrtValue]:
            values = _run_half(forwards[i], halves.feeds[i], ready.masks[i], self.forward_names)
            env = dict(halves.feeds[i])
            env.update(zip(self.forward_names, [values[j] for j in range(len(values))]))
            return env

        envs = self._both(run, ready.park)
        loss = self.rows.loss.output if self.rows.loss is not None else None
        outs = []
        for name in self.output_names:
            a, b = exchange.to_torch(envs[0][name]), exchange.to_torch(envs[1][name])
            outs.append(exchange.to_ortvalue(combined([a], [b], halves.weights)[0] if name == loss
                                             else torch.cat([a, b])))
        return outs, Halved(envs, halves.first, halves.weights)

    def backward(self, halved: Halved, grads: Sequence[C.OrtValue | None],
                 feeds: Callable[[dict[str, C.OrtValue], list[C.OrtValue | None]], dict[str, C.OrtValue]]
                 ) -> list[torch.Tensor]:
        """The full backward's outputs for the module outputs' gradients `grads`, each half's run with its share of
        them (a loss's scaled by the half's weight, others cut at the half's rows; `feeds(values, grads)`: a half's
        backward feeds), added; both at once where the worker is free, else one after the other."""
        shares: list[list[C.OrtValue | None]] = [[], []]
        loss = self.rows.loss.output if self.rows.loss is not None else None
        for name, g in zip(self.output_names, grads):
            if g is None:
                shares[0].append(None)
                shares[1].append(None)
                continue
            t = exchange.to_torch(g)
            if name == loss:
                parts = [t * w for w in halved.weights]
            else:
                rows = halved.first * self.per_sample[name]
                parts = [t[:rows], t[rows:]]
            for i in range(2):
                shares[i].append(exchange.to_ortvalue(parts[i]))
        fed = [feeds(halved.values[i], shares[i]) for i in range(2)]
        backwards = self.backwards

        def run(i: int) -> list[torch.Tensor]:
            return exchange.vector_to_torch(backwards[i].run_vector(fed[i], self.backward_names))

        if self._busy.acquire(blocking=False):
            try:
                mine, theirs = self._both(run, openmp.room(2)[0])
            finally:
                self._busy.release()
        else:
            mine, theirs = run(0), run(1)
        return combined(mine, theirs, (1.0, 1.0), self.joined)

    def _timed(self, arm: int, tried: bool, start: float) -> tuple[int, bool, float] | None:
        """A forward of `arm` begun at `start`, for the backward to complete: None outside trials and verdicts."""
        if tried or self.trial.chosen is not None:
            return arm, tried, time.perf_counter() - start
        return None

    def finish(self, timed: tuple[int, bool, float], seconds: float) -> None:
        """A step's backward took `seconds` after a forward `timed`: the step's time goes to the trial."""
        arm, tried, forward = timed
        self._record(arm, tried, forward + seconds)
