"""torch module + one call's arguments -> a forward ONNX graph whose parameters and buffers are INPUTS.

Parameters must be graph inputs, not initializers, so every step feeds their current values (an
optimizer's in-place update is seen without re-export). Two exporters:

- "torchscript" (default; torch's legacy exporter, opset 17): exports in 0.1 s, keeps each module's
  own train/eval mode (TrainingMode.PRESERVE: BatchNorm in training mode, Dropout active), and with
  `keep_initializers_as_inputs=True` never merges parameters that happen to hold equal values (its
  de-duplication pass would otherwise fuse e.g. two freshly initialised LayerNorms). EVAL mode is
  avoided because its peephole pass folds BatchNorm into Conv weights.
- "dynamo" (torch.export, opset 18+, `optimize=False` so parameters keep their names): slower
  (seconds), emits BatchNorm in inference mode even in train(), which `batchnorm` corrects.

Every tensor argument gets all dimensions dynamic; non-tensor arguments are baked in as constants
(their values are part of the cache key in `module.py`).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import io
import itertools
import logging
import os
import random
import threading
import warnings
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import helper
from onnxruntime.capi import _pybind_state as C
from torch import nn
from torch.nn.modules import module as nn_module
from torch.nn.utils import parametrize
from torch.onnx._internal.torchscript_exporter import utils as torchscript_utils
from torch.overrides import TorchFunctionMode

from gradbuilder.graph import graph_nodes, infer_shapes_safely
from gradbuilder.inference import infer_shapes, tensor_types

from . import (
    accumulation,
    checkpoints,
    custom_functions,
    double_scalars,
    exchange,
    scalars,
    stop_gradients,
    symbolics,
    torch_draws,
)
from .attention import lean_attention
from .batchnorm import BatchStats, stand_in_statistics, training_batchnorm
from .dropouts import exportable_dropouts
from .dynamo_translations import translations as dynamo_translations
from .edits import BACKWARD_HOOKS, grad_attributes
from .forward_hooks import Replay, forget, recorded, user_hooks
from .functions import exportable_functions
from .hook_state import kept_hook_state
from .losses import exportable_losses
from .ort_session import Runner, SessionConfig
from .ort_session import draws_random as draws_random_numbers
from .packed import exportable_packing
from .passes import constant_values, inactive_dropouts, int_attr, names_in_use, rename_tensors, written_rate
from .patching import replaced, traced_number, untraced
from .scalars import Scalars
from .size_guards import SizeGuards
from .structure import Const, Node, Spec, constants, flatten, numbers_as_leaves, numbers_marked, tensor_paths, unflatten

EXPORTERS = ("torchscript", "dynamo")
DEFAULT_OPSET = {"torchscript": 17, "dynamo": 18}


class ExportError(RuntimeError):
    """torch could not export the module, or the export is unusable for training. (An error the module's forward
    itself raises on the call's inputs is raised as it is: torch's own call raises it too.)"""


class ExportWarning(UserWarning):
    """The trace may not generalise to other inputs (a tensor became a Python value while tracing)."""


@dataclass(frozen=True)
class ExportOptions:
    exporter: str = "torchscript"
    opset: int | None = None
    check: bool = True
    """Compare onnxruntime's outputs of the call that exported with torch's (`Exported.reference`)."""
    torch_dropout: bool = False
    """Dropouts exported so that masks drawn as torch's are torch's at every call: attention's result in torch's
    layout (`attention.lean_attention`), float64 rates as doubles (`_float64_dropout_rates`)."""

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ValueError(f"exporter must be one of {EXPORTERS}, not {self.exporter!r}")

    @property
    def opset_version(self) -> int:
        return self.opset or DEFAULT_OPSET[self.exporter]


REFERENCES = itertools.count()
"""Marks in the order taken: a call takes one before it looks up its schema, so a reference made after it is that
call's own (`Reference.made`)."""


@dataclass(frozen=True)
class Reference:
    """torch's own run of the call that exported, to check onnxruntime's outputs and first gradients of the same
    call against (`runtime/checks.py`)."""

    outputs: tuple[torch.Tensor, ...]
    """torch's outputs, with their autograd graph."""
    leaves: tuple[torch.Tensor, ...]
    """The call's input leaves as the trace took them, those requiring grad as leaves of their own
    (`_traced_leaf`): torch's gradients of this call alone, where the caller's tensors would also take the paths
    that reach them outside it (an input computed from a parameter the module shares, one tensor passed twice)."""
    backward_hooks: tuple[str, ...] = ()
    """The module's backward hooks and its forward's tensor hooks, which torch's gradients pass through and
    onnxruntime's backward cannot run (named where the gradients differ)."""
    thread: int = field(default_factory=threading.get_ident)
    """The thread whose call exported: another thread's call may find the schema first, with other inputs."""
    made: int = field(default_factory=REFERENCES.__next__)
    """Its mark (`REFERENCES`): a reference older than the call reading it was left by a call that failed before its
    check (a gradient build refused), and holds that call's outputs, not this one's."""
    random: bool = False
    """Whether torch's run drew random numbers (Dropout masks, randn_like, rand, bernoulli_): onnxruntime's outputs
    are comparable where its run took the same ones from torch's generator, put back after the trace (the session's
    `draw_masks_as_torch`), and the check's float64 arbiter draws them again from the call's RNG state, in float32
    as torch's run drew them (`checks.float32_draws`)."""


@dataclass
class Exported:
    """The forward graph of one call schema and how its inputs and outputs map to torch."""

    model: onnx.ModelProto
    inputs: list[tuple[str, int]]
    """(graph input, index of the argument leaf feeding it), for the leaves the graph reads."""
    state: list[tuple[str, str]]
    """(graph input, qualified name of the parameter or buffer feeding it)."""
    outputs: list[str]
    """Graph outputs for the tensor leaves of the module's result, in leaf order."""
    out_spec: Spec
    batch_stats: list[BatchStats] = field(default_factory=list)
    frozen: frozenset[str] = frozenset()
    """State inputs never differentiated (second reads of a tensor, see `_embedding_padding`)."""
    updates: list[tuple[str, str]] = field(default_factory=list)
    """(graph output, qualified name of a buffer): the buffer's value after the forward, which changes it in place
    (written back by the engine after each call). These outputs follow the user's, before BatchNorm's."""
    reference: Reference | None = None
    """torch's run of the traced call (the engine takes it); None where it cannot match (random ops, state changed
    in place) or is not kept."""
    scalars: Scalars | None = None
    """The Python numbers and strings the forward read from module attributes, which the graph holds as constants
    (`runtime/scalars.py`)."""
    unchecked: bool = False
    """What the gradient checks are for went unchecked: exported with nothing requiring grad, the Functions it
    applied (`custom_functions.unchecked`), or, the exporting call run without a backward, the backward hooks that
    torch's gradients pass through (`Reference.backward_hooks`). A gradient build exports again first, and that
    call is checked."""
    guards: SizeGuards | None = None
    """The input sizes a dynamo export holds for; None for the legacy exporter, whose other sizes are checked by
    exporting them again (`Engine._new_sizes`)."""
    internal: frozenset[int] = frozenset()
    """The positions in `outputs` of those other outputs are computed from (a feature returned beside the logits, a
    hooked activation): their gradient from the caller is only part of torch's (`function.partial_gradient`)."""
    hooks: Replay | None = None
    """The user's forward hook calls, run again after each call on the last `len(hooks.names)` of `outputs`
    (`runtime/forward_hooks.py`)."""
    ties: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    """(qualified name fed, the other names of that tensor at the export): tied weights, one graph input for all
    (checked at each call: `functional_call(..., tie_weights=False)` replaces one name only)."""

    @functools.cached_property
    def state_names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.state)

    @functools.cached_property
    def recomputed_stats(self) -> bool:
        """Whether a BatchNorm call lies in a checkpointed region (its statistics updated again at backward)."""
        return any(s.region is not None for s in self.batch_stats)


class _Shared(dict):
    """A dict that survives the copies torch.export makes of the module it traces."""

    def __deepcopy__(self, memo: dict) -> _Shared:
        return self

    def __copy__(self) -> _Shared:
        return self


def as_called(bound: inspect.BoundArguments) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The forward's arguments as a caller passes them: in position the positional-only ones, those before a
    non-empty *args, and the leading ones without a default (`model(x)`: the module's own forward pre-hooks read
    `args[0]`, and failed to find it), the rest by keyword. `BoundArguments.args` puts every argument it can in
    position, defaults included: a decorator filling a default into **kwargs when it does not see the argument
    among the positionals (transformers' merge_with_config_defaults: XGLM, M2M100, Llava) then met it twice."""
    params = bound.signature.parameters
    varargs = next((name for name, p in params.items() if p.kind is p.VAR_POSITIONAL), None)
    if varargs is not None and bound.arguments.get(varargs):
        return tuple(bound.args), dict(bound.kwargs)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        p = params[name]
        if p.kind is p.POSITIONAL_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty and not kwargs):
            args.append(value)
        elif p.kind is p.VAR_KEYWORD:
            kwargs.update(value)
        elif p.kind is not p.VAR_POSITIONAL:
            kwargs[name] = value
    return tuple(args), kwargs


class _Flat(nn.Module):
    """The module as a function of flat tensors returning a flat tuple of tensors.

    It shares the module's parameter, buffer and child dicts, so the exporters name every parameter
    by its qualified name in the module itself.
    """

    def __init__(self, module: nn.Module, signature: inspect.Signature, in_spec: Spec):
        super().__init__()
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        self._modules = module._modules
        self.training = module.training
        object.__setattr__(self, "_target", module)
        self._signature = signature
        self._in_spec = in_spec
        object.__setattr__(self, "_result", _Shared())

    @property
    def out_spec(self) -> Spec | None:
        return self._result.get("spec")

    def forward(self, *leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        arguments = unflatten(self._in_spec, leaves)
        bound = inspect.BoundArguments(self._signature, arguments)
        legacy = self._result.get("without_grad")  # the legacy exporter's trace (dynamo's tensors are fake)
        reads = _PythonReads(dict(self._target.named_buffers())) if legacy else contextlib.nullcontext()
        with reads, stop_gradients.WithoutGrad() if legacy else contextlib.nullcontext() as mode, \
                recorded(self._target) as hooks:
            args, kwargs = as_called(bound)
            try:
                out = self._target(*args, **kwargs)
            except Exception as e:
                self._result["raised"] = e  # the forward's own error, which torch's call raises too
                self._result["hook_failed"] = hooks.failed
                raise
        flat, spec = flatten(out)
        if legacy:
            numbers = {i: _python_type(t) for i, t in enumerate(flat) if traced_number(t)}
            spec = numbers_marked(spec, numbers) if numbers else spec
        else:  # dynamo's run before the export and its trace alike: numbers as outputs
            spec, numbers = numbers_as_leaves(spec, flat)
        self._result["spec"] = spec
        self._result["numbers"] = numbers
        self._result["hooks"], extra = hooks.replay(flat)
        flat += extra  # as they are at the end of the forward, as torch's hooks hold them by then
        self._result.setdefault("hook_runs", []).append([*hooks.tensors, *hooks.made])
        self._result["kept_in_attributes"] = hooks.replaced
        if isinstance(reads, _PythonReads):
            self._result["python_reads"] = reads.read
            self._result["returned_numbers"] = reads.returned(self._result["spec"])
        if mode is not None:
            self._result["tensor_hooks"] = mode.tensor_hooks
            self._result["changed_parameters"] = mode.changed_parameters
        params = dict(self._target.named_parameters())  # a parameter changed in place: its value, no gradient
        updated = [params[name].detach() if name in params else self._target.get_buffer(name)
                   for name in self._result.get("updates", ())]
        with untraced():  # copies of the changed buffers' values, not part of the trace
            copies = [b.detach().clone() for b in updated]
            # a Python float computed from sizes is a double in torch's call (`numbers_in_double`)
            values = [t.double() if numbers.get(i) is float else t for i, t in enumerate(flat)]
        self._result["outputs"] = [*values, *copies]  # the values torch computed (the tracer runs the module eagerly)
        return (*flat, *updated)


def _python_type(t: torch.Tensor) -> type:
    return bool if t.dtype == torch.bool else float if t.is_floating_point() else int


_GLOBAL_FORWARD_HOOKS = (nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks)
_EXPORTERS_WRAPPERS = ("torch.jit._trace", "torch.export.")


@contextlib.contextmanager
def _global_hooks_on_modules_only() -> Iterator[None]:
    """torch's global forward hooks (`register_module_forward_hook`: a FLOP counter, an output rescaling) skip the
    exporters' own wrappers while an export runs (`_Flat`, torch.jit's ONNXTracedModule, torch.export's Wrapper and
    GuardsFn): they run for the module's own calls, as torch's, and one handed a wrapper's flat tuple (written for
    the module's outputs) failed."""
    saved = [(hooks, dict(hooks)) for hooks in _GLOBAL_FORWARD_HOOKS]
    for hooks, kept in saved:
        hooks.update((k, _on_modules_only(hook)) for k, hook in kept.items())
    try:
        yield
    finally:
        for hooks, kept in saved:
            hooks.update((k, hook) for k, hook in kept.items() if k in hooks)


def _on_modules_only(hook: Callable[..., Any]) -> Callable[..., Any]:
    def run(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if isinstance(module, _Flat) or type(module).__module__.startswith(_EXPORTERS_WRAPPERS):
            return None
        return hook(module, *args, **kwargs)
    return run


@contextlib.contextmanager
def _preserved(module: nn.Module) -> Iterator[Callable[[], list[str]]]:
    """Tracing runs the module: put back its buffers (BatchNorm statistics), the RNG state and what its forward
    hooks keep (`hook_state`: a count or running sum counts each call once, as torch's) after. Yields a
    function naming the buffers and parameters the forward changed in place so far (BatchNorm's statistics left
    out: the runtime updates those; a parameter by its version counter, so nothing is copied), or replaced (a
    recurrent state kept from call to call, `self.h = h.detach()`: its slot holds another tensor)."""
    saved = [(name, b, b.detach().clone()) for name, b in module.named_buffers()]
    buffer_versions = {id(b): b._version for _, b, _ in saved}
    slots = {name: _holder(module, name) for name, _, _ in saved}
    empty = [(m, attr) for m in module.modules() for attr, b in m._buffers.items() if b is None]
    versions = [(name, p, p._version) for name, p in module.named_parameters()]
    rng = torch.random.get_rng_state()
    statistics = {f"{m}.{b}" if m else b for m, mod in module.named_modules()
                  if isinstance(mod, nn.modules.batchnorm._BatchNorm)
                  for b in ("running_mean", "running_var", "num_batches_tracked")}
    through_data = _DataAccess({id(p): name for name, p, _ in versions})

    def replaced(name: str, b: torch.Tensor) -> bool:
        holder, attr = slots[name]
        now = holder._buffers[attr]
        return isinstance(now, torch.Tensor) and now is not b

    def changed() -> list[str]:
        bumped = [name for name, p, version in versions if p._version != version]
        # a buffer by its version counter too: a change that leaves this call's value as it was (a running maximum
        # not exceeded yet, an EMA teacher equal to its student at the start) is still a change of every call
        return [*(name for name, b, v in saved if name not in statistics and
                  (b._version != buffer_versions[id(b)] or not _same(b, v) or replaced(name, b))),
                *bumped, *(name for name in through_data.changed() if name not in bumped)]

    try:
        with through_data, kept_hook_state(module), _global_hooks_on_modules_only():
            yield changed
    finally:
        with torch.no_grad():
            for name, b, v in saved:
                if b.shape != v.shape:  # resized in place (a per-channel observer's first call sizes its statistics)
                    b.resize_(v.shape)
                if b._version != buffer_versions[id(b)] or not _same(b, v):
                    # through .data, the version counter left as is: the trace's autograd graph (the first-call
                    # check's reference) saved BatchNorm's statistics and the buffers it reads, which a bumped
                    # version makes torch refuse to differentiate (its BatchNorm kernel updates them unbumped)
                    b.data.copy_(v)
                holder, attr = slots[name]
                holder._buffers[attr] = b
            for holder, attr in empty:  # set by the trace: no traced tensor left in the module
                holder._buffers[attr] = None
        torch.random.set_rng_state(rng)


@contextlib.contextmanager
def _fed_buffers(module: nn.Module, attributes: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Non-persistent buffers fed as graph inputs like the others: the exporters take the state to feed from the
    state_dict, which leaves them out, so their values at the export became constants, and a change between calls
    (a schedule, a recurrent state carried from call to call, a resized mask) went unseen. Their modules' sets of
    non-persistent names are emptied for the export (in place: the flat module shares the root's). `attributes`
    (`edits.grad_attributes`: tensors requiring grad in plain attributes) are buffers while it lasts, so that they
    become inputs too (the legacy exporter refused them as constants; dynamo's graph held them as such, without
    gradient). A tensor made by `nn.Buffer(persistent=False)` carries its flag, which assigning it again in the
    forward reads (CTRL's `self.pos_encoding = self.pos_encoding.to(...)`, the same tensor): set too, else the
    assignment made it non-persistent again mid-trace ("state_dict changed after running the tracer")."""
    sets = [(m._non_persistent_buffers_set, set(m._non_persistent_buffers_set)) for m in module.modules()]
    for names, _ in sets:
        names.clear()
    flagged = [b for m in module.modules() for b in m._buffers.values() if getattr(b, "persistent", True) is False]
    for b in flagged:
        b.persistent = True
    moved = [(*_holder(module, fqn), t) for fqn, t in attributes.items()]
    for owner, attr, t in moved:
        del owner.__dict__[attr]
        owner._buffers[attr] = t
    try:
        yield
    finally:
        for owner, attr, t in moved:
            owner._buffers.pop(attr, None)
            owner.__dict__[attr] = t
        for names, kept in sets:
            names.update(kept)
        for b in flagged:
            b.persistent = False


def _holder(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding a buffer or parameter and its attribute there."""
    owner, _, attr = name.rpartition(".")
    return (module.get_submodule(owner) if owner else module), attr


@contextlib.contextmanager
def scratch_buffers(module: nn.Module) -> Iterator[None]:
    """The module computes on copies of its buffers, and the RNG state is put back after: a call computed again
    (for backward(create_graph=True)) leaves BatchNorm's statistics as the call itself left them. Copies, not
    values put back in place: the recomputed graph saves the buffers it read (BatchNorm's running statistics),
    and changing those in place would fail its backward."""
    swapped = [(m, attr, b) for m in module.modules() for attr, b in m._buffers.items() if b is not None]
    rng = torch.random.get_rng_state()
    for m, attr, b in swapped:
        m._buffers[attr] = b.clone()
    try:
        yield
    finally:
        for m, attr, b in swapped:
            m._buffers[attr] = b
        torch.random.set_rng_state(rng)


class _DataAccess(TorchFunctionMode):
    """Parameters the forward reaches through `.data`, their values as they were then: a change through `.data`
    (`w.data.clamp_(-c, c)`, `w.data = F.normalize(w.data)`) is neither traced nor counted by the parameter's
    version counter, so only their values tell (compared for these alone, not copied for every export)."""

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names = names
        self.before: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__self__", None) is stop_gradients.DATA and args and id(args[0]) in self.names:
            name = self.names[id(args[0])]
            if name not in self.before:
                self.before[name] = (args[0], args[0].detach().clone())
        return func(*args, **(kwargs or {}))

    def changed(self) -> list[str]:
        return [name for name, (p, value) in self.before.items() if not _same(p.detach(), value)]




@contextlib.contextmanager
def _inputs_kept(leaves: Sequence[torch.Tensor], names: Sequence[str]) -> Iterator[Callable[[], list[str]]]:
    """Tracing runs the module on the caller's tensors: a forward changing an input in place (`x.mul_(0.5)`)
    changed the caller's tensor once per run of the export, and the graph then applied the change again to it.
    Yields a function naming the inputs changed so far (by their version counters); puts back the values of those
    that do not require grad (the rest torch itself lets change only when they are not leaves)."""
    versions = [None if t.is_inference() else t._version for t in leaves]  # inference tensors have none
    kept = [None if t.requires_grad or t.is_inference() else t.detach().clone() for t in leaves]

    def changed() -> list[str]:
        return [name for name, t, v in zip(names, leaves, versions) if v is not None and t._version != v]

    try:
        yield changed
    finally:
        with torch.no_grad():
            for t, v, copy in zip(leaves, versions, kept):
                if copy is not None and t._version != v:
                    t.copy_(copy)


_CONVERSIONS = frozenset({torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
                          torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist})


class _PythonReads(TorchFunctionMode):
    """Records which of `buffers` (qualified name -> tensor) the forward turns into Python numbers (`int(self.ptr)`,
    a view of one included): the trace keeps the number it read as a constant."""

    def __init__(self, buffers: dict[str, torch.Tensor]):
        super().__init__()
        # storages, not sizes: a size read while tracing is itself traced (and warned about as a conversion)
        self.storages = {ptr: name for name, b in buffers.items() if (ptr := b.untyped_storage().data_ptr())}
        self.read: set[str] = set()
        self.converted: list[Any] = []
        """Every number a conversion returned (held, so that identities stay theirs)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if func in _CONVERSIONS and args and isinstance(args[0], torch.Tensor):
            name = self.storages.get(args[0].untyped_storage().data_ptr())
            if name is not None:
                self.read.add(name)
            self.converted.extend(_flat_list(result) if isinstance(result, list) else [result])
        return result

    def returned(self, spec: Spec) -> list[str]:
        """Paths of the forward's result holding a number a conversion made (`loss.item()`, `float(acc)`): the
        trace keeps this call's. By identity, so a literal equal to one is not taken for it; ints and bools are
        interned where small, so floats and large ints only."""
        made = {id(v) for v in self.converted if _own_object(v)}
        return [path for path, v in constants(spec) if id(v) in made]


def _flat_list(values: list[Any]) -> list[Any]:
    return [x for v in values for x in (_flat_list(v) if isinstance(v, list) else [v])]


def _own_object(value: Any) -> bool:
    return isinstance(value, float) or (type(value) is int and not -5 <= value <= 256)


_PYTHON_RANDOM = (("random", random, ("random", "uniform", "randint", "randrange", "choice", "choices", "sample",
                                         "shuffle", "gauss", "normalvariate", "betavariate")),
                  ("numpy.random", np.random, ("rand", "randn", "random", "uniform", "randint", "choice",
                                               "normal", "permutation", "shuffle", "binomial")))


@contextlib.contextmanager
def _python_draws() -> Iterator[list[str]]:
    """The module-level Python and numpy random functions the block calls (`random.uniform`, ...), in call order:
    the trace keeps what they drew as constants (a layer drop decided once for every step)."""
    drawn: list[str] = []

    def recording(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def draw(*args: Any, **kwargs: Any) -> Any:
            if label not in drawn:
                drawn.append(label)
            return fn(*args, **kwargs)
        return draw

    with replaced((owner, name, recording(f"{prefix}.{name}", getattr(owner, name)))
                  for prefix, owner, names in _PYTHON_RANDOM for name in names):
        yield drawn


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (a buffer holding NaN is unchanged when left alone)."""
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and \
        torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _listed(items: Sequence[str], most: int = 4) -> str:
    return ", ".join(items[:most]) + (" and more" if len(items) > most else "")


def _hooked(module: nn.Module, kinds: Sequence[str]) -> list[str]:
    """Where the user's hooks of these kinds are, each place once."""
    return list(dict.fromkeys(where for where, *_ in user_hooks(module, kinds)))


def _unique(names: Sequence[str], taken: set[str]) -> list[str]:
    out = []
    for n in names:
        name, k = n or "input", 1
        while name in taken:
            name, k = f"{n}#{k}", k + 1
        taken.add(name)
        out.append(name)
    return out


def _values_that_shape(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters whose values shape inference may need: integer and boolean tensors, and small ones. The
    exporter's ONNX shape inference copies the value of every parameter a node reads into the model it infers
    that node in; a weight's shape is already on its graph input."""
    return {k: v for k, v in params.items() if not v.is_floating_point() or v.numel() <= 64}


@contextlib.contextmanager
def _shape_inference_without_weights() -> Iterator[None]:
    """The legacy exporter's ONNX shape inference, handed only `_values_that_shape` of the parameters: same
    graph (GPT-2 small: byte-identical), 7.6 -> 1.6 s of export. Holds under `EXPORT_LOCK` only."""
    whole, node = torch._C._jit_pass_onnx_graph_shape_type_inference, torch._C._jit_pass_onnx_node_shape_type_inference
    torch._C._jit_pass_onnx_graph_shape_type_inference = lambda g, params, opset: whole(g, _values_that_shape(params),
                                                                                         opset)
    torch._C._jit_pass_onnx_node_shape_type_inference = lambda n, params, opset: node(n, _values_that_shape(params),
                                                                                       opset)
    try:
        yield
    finally:
        torch._C._jit_pass_onnx_graph_shape_type_inference, torch._C._jit_pass_onnx_node_shape_type_inference = \
            whole, node


@contextlib.contextmanager
def _parametrizations_uncached() -> Iterator[None]:
    """The export outside `torch.nn.utils.parametrize.cached()`, which the trace refuses ("Cannot trace a model
    while caching parametrizations"): the graph computes the parametrized weight from its originals anyway."""
    enabled, cache = parametrize._cache_enabled, parametrize._cache
    parametrize._cache_enabled, parametrize._cache = 0, {}
    try:
        yield
    finally:
        parametrize._cache_enabled, parametrize._cache = enabled, cache


@contextlib.contextmanager
def _onnx_log_off() -> Iterator[None]:
    """torch's legacy export turns its ONNX log on and leaves it on (`setup_onnx_logging` tests the function
    `_jit_is_onnx_log_enabled`, always true, not its result): a failed export printed its whole TorchScript graph
    to stdout ("Torch IR graph at exception"), thousands of lines for a large model, and the log stayed on in the
    caller's process. Off while the export runs, then as it was."""
    was = torch._C._jit_is_onnx_log_enabled()
    torch._C._jit_set_onnx_log_enabled(False)
    try:
        with replaced([(torchscript_utils, "setup_onnx_logging", lambda verbose: contextlib.nullcontext())]):
            yield
    finally:
        torch._C._jit_set_onnx_log_enabled(was)


def _refuse_bfloat16_casts(model: onnx.ModelProto) -> None:
    """The legacy exporter writes a type promotion to bfloat16 (`x.bfloat16() * ints`: Falcon's alibi) as Cast to
    torch's number for it, 15, which is ONNX's COMPLEX128 (its own writes no complex types), and onnxruntime's CPU
    kernels compute no bfloat16 arithmetic anyway: named here, where the first run failed on "COMPLEX128"."""
    for n in graph_nodes(model.graph):
        if n.op_type == "Cast" and int_attr(n, "to", 0) == onnx.TensorProto.COMPLEX128:
            raise ExportError(f"the forward computes in bfloat16 (node {n.name or n.output[0]!r}: torch's legacy "
                              "exporter writes the cast as ONNX's COMPLEX128), which onnxruntime's CPU kernels do not "
                              "compute: compute it in float32 (Falcon: alibi=False, or its slopes in float32), or run "
                              "the module in torch.")


def _torchscript(flat: _Flat, leaves: Sequence[torch.Tensor], names: list[str], opset: int) -> onnx.ModelProto:
    buf = io.BytesIO()
    flat._result["without_grad"] = True  # a forward's no_grad results detached: both kept as StopGradient
    with warnings.catch_warnings(record=True) as caught, _shape_inference_without_weights(), _onnx_log_off(), \
            stop_gradients.exported_detach(), accumulation.exported_accumulation(), symbolics.exported_symbolics():
        warnings.simplefilter("always")
        with scalars.reads() as read, double_scalars.traced_numbers() as numbers:  # the forward's one eager run
            torch.onnx.export(
                flat, tuple(leaves), buf, dynamo=False, opset_version=opset, input_names=names,
                dynamic_axes={n: {d: f"{n}_dim{d}" for d in range(t.dim())} for n, t in zip(names, leaves)},
                training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False,
                # parameters become graph inputs fed at run time: serialising their values would double the
                # export time of a large model (GPT-2 small: 14 -> 7.5 s)
                export_params=False, keep_initializers_as_inputs=True,
            )
    flat._result["scalar_reads"] = read
    seen = set()
    for w in caught:
        inside_torch = w.filename.startswith(os.path.dirname(torch.__file__))  # torch's own size checks
        if issubclass(w.category, torch.jit.TracerWarning) and not inside_torch and str(w.message) not in seen:
            seen.add(str(w.message))
            warnings.warn(f"ORTModule({type(flat._target).__name__}): the export baked a traced value in and may be "
                          f"wrong for other inputs: {w.message} ({w.filename}:{w.lineno}). ORTModule exports it "
                          "again at new input sizes, the batch's too, and compares", ExportWarning, stacklevel=2)
    model = torch_draws.expand(onnx.load_from_string(buf.getvalue()))
    _refuse_bfloat16_casts(model)
    traced = flat._result.get("outputs") or ()
    doubles = [o.name for o, t in zip(model.graph.output, traced)
               if isinstance(t, torch.Tensor) and t.dtype == torch.float64]
    returned = [model.graph.output[i].name for i, kind in flat._result.get("numbers", {}).items() if kind is float]
    model = double_scalars.numbers_in_double(double_scalars.in_double(model, doubles, numbers), returned)
    return checkpoints.tag_regions(double_scalars.sizes_in_double(model, numbers))


def _dynamo(flat: _Flat, leaves: Sequence[torch.Tensor], names: list[str], opset: int) -> onnx.ModelProto:
    # one forward in torch first (buffers and RNG put back after): its stop-gradients and attribute reads
    with stop_gradients.Finder() as finder, scalars.reads() as read:
        flat(*leaves)
    flat._result["scalar_reads"] = read
    computed = flat._result.get("outputs")  # torch's values of this call: the reference of the first-call checks
    if finder.found:
        raise ExportError(f"the dynamo exporter loses torch's no_grad blocks, and this forward has one "
                          f"({finder.found}): its gradients would flow where torch's do not. Use detach() "
                          "instead, or exporter='torchscript' (the default), which keeps them.")
    from torch.onnx._internal.exporter._errors import TorchExportError

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()), _quiet(_DYNAMO_LOGGERS), _plain_parameters_wrapped(flat):
        warnings.simplefilter("ignore")
        attempts = [_dynamic_dims(leaves, leading) for leading in SYMBOLIC_AXES]
        for k, dims in enumerate(attempts):
            try:
                program = torch.onnx.export(flat, tuple(leaves), dynamo=True, optimize=False, opset_version=opset,
                                            input_names=names, dynamic_shapes=(dims,), verbose=False,
                                            custom_translation_table={**checkpoints.translations(),
                                                                      **dynamo_translations()})
                break
            except TorchExportError:
                if k == len(attempts) - 1:
                    raise
    flat._result["outputs"] = computed  # the export ran the module again, on fake tensors
    # float64 arithmetic's Python numbers read as written (onnxscript casts float32 Constants: 1e-8 off)
    numbers = double_scalars.numbers_in(program.exported_program.graph.nodes)  # type: ignore[union-attr]
    _unique_value_names(program.model)  # type: ignore[union-attr]
    model = checkpoints.tag_regions(double_scalars.sizes_in_double(double_scalars.constants_in_double(
        torch_draws.expand(program.model_proto), numbers), numbers))  # type: ignore[union-attr]
    _pin_single_values(model, program.exported_program.range_constraints)  # type: ignore[union-attr]
    _outputs_sized_by_inputs(model)
    flat._result["guards"] = SizeGuards.of(program.exported_program, len(leaves))  # type: ignore[union-attr]
    return model


def _unique_value_names(model: Any) -> None:
    """Node outputs named as a graph input or initializer renamed, in the dynamo exporter's IR (whose values are
    distinct objects, their uses following them): it names a parameter by its qualified name and a node's output
    by its FX node's, so a parameter `t` and a transpose `z.t()` were both 't', an invalid graph ("tensor 't' is
    defined twice")."""
    graph = model.graph
    sources = {v.name for v in graph.inputs} | set(graph.initializers)
    taken = sources | {v.name for node in graph for v in node.outputs}
    for node in graph:
        for v in node.outputs:
            if v.name in sources:
                k = 1
                while f"{v.name}_{k}" in taken:
                    k += 1
                v.name = f"{v.name}_{k}"
                taken.add(v.name)


SYMBOLIC_AXES = (None, 1, 0)
"""How many leading axes of each input the dynamo export leaves symbolic (None: every one), tried in turn where
torch.export fails: its symbolic
reasoning refuses some sizes computed from dynamic ones ("Eq(((s63 + 1)//18), 4) is inconsistent!" for
`torch.cat([y, y.flip(-1)], -1)[..., ::3]`, a matmul's "must have same reduction dim" after `unflatten`), which
static ones pass. An axis left static is an int in the export's `SizeGuards`: another size there exports again."""


def _dynamic_dims(leaves: Sequence[torch.Tensor], leading: int | None) -> tuple[dict[int, Any], ...]:
    return tuple({d: torch.export.Dim.AUTO for d in range(t.dim() if leading is None else min(leading, t.dim()))}
                 for t in leaves)


@contextlib.contextmanager
def _plain_parameters_wrapped(module: nn.Module) -> Iterator[None]:
    """Plain tensors in parameter slots (`torch.func.functional_call`'s fast weights, a hypernetwork's) as
    Parameters of their values while dynamo exports: torch.export refuses them ("State dict entry for parameter
    ... is not an instance of torch.nn.Parameter"); the graph's inputs keep their names, and each call feeds the
    tensors the slots then hold (with their gradients, as any parameter's)."""
    swapped = [(m, name, t) for m in module.modules() for name, t in m._parameters.items()
               if t is not None and not isinstance(t, nn.Parameter)]
    for m, name, t in swapped:
        m._parameters[name] = nn.Parameter(t.detach(), requires_grad=t.requires_grad)
    try:
        yield
    finally:
        for m, name, t in swapped:
            m._parameters[name] = t


_DYNAMO_LOGGERS = ("torch.onnx._internal.exporter._registration", "torch.fx.experimental.symbolic_shapes")
"""torch's loggers that write to stderr while dynamo exports: the registry's missing torchvision ops, and a failing
export's sizes without user code ("Unable to find user code corresponding to {u0}"). torch.export prints the
partial FX graph of a failure to sys.stderr itself (redirected): dynamo is tried after the legacy exporter fails,
whose error names both exporters' causes."""


@contextlib.contextmanager
def _quiet(names: Iterable[str]) -> Iterator[None]:
    """The named loggers at ERROR while the block lasts, then as they were."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _pin_single_values(model: onnx.ModelProto, ranges: dict[Any, Any]) -> None:
    """torch.onnx.export declares each dim it was told is dynamic as a symbol even where torch.export found that the
    graph holds for one value only (its range [10, 10]: an RNN unrolled over the 10 steps of the traced sequence),
    so the graph ran other sizes without a word (an output of 10 steps for a sequence of 12). Such dims become that
    value in every declaration (onnxruntime then refuses another size, which `SizeGuards` sends to an export of its
    own)."""
    fixed = {str(sym): int(r.lower) for sym, r in ranges.items() if r.is_int and r.lower == r.upper}
    if not fixed:
        return
    g = model.graph
    for d in _named_dims((*g.input, *g.value_info, *g.output), fixed):
        d.dim_value = fixed[d.dim_param]


def _outputs_sized_by_inputs(model: onnx.ModelProto) -> None:
    """Output dims dynamo declared as the traced size where onnx's shape inference derives them from a symbolic input
    dim, with no guard pinning that (GRU's and LSTM's steps: an output of the traced 6 steps, so that another length
    ran the forward and failed the backward, whose output gradient was declared 6): they take the symbol."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.value_info[:]
    for o in probe.graph.output:
        o.type.tensor_type.ClearField("shape")
    inferred = infer_shapes_safely(probe)
    if inferred is None:
        return
    derived = {o.name: o.type.tensor_type.shape.dim for o in inferred.output if o.type.tensor_type.HasField("shape")}
    for o in model.graph.output:
        dims = derived.get(o.name)
        declared = o.type.tensor_type.shape.dim
        if dims is None or len(dims) != len(declared):
            continue
        for d, sym in zip(declared, dims):
            if d.HasField("dim_value") and sym.HasField("dim_param"):
                d.dim_param = sym.dim_param


def _named_dims(infos: Iterable[onnx.ValueInfoProto], names: Container[str]
                ) -> Iterator[onnx.TensorShapeProto.Dimension]:
    """The dimensions of these declarations named one of `names`, to be rewritten in place."""
    for vi in infos:
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in names:
                yield d


EXPORT_LOCK = threading.RLock()
"""torch.onnx.export keeps process-wide state (it refuses to start while another export runs): one at a time; the
export's replacements of torch's functions are process-wide too (`replay` sets them again)."""


class _Exporting(threading.local):
    active = False  # each thread's starting value (a class attribute: no AttributeError to catch at each call)


_EXPORTING = _Exporting()


def exporting() -> bool:
    """Whether this thread is inside `export`: an ORTModule nested in the exported module then runs as its torch
    module, which the export traces (its own export would wait for `EXPORT_LOCK` forever)."""
    return _EXPORTING.active


@contextlib.contextmanager
def _marked_exporting() -> Iterator[None]:
    _EXPORTING.active, before = True, _EXPORTING.active
    try:
        yield
    finally:
        _EXPORTING.active = before


def export(module: nn.Module, signature: inspect.Signature, in_spec: Spec, leaves: Sequence[torch.Tensor],
           options: ExportOptions, updates: tuple[str, ...] = ()) -> Exported:
    """Export one call of `module` (bound arguments flattened to `in_spec` + `leaves`). A forward that changes
    buffers in place (a running statistic, a queue of keys, a step count) is exported again with those buffers'
    new values as extra outputs (`updates`; the legacy exporter), which the engine writes back after each call."""
    # every name of a shared (tied) tensor: the exporters may call it by any of them (dynamo by the last)
    state = dict(module.named_parameters(remove_duplicate=False))
    state.update(module.named_buffers(remove_duplicate=False))
    attributes = grad_attributes(module)
    state.update(attributes)
    names = _unique(tensor_paths(in_spec), set(state))
    flat = _Flat(module, signature, in_spec)
    flat._result["updates"] = list(updates)
    buffers = {name for name, _ in module.named_buffers()}
    try:
        # traced with grad enabled whatever the caller's mode: under no_grad torch takes fused inference
        # paths (nn.TransformerEncoderLayer's fast path) that have no ONNX export
        # float32 whatever the caller's autocast: onnxruntime's CPU kernels have no bfloat16 products (engine warns)
        with EXPORT_LOCK, _marked_exporting(), torch.inference_mode(False), torch.enable_grad(), \
                _parametrizations_uncached(), \
                torch.autocast("cpu", enabled=False), _preserved(module) as changed, \
                _inputs_kept(leaves, names) as changed_inputs, _fed_buffers(module, attributes), \
                stand_in_statistics(module) as stand_ins, lean_attention(options.torch_dropout), \
                exportable_dropouts(), \
                exportable_losses(), exportable_functions(), exportable_packing(), \
                checkpoints.exportable_checkpoints(options.exporter == "torchscript"), \
                custom_functions.applied_functions() as applied, _python_draws() as drawn:
            original, leaves = leaves, [_traced_leaf(t, options.exporter == "dynamo") for t in leaves]
            run = _torchscript if options.exporter == "torchscript" else _dynamo
            model = run(flat, leaves, names, options.opset_version)
            mutated = changed()
            inputs_changed = changed_inputs()
            # tensors that exist only while exporting (stand-in statistics) are constants of the export
            temporary = {n: t.detach().clone() for n, t in module.named_buffers() if n not in state}
        runs = flat._result.pop("hook_runs", [])
        hooked = [t for run in runs for t in run]
        forget(hooked, [runs, hooked, leaves, flat._result.get("outputs") or []], [*leaves, *original, *state.values()])
    except Exception as e:
        if flat._result.get("raised") is e and not isinstance(e, ExportError):
            raise  # the forward's own error (or its hooks'), on the call's inputs: torch's call raises it too
        hook = flat._result.get("hook_failed")
        cause = (f"a forward hook on {hook} failed while exporting, run on the export's tensors (dynamo's are fake: "
                 "it cannot read their values, as .item(), float() or a branch on them do; the legacy exporter "
                 "runs hooks on real ones). " if hook else "")
        raise ExportError(f"torch.onnx.export ({options.exporter}) failed for {type(module).__name__}: {cause}"
                          f"{_known_cause(module, options.exporter, e)}{type(e).__name__}: {e}") from e
    finally:
        changed_parameters = flat._result.pop("changed_parameters", [])
        with torch.no_grad():  # changed by the trace's run: the graph's run changes them, once, as torch's call
            for p, before in reversed(changed_parameters):
                p.copy_(before)
    if inputs_changed:
        raise ExportError(f"{type(module).__name__}'s forward changes its input {_listed(inputs_changed)} in place: "
                          "ORTModule's graph computes with the changed value but cannot change the caller's tensor, "
                          "as torch does (its value is put back as it was before the export). Change a copy "
                          "(x = x * 0.5 instead of x.mul_(0.5)), or run the module in torch.")
    carried = {id(p) for p, _ in changed_parameters}  # other changes of parameters are warned about, below
    parameters = {name for name, p in module.named_parameters() if id(p) in carried}
    changed_buffers = tuple(name for name in mutated if name in buffers or name in parameters)
    frozen_reads = sorted(set(changed_buffers) & flat._result.get("python_reads", set()))
    if frozen_reads:
        raise ExportError(f"{type(module).__name__}'s forward changes {_listed(frozen_reads)} in place and reads "
                          "it as a Python number (int(), float(), .item(), an index): the export keeps the number "
                          "of this call, so from the next step on it would compute with a stale one. Compute with "
                          "the tensor instead (torch.roll, index_copy_ with a tensor index, torch.where), or run "
                          "the module in torch.")
    if changed_buffers and not updates and options.exporter == "torchscript":
        return export(module, signature, in_spec, leaves, options, changed_buffers)
    returned = flat._result.get("returned_numbers")
    if returned:
        raise ExportError(f"{type(module).__name__}'s forward returns Python numbers computed from tensors (output "
                          f"{_listed(returned)}: `.item()`, `float()` of a tensor): the export keeps this call's, so "
                          "every call would return those. Return the tensors (`acc` instead of `acc.item()`) and "
                          "read them after the call, or run the module in torch.")
    refused = custom_functions.refusal(type(module).__name__, applied)
    differentiable = any(t.requires_grad for t in leaves) or any(p.requires_grad for p in module.parameters())
    if refused:
        raise ExportError(refused)
    if drawn:
        warnings.warn(f"ORTModule({type(module).__name__}): the forward draws Python random numbers ({_listed(drawn)}) "
                      "while it is exported: the graph keeps this call's draws, so every step repeats them (a layer "
                      "dropped or kept, a size). Draw them as torch tensors the computation uses as tensors "
                      "(torch.rand with torch.where), or run the module in torch.", ExportWarning, stacklevel=4)
    unrun = _hooked(module, BACKWARD_HOOKS)
    if flat._result.get("tensor_hooks"):
        unrun.append("a gradient hook on a tensor inside forward (register_hook)")
    if unrun:
        warnings.warn(f"ORTModule({type(module).__name__}): {_listed(unrun)} will not run at each step: the "
                      "module runs as one onnxruntime graph, whose backward cannot run the hooks of its modules or "
                      "tensors (hooks on its inputs and outputs and on parameters do run; forward hooks run at "
                      "each call).", ExportWarning, stacklevel=4)
    out_spec = flat.out_spec
    assert out_spec is not None
    if not model.graph.output:
        raise ExportError(f"exporting {type(module).__name__}: the exported graph has no outputs; the module returns "
                          "no tensor computed by torch operations.")
    for path, value in _objects_holding_tensors(out_spec):
        warnings.warn(f"ORTModule({type(module).__name__}): the result's {path or 'value'} is a {type(value).__name__} "
                      "holding tensors. ORTModule computes the tensors of a result (also inside containers and "
                      "dataclasses) and returns any other object as the export traced it, so every call gets this "
                      "object with the export's tensors. Leave it out of the result (Hugging Face models: "
                      "use_cache=False).", ExportWarning, stacklevel=4)
    _constants_for(model, temporary)
    _sdpa_dropouts_in_training(model)
    if options.torch_dropout:
        _float64_dropout_rates(model)
    _state_as_inputs(model, state, type(module).__name__)
    _split_sequences_to_slices(model.graph)
    if options.exporter == "torchscript":  # dynamo's inputs are dynamic where its graph is (`_pin_single_values`)
        _dynamic_inputs(model, set(names))
    hooks: Replay | None = flat._result.get("hooks")
    wanted = ["output" + (f".{p}" if p else "") for p in tensor_paths(out_spec)]
    wanted += hooks.names if hooks is not None else []
    outputs = _name_outputs(model, wanted)
    _unshared_symbols(model, outputs, flat._result.get("outputs") or ())
    carried = _updates(model, outputs[len(wanted):], updates)
    outputs = outputs[:len(wanted)]
    lost = [name for name in mutated if name not in {fqn for _, fqn in carried}]
    _batch_norm_on_lost_buffers(model, lost, options.exporter)
    if lost:
        warnings.warn(f"ORTModule({type(module).__name__}): the forward changes {_listed(lost)} in place, "
                      "which the exported graph does not carry back to the module (buffers are, with the legacy "
                      "exporter; parameters are not): each step reads its value as it is, where torch's changes. "
                      "Update it outside forward(), or run the module in torch.", ExportWarning, stacklevel=4)
    kept_in_attributes = flat._result.get("kept_in_attributes")
    if kept_in_attributes:
        warnings.warn(f"ORTModule({type(module).__name__}): the forward replaces the tensor in "
                      f"{_listed(kept_in_attributes)}, a plain attribute, which ORTModule sets after each call to the "
                      "call's value, as torch's; but where a later call reads it (a recurrent state carried from call "
                      "to call), the graph holds the value of the call that exported. Register it in __init__ as a "
                      "buffer holding its first value (self.register_buffer('h', torch.zeros(...), "
                      "persistent=False)): ORTModule carries buffers from call to call as torch does.",
                      ExportWarning, stacklevel=4)
    graph_inputs = {i.name for i in model.graph.input}
    inputs = [(n, k) for k, n in enumerate(names) if n in graph_inputs]
    state_inputs = [(i.name, i.name) for i in model.graph.input if i.name in state]
    owner = {n: n.rsplit(".", 1)[0] if "." in n else "" for n, _ in state_inputs if n.endswith("running_mean")}
    owner.update(stand_ins)
    stats = training_batchnorm(model, owner, dict(module.named_modules()))
    state_inputs = _read_buffers_only(model, state_inputs, buffers)
    # the legacy exporter's lookups with a padding_idx are written to cut row p's gradient (`symbolics._embedding`)
    frozen = _embedding_padding(model, module, state) if options.exporter == "dynamo" else []
    state_inputs += frozen
    feeds = {name: leaves[k] for name, k in inputs}
    feeds.update({name: state[fqn] for name, fqn in state_inputs})
    _complete_ranks(model, feeds, inferred_outputs=options.exporter == "torchscript")
    reference = None
    if options.check and not lost:
        reference = Reference(tuple(flat._result.get("outputs") or ()), tuple(leaves), tuple(unrun),
                              random=_draws_random(model))
    fed = {fqn for _, fqn in state_inputs}
    ties = [(fqn, others) for fqn in sorted(fed)
            if (others := tuple(o for o, t in state.items() if t is state[fqn] and o not in fed))]
    return Exported(model, inputs, state_inputs, outputs, out_spec, stats, frozenset(n for n, _ in frozen),
                    carried, reference, Scalars.of(flat._result.get("scalar_reads", set()), module),
                    not differentiable and custom_functions.unchecked(applied),
                    flat._result.get("guards"), _consumed(model, outputs), hooks, ties)


def _batch_norm_on_lost_buffers(model: onnx.ModelProto, lost: Sequence[str], exporter: str) -> None:
    """Refuse a BatchNormalization reading, as its running statistics, buffers the forward changed in place and the
    graph does not carry out: `F.batch_norm` in training on a module's own buffers under dynamo, which writes it in
    inference mode (normalizing by the running statistics, not the batch's) and drops the update, so that every
    step would compute something else than torch, unchecked (the first call's check cannot run where a buffer's
    change is lost). The legacy exporter carries them (`batchnorm.training_batchnorm`)."""
    lost_set = set(lost)
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" and len(node.input) >= 5 and lost_set & set(node.input[3:5]):
            raise ExportError(f"the forward calls batch_norm on {_listed(node.input[3:5])} in training (node "
                              f"{node.name or node.output[0]!r}), which the {exporter} exporter writes in inference "
                              "mode, dropping their update: use exporter='torchscript' (the default), or an "
                              "nn.BatchNorm module.")


def _consumed(model: onnx.ModelProto, outputs: Sequence[str]) -> frozenset[int]:
    read = {name for node in graph_nodes(model.graph) for name in node.input}
    return frozenset(k for k, name in enumerate(outputs) if name in read)


def _called_elsewhere(node: onnx.NodeProto, paths: Sequence[str]) -> bool:
    """Whether dynamo names `node` as computed in a module other than those at `paths`, by its `name_scopes`
    metadata (`['', 'blocks.0', 'blocks.0.emb', 'embedding']`: the innermost module's path before the op's name).
    A node it does not name is not known to be elsewhere."""
    scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
    if scopes is None:
        return False
    parts = [str(x) for x in ast.literal_eval(scopes)]
    return len(parts) >= 2 and parts[-2] not in paths


def _traced_leaf(t: torch.Tensor, dynamo: bool) -> torch.Tensor:
    """An input as the trace takes it: a copy of an inference tensor (which autograd cannot record), and a tensor
    requiring grad as a leaf of its own on the same memory (`Reference.leaves`). Dynamo's a contiguous copy of a
    non-contiguous one: torch.export read its strides as symbols ("aten.sym_stride" then has no ONNX function),
    and onnxruntime is fed a contiguous copy of it anyway."""
    if t.is_inference():
        return t.clone()
    if dynamo and not t.is_contiguous():
        return t.detach().contiguous().requires_grad_(t.requires_grad)
    return t.detach().requires_grad_() if t.requires_grad else t


def _known_cause(module: nn.Module, exporter: str, error: Exception) -> str:
    """What to do, where an export failure has a cause known to be the model's and not the exporter's bug: a
    buffer registered as None that the forward sets, an input requiring grad changed in place, a BatchNorm
    averaging its statistics over all batches (momentum=None: its factor from num_batches_tracked as a Python
    number, a value torch.export cannot trace, "data-dependent"), Hugging Face's experts by grouped_mm."""
    if "state_dict changed after running the tracer" in str(error):
        unset = [f"{prefix}.{attr}" if prefix else attr for prefix, m in module.named_modules()
                 for attr, b in m._buffers.items() if b is None]
        if unset:
            return (f"the forward sets {_listed(unset)}, registered as None, which the legacy exporter cannot follow "
                    "(it takes the buffers before the call): register it holding its first value "
                    "(torch.zeros(...)). ")
    if "leaf Variable that requires grad is being used in an in-place operation" in str(error):
        return ("the forward changes an input that requires grad in place, which ORTModule's graph cannot do to the "
                "caller's tensor: change a copy (x = x * 0.5 instead of x.mul_(0.5)), or run the module in torch. ")
    if "grouped_mm" in str(error):
        return ("its mixture-of-experts layers compute the experts with torch's grouped_mm (Hugging Face's default "
                "experts_implementation), which neither exporter converts: build the model with "
                "experts_implementation=\"eager\" (a keyword of from_pretrained and of the config), whose experts "
                "ORTModule exports. ")
    if exporter != "dynamo" or "data-dependent" not in str(error):
        return ""
    cumulative = [name or type(m).__name__ for name, m in module.named_modules()
                  if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is None and m.training
                  and m.track_running_stats]
    if not cumulative:
        return ""
    names = _listed([repr(n) for n in cumulative])
    return (f"BatchNorm {names} has momentum=None (a cumulative average), whose factor torch computes from "
            "num_batches_tracked as a Python number, which torch.export cannot trace: use exporter='torchscript' "
            "(the default), or give it a momentum. ")


def _updates(model: onnx.ModelProto, outputs: Sequence[str], buffers: Sequence[str]) -> list[tuple[str, str]]:
    """The extra outputs of a re-export that carries `buffers`, named `state.<buffer>`: (output, buffer) for
    those the trace changed. An output that is still the buffer's own graph input was not changed by the trace
    (a change it missed): removed, so the warning names it."""
    g = model.graph
    inputs = {i.name for i in g.input}
    taken = names_in_use(g)
    kept, carried, rename = [], [], {}
    for vi in g.output:
        if vi.name not in outputs:
            kept.append(vi)
            continue
        fqn = buffers[list(outputs).index(vi.name)]
        if vi.name in inputs:
            continue
        new = _unique([f"state.{fqn}"], taken)[0]
        rename[vi.name] = new
        vi.name = new
        kept.append(vi)
        carried.append((new, fqn))
    rename_tensors(g, rename)
    del g.output[:]
    g.output.extend(kept)
    return carried


def _draws_random(model: onnx.ModelProto) -> bool:
    """Whether the graph draws random numbers (Dropouts that drop, random ops): its outputs are torch's only where
    the host draws them all as torch does, which the call decides (`TrainingSession.draw_masks_as_torch`)."""
    return draws_random_numbers(inactive_dropouts(model).graph)


def _embedding_padding(model: onnx.ModelProto, module: nn.Module, state: dict[str, torch.Tensor]
                       ) -> list[tuple[str, str]]:
    """nn.Embedding(padding_idx=p) gives row p no gradient, but dynamo emits a plain Gather. Each Gather
    of such a weight takes the rows of padding ids from a second graph input fed the same tensor and never
    differentiated: Where(ids == p, Gather(weight_no_grad, ids), Gather(weight, ids)). Not the Gathers the
    exporter names as another module's (`weight[ids]`, `F.embedding` without padding_idx: torch gives their row p
    its gradient; all were cut).
    Returns the added inputs as (graph input, qualified name of the weight)."""
    padding = {id(m.weight): m.padding_idx for m in module.modules()
               if isinstance(m, nn.Embedding) and m.padding_idx is not None}
    owners: dict[int, list[str]] = {}  # the embeddings' paths, by weight
    for path, m in module.named_modules():
        if isinstance(m, nn.Embedding) and m.padding_idx is not None:
            owners.setdefault(id(m.weight), []).append(path)
    g = model.graph
    weights = {i.name: i for i in g.input if i.name in state and id(state[i.name]) in padding}
    if not weights:
        return []
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    taken = names_in_use(g)
    added: dict[str, str] = {}
    nodes: list[onnx.NodeProto] = []
    for node in g.node:
        axis = int_attr(node, "axis", 0)
        if node.op_type != "Gather" or node.input[0] not in weights or axis != 0 or \
                _called_elsewhere(node, owners[id(state[node.input[0]])]):
            nodes.append(node)
            continue
        w, ids, out = node.input[0], node.input[1], node.output[0]
        if w not in added:
            added[w] = _unique([f"{w}#no_grad"], taken)[0]
            frozen = onnx.ValueInfoProto()
            frozen.CopyFrom(weights[w])
            frozen.name = added[w]
            g.input.append(frozen)
        p, p_cast, rows, pad_rows, is_pad_flat, axes, is_pad = _unique(
            [f"{out}#{k}" for k in ("padding_idx", "padding_idx_cast", "rows", "padding_rows", "is_padding_flat",
                                    "axes", "is_padding")], taken)
        g.initializer.append(onnx.numpy_helper.from_array(np.array(padding[id(state[w])], np.int64), p))
        if opset >= 13:
            g.initializer.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), axes))
            unsqueeze = helper.make_node("Unsqueeze", [is_pad_flat, axes], [is_pad])
        else:
            unsqueeze = helper.make_node("Unsqueeze", [is_pad_flat], [is_pad], axes=[-1])
        node.output[0] = rows
        nodes += [node,
                  helper.make_node("Gather", [added[w], ids], [pad_rows], axis=0),
                  helper.make_node("CastLike", [p, ids], [p_cast]),
                  helper.make_node("Equal", [ids, p_cast], [is_pad_flat]),
                  unsqueeze,
                  helper.make_node("Where", [is_pad, pad_rows, rows], [out])]
    del g.node[:]
    g.node.extend(nodes)
    return [(name, w) for w, name in added.items()]


def _unshared_symbols(model: onnx.ModelProto, outputs: Sequence[str], values: Sequence[Any]) -> None:
    """Clear the dimension names the exporter's shape inference gave to sizes that differ in the call it traced,
    in place, wherever they appear but the graph inputs: the legacy exporter declared an adaptive average pool to
    8 x 10 (`F.interpolate(mode="area")`) with one name for both axes, which the backward was built on (the first
    run refused it). `values`: torch's outputs of that call, in `outputs` order."""
    g = model.graph
    declared = {o.name: o for o in g.output}
    sizes: dict[str, set[int]] = {}
    for name, value in zip(outputs, values):
        vi = declared.get(name)
        if vi is None or not isinstance(value, torch.Tensor) or len(vi.type.tensor_type.shape.dim) != value.dim():
            continue
        for d, n in zip(vi.type.tensor_type.shape.dim, value.shape):
            if d.HasField("dim_param"):
                sizes.setdefault(d.dim_param, set()).add(int(n))
    wrong = {name for name, seen in sizes.items() if len(seen) > 1}
    for d in _named_dims((*g.value_info, *g.output), wrong):
        d.Clear()


def _complete_ranks(model: onnx.ModelProto, feeds: dict[str, torch.Tensor], inferred_outputs: bool = False) -> None:
    """Give every tensor whose rank ONNX shape inference cannot derive (Reshape to a computed shape, as
    in torch's unflatten) a rank, taken from one run of the graph on the call's own inputs: gradient rules
    need ranks. Dimensions stay unknown, so no size is baked in. `inferred_outputs`: the outputs are declared as
    inference derives them from the inputs' dynamic sizes, not as traced (the legacy exporter declares the sizes
    of the call it traced where its own inference found none: a Squeeze without axes of a (batch, 1) tensor as
    [8], on which the backward was built, failing at the next batch)."""
    g = model.graph
    if inferred_outputs:
        for vi in g.output:
            vi.type.tensor_type.ClearField("shape")
    try:
        inferred = infer_shapes(model, data_prop=True).graph
    except Exception:
        inferred = g
    if inferred_outputs:
        shapes = {vi.name: vi.type.tensor_type for vi in inferred.output if vi.type.tensor_type.HasField("shape")}
        for vi in g.output:
            if vi.name in shapes:
                vi.type.tensor_type.shape.CopyFrom(shapes[vi.name].shape)
    typed = [*inferred.value_info, *inferred.input, *inferred.output]
    known = {v.name for v in typed if v.type.tensor_type.HasField("shape")} | {t.name for t in g.initializer}
    elem = {v.name: v.type.tensor_type.elem_type for v in typed}
    # onnxruntime refuses a graph output without an element type: probed are those inference typed
    unknown = [o for n in g.node for o in n.output if o and o not in known and elem.get(o)]
    if not unknown:
        return
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_tensor_value_info(n, elem[n], None) for n in unknown)
    for v in probe.graph.output:  # a declared output shape may be wrong (an If's, typed by its other branch)
        v.type.tensor_type.ClearField("shape")
    config = SessionConfig(threads=1, optimization=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    try:
        runner = Runner(probe, config, "shape probe")
    except RuntimeError:
        return  # the gradient build will name the tensor whose rank it misses
    values_of = {k: exchange.to_ortvalue(v) for k, v in feeds.items()}
    try:
        values = runner.run(values_of, unknown)
    except RuntimeError:
        _runs_as_exported(model, config, values_of)
        return  # the probe's own outputs failed (a tensor inside a branch): the gradient build names what it misses
    outputs = {vi.name: vi for vi in g.output}
    for name, v in zip(unknown, values):
        if v.is_tensor():
            g.value_info.append(helper.make_tensor_value_info(name, v.element_type(), [None] * len(v.shape())))
            if name in outputs and not outputs[name].type.tensor_type.HasField("shape"):
                outputs[name].type.tensor_type.shape.dim.extend([onnx.TensorShapeProto.Dimension()] * len(v.shape()))


def _runs_as_exported(model: onnx.ModelProto, config: SessionConfig, feeds: dict[str, C.OrtValue]) -> None:
    """Refuse an export onnxruntime cannot run on the very inputs it was traced with (torch's legacy exporter
    translates some modules wrongly, AdaptiveLogSoftmaxWithLoss's index_copy_ for one), naming the node that
    fails, rather than let the gradient build blame what it then misses."""
    shapeless = onnx.ModelProto()
    shapeless.CopyFrom(model)
    graphs = [shapeless.graph]
    while graphs:  # declared shapes may be wrong (an If's, typed by its other branch), as onnxruntime holds them
        g = graphs.pop()
        del g.value_info[:]
        for v in g.output:
            v.type.tensor_type.ClearField("shape")
        graphs.extend(a.g for n in g.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH)
        graphs.extend(sub for n in g.node for a in n.attribute for sub in a.graphs)
    try:
        runner = Runner(shapeless, config, "exported")
    except RuntimeError:
        return
    try:
        runner.run(feeds, [o.name for o in model.graph.output])
    except RuntimeError as e:
        raise ExportError(
            f"onnxruntime cannot run the exported graph on the inputs it was traced with ({str(e).strip()}): the "
            "exporter translated the module wrongly. Try the other exporter (ORTModule(module, exporter=...)), "
            "or run the module in torch.") from e


def _sdpa_dropouts_in_training(model: onnx.ModelProto) -> None:
    """Both exporters translate `scaled_dot_product_attention(dropout_p=p)` (and so nn.MultiheadAttention's
    attention dropout in training) as `Dropout(x, p)` without `training_mode`, which in ONNX is inference: an
    identity. torch drops whenever p > 0, and neither exporter emits any other Dropout without a mode (an
    nn.Dropout in training mode gets `training_mode=True`, in eval mode no node), so each such Dropout of the
    main graph gets a constant true `training_mode`, in place."""
    g = model.graph
    targets = [n for n in g.node if n.op_type == "Dropout" and n.domain in ("", "ai.onnx") and len(n.input) == 2
               and n.input[1]]
    if not targets:
        return
    taken = names_in_use(g)
    name = _unique(["attention_dropout_training"], taken)[0]
    g.initializer.append(onnx.numpy_helper.from_array(np.array(True), name))
    for n in targets:
        n.input.append(name)


def _float64_dropout_rates(model: onnx.ModelProto) -> None:
    """Under `torch_dropout`, a float64 Dropout's rate as the double it stands for (0.3, not float32's 0.30000001):
    torch scales by 1 / (1 - p) in double from p as written, forward and backward, and the gradient rule reads the
    rate from the graph (5e-8 apart in float64). In place; other Dropouts keep onnxruntime's float32 rate."""
    g = model.graph
    drops = [n for n in g.node if n.op_type == "Dropout" and n.domain in ("", "ai.onnx") and len(n.input) > 1
             and n.input[1]]
    if not drops:
        return
    inferred = infer_shapes_safely(model)
    types = tensor_types(inferred) if inferred is not None else {}
    rates = constant_values(g, lambda t: t.data_type == onnx.TensorProto.FLOAT and not t.dims)
    taken = names_in_use(g)
    for n in drops:
        if types.get(n.input[0], (0, None))[0] == onnx.TensorProto.DOUBLE and n.input[1] in rates:
            name = _unique([f"{n.input[1]}.double"], taken)[0]
            exact = np.array(written_rate(rates[n.input[1]]), np.float64)
            g.initializer.append(onnx.numpy_helper.from_array(exact, name))
            n.input[1] = name


def _constants_for(model: onnx.ModelProto, values: dict[str, torch.Tensor]) -> None:
    """Initializers for the graph inputs the export declared without a value (the legacy exporter runs with
    export_params=False) that are fed by none of the module's own tensors."""
    have = {t.name for t in model.graph.initializer}
    for i in model.graph.input:
        if i.name in values and i.name not in have:
            model.graph.initializer.append(onnx.numpy_helper.from_array(values[i.name].cpu().numpy(), i.name))


def _read_buffers_only(model: onnx.ModelProto, state_inputs: list[tuple[str, str]], buffers: set[str]
                       ) -> list[tuple[str, str]]:
    """The state inputs without the buffers no node reads, which leave the graph's inputs too: a training
    BatchNorm's running statistics once `training_batchnorm` has given its node constants (each fed anyway, and
    an input onnxruntime takes in, at 2-3 µs a step each after a run)."""
    read = {name for node in graph_nodes(model.graph) for name in node.input}
    read |= {o.name for o in model.graph.output}
    unread = {name for name, fqn in state_inputs if fqn in buffers and name not in read}
    if not unread:
        return state_inputs
    kept = [i for i in model.graph.input if i.name not in unread]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    return [(name, fqn) for name, fqn in state_inputs if name not in unread]


def _state_as_inputs(model: onnx.ModelProto, state: dict[str, torch.Tensor], what: str) -> None:
    """Parameters and buffers become graph inputs; every other initializer stays a constant."""
    g = model.graph
    declared = {i.name for i in g.input}
    keep, params = [], []
    for t in g.initializer:
        (params if t.name in state else keep).append(t)
    # a parameter folded into a constant or renamed would silently get no gradient: refuse
    present = {t.name for t in params} | declared
    reached = {id(v) for k, v in state.items() if k in present}
    missing = {k: v for k, v in state.items() if id(v) not in reached and v.is_floating_point() and v.numel() > 1}
    if missing:
        sigs = {(tuple(v.shape), str(v.dtype).replace("torch.", "")): k for k, v in missing.items()}
        for t in keep:
            arr = onnx.numpy_helper.to_array(t)
            k = sigs.get((tuple(arr.shape), str(arr.dtype)))
            if k is not None and torch.equal(torch.from_numpy(arr.copy()), missing[k].detach().cpu()):
                raise ExportError(f"exporting {what}: parameter '{k}' became the constant '{t.name}' (folded or "
                                  "renamed by the exporter); it would get no gradient.")
    del g.initializer[:]
    g.initializer.extend(keep)
    consts = {t.name for t in keep}
    inputs = [i for i in g.input if i.name not in consts]
    for t in params:
        if t.name not in declared:
            inputs.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    del g.input[:]
    g.input.extend(inputs)


def _dynamic_inputs(model: onnx.ModelProto, names: set[str]) -> None:
    for vi in model.graph.input:
        if vi.name in names:
            for d, dim in enumerate(vi.type.tensor_type.shape.dim):
                if not dim.dim_param:
                    dim.Clear()
                    dim.dim_param = f"{vi.name}_dim{d}"


def pin_dims(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]], batch: bool = False) -> onnx.ModelProto:
    """A copy of `model` whose inputs in `shapes` get those sizes, except dim 0 (the batch) which stays
    dynamic unless `batch`: for gradient rules that need static spatial or feature sizes."""
    pinned = onnx.ModelProto()
    pinned.CopyFrom(model)
    for vi in pinned.graph.input:
        if vi.name in shapes:
            for d, (dim, size) in enumerate(zip(vi.type.tensor_type.shape.dim, shapes[vi.name])):
                if d > 0 or batch:
                    dim.Clear()
                    dim.dim_value = int(size)
    return pinned


def _name_outputs(model: onnx.ModelProto, wanted: Sequence[str]) -> list[str]:
    """The first outputs named as `wanted` (`output`, `output.logits`, ..., made distinct); an output that is a
    graph input or repeats another output gets an Identity, so each output is its own tensor."""
    g = model.graph
    taken = names_in_use(g)
    inputs = {i.name for i in g.input} | {t.name for t in g.initializer}
    seen: set[str] = set()
    rename: dict[str, str] = {}
    for vi, want in zip(g.output, _unique(wanted, set(taken) - {o.name for o in g.output})):
        old = vi.name
        if old in inputs or old in seen:
            g.node.append(helper.make_node("Identity", [old], [want]))
        else:
            rename[old] = want
        seen.add(old)
        vi.name = want
    rename_tensors(g, rename)
    return [o.name for o in g.output]


def _objects_holding_tensors(spec: Spec, path: str = "") -> Iterator[tuple[str, object]]:
    """Constants of a result (anything `structure` does not take apart) with tensors among their attributes,
    such as a Hugging Face DynamicCache: returned as traced, so their tensors are stale."""
    if isinstance(spec, Const):
        if _holds_tensors(spec.value):
            yield path, spec.value
    elif isinstance(spec, Node):
        keys = spec.keys if spec.keys is not None else range(len(spec.children))
        for k, child in zip(keys, spec.children):
            yield from _objects_holding_tensors(child, f"{path}.{k}" if path else str(k))


def _holds_tensors(x: object, depth: int = 4) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if depth == 0 or isinstance(x, (type, nn.Module)):
        return False
    if isinstance(x, Mapping):
        items: Iterable[object] = x.values()
    elif isinstance(x, (list, tuple, set, frozenset)):
        items = x
    else:
        items = getattr(x, "__dict__", {}).values()
    return any(_holds_tensors(v, depth - 1) for v in items)


def _split_sequences_to_slices(g: onnx.GraphProto) -> None:
    """The dynamo exporter (unoptimised) turns torch.split/chunk/unbind into SplitToSequence + SequenceAt, which
    have no gradient rule. Each SequenceAt at a constant index becomes a Slice of the split tensor: chunk i of size
    s is [i*s, (i+1)*s) (Slice clamps the last), of sizes [s0, s1, ...] it is [s0+...+s(i-1), ... + si); an item
    of a split without sizes (unbind, an unrolled RNN's time steps) is a Gather of index i, scalar where the axis
    goes (keepdims=0). Splits whose sizes or indices are not of that form stay as they are (a rule error then names
    them)."""
    consts: dict[str, np.ndarray] = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant" and len(n.attribute) == 1 and n.attribute[0].name == "value":
            consts[n.output[0]] = onnx.numpy_helper.to_array(n.attribute[0].t)
    splits = {n.output[0]: n for n in g.node if n.op_type == "SplitToSequence"}
    if not splits:
        return
    taken = {i.name for i in g.input} | set(consts) | {o for n in g.node for o in n.output}
    ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in g.value_info
             if vi.type.tensor_type.HasField("shape")}
    ranks.update((n.output[0], 1) for n in g.node if n.op_type == "Concat")  # split sizes: a Concat is 1-D
    nodes: list[onnx.NodeProto] = []
    for n in g.node:
        split = splits.get(n.input[0]) if n.op_type == "SequenceAt" else None
        index = consts.get(n.input[1]) if split is not None else None
        if split is None or index is None or index.ndim != 0:
            nodes.append(n)
            continue
        axis = int_attr(split, "axis", 0)
        i = int(index)
        if len(split.input) == 1 or not split.input[1]:  # unbind: items of size 1, the axis kept with keepdims
            at = _unique([f"{n.output[0]}#index"], taken)[0]
            _constant(g, at, [i] if int_attr(split, "keepdims", 1) else i)
            nodes.append(helper.make_node("Gather", [split.input[0], at], [n.output[0]], axis=axis))
            continue
        x, sizes = split.input
        starts, ends, axes = _unique([f"{n.output[0]}#{k}" for k in ("starts", "ends", "axes")], taken)
        const = consts.get(sizes)
        if const is not None and const.ndim == 1 and -len(const) <= i < len(const):
            i %= len(const)
            bounds = [(starts, int(const[:i].sum())), (ends, int(const[: i + 1].sum()))]
        elif i >= 0 and const is None and ranks.get(sizes) == 1:  # sizes computed from sizes: [E, 2E]
            size_1d = _unique([f"{n.output[0]}#sizes"], taken)[0]
            nodes.append(helper.make_node("Cast", [sizes], [size_1d], to=onnx.TensorProto.INT64))
            before = _sliced(g, nodes, size_1d, 0, i, taken)
            nodes.append(helper.make_node("ReduceSum", [before], [starts], keepdims=1))  # no axes: all; 0 for i = 0
            nodes.append(helper.make_node("Add", [starts, _sliced(g, nodes, size_1d, i, i + 1, taken)], [ends]))
            bounds = []
        elif i >= 0 and (const is None or const.ndim == 0):
            size, size_1d = _unique([f"{n.output[0]}#size", f"{n.output[0]}#size_1d"], taken)
            nodes += [helper.make_node("Reshape", [sizes, _constant(g, f"{size_1d}.shape", [1])], [size_1d]),
                      helper.make_node("Cast", [size_1d], [size], to=onnx.TensorProto.INT64),
                      helper.make_node("Mul", [size, _constant(g, f"{starts}.index", [i])], [starts]),
                      helper.make_node("Add", [starts, size], [ends])]
            bounds = []
        else:
            nodes.append(n)
            continue
        for name, value in bounds:
            _constant(g, name, [value])
        nodes.append(helper.make_node("Slice", [x, starts, ends, _constant(g, axes, [axis])], [n.output[0]]))
    used = {i for n in nodes for i in n.input} | {o.name for o in g.output}
    del g.node[:]
    g.node.extend(n for n in nodes if not (n.op_type == "SplitToSequence" and n.output[0] not in used))


def _sliced(g: onnx.GraphProto, nodes: list[onnx.NodeProto], x: str, start: int, end: int, taken: set[str]) -> str:
    """x[start:end] of a 1-D run-time tensor, its Slice appended to `nodes`."""
    out = _unique([f"{x}#{start}:{end}"], taken)[0]
    bounds = [_constant(g, f"{out}.start", [start]), _constant(g, f"{out}.end", [end])]
    nodes.append(helper.make_node("Slice", [x, *bounds], [out]))
    return out


def _constant(g: onnx.GraphProto, name: str, values: list[int] | int) -> str:
    g.initializer.append(onnx.numpy_helper.from_array(np.array(values, np.int64), name))
    return name
