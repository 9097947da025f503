"""One onnxruntime session configured for training, run on OrtValues at the C level.

Training graphs need things inference sessions do not: Dropout must survive optimization
(`EliminateDropout` removes it at level BASIC and above, whatever its `training_mode`); equal
constants must stay apart (`ConstantSharing` merges them, but training-mode BatchNormalization writes
its batch statistics in place into its running-stat inputs, constants here (see `batchnorm`), so two
BatchNorms of equal width would report one's statistics for both); and a step runs thousands of
times, so the Python wrappers' per-call conversions are skipped. Backward sessions also go without
onnxruntime's NCHWc layout (`BACKWARD_DISABLED_OPTIMIZERS`). A run on more than one thread parks torch's
OpenMP workers if they are spinning (`openmp`), so that onnxruntime's threads have the cores. Sessions allocate
from one process-wide arena (`shared_arena`), so that a backward reuses the memory its forward just wrote.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import statistics
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
from onnxruntime.capi import _pybind_state as C

from gradbuilder.graph import graph_nodes

from . import double_forms, openmp

DISABLED_OPTIMIZERS = ("EliminateDropout", "ConstantSharing")
BACKWARD_DISABLED_OPTIMIZERS = (*DISABLED_OPTIMIZERS, "NchwcTransformer")
"""A backward's only Convs with a constant weight are the one-hot unfolds of weight gradients; over a single
input channel NCHWc takes them, and reordering their many-channel output back to NCHW cost more than the
blocked kernel saved (LeNet's first layer in onnxruntime's profile: 0.94 ms of Conv + 0.91 ms of ReorderOutput,
against 1.1 ms for the plain Conv; LeNet steps 0.95-1.04 of before, median 0.96, paired). The forward keeps NCHWc (its
pools use it; without, 1-channel to 3-channel LeNets were 1.00-1.04 of before)."""


class SessionLoadError(RuntimeError):
    """onnxruntime refused to create a session for a model."""


GRAPH_ORDER = ort.ExecutionOrder.PRIORITY_BASED
"""The execution order of sessions run in their graph's order (`SessionConfig.graph_order`)."""


@dataclass(frozen=True)
class SessionConfig:
    """How every onnxruntime session of one TrainingSession is created."""

    threads: int | None = None
    """intra-op threads; None lets onnxruntime choose (one per core)."""
    optimization: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    spin: bool = True
    """Let onnxruntime's idle threads spin while a run lasts, and stop them when it ends: a sleeping worker
    costs a futex wake-up (tens of µs in a VM) per parallel kernel, but threads spinning on after the run
    would steal the cores torch runs on in between (`session.force_spinning_stop`)."""
    shrink: bool = True
    """Rematerialize cheap tensors and stash boolean masks instead of what they are computed from
    (`passes.shrink_stash`)."""
    lower: bool = True
    """Rewrite backward nodes that onnxruntime runs slowly into equivalent faster ones (`passes.lower`)."""
    arena: bool = True
    """onnxruntime's CPU memory arena: kept on (0-5% faster steps); off for sessions run only now and then, whose
    arena would hold on to their largest run's memory."""
    mem_pattern: bool = False
    """onnxruntime's memory pattern (one block planned a run for all intermediates): off by default, since the plan
    holds more than the run needs at once (GPT-2-width, 4 layers: a backward's peak 614 MB above its start with it,
    451 without, the gradients 403 of those); ORTModule turns it on for small modules, where it saved ~10% of the
    CNN's step on the AVX2 machine (`engine.memory_pattern_pays`)."""
    shared_arena: bool = True
    """Sessions with an arena allocate from one process-wide arena (`shared_arena`) instead of one each, so that a
    backward writes into memory the forward just used, still in the cache, rather than into its own arena's (run
    alternately, the forward and backward of a Conv-ReLU-BatchNorm CNN took 5.7-6.7 ms with an arena each against
    5.0 run each in a block; 5.2-5.5 sharing one). CNN steps against torch's, alternating processes: 0.92-0.96 of
    before; MLP and transformer level; peak RSS within 2%."""
    fuse: bool = True
    """A module whose only differentiable output is a scalar runs its backward within its forward, seeded with 1,
    where the gradients are no larger than the stash (`fused`); backward then scales them by the host's gradient."""
    halves: bool | None = None
    """A step whose forward computes sample by sample may run as two halves of the batch at once, on one-thread
    sessions of their own, until a trial finds the whole batch faster (`halves`), on a machine with two cores for
    them. None: where runs may use more than one thread (`parallel`); ORTModule says True also for the sessions it
    puts on one thread for a small forward (the halves need no intra-op threads), False where asked for one."""
    park_openmp: bool = True
    """Runs on more than one thread park torch's spinning OpenMP workers while they last (`openmp.park`), so
    that they do not share cores with onnxruntime's threads."""
    graph_order: bool = False
    """Run nodes in the graph's order where their inputs allow (onnxruntime's priority-based order: the ready node
    first in the graph, Shape and Size before all) instead of its default walk back from the outputs, which ran
    every checkpointed region's recomputation first (`recompute`: 588 MB at the peak of a backward against 196).
    Only backward runs that recompute such regions: elsewhere neither order wins (GPT-2's backward peaked 100 MB
    higher in graph order, a stack of MLP blocks 250 MB lower)."""
    torch_masks: bool = False
    """Draw host-masked Dropouts' masks with torch's own generator and kernel, as torch's dropout does
    (`host_dropout`): the same masks as torch's forward from the same generator state, at ~3x the cost of the
    default draws."""
    narrow_when_crowded: bool = True
    """A run on more than one thread that finds the machine crowded (more threads running than cores, `openmp.room`)
    runs on a one-thread session of the same graph instead, made when first needed; not for graphs drawing random
    numbers in onnxruntime (a session of their own would draw others)."""
    choose_threads: bool = False
    """Runs on more than one thread time their runs on those threads and on one (a one-thread session of the same
    graph, as for crowded runs), alternately, and keep the faster, again when it may have changed (`Trial`): for
    graphs whose work leaves the choice open (`workload.TRIAL_BOTTOM`, `TRIAL_TOP`). Not for graphs drawing random
    numbers in onnxruntime."""

    @property
    def torch_dropout_outputs(self) -> bool:
        """Whether forward Dropouts whose masks the host draws compute their outputs in torch's arithmetic
        (`host_dropout`), which backward's recomputed outputs must repeat (`passes.copied_into_backward`)."""
        return self.lower and self.torch_masks

    @property
    def thread_count(self) -> int:
        """The intra-op threads runs use: `threads`, or where onnxruntime picks (None or 0) the cores this process
        may use (its affinity, not the machine's CPUs)."""
        return self.threads or openmp.usable_cores()

    @property
    def split_batch(self) -> bool:
        """Whether steps may run as two halves of the batch (`halves`): allowed (`halves`), and two cores for them."""
        return (self.parallel if self.halves is None else self.halves) and openmp.usable_cores() >= 2

    @property
    def parallel(self) -> bool:
        """Whether runs may use more than one intra-op thread."""
        return self.thread_count > 1

    def options(self) -> ort.SessionOptions:
        so = ort.SessionOptions()
        so.graph_optimization_level = self.optimization
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.inter_op_num_threads = 1
        if self.threads is not None:
            so.intra_op_num_threads = int(self.threads)
        so.log_severity_level = 3
        so.enable_cpu_mem_arena = self.arena
        if self.arena and self.shared_arena and shared_arena():
            so.add_session_config_entry("session.use_env_allocators", "1")
        so.enable_mem_pattern = self.mem_pattern
        if self.graph_order:
            so.execution_order = GRAPH_ORDER
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spin else "0")
        if self.spin:
            so.add_session_config_entry("session.force_spinning_stop", "1")
        return so


@functools.cache
def shared_arena() -> bool:
    """Register onnxruntime's process-wide CPU arena, once (sessions opt in with `session.use_env_allocators`);
    False where that fails (one registered by other code, for instance), and sessions keep their own."""
    try:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
    except Exception:  # onnxruntime raises its own zoo of types
        return False
    return True


RANDOM_OPS = ("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial")
"""onnxruntime's random ops besides Dropout: each session draws from its own generators."""


def _lacks_kernel(error: Exception) -> bool:
    return "Could not find an implementation" in str(error)


def _computes_in_float64(model: onnx.ModelProto, error: Exception) -> bool:
    """Whether the node onnxruntime found no kernel for ("... node with name 'n'") reads float64: its CPU
    provider has float64 kernels for few ops besides the elementwise ones (no Conv, Det, AveragePool, Resize).
    Types from shape inference, on this failure's path only."""
    found = re.search(r"node with name '([^']*)'", str(error))
    node = next((n for n in model.graph.node if found and n.name == found.group(1)), None)
    return node is not None and bool(double_forms.float64_tensors(model).intersection(node.input))


def _misled_optimizers(model: onnx.ModelProto) -> list[str]:
    """onnxruntime's optimizers that would compute this graph wrongly, to run without:
    - NoopElimination reads a one-element float64 constant in float32 and removes a Mul or Div by one that rounds
      to 1 there: a factor of 1 - 1e-8 (`functions._layer_norm`'s) was lost, the gradient through it 1.3e-8 off;
    - ExpandElimination takes an Expand of ones to a constant size holding 0 for a no-op: [1, 1] to [0, 1] gave
      [1, 1], which the backward, sized by the graph's [0, 1], refused (runtime replay fuzz, seed 97);
    - FuseReluClip removes a Relu read by a Clip and gives the Clip the Relu's input, whichever of the Clip's inputs
      read it: Clip(d, 2, Relu(d)) became Clip(d, 2, d), d where ONNX's Clip gives the bound Relu(d) for d < 2
      (runtime replay fuzz, seed 438)."""
    tensors = {t.name: t for t in model.graph.initializer}
    tensors.update((n.output[0], a.t) for n in model.graph.node if n.op_type == "Constant" and n.output
                   for a in n.attribute if a.name == "value")
    scalars = [float(numpy_helper.to_array(t).reshape(())) for t in tensors.values()
               if t.data_type == onnx.TensorProto.DOUBLE and math.prod(t.dims) == 1]
    misled = []
    if any(v not in (0.0, 1.0) and abs(v) < 2 and float(np.float32(v)) in (0.0, 1.0) for v in scalars):
        misled.append("NoopElimination")
    targets = [tensors[n.input[1]] for n in model.graph.node if n.op_type == "Expand" and len(n.input) > 1
               and n.input[1] in tensors]
    if any(0 in numpy_helper.to_array(t).ravel() for t in targets if t.data_type == onnx.TensorProto.INT64):
        misled.append("ExpandElimination")
    relus = {n.output[0] for n in model.graph.node if n.op_type == "Relu"}
    if any(n.op_type == "Clip" and relus.intersection(n.input[1:]) for n in model.graph.node):
        misled.append("FuseReluClip")
    return misled


def _half_precision(model: onnx.ModelProto) -> bool:
    """Whether the graph casts to bfloat16 or float16 somewhere."""
    half = (onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16)
    return any(n.op_type == "Cast" and any(a.name == "to" and a.i in half for a in n.attribute)
               for n in model.graph.node)


TRIAL_DELAY = 8
"""Runs on the configured threads before the first trial. A two-thread session's first runs had stalled 2-10 ms
(7 of its first 15, against 0.3-0.5 ms after), and trials over them put forwards on one thread where two were faster
by a third. Those stalls were mostly runs left unparked beside torch's spinning workers by a stale `openmp.room`
decision (now made again at each run that parks nothing): after that change, with 8 runs, 7 MLPs in each of two
processes got verdicts matching the measured speeds (30 runs had before it)."""
TRIAL_WARMUP = 2
"""Runs of the one-thread session that a trial does not time, besides the first of its visit: a session's first
runs plan its memory and allocate."""
TRIAL_RUNS = 6
"""Timed runs of each session in a trial; their medians decide."""
TRIAL_APART = 1.2
"""Half of `TRIAL_RUNS` decide where every timed run of one session is this many times faster than every one of the
other's: a trial's slower session then takes 6 runs instead of 10 (at batch 256 a LeNet's fused run took 16-17 ms
on one thread and 11-12 on two). They decide for arm 0 (the configured threads; in `halves`' trial, the halves)
too where arm 1's fastest run is no faster than arm 0's median (`Trial._apart`): the trial's slower runs land in a
run's first steps, where a benchmark of a few dozen steps reads them (session 49: the CNN's halves against its whole
batch, 2.4-2.7 against 2.9-3.3 ms, took 10 of its first 28 steps on the whole batch, now 4)."""
TRIAL_MARGIN = 1.1
"""One thread is chosen only where its median is this many times faster than the configured threads': its verdict
holds `TRIAL_RECHECK` runs unwatched, while the configured threads' runs are watched (`TRIAL_DRIFT`). LeNet 1-16-32
at batch 64 took 15.1 ms on two threads and 14.2 on one while the VM's CPUs sat far apart, and 7.6-8.5 on two when
near: a one-thread verdict made in a far spell held past the spell (1.40 of torch's step in two of six processes,
session 46)."""
TRIAL_VISIT = 4
"""Runs of one session in a row during a trial, the first untimed: no timed run comes right after the other
session's runs (its caches and its threads as the other left them), as none will after the verdict."""
TRIAL_REVIEW = 1000
"""Runs after a verdict until the next trial: a trial can coincide with a burst of other work on the machine, and
what runs beside a long training changes. The slower session's 8 runs in 1000 cost 0.3% of the runs' time where
the two differ by a third."""
TRIAL_RECHECK = 100
"""Runs after a one-thread verdict until the next trial, doubled by each trial that keeps one thread again, up to
`TRIAL_REVIEW`: whether two threads pay can change within seconds (`TRIAL_DRIFT`), and one thread's runs do not
show it."""
TRIAL_DRIFT = 1.3
"""The chosen session's recent runs (the median of `TRIAL_WATCH`) this many times its median in the trial: a new
trial at once. On the AVX-512 EPYC, a two-thread run's time depends on where the VM's two CPUs sit on the host,
which changes every 10-70 s: a round trip between two threads pinned one to a CPU took 55-70 ns or 330-370 ns, and
with the far placement a LeNet's fused run at batch 256 took 26-29 ms on two threads against 11-12 ms with the near
one, and 15-18 ms on one thread with either (each op's data, written by both threads, moves between the CPUs'
caches). torch's step moved from 13 to 16-17 ms."""
TRIAL_WATCH = 8
"""Runs of the chosen session whose median is compared with its trial's (`TRIAL_DRIFT`)."""


@dataclass(frozen=True)
class TrialSettings:
    """A trial's constants (the module's `TRIAL_` ones, read when the trial is made, so a test can set them)."""

    delay: int
    warmup: int
    runs: int
    apart: float
    margin: float
    visit: int
    review: int
    recheck: int
    drift: float
    watch: int

    @classmethod
    def now(cls, **given: float) -> TrialSettings:
        """The module's constants as they are now, with `given` over them."""
        current = {"delay": TRIAL_DELAY, "warmup": TRIAL_WARMUP, "runs": TRIAL_RUNS, "apart": TRIAL_APART,
                   "margin": TRIAL_MARGIN, "visit": TRIAL_VISIT, "review": TRIAL_REVIEW, "recheck": TRIAL_RECHECK,
                   "drift": TRIAL_DRIFT, "watch": TRIAL_WATCH}
        return cls(**{**current, **given})  # type: ignore[arg-type]


class _Doubling:
    """A number of runs that doubles, up to `cap`, while what it waits for does not come, and starts over."""

    def __init__(self, first: int, cap: int):
        self.first, self.cap, self.runs = first, cap, first

    def double(self) -> None:
        self.runs = min(2 * self.runs, self.cap)

    def reset(self) -> None:
        self.runs = self.first


class Trial:
    """Which of two sessions of one graph runs it faster, the one on the configured threads (arm 0) or the one on
    a single thread (arm 1), timed alternately over runs as the caller makes them (each right after whatever the
    caller's step did before it, as later runs will be), then again every `TRIAL_REVIEW` runs.

    Whether a second intra-op thread pays depends on the machine more than a constant can say: MLP steps that the
    forward's work (`workload.forward_work`) put on one thread, on an AVX-512 EPYC, against torch's step with one
    thread / with two (`benchmarks.ab`, 3 rounds): 784-512-512-10 at batch 32 1.37 / 1.10, 784-300-100-10 at batch
    64 1.23 / 1.11, while 100-200-200-10 at batch 64 kept one (1.18 / 1.21). `workload.SMALL` was measured on another
    AVX-512 machine and `workload.mac_weight` on an AVX2 EPYC, which put the crossovers at a third of the
    work; the EPYC with AVX-512 is neither. And the answer can change while the process runs (`TRIAL_DRIFT`):
    the chosen session's runs are watched (`watch`), and a one-thread verdict is tried again soon
    (`TRIAL_RECHECK`). `halves` uses the same trial for the batch's halves (arm 0) against the whole batch (arm 1)."""

    def __init__(self, settings: TrialSettings | None = None):
        self.settings = s = settings or TrialSettings.now()
        self.recheck = _Doubling(s.recheck, s.review)
        """Runs until a one-thread verdict is tried again, doubling while trials keep it."""
        self.watched = _Doubling(s.watch, s.review)
        """Runs of the chosen session a drift is judged over; doubled after each trial a drift started that kept
        the verdict (run times that move for other reasons, a batch size that varies, do not keep trials going)."""
        self._limit = math.inf  # the chosen session's recent median above this: a new trial
        self._recent: list[float] = []
        self._drifted = False  # the trial under way was started by a drift
        self.arm = 0
        """The session the next trial run takes."""
        self.chosen: int | None = None
        """The arm the last trial found faster; None before the first verdict."""
        self._times: tuple[list[float], list[float]] = ([], [])
        self._left = s.visit  # runs left in this visit to the arm
        self._fresh = True  # the one-thread session not run yet
        self._wait = s.delay

    def due(self) -> bool:
        """Whether this run is a trial's; counts the runs down to the next trial otherwise."""
        if self._wait <= 0:
            return True
        self._wait -= 1
        return False

    def record(self, arm: int, seconds: float) -> int | None:
        """One trial run of `arm` took `seconds`: timed unless it is the first of its visit to the arm (or among the
        one-thread session's first runs). The verdict once both arms have their timed runs (then the wait for the
        next trial starts), else None."""
        s = self.settings
        self._left -= 1
        if self._left < s.visit - 1:
            self._times[arm].append(seconds)
        wide, narrow = self._times
        if min(len(wide), len(narrow)) >= s.runs or self._apart(wide, narrow):
            return self._decide(statistics.median(wide), statistics.median(narrow))
        if self._left <= 0 or len(self._times[arm]) >= s.runs:
            other = 1 - arm
            self.arm = other if len(self._times[other]) < s.runs else arm
            self._left = s.visit
            if self.arm == 1 and self._fresh:
                self._fresh, self._left = False, s.visit + s.warmup
        return None

    def _decide(self, wide: float, narrow: float) -> int:
        """The verdict from the sessions' medians, and what follows it: the next trial `review` runs away after two
        threads, `recheck` runs (doubling) after one; the drift that started this trial, if it changed nothing,
        judged over more runs next time."""
        s = self.settings
        kept, self.chosen = self.chosen, int(narrow * s.margin < wide)
        if self._drifted and kept == self.chosen:
            self.watched.double()
        else:
            self.watched.reset()
        self._drifted, self._recent = False, []
        self._limit = s.drift * (narrow if self.chosen else wide)
        self._times, self.arm, self._left = ([], []), 0, s.visit
        if self.chosen:
            self._wait = min(self.recheck.runs, s.review)
            self.recheck.double()
        else:
            self._wait = s.review
            self.recheck.reset()
        return self.chosen

    def _apart(self, wide: list[float], narrow: list[float]) -> bool:
        """Whether half the timed runs each already tell the sessions apart (`TRIAL_APART`), or show that arm 1
        (the one-thread session; the whole batch in `halves`' trial) cannot win: its fastest run no faster than arm
        0's median (it would need a median `margin` times faster), so its further runs would only cost."""
        if 2 * min(len(wide), len(narrow)) < self.settings.runs:
            return False
        apart = self.settings.apart
        return (max(wide) * apart <= min(narrow) or max(narrow) * apart <= min(wide)
                or min(narrow) >= statistics.median(wide))

    def pin(self, arm: int) -> None:
        """Take `arm` from now on, never tried again (a caller that measured, a test)."""
        self.chosen, self._wait, self._limit = arm, math.inf, math.inf

    def watch(self, seconds: float) -> None:
        """A run of the chosen session outside trials took `seconds`. Every `watched` runs, a median above the
        trial's by `drift` makes the next run a trial's."""
        self._recent.append(seconds)
        if len(self._recent) >= self.watched.runs:
            if statistics.median(self._recent) > self._limit:
                self._wait, self._drifted = 0, True
            self._recent = []


class Runner:
    """A created-once onnxruntime session plus its input and output names."""

    def __init__(self, model: onnx.ModelProto, config: SessionConfig, what: str,
                 disabled: Sequence[str] = DISABLED_OPTIMIZERS):
        self.what = what
        disabled = (*disabled, *(name for name in _misled_optimizers(model) if name not in disabled))
        data = model.SerializeToString()
        try:
            self.session = _session(data, config, disabled)
        except Exception as e:  # onnxruntime raises its own zoo of types
            written = double_forms.written_out(model) if _lacks_kernel(e) else model
            if written is not model:  # float64 nodes onnxruntime has no kernel of, written out: loaded again
                self.__init__(written, config, what, disabled)
                return
            if _lacks_kernel(e) and _half_precision(model):
                raise SessionLoadError(
                    f"onnxruntime cannot load the {what} model: {e} The graph computes in bfloat16 or float16 "
                    "(a torch.autocast or .bfloat16()/.half() inside the forward), which onnxruntime's CPU kernels "
                    "mostly do not: compute in float32 (ORTModule runs autocast around the call in float32 already), "
                    "or run the module in torch.") from e
            if _lacks_kernel(e) and _computes_in_float64(model, e):
                raise SessionLoadError(
                    f"onnxruntime cannot load the {what} model: {e} That node computes in float64, for which "
                    "onnxruntime's CPU provider has no kernel of this op: train the module in float32, or run it in "
                    "torch.") from e
            config = self._unoptimized(data, config, disabled, e)
        self._c = self.session._sess
        self._run_options = C.RunOptions()
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._parallel = config.parallel
        self._park = config.park_openmp
        self._threads = config.thread_count
        self.draws_random = draws_random(model.graph)
        """onnxruntime seeds its random ops per session: a second session of the graph would draw other numbers."""
        narrow = ((config.narrow_when_crowded or config.choose_threads) and config.parallel
                  and not self.draws_random)
        self._narrow: tuple[bytes, SessionConfig, list[str]] | None = (
            (data, dataclasses.replace(config, threads=1, choose_threads=False), list(disabled)) if narrow else None)
        self._narrow_c: C.InferenceSession | None = None
        self._narrow_when_crowded = config.narrow_when_crowded
        self._wide = self._c
        """The session on the configured threads (`_c` is the one runs take: it or, after a trial, the narrow one)."""
        self._trial: Trial | None = Trial() if narrow and config.choose_threads else None

    @property
    def chosen_threads(self) -> int | None:
        """The intra-op threads the last trial (`SessionConfig.choose_threads`) found faster; None before one."""
        chosen = self._trial.chosen if self._trial is not None else None
        return None if chosen is None else (1 if chosen else self._threads)

    def _unoptimized(self, data: bytes, config: SessionConfig, disabled: Sequence[str], error: Exception
                     ) -> SessionConfig:
        """The session without graph optimizations, where onnxruntime's optimizers fail on a graph its kernels run
        (its GemmTransposeFusion dropped the producer of a Gemm's computed bias that is also a graph output, at
        every level but none); warned, since it runs slower. Its config; SessionLoadError where that fails too."""
        plain = dataclasses.replace(config, optimization=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        if config.optimization == plain.optimization:
            raise SessionLoadError(f"onnxruntime cannot load the {self.what} model: {error}") from error
        try:
            self.session = _session(data, plain, disabled)
        except Exception:
            raise SessionLoadError(f"onnxruntime cannot load the {self.what} model: {error}") from error
        warnings.warn(f"onnxruntime's graph optimizations failed on the {self.what} model ({str(error).strip()}), "
                      "so it runs without them, slower; please report it with the model.", RuntimeWarning,
                      stacklevel=4)
        return plain

    def run(self, feeds: Mapping[str, C.OrtValue], outputs: Sequence[str] | None = None) -> list[C.OrtValue]:
        """Run on C-level OrtValues; returns OrtValues in `outputs` order (default: all outputs)."""
        out = self.run_vector(feeds, outputs)
        # indexing, not iterating: iterating an OrtValueVector costs ~15 µs per element (IndexError at the end)
        return [out[i] for i in range(len(out))]

    def run_vector(self, feeds: Mapping[str, C.OrtValue], outputs: Sequence[str] | None = None) -> C.OrtValueVector:
        """Run and return onnxruntime's own vector of outputs (`exchange.vector_to_torch` converts it whole)."""
        names = self.output_names if outputs is None else outputs
        feeds = feeds if isinstance(feeds, dict) else dict(feeds)
        trial = self._trial
        if trial is None and not self._parallel:  # one thread, nothing to try or park: the run itself
            return self._run(self._c, False, feeds, names)
        if trial is not None and trial.due():
            return self._tried(trial, feeds, names)
        park, crowded = openmp.room(self._threads) if self._parallel else (False, False)
        if crowded or trial is None or trial.chosen is None:  # crowded runs are not the chosen session's own
            narrow = crowded and self._narrow is not None and self._narrow_when_crowded
            return self._run(self._narrow_session() if narrow else self._c, park and self._park, feeds, names)
        start = time.perf_counter()
        out = self._run(self._c, park and self._park, feeds, names)
        trial.watch(time.perf_counter() - start)
        return out

    def binding(self) -> C.SessionIOBinding | None:
        """An IOBinding for runs writing into the caller's buffers (`run_bound`): only for a runner whose runs all
        take one session (one thread: nothing tried, parked or narrowed); None otherwise."""
        if self._parallel or self._trial is not None:
            return None
        return C.SessionIOBinding(self._c)

    def run_bound(self, binding: C.SessionIOBinding) -> None:
        """A run of what `binding` (from `binding()`) binds: its outputs written where they are bound."""
        try:
            self._c.run_with_iobinding(binding, self._run_options)
        except Exception as e:
            raise self._failure(e) from e

    def _run(self, session: C.InferenceSession, park: bool, feeds: dict[str, C.OrtValue], names: Sequence[str]
             ) -> C.OrtValueVector:
        try:
            if park:  # `openmp.parked`, without a generator's frames in every run
                entered = openmp.park()
                try:
                    return session.run_with_ort_values(feeds, names, self._run_options)
                finally:
                    openmp.release(entered, later=True)
            return session.run_with_ort_values(feeds, names, self._run_options)
        except Exception as e:
            raise self._failure(e, feeds) from e

    def _failure(self, error: Exception, feeds: Mapping[str, C.OrtValue] | None = None) -> RuntimeError:
        """onnxruntime's error of a run, naming the model and the inputs `feeds` lacks."""
        missing = [n for n in self.input_names if n not in feeds] if feeds is not None else []
        hint = f" (missing inputs: {missing})" if missing else ""
        return RuntimeError(f"onnxruntime failed running the {self.what} model{hint}: {error}")

    def _tried(self, trial: Trial, feeds: dict[str, C.OrtValue], names: Sequence[str]) -> C.OrtValueVector:
        """A trial's run: on the arm whose turn it is, timed with its parking. A run that finds the machine crowded
        runs as crowded runs do, untimed (neither arm would run as on a free machine). The verdict sets the session
        later runs take."""
        park, crowded = openmp.room(self._threads)
        if crowded:
            if self._narrow_when_crowded:
                return self._run(self._narrow_session(), False, feeds, names)
            return self._run(self._wide, park and self._park, feeds, names)
        arm = trial.arm
        session = self._wide if arm == 0 else self._narrow_session()
        if self._narrow is None:  # the one-thread session could not be made: no trial
            self._trial, self._c, self._parallel = None, self._wide, True
            return self._run(self._wide, park and self._park, feeds, names)
        start = time.perf_counter()
        out = self._run(session, park and self._park and arm == 0, feeds, names)
        verdict = trial.record(arm, time.perf_counter() - start)
        if verdict is not None:  # on one thread nothing is parked and no load read
            self._c, self._parallel = (self._narrow_session(), False) if verdict else (self._wide, True)
        return out

    def _narrow_session(self) -> C.InferenceSession:
        """The one-thread session for crowded runs and trials, made at the first (the usual one where it cannot be
        made)."""
        if self._narrow_c is None:
            assert self._narrow is not None
            data, config, disabled = self._narrow
            try:
                narrow = _session(data, config, disabled)
            except Exception:  # onnxruntime raises its own zoo of types; the usual session serves on
                self._narrow = None
                return self._c
            self._narrow_c = narrow._sess
        return self._narrow_c


def _session(data: bytes, config: SessionConfig, disabled: Sequence[str]) -> ort.InferenceSession:
    session = ort.InferenceSession(data, config.options(), providers=list(config.providers),
                                   disabled_optimizers=list(disabled))
    if config.spin and config.thread_count > 1:  # its workers spin from now until its first run ends
        openmp.made_workers(config.thread_count - 1)
    return session


def draws_random(graph: onnx.GraphProto) -> bool:
    """Whether onnxruntime draws random numbers running `graph` (its Dropouts, its random ops, in bodies too)."""
    return any(n.op_type == "Dropout" or n.op_type in RANDOM_OPS for n in graph_nodes(graph))
