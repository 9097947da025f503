"""What ORTModule does per call: find the export for the call's schema, feed it, run it.

A schema is everything an export bakes in: the argument structure with its non-tensor values, each
tensor's dtype, rank and device, every submodule's train/eval flag, and the parameters' dtypes and
devices (a counter bumped by `.to()`). Sizes are not part of it (all dimensions are dynamic). Per
schema, training sessions are built for each set of tensors that require grad (a static one for the
first sizes, one dynamic one for every other size, see `Schema`), so frozen parameters cost nothing;
with grad disabled (or nothing requiring grad) the exported forward runs alone, stashing nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import os
import threading
import warnings
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import onnx
import torch
from onnxruntime.capi import _pybind_state as C
from torch import nn
from torch.autograd import forward_ad

import gradbuilder
from gradbuilder.errors import InvalidModelError, RuleError

from . import checks, exchange, function, lowering, workload
from .batchnorm import FlatStatistics, second_updates, update_running_stats
from .edits import Watch
from .export import (
    REFERENCES,
    Exported,
    ExportError,
    ExportOptions,
    ExportWarning,
    as_called,
    export,
    pin_dims,
    scratch_buffers,
)
from .forward_hooks import HookChanged, HookError, forget, recorded
from .function import partial_gradient, reads_its_gradient
from .hook_state import kept_hook_state
from .host_dropout import MaskedRunner
from .ort_session import Runner, SessionConfig, SessionLoadError
from .session import TrainingSession
from .steady import Steady, argument_kinds
from .structure import Const, constants, flatten, numbers, unflatten, without_numbers

SAVE_ENV = "GRADBUILDER_SAVE_ONNX"


class ORTModuleError(RuntimeError):
    """The module cannot run on onnxruntime (export failed, or an op has no gradient rule)."""


class FallbackWarning(RuntimeWarning):
    """ORTModule runs (part of) a module in PyTorch instead of onnxruntime."""


@dataclass(frozen=True)
class Options:
    export: ExportOptions
    threads: int | None
    specialise: bool
    fallback: bool
    save_dir: Path | None
    park_torch_threads: bool = True
    """`SessionConfig.park_openmp` of every session."""
    mem_pattern: bool = False
    """`SessionConfig.mem_pattern` of every session (`memory_pattern_pays`)."""

    def config(self, threads: int | None, choose: bool = False) -> SessionConfig:
        """Every session's; torch's dropout masks where the export made them drawable (`ExportOptions`); `choose`:
        runs on more than one thread try one too (`SessionConfig.choose_threads`)."""
        return SessionConfig(threads=threads, park_openmp=self.park_torch_threads, mem_pattern=self.mem_pattern,
                             torch_masks=self.export.torch_dropout, choose_threads=choose, halves=self.threads != 1)

    def config_for(self, work: float, band: tuple[float, float] = workload.BAND) -> SessionConfig:
        """The sessions' config for a forward of this much work (`workload`): one thread below `workload.SMALL`
        times the band's bottom, the configured threads from `SMALL` times its top (`workload.trial_band`), and
        between, the faster of the two as runs measure it."""
        if work < workload.SMALL * band[0]:
            return self.config(1)
        return self.config(self.threads, choose=work < workload.SMALL * band[1])


MEM_PATTERN_MAX_BYTES = 64 * 2**20
"""Parameters (their bytes) up to which a module's sessions plan each run's memory in one block."""


def memory_pattern_pays(module: nn.Module) -> bool:
    """Whether onnxruntime's memory pattern (each run's intermediates in one block planned at the first run) is on
    for this module: for small ones it saves an arena allocation per node and costs little memory. On the AVX2
    machine, one module a process against torch (`benchmarks.ab`, two runs of 3 rounds, ratio to torch's step
    with / without): the CNN 0.760 / 0.850 and 0.847 / 0.952; MLPs and the transformer within the noise
    (0.96-1.02 of the step without); earlier measured level on the AVX-512 machine. Large models keep it off:
    the plan holds more than a run needs at once (GPT-2-width with 4 layers: a backward's peak 614 MB above its
    start with it, 451 without)."""
    return sum(p.numel() * p.element_size() for p in module.parameters()
               if not isinstance(p, nn.parameter.UninitializedParameter)) <= MEM_PATTERN_MAX_BYTES


def _uninitialized(module: nn.Module) -> bool:
    return any(isinstance(t, nn.parameter.UninitializedTensorMixin)
               for t in itertools.chain(module.parameters(), module.buffers()))


class _Small(NamedTuple):
    """Where a schema whose first call was small reads its batch size, and its forward work a sample."""

    input: str
    """The batch-bearing graph input."""
    leaf: int
    """Its position among the call's tensors."""
    work_per_sample: float


class Schema:
    """One export and the sessions built from it (one per set of tensors requiring grad).

    The export is all-dynamic. The first gradient build of a set of tensors pins every input dimension but
    the batch to that call's sizes: static shapes spare the rules and onnxruntime run-time size arithmetic
    and crops (a LeNet step 3-4% faster). A call of other sizes then builds the all-dynamic graph once,
    which serves every size but the pinned one from then on (torch.compile's automatic dynamic shapes do
    the same); Conv, ConvTranspose and pooling compute their size-dependent pads at run time there.
    Fallback for the few rules that need a static size (Einsum broadcasting a symbolic dim of an ellipsis,
    GatherND's index depth, ConvTranspose's output_shape, Resize's keep_aspect_ratio_policy): when the
    dynamic build raises a RuleError, that set of tensors keeps a pinned build per size (a new size
    rebuilds, it does not re-export). Each new size is first checked against the export (`Engine._new_sizes`).
    """

    def __init__(self, exported: Exported, options: Options, save_dir: Path | None):
        self.exported = exported
        self.options = options
        self.save_dir = save_dir
        self.config = options.config(options.threads)
        self._infer: Runner | MaskedRunner | None = None
        self.sessions: dict[tuple[frozenset[str], Hashable], TrainingSession] = {}
        self._building = threading.Lock()
        self.pinned: set[frozenset[str]] = set()
        """Sets of tensors whose all-dynamic build a rule refused: a pinned build per size."""
        self.first_sizes: dict[frozenset[str], tuple[tuple[int, ...], ...]] = {}
        """The sizes each set's first (pinned) build was made for."""
        self.sizes_seen: set[tuple[tuple[int, ...], ...]] = set()
        """Every call's input sizes but the batch, once checked against this export (`Engine._new_sizes`)."""
        self.values_checked = False
        """Whether a second call re-exported and compared (`Engine._new_values`)."""
        self.ran = False
        """Whether onnxruntime ran this export: its first run fails only where the export does (a conversion the
        exporter got wrong, such as dynamo's LSTM with projections), since torch ran the same call."""
        types = {o.name: o.type.tensor_type.elem_type for o in exported.model.graph.output}
        float_types = gradbuilder.graph.FLOAT_TYPES
        self.float_outputs = [n for n in exported.outputs if types.get(n, 0) in float_types or not types.get(n)]
        self.sparse: frozenset[str] = frozenset()
        """Graph names whose gradient torch makes sparse (`Engine._sparse_names`)."""
        self._threads_settled = False
        self._small: _Small | None = None
        """Set while a small first call keeps the sessions on one thread (`_fit_threads` watches the batch)."""
        self._batch = -1
        self._trial_band = workload.BAND
        """The band that trials the thread count for this export's forward (`workload.trial_band`)."""
        if save_dir is not None:
            gradbuilder.save_model_atomic(exported.model, save_dir / "exported.onnx")

    def _settle_threads(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Once, before the first session: the threads for the forward's work at these input shapes
        (`Options.config_for`: one intra-op thread for a small one, where threads would cost more than they save);
        `options.threads` is the most."""
        if self._threads_settled:
            return
        self._threads_settled = True
        if self.options.threads == 1:
            return
        work = workload.forward_work(self.exported.model, shapes)
        batched = [(name, k, shapes[name][0]) for name, k in self.exported.inputs if shapes.get(name)]
        if work is not None and batched:
            name, k, batch = batched[0]
            per_row = work / max(batch, 1)
            self._trial_band = workload.trial_band(self.exported.model, per_row)
            self.config = self.options.config_for(work, self._trial_band)
            if self.config.threads == 1:
                self._small, self._batch = _Small(name, k, per_row), batch

    def _fit_threads(self, batch: int) -> None:
        """Off one thread, for good, once a batch makes the forward's work leave the small ones
        (`Options.config_for`)."""
        if batch == self._batch or self._small is None:
            return
        self._batch = batch
        config = self.options.config_for(batch * self._small.work_per_sample, self._trial_band)
        if config.threads != 1:
            self._small = None
            self.config = config
            for s in self.sessions.values():
                s.reconfigure(self.config)
            self._infer = None

    def session(self, wrt: Sequence[str], leaves: Sequence[torch.Tensor]) -> tuple[TrainingSession, bool]:
        """The session for this set of tensors requiring grad and these sizes; True when it was just built."""
        w = frozenset(wrt)
        inputs = self.exported.inputs
        if self._small is not None:
            self._fit_threads(leaves[self._small.leaf].shape[0])
        sizes = tuple([tuple(leaves[k].shape[1:]) for _, k in inputs])
        s = self._built(w, sizes)
        if s is not None:
            return s, False
        with self._building:  # threads making their first steps at once build once
            s = self._built(w, sizes)
            return (s, False) if s is not None else (self._new_session(w, wrt, leaves, sizes), True)

    def _built(self, w: frozenset[str], sizes: tuple[tuple[int, ...], ...]) -> TrainingSession | None:
        s = self.sessions.get((w, sizes))
        if s is None and w not in self.pinned:
            s = self.sessions.get((w, None))
        return s

    def _new_session(self, w: frozenset[str], wrt: Sequence[str], leaves: Sequence[torch.Tensor],
                     sizes: tuple[tuple[int, ...], ...]) -> TrainingSession:
        inputs = self.exported.inputs
        self._settle_threads({name: tuple(leaves[k].shape) for name, k in inputs})
        s: TrainingSession | None = None
        key: Hashable = sizes
        rows = _rows({name: tuple(leaves[k].shape) for name, k in inputs})
        if w in self.first_sizes and w not in self.pinned:  # a second size: the all-dynamic build
            try:
                s, key = self._build(self.exported.model, wrt, rows), None
            except gradbuilder.GradBuilderError:  # a rule refusing run-time sizes, an If only they leave open
                self.pinned.add(w)
        if s is None:
            try:
                pinned = pin_dims(self.exported.model, {n: tuple(leaves[k].shape) for n, k in inputs})
                s = self._build(pinned, wrt, rows)
            except RuleError:
                if w in self.first_sizes:  # the dynamic build failed too
                    raise
                s, key = self._build(self.exported.model, wrt, rows), None  # a rule refusing static sizes: dynamic
            self.first_sizes.setdefault(w, sizes)
        self.sessions[(w, key)] = s
        return s

    def _build(self, model: onnx.ModelProto, wrt: Sequence[str], rows: int | None) -> TrainingSession:
        save = self.save_dir / f"grad{len(self.sessions)}" if self.save_dir is not None else None
        return TrainingSession.from_forward(model, wrt=list(wrt), outputs=self.float_outputs, config=self.config,
                                            specialise=self.options.specialise, save_dir=save, rows=rows)

    def infer(self, feeds: dict[str, C.OrtValue]) -> list[C.OrtValue]:
        if self._small is not None:
            self._fit_threads(feeds[self._small.input].shape()[0])
        if self._infer is None:
            shapes = {name: tuple(feeds[name].shape()) for name, _ in self.exported.inputs}
            self._settle_threads(shapes)
            source = lowering.source(self.exported.model, self.config, _rows(shapes))  # as training forwards are
            self._infer = lowering.forward_runner(source, self.config, "forward (inference)")
        return self._infer.run(feeds)


def _rows(shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The batch of a call: the first dim of its first input with one (what the export leaves symbolic)."""
    return next((shape[0] for shape in shapes.values() if shape), None)


_FALLBACK = object()


@dataclass(frozen=True)
class _Refused:
    """A schema that failed without fallback: every later call of it raises the same error (the call after a
    refusal by the first-call checks ran the refused graph, its wrong values and all)."""

    error: ORTModuleError

    def again(self) -> ORTModuleError:
        return ORTModuleError(*self.error.args)


FIRST_RUN_ERRORS = (RuntimeError, InvalidModelError)
"""What a run of an export raises where the export is wrong: onnxruntime's errors, and its outputs of other shapes
than the graph declares (`declared`)."""

SCALAR_EXPORTS = 8
"""Exports again for a changed Python attribute the forward reads (`runtime/scalars.py`) before the module fails."""

SIZE_CHECKS = 8
"""New input sizes exported again and compared (`Engine._new_sizes`) before an export that was the same graph at
all of them serves every size unchecked: a model padding each batch to its longest sequence meets many lengths,
and an export costs 0.1-0.3 s (a 2-layer encoder, a 4-layer GPT-2)."""

PER_SIZE_SCHEMAS = 32
"""Exports kept at most for a module exported per input size (`Engine.per_size`): past that the least recently used
is dropped, and its sessions' memory with it (a character RNN meeting every length up to 500 held 500 pairs of
sessions), to be exported again if its sizes come back."""


def _same_graph(a: onnx.ModelProto, b: onnx.ModelProto) -> bool:
    """The same nodes (attributes and subgraphs included) and initializers, and outputs of the same ranks, whatever
    the declared sizes (a squeeze() without a dim of a (batch, 1) output: rank 0 at a batch of 1, whose backward
    takes a gradient of that rank)."""
    return (len(a.graph.node) == len(b.graph.node) and len(a.graph.initializer) == len(b.graph.initializer)
            and _output_ranks(a) == _output_ranks(b)
            and all(x.SerializeToString() == y.SerializeToString() for x, y in zip(a.graph.node, b.graph.node))
            and all(x.SerializeToString() == y.SerializeToString()
                    for x, y in zip(a.graph.initializer, b.graph.initializer)))


def _output_ranks(model: onnx.ModelProto) -> list[int | None]:
    return [len(o.type.tensor_type.shape.dim) if o.type.tensor_type.HasField("shape") else None
            for o in model.graph.output]


def _hook_calls(exported: Exported) -> list[tuple[int, int]]:
    return [(id(c.registry), c.hid) for c in exported.hooks.calls] if exported.hooks is not None else []


def _is_parameter(holder: nn.Module, attr: str) -> bool:
    return attr in holder._parameters


def _in_float64(module: nn.Module, ex: Exported, leaves: list[torch.Tensor], named: dict[str, torch.Tensor],
                wrt: list[str]) -> tuple[list[torch.Tensor], dict[int, torch.Tensor], dict[str, torch.Tensor]]:
    """`Engine.in_torch`'s inputs, fed tensors and functional_call dict for a float64 run: one detached float64
    copy per float tensor (tied weights stay tied), the module's own parameters and buffers as well as the ones
    the forward was fed; the copies of tensors requiring grad require it."""
    copies: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        if id(t) not in copies:
            copies[id(t)] = t.detach().double().requires_grad_(t.requires_grad)
        return copies[id(t)]

    position = dict(ex.inputs)
    aliases = [copy(t) for t in leaves]
    fed = {id(named[name]): copy(named[name]) for name in wrt if name not in position}
    own = itertools.chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False))
    tensors = {fqn: copy(t) for fqn, t in own if t.is_floating_point()}  # the others: `scratch_buffers`' copies
    tensors.update({fqn: copy(named[name]) for name, fqn in ex.state if named[name].is_floating_point()})
    return aliases, fed, tensors


def _lacked(error: BaseException | None) -> str | None:
    """What the legacy exporter's failure says it has no translation of: the operator an UnsupportedOperatorError
    names ("Exporting the operator 'aten::diff' to ONNX ..."), or complex tensors, which it never has (torch.stft's
    `return_complex=True`: "STFT does not currently support complex types"); None for other failures."""
    if isinstance(error, torch.onnx.errors.UnsupportedOperatorError):
        quoted = str(error).split("'")
        return quoted[1] if len(quoted) > 2 else "an operator"
    if isinstance(error, torch.onnx.errors.SymbolicValueError) and "complex" in str(error).split("[Caused by")[0]:
        return "complex tensors"
    return None


class Engine:
    """The state of one ORTModule: cached schemas, parameter OrtValues, counters."""

    def __init__(self, module: nn.Module, options: Options):
        self.module = module
        self.options = options
        self.name = type(module).__name__
        self.signature = inspect.signature(module.forward)
        self.schemas: dict[Hashable, Any] = {}
        self._exporting = threading.Lock()  # threads making their first calls at once export once
        self.failed: dict[tuple[Hashable, frozenset[str]], _Refused | None] = {}
        """Gradient builds that failed, by schema and tensors differentiated: raised again (None: with fallback)."""
        self.version = 0
        self.stats = {"exports": 0, "builds": 0, "fallbacks": 0}
        self._ortvalues: dict[str, tuple[torch.Tensor, int, tuple[int, ...], C.OrtValue]] = {}
        self._owners: dict[str, tuple[nn.Module, str]] = {}
        self._by_name: dict[str, nn.Module] | None = None
        self._module_list: list[nn.Module] | None = None
        self._watch = Watch(module)
        self._positional: dict[int, Any] = {}
        self._argument_values: dict[Hashable, list[Any]] = {}
        """The argument specs exported, by the spec without its Python numbers (`_new_argument_values`)."""
        self._warned_autocast = False
        self._warned_transforms = False
        self._warned_sizes = False
        self._lazy = _uninitialized(module)
        """Lazy modules' parameters not yet sized (nn.LazyLinear): calls run in torch until its first sizes them."""
        self.per_size = False
        """Whether the module's exports depend on its input sizes (`_new_sizes`): schemas are then keyed by them."""
        self.scalar_exports = 0
        """Exports made because a Python attribute the forward reads changed (`_scalar_changed`)."""
        self._steady: Steady | None = None
        """The last training call's decisions, which the next may reuse (`steady`)."""
        self._statistics: FlatStatistics | None = None
        """The last steady call's running statistics as one tensor, kept for the next recorded call."""

    def sessions(self) -> list[TrainingSession]:
        schemas = {id(schema): schema for schema in self.schemas.values() if isinstance(schema, Schema)}
        return [s for schema in schemas.values() for s in schema.sessions.values()]

    def invalidate(self) -> None:
        """Parameters changed dtype or device (`.to()`), or the module what its exports hold (`edits`): export again at
        the next call."""
        self.version += 1
        self.schemas.clear()
        self._ortvalues.clear()
        self._owners.clear()
        self._by_name = None
        self._module_list = None
        self._steady = None
        self._statistics = None
        self._watch.retake()

    # --- the call ------------------------------------------------------------------------------------
    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # torch.func.grad, vmap: tensors without storage; forward-mode AD: tangents, which onnxruntime would drop
        if torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0:
            if not self._warned_transforms:
                self._warned_transforms = True
                warnings.warn(f"ORTModule({self.name}) runs calls under torch.func transforms (grad, vmap, jacrev) "
                              "and forward-mode AD (dual tensors) in PyTorch: onnxruntime cannot compute on their "
                              "wrapped tensors or carry tangents.", FallbackWarning, stacklevel=5)
            return self.module(*args, **kwargs)
        if self._lazy:
            self._lazy = _uninitialized(self.module)
            if self._lazy:  # the call sizes them, as torch's first: then exported from the next
                return self.module(*args, **kwargs)
        if self._watch.changed():  # a hook, submodule, parameter or buffer added, removed or replaced
            self.invalidate()
        if torch.is_autocast_enabled("cpu") and not self._warned_autocast:
            self._warned_autocast = True
            warnings.warn(f"ORTModule({self.name}) computes in float32 under torch.autocast: the module runs as "
                          "exported without autocast (onnxruntime's CPU kernels have no bfloat16 matrix products), so "
                          "its outputs are float32.", RuntimeWarning, stacklevel=3)
        steady = self._steady
        if steady is not None and steady.holds(args, kwargs):
            return self._steady_call(steady, [*args, *kwargs.values()] if kwargs else args)
        since = next(REFERENCES)  # references made after this are this call's
        leaves, in_spec = self._flatten(args, kwargs)
        kinds = []
        empty = False
        for t in leaves:
            if not t.is_cpu:
                raise ORTModuleError(f"ORTModule({self.name}) runs on onnxruntime's CPU provider; an input is on "
                                     f"{t.device}. Move the module and inputs to the CPU.")
            kinds.append((t.dtype, t.dim()))
            empty = empty or not t.numel()
        if empty:  # an empty batch: torch computes it exactly, where graphs reshaping by -1 cannot size it
            return self.module(*args, **kwargs)
        if self._module_list is None:
            self._module_list = list(self.module.modules())
        key: Hashable = (in_spec, tuple(kinds), tuple([m.training for m in self._module_list]), self.version)
        sizes = tuple([tuple(t.shape) for t in leaves])
        if self.per_size:
            key = (key, sizes)
        schema = self.schemas.get(key)
        if self.per_size and schema is not None:  # the most recently used last
            self.schemas[key] = self.schemas.pop(key, schema)
        if schema is None:
            schema = self._new_schema(key, in_spec, leaves)
            if self.per_size and len(self.schemas) > PER_SIZE_SCHEMAS:
                self._drop_least_recent()
        elif type(schema) is _Refused:
            raise schema.again()
        elif schema is not _FALLBACK and schema.exported.scalars is not None and schema.exported.scalars.held:
            changed = schema.exported.scalars.changed()
            if changed is not None:
                schema = self._scalar_changed(key, changed, in_spec, leaves)
        if schema is not _FALLBACK and sizes not in schema.sizes_seen:
            schema = self._new_sizes(key, schema, in_spec, leaves, sizes)
        elif schema is not _FALLBACK and not schema.values_checked:
            schema = self._new_values(key, schema, in_spec, leaves)
        if schema is _FALLBACK:
            return self.module(*args, **kwargs)
        ex: Exported = schema.exported
        if ex.reference is not None and ex.reference.made < since and ex.reference.thread == threading.get_ident():
            ex.reference = None  # an earlier call's, which failed before its check: not this call's outputs
        # one pass over the graph inputs: feeds, and which of them get gradients (graph input order)
        grad = torch.is_grad_enabled()
        frozen = ex.frozen
        named: dict[str, torch.Tensor] = {}
        feeds: dict[str, C.OrtValue] = {}
        wrt: list[str] = []
        for name, k in ex.inputs:
            t = named[name] = leaves[k]
            feeds[name] = exchange.to_ortvalue(t)
            if grad and t.requires_grad and name not in frozen:
                wrt.append(name)
        owners, cached = self._owners, self._ortvalues
        for name, fqn in ex.state:  # parameters and buffers: their lookup and `_ortvalue` inlined for the hits
            where = owners.get(fqn) or self._owner(fqn)
            t = where[0]._parameters.get(where[1])
            if t is None:
                t = where[0]._buffers.get(where[1])
                if t is None:  # a tensor requiring grad in a plain attribute (`edits.grad_attributes`)
                    t = where[0].__dict__.get(where[1])
            hit = cached.get(name)
            if hit is not None and hit[0] is t and hit[1] == t.data_ptr() and hit[2] == t.shape and t.is_contiguous():
                feeds[name] = hit[3]
            elif t is None or self._watch.kind_changed(fqn, t):  # gone, or resized: `weight.data = bigger`
                self.invalidate()
                return self(args, kwargs)
            else:
                feeds[name] = self._ortvalue(name, t)
            named[name] = t
            if grad and t.requires_grad and name not in frozen:
                wrt.append(name)
        if ex.ties and self._untied(ex):  # torch reads each name's own tensor: exported again, untied
            self.invalidate()
            return self(args, kwargs)
        n = len(ex.outputs)
        call = rng = None
        if wrt:
            if ex.unchecked:  # its custom Functions or backward hooks went unchecked: exported again, checked
                self.schemas.pop(key, None)
                return self(args, kwargs)
            if ex.reference is not None and ex.reference.random:  # the trace's, put back: torch's draws came from it
                rng = torch.random.get_rng_state()  # (before the session, whose runners draw seeds)
            session = self._session(key, schema, wrt, leaves)
            if session is None:
                return self.module(*args, **kwargs)
            if rng is not None and not session.draw_masks_as_torch(rng):
                rng = None
            read = tuple([named[name] for name in session.read_inputs if name in named])
            sparse = tuple([i for i, w in enumerate(wrt) if w in schema.sparse]) if schema.sparse else ()
            call = function.Call(session, feeds, wrt, n, read, sparse)
            call.in_torch = functools.partial(self.in_torch, ex, in_spec, leaves, [t._version for t in leaves],
                                              list(named), list(named.values()), wrt)
            try:
                user, stats = function.apply(call, [named[name] for name in wrt])
            except FIRST_RUN_ERRORS as e:
                return self._first_run_failed(key, schema, e, args, kwargs)
        else:
            try:
                outs = schema.infer(feeds)
            except SessionLoadError as e:
                self._refuse(key, e, "onnxruntime session creation")
                return self.module(*args, **kwargs)
            except FIRST_RUN_ERRORS as e:
                return self._first_run_failed(key, schema, e, args, kwargs)
            values = [exchange.to_torch(v) for v in outs]
            user, stats = values[:n], values[n:]
        schema.ran = True
        updated = stats[:len(ex.updates)]
        stats = stats[len(ex.updates):]
        if ex.reference is not None and ex.reference.thread == threading.get_ident():
            # the call that exported: checked against torch (runtime/checks.py)
            reference, ex.reference = ex.reference, None
            if call is None and reference.backward_hooks:  # no backward to check them at: at the next export's
                ex.unchecked = True
            if reference.random and rng is None:  # onnxruntime's draws, not torch's: nothing to compare
                reference = None
            if reference is not None:
                error = checks.outputs_error(reference.outputs, [*user, *updated])
                if error is not None:
                    self._refuse(key, error, "export check")
                    return self.module(*args, **kwargs)
                if call is not None:
                    position = dict(ex.inputs)
                    traced = [reference.leaves[position[name]] if name in position else named[name] for name in wrt]
                    call.check = checks.gradient_check(reference.outputs, traced,
                                                       lambda e: self._refuse(key, e, "gradient check"),
                                                       reference.backward_hooks,
                                                       functools.partial(call.in_torch, False, True, rng))
        if ex.updates:
            self._write_back(ex, updated, set(call.session.read_inputs) if call is not None else set())
        if ex.batch_stats:
            modules = self._modules()
            update_running_stats(modules, ex.batch_stats, stats)
            if call is not None and ex.recomputed_stats:
                again = second_updates(ex.batch_stats, stats)
                call.after_backward = functools.partial(update_running_stats, modules, *again)
        if call is not None and ex.internal:  # checked at backward: retain_grad() may come after the call
            call.watched = tuple([(ex.outputs[i], weakref.ref(user[i])) for i in ex.internal])
        if ex.hooks is not None:  # the user's forward hooks, on this call's values of what they received
            result = unflatten(ex.out_spec, user[:len(user) - len(ex.hooks.names)])
            try:
                ex.hooks(user)
                read = next((i for i in ex.hooks.received if i in ex.internal and reads_its_gradient(user[i])), None)
                if read is not None:  # a hook registered on a hooked tensor (Grad-CAM): refused before its backward
                    raise HookError(partial_gradient(ex.outputs[read]))
            except HookError as e:
                self._refuse(key, e, "run of its forward hooks")
                return self.module(*args, **kwargs)
            except HookChanged as e:  # what it returns depends on state outside the module: exported again
                warnings.warn(f"ORTModule({self.name}): {e}, so the module is exported again.", ExportWarning,
                              stacklevel=3)
                self.invalidate()
                return self(args, kwargs)
            return result
        if call is not None:
            self._steady = self._record(schema, call, args, kwargs, leaves, in_spec, named, stats)
        return unflatten(ex.out_spec, user)

    def _record(self, schema: Schema, call: function.Call, args: tuple[Any, ...], kwargs: dict[str, Any],
                leaves: list[torch.Tensor], in_spec: Any, named: dict[str, torch.Tensor],
                stats: Sequence[torch.Tensor]) -> Steady | None:
        """This training call's decisions for the next to reuse (`steady`); None where a call of its export does
        more than feed and run, or its arguments were not distinct tensors alone (a call giving the same keywords
        in the same order then has the same structure, its tensors flattened in the same order)."""
        ex = schema.exported
        given = [*args, *kwargs.values()]
        position = {id(t): i for i, t in enumerate(given)}
        if (len(position) != len(given) or len(leaves) != len(given) or any(id(t) not in position for t in leaves)
                or not schema.values_checked or self.per_size or ex.updates or ex.recomputed_stats or ex.internal
                or ex.hooks is not None or ex.ties or ex.unchecked):
            return None
        kinds = argument_kinds(given)
        if kinds is None:
            return None
        order = [position[id(t)] for t in leaves]
        holders, attrs, tensors = [], [], []
        for name, fqn in ex.state:
            owner, attr = self._owners[fqn]
            t = named[name]
            holder = next((d for d in (owner._parameters, owner._buffers, owner.__dict__) if d.get(attr) is not None),
                          None)
            hit = self._ortvalues.get(name)
            if holder is None or holder[attr] is not t or hit is None or hit[0] is not t:
                return None  # not cached: fed anew at each call (a strided parameter)
            holders.append(holder)
            attrs.append(attr)
            tensors.append(t)
        names: list[str | None] = [None] * len(given)
        for name, k in ex.inputs:
            names[k] = name
        names += [name for name, _ in ex.state]
        where = {name: i for i, name in enumerate(names) if name is not None}
        return Steady(schema, call.session, kinds, list(self._module_list or ()),
                      [m.training for m in self._module_list or ()], holders, attrs, tensors,
                      [t.data_ptr() for t in tensors], [t.shape for t in tensors], [t.requires_grad for t in tensors],
                      {name: call.feeds[name] for name, _ in ex.state}, list(ex.inputs), names, list(call.wrt),
                      [where[w] for w in call.wrt], [where[n] for n in call.session.read_inputs if n in where],
                      call.sparse, in_spec, tuple(kwargs), order if order != list(range(len(order))) else None,
                      self._flat_statistics(ex, stats))

    def _flat_statistics(self, ex: Exported, stats: Sequence[torch.Tensor]) -> FlatStatistics | None:
        if not ex.batch_stats:
            return None
        self._statistics = FlatStatistics.of(self._modules(), ex.batch_stats, stats, self._statistics)
        return self._statistics

    def _steady_call(self, steady: Steady, given: Sequence[torch.Tensor]) -> Any:
        """A call that finds what the recorded one found (`given`: its tensors, positional then keyword), fed and
        run without looking anything up again."""
        ex = steady.schema.exported
        leaves = given if steady.order is None else [given[i] for i in steady.order]
        tensors = [*leaves, *steady.tensors]
        call = function.Call(steady.session, steady.feeds(leaves), steady.wrt, len(ex.outputs),
                             tuple([tensors[i] for i in steady.read]), steady.sparse)
        call.in_torch = functools.partial(self.in_torch, ex, steady.in_spec, list(leaves),
                                          [t._version for t in leaves], steady.names, tensors, steady.wrt)
        user, stats = function.apply(call, [tensors[i] for i in steady.differentiated])
        if ex.batch_stats:  # the sizes the recorded call's check of one value a channel passed
            if steady.statistics is not None and steady.statistics.holds():
                steady.statistics.update(stats)
            else:
                update_running_stats(self._modules(), ex.batch_stats, stats, checked=True)
        return unflatten(ex.out_spec, user)

    def _write_back(self, ex: Exported, values: Sequence[torch.Tensor], read: set[str]) -> None:
        """Buffers the forward changes in place get its new values, as torch's forward leaves them: copied in,
        or, where this call's backward reads the buffer (its old value, from the buffer's own memory), the new
        value put in its place. A parameter (an embedding's max_norm rows) is copied into: the optimizer holds it,
        and a backward reading its old value fails as torch's does (a saved tensor changed in place)."""
        feeding = {fqn: name for name, fqn in ex.state}
        with torch.no_grad():
            for (_, fqn), value in zip(ex.updates, values):
                holder, attr = self._owners.get(fqn) or self._owner(fqn)
                if attr in holder._parameters:
                    holder._parameters[attr].copy_(value)
                elif feeding.get(fqn) in read or holder._buffers[attr].shape != value.shape:  # or resized: a bank
                    holder._buffers[attr] = value  # grown by torch.cat, as the forward put a new tensor in its slot
                else:
                    holder._buffers[attr].copy_(value)

    def _scalar_changed(self, key: Hashable, changed: str, in_spec: Any, leaves: list[torch.Tensor]) -> Any:
        """A Python number the forward reads from a module attribute changed since the export, which holds it as a
        constant (an annealed temperature): exported again, warned once. More than `SCALAR_EXPORTS` such exports
        fail as a failed export does (a value changing at every step would export at every step)."""
        self.schemas.pop(key, None)
        self.scalar_exports += 1
        if self.scalar_exports > SCALAR_EXPORTS:
            error = ExportError(f"the forward reads {changed}, which changed again after {SCALAR_EXPORTS} exports "
                                "for such changes: the graph holds it as a constant. Keep a value that changes in a "
                                "tensor (register_buffer('tau', torch.tensor(1.0)), updated with .fill_()).")
            return self._refuse(key, error, "export for a changed attribute", held=False)
        if self.scalar_exports == 1:
            warnings.warn(f"ORTModule({self.name}): the forward reads {changed}, a Python value the exported graph "
                          "holds as a constant: exported again. Keep a value that changes in a tensor buffer to "
                          "train without exporting again.", RuntimeWarning, stacklevel=4)
        return self._new_schema(key, in_spec, leaves)

    def _first_run_failed(self, key: Hashable, schema: Schema, error: Exception, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> Any:
        """A run failing after others did is the caller's to see; the export's first fails as a failed export does
        (torch ran the same call, so only the export explains it): raised, or with fallback torch's result."""
        if schema.ran:
            raise error
        self._refuse(key, error, "first onnxruntime run of the export")
        return self.module(*args, **kwargs)

    def _refuse(self, key: Hashable, error: Exception, stage: str, held: bool = True) -> Any:
        """The schema fails as a failed export does: raised, or with fallback its calls run in torch from now.
        `held`: raised again at every later call of it, without trying again (an export that exists and was refused
        by a check; a failed export is tried again at the next call, which an attribute set since may let
        through)."""
        try:
            self.schemas[key] = self._fail(error, stage)
        except ORTModuleError as refused:
            if held:
                self.schemas[key] = _Refused(refused)
            raise
        return self.schemas[key]

    def _flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], Any]:
        """The call's tensors and spec. A call of tensors only, filling the signature positionally, has the
        spec of the previous such call (binding and walking the arguments cost ~20 µs a step)."""
        if not kwargs and all(type(a) is torch.Tensor for a in args):
            spec = self._positional.get(len(args))
            if spec is not None:
                return list(args), spec
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        leaves, in_spec = flatten(bound.arguments)
        if not kwargs and len(bound.arguments) == len(args) and len(leaves) == len(args) and \
                all(type(a) is torch.Tensor and a is t for a, t in zip(args, leaves)):
            self._positional[len(args)] = in_spec
        return leaves, in_spec

    # --- caches -----------------------------------------------------------------------------------------
    def _new_schema(self, key: Hashable, in_spec: Any, leaves: list[torch.Tensor]) -> Any:
        with self._exporting:
            schema = self.schemas.get(key)  # another thread's export of this schema, while this one waited
            if schema is not None:
                return schema
            refused = self._new_argument_values(in_spec, leaves)
            if refused is not None:
                return self._refuse(key, refused, "export for new argument values", held=False)
            return self._export_schema(key, in_spec, leaves)

    def _drop_least_recent(self) -> None:
        if not self._warned_sizes:
            self._warned_sizes = True
            warnings.warn(f"ORTModule({self.name}) is exported for each input size, and has met {len(self.schemas)}: "
                          f"only the {PER_SIZE_SCHEMAS} used last are kept, the others exported again if they come "
                          "back. Pad inputs to a few fixed sizes (bucketing) to train without exporting again.",
                          RuntimeWarning, stacklevel=4)
        while len(self.schemas) > PER_SIZE_SCHEMAS:
            del self.schemas[next(iter(self.schemas))]

    def _new_argument_values(self, in_spec: Any, leaves: list[torch.Tensor]) -> ExportError | None:
        """Python arguments are constants of the export, one per set of values: a number changing at every call (a
        diffusion timestep, a schedule passed as a float) exported at every call, with sessions piling up and
        nothing said. Warned at the first change of a number, and refused after `SCALAR_EXPORTS` values, as changed
        attributes are (`_scalar_changed`); flags and strings pick among a few graphs."""
        variant = (without_numbers(in_spec), tuple([(t.dtype, t.dim()) for t in leaves]))
        seen = self._argument_values.setdefault(variant, [])  # the specs exported, by the spec without its numbers
        if in_spec in seen:
            return None
        seen.append(in_spec)
        if len(seen) == 1:
            return None
        before = dict(constants(seen[-2]))
        changed = next((f"{path} ({before.get(path)!r} -> {value!r})" for path, value in constants(in_spec)
                        if Const(value) != Const(before.get(path))), "an argument")
        if len(seen) > SCALAR_EXPORTS:
            return ExportError(f"the forward's Python argument {changed} took {len(seen)} values, each a constant "
                               f"of a graph of its own. Pass a value that changes from call to call as a tensor "
                               "(torch.tensor(t)), which the graph reads as an input.")
        if len(seen) == 2:
            warnings.warn(f"ORTModule({self.name}): the forward's Python argument {changed} is a constant of the "
                          "exported graph: exported again, for each new value. Pass a value that changes from call "
                          "to call as a tensor to train without exporting again.", RuntimeWarning, stacklevel=5)
        return None

    def _export_schema(self, key: Hashable, in_spec: Any, leaves: list[torch.Tensor]) -> Any:
        if self.per_size:  # dynamo: an earlier export may hold for these sizes too
            base, sizes = key  # type: ignore[misc]
            for (other_base, _), schema in list(self.schemas.items()):
                ex = schema.exported if isinstance(schema, Schema) else None
                if other_base == base and ex is not None and ex.guards is not None and \
                        ex.guards.refusal(sizes) is None and (ex.scalars is None or ex.scalars.changed() is None):
                    schema.sizes_seen.add(sizes)
                    self.schemas[key] = schema
                    return schema
        self.stats["exports"] += 1
        try:
            exported = export(self.module, self.signature, in_spec, leaves, self.options.export)
        except ExportError as e:
            exported = self._other_exporter(e, in_spec, leaves)
            if exported is None:
                return self._refuse(key, e, "export", held=False)
        finally:
            self._watch.rebase()
        schema = self.schemas[key] = self._schema(exported)
        return schema

    def in_torch(self, ex: Exported, in_spec: Any, leaves: list[torch.Tensor], versions: list[int],
                 names: list[str | None], values: list[torch.Tensor], wrt: list[str], aliased: bool = True,
                 double: bool = False, rng: torch.Tensor | None = None) -> tuple[list[Any], list[torch.Tensor]]:
        """One call computed again by torch's module with grad enabled: on the same inputs (unchanged since), the
        parameters the forward was fed (a `torch.func.functional_call`'s fast weights too, swapped back since),
        copies of the buffers and the RNG state put back after. Its flat outputs, and the tensors behind `wrt`.
        Holding the tensors costs no memory where the call's feeds share their storage until its backward (all
        but non-contiguous inputs, which the feeds copy). `double`: on float64 copies of every float tensor the
        call reads (inputs, parameters, buffers), detached: the first-call check's arbiter (`checks`). `rng`: the
        RNG state to draw from (the call's, whose random numbers were drawn as torch's: `draw_masks_as_torch`; in
        float64, as the float32 call drew them: `checks.float32_draws`)."""
        if any(t._version != v for t, v in zip(leaves, versions)):
            raise RuntimeError(f"ORTModule({self.name}): backward(create_graph=True) computes the call again in "
                               "torch, but one of its inputs has been changed in place since the forward; keep the "
                               "inputs as they were until this backward.")
        # each tensor differentiated through an alias of its own (an input per position): torch's gradients of this
        # call alone, as the first-call check takes them (`export.Reference.leaves`), still connected to the
        # caller's graph for the next differentiation. Not under vmap (a batched backward), where functorch's
        # gradients with respect to such views came out wrong: there the caller's tensors themselves.
        named = {name: t for name, t in zip(names, values) if name is not None}
        position = dict(ex.inputs)
        if double:
            aliases, fed, tensors = _in_float64(self.module, ex, leaves, named, wrt)
        else:
            aliases = [t.view_as(t) if t.requires_grad and aliased else t for t in leaves]
            fed = {}
            for name in wrt:
                if name not in position:
                    fed.setdefault(id(named[name]), named[name].view_as(named[name]) if aliased else named[name])
            tensors = {fqn: fed.get(id(named[name]), named[name]) for name, fqn in ex.state
                       if id(named[name]) in fed or _is_parameter(*self._owner(fqn))}
        bound = inspect.BoundArguments(self.signature, unflatten(in_spec, aliases))
        draws = checks.float32_draws() if double and rng is not None else contextlib.nullcontext()
        with torch.enable_grad(), scratch_buffers(self.module), kept_hook_state(self.module), \
                recorded(self.module) as hooks, draws:
            if rng is not None:
                torch.random.set_rng_state(rng)
            out = torch.func.functional_call(self.module, tensors, *as_called(bound), strict=False)
        differentiated = [aliases[position[n]] if n in position else fed[id(named[n])] for n in wrt]
        result = flatten(out)[0]
        outputs = [*result, *hooks.replay(result)[1]]  # as the graph's: the result's, then what hooks received
        # the hooks ran at the call already
        forget([*hooks.tensors, *hooks.made], [outputs, hooks.tensors, hooks.made, aliases, differentiated, leaves],
               [*leaves, *named.values(), *tensors.values()])
        return outputs, differentiated

    def _other_exporter(self, error: ExportError, in_spec: Any, leaves: list[torch.Tensor]) -> Exported | None:
        """The module exported by dynamo from now on, where the legacy exporter has no translation of an operator
        its first export met (kron, nansum, quantile, trace, count_nonzero: torch.export decomposes them into ops
        it has), or of complex tensors (a complex STFT). Only before any schema exists, so that one engine never
        mixes the two exporters' graphs; None (the legacy exporter's error stands, with dynamo's added) where dynamo
        fails too."""
        lacked = _lacked(error.__cause__)
        if self.options.export.exporter != "torchscript" or lacked is None or \
                any(isinstance(s, Schema) for s in self.schemas.values()):
            return None
        options = dataclasses.replace(self.options, export=dataclasses.replace(self.options.export, exporter="dynamo"))
        try:
            exported = export(self.module, self.signature, in_spec, leaves, options.export)
        except ExportError as e:
            error.args = (f"{error}\nexporter='dynamo', tried next, failed too: {e}",)
            return None
        warnings.warn(f"ORTModule({self.name}): torch's legacy exporter has no ONNX translation of "
                      f"{lacked}, so this module is exported by dynamo (exporter='dynamo') from "
                      "now on.", ExportWarning, stacklevel=7)
        self.options = options
        return exported

    def _schema(self, exported: Exported) -> Schema:
        save = self.options.save_dir
        schema = Schema(exported, self.options, save / f"{self.name}_{len(self.schemas)}" if save else None)
        schema.sparse = self._sparse_names(exported)
        return schema

    def _new_sizes(self, key: Hashable, schema: Schema, in_spec: Any, leaves: list[torch.Tensor],
                   sizes: tuple[tuple[int, ...], ...]) -> Any:
        """A call of input sizes the schema's export has not seen, the batch's too: exported again at them, the
        same graph serves them (its sizes are run-time ones, as exported). Another graph means the module's code
        turned its input sizes into constants the trace kept (a pool's kernel from `x.shape[-1]`, a branch on a
        size, a mean by `len(x)` or a loop over the batch, which no trace warning names), which would silently
        compute something else at these sizes: from then on every size gets an export of its own (warned once).
        After `SIZE_CHECKS` sizes all the same graph, the export serves every size."""
        guards = schema.exported.guards  # dynamo's: what its graph assumes of the sizes
        if not schema.sizes_seen or (guards.refusal(sizes) is None if guards is not None else
                                     len(schema.sizes_seen) > SIZE_CHECKS):
            schema.sizes_seen.add(sizes)
            return schema
        dynamo = guards is not None  # else exported again and compared, as the legacy exporter's
        try:
            exported = export(self.module, self.signature, in_spec, leaves, self.options.export)
        except ExportError as e:
            return self._fail(e, f"export at new input sizes {list(sizes)}")
        if not dynamo and _same_graph(exported.model, schema.exported.model):
            schema.sizes_seen.add(sizes)
            schema.values_checked = True  # exported again on this call's values too (`_new_values`)
            return schema
        if not self.per_size:
            why = ("its export at {} assumes what these sizes break (torch.export's guards: a branch on a size, a "
                   "loop over a size unrolled, such as an RNN's steps)" if dynamo else "the graph differs from its "
                   "export at {}: the module's code turns input sizes into constants (a pool's kernel from x.shape, "
                   "a Python branch on a size)").format(list(next(iter(schema.sizes_seen))))
            warnings.warn(f"ORTModule({self.name}): exported at input sizes {list(sizes)}, as {why}, so each input "
                          "size gets its own export and gradient build.", RuntimeWarning, stacklevel=4)
            self.per_size = True
            self.schemas = {(k, seen): old for k, old in self.schemas.items() if isinstance(old, Schema)
                            for seen in old.sizes_seen}
            key = (key, sizes)
        self.stats["exports"] += 1
        fresh = self._schema(exported)
        fresh.sizes_seen.add(sizes)
        self.schemas[key] = fresh
        return fresh

    def _new_values(self, key: Hashable, schema: Schema, in_spec: Any, leaves: list[torch.Tensor]) -> Any:
        """The second call at sizes already seen: exported again, on these values, and compared with the export
        it would reuse. Another graph means the trace kept values of the first call as constants (a branch on a
        tensor, a Python number the forward reads from a tensor or changes between calls: an annealed weight, a
        layer dropped by a draw), which every later call would compute with: the schema fails as a failed export
        does. Once a schema; not for dynamo (fake tensors) or with `check_export=False`."""
        schema.values_checked = True
        if self.options.export.exporter == "dynamo" or not self.options.export.check:
            return schema
        try:
            with warnings.catch_warnings():  # the first export showed them
                warnings.simplefilter("ignore")
                exported = export(self.module, self.signature, in_spec, leaves, self.options.export)
        except ExportError:
            return schema
        now, then = numbers(exported.out_spec), numbers(schema.exported.out_spec)
        if now != then:
            changed = [f"output {path} ({then.get(path)} at the first call, {now.get(path)} at this one)"
                       for path in dict.fromkeys([*then, *now]) if then.get(path) != now.get(path)]
            self._refuse(key, ExportError(
                f"the forward returns Python numbers that differ from call to call ({', '.join(changed)}): the "
                "export keeps the first call's (a number read from a tensor, a count kept in a Python attribute), so "
                "every call would return those. Return tensors (`acc` instead of `acc.item()`) and read them after "
                "the call, or run the module in torch."), "export check")
            return _FALLBACK
        if _same_graph(exported.model, schema.exported.model):
            if schema.exported.reference is not None:  # the first call failed before its check: this one's instead
                schema.exported.reference = exported.reference
            return schema
        # a hook removed (by itself) or added while exporting; tied weights tied again (or not) since the export
        if _hook_calls(exported) != _hook_calls(schema.exported) or exported.ties != schema.exported.ties:
            self.stats["exports"] += 1
            self.schemas[key] = fresh = self._schema(exported)
            fresh.values_checked = True
            fresh.sizes_seen.update(schema.sizes_seen)
            return fresh
        self._refuse(key, ExportError(
            "exported again at its second call, the module gives another graph: its trace kept values of the first "
            "call as constants (a Python branch on a tensor's value, a number read from a tensor or kept in a "
            "Python attribute that changes between calls: an annealed weight, a layer dropped by a draw), so every "
            "call would compute with those. Compute them as tensors (torch.where instead of if, a buffer instead of "
            "a Python attribute), or run the module in torch. ORTModule(module, check_export=False) skips this "
            "check."), "export check")
        return _FALLBACK

    def _sparse_names(self, exported: Exported) -> frozenset[str]:
        """Graph names of the weights of embeddings with `sparse=True` that no other module shares: torch gives
        those a sparse gradient (rows of the looked-up ids), which optimizers such as SparseAdam require."""
        owners: dict[int, int] = {}
        for _, p in self.module.named_parameters(remove_duplicate=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
        sparse = {f"{name}.weight" if name else "weight" for name, m in self.module.named_modules()
                  if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse and owners.get(id(m.weight)) == 1}
        return frozenset(name for name, fqn in exported.state if fqn in sparse)

    def _session(self, key: Hashable, schema: Schema, wrt: list[str], leaves: list[torch.Tensor]
                 ) -> TrainingSession | None:
        if self.failed and (key, frozenset(wrt)) in self.failed:
            refused = self.failed[key, frozenset(wrt)]
            if refused is not None:
                raise refused.again()
            return None
        try:
            session, built = schema.session(wrt, leaves)
        except (gradbuilder.GradBuilderError, RuntimeError) as e:
            self.failed[key, frozenset(wrt)] = None
            try:
                self._fail(e, "onnxruntime session creation" if isinstance(e, SessionLoadError) else "gradient build")
            except ORTModuleError as refused:
                self.failed[key, frozenset(wrt)] = _Refused(refused)
                raise
            return None
        self.stats["builds"] += built
        return session

    def _fail(self, error: Exception, stage: str) -> Any:
        message = (f"ORTModule({self.name}): the {stage} failed, so this module cannot train on onnxruntime: "
                   f"{error}")
        if not self.options.fallback:
            raise ORTModuleError(message + "\nPass ORTModule(module, fallback=True) to run such calls in PyTorch "
                                 "instead (with a warning).") from error
        self.stats["fallbacks"] += 1
        warnings.warn(f"{message}\n*** ORTModule FALLBACK: these calls run in PyTorch, not onnxruntime. ***",
                      FallbackWarning, stacklevel=4)
        return _FALLBACK

    def _modules(self) -> dict[str, nn.Module]:
        if self._by_name is None:
            self._by_name = dict(self.module.named_modules())
        return self._by_name

    def _untied(self, ex: Exported) -> bool:
        """Whether a tied tensor's names now hold different tensors (one graph input cannot feed both)."""
        def held(fqn: str) -> torch.Tensor | None:
            where = self._owners.get(fqn) or self._owner(fqn)
            t = where[0]._parameters.get(where[1])
            return where[0]._buffers.get(where[1]) if t is None else t

        return any(held(o) is not held(fqn) for fqn, others in ex.ties for o in others)

    def _owner(self, fqn: str) -> tuple[nn.Module, str]:
        """The module holding a parameter or buffer, and its attribute name there (cached: the tensor itself is
        read anew each call, so reassigned parameters are seen)."""
        owner, _, attr = fqn.rpartition(".")
        where = self._owners[fqn] = (self.module.get_submodule(owner) if owner else self.module, attr)
        return where

    def _ortvalue(self, name: str, t: torch.Tensor) -> C.OrtValue:
        """Parameters' OrtValues are made once and reused while the tensor keeps its memory: in-place
        optimizer updates are seen by the next step through the shared memory."""
        hit = self._ortvalues.get(name)
        ptr, shape = t.data_ptr(), tuple(t.shape)
        if hit is not None and hit[0] is t and hit[1] == ptr and hit[2] == shape and t.is_contiguous():
            return hit[3]
        v = exchange.to_ortvalue(t)
        if t.is_contiguous():
            self._ortvalues[name] = (t, ptr, shape, v)
        return v


def default_save_dir(save_onnx: str | os.PathLike | None) -> Path | None:
    path = save_onnx if save_onnx is not None else os.environ.get(SAVE_ENV) or None
    return Path(path) if path else None
