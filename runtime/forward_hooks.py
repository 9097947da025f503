"""The user's forward hooks run at each call, on onnxruntime's values.

An export traces the forward once. What a forward hook returns (a changed input or output) is part of the graph,
but what it does besides happened only while exporting, on the export's tensors: the activation a feature-matching,
perceptual or distillation loss reads, a Grad-CAM map, a running statistic, a counter. torch runs it at every call.

So each call of a user's forward hook (or forward pre-hook) while exporting is recorded: the hook, its module, and
the tensors it received, which become extra outputs of the graph. They are taken at the end of the forward, so a
tensor changed in place after the hook ran (a hooked convolution followed by an in-place ReLU) is what torch's
stored reference to it reads by then. After each call the hooks are called again, in order, with onnxruntime's
values of those tensors (`Replay`); their return values are dropped, since the graph holds them. A loss on a
recorded tensor sends its gradient back through the graph, summed with the graph's own where the graph uses the
tensor too.

Hooks defined in installed packages serve the forward itself (torch's weight norm computes a weight in a pre-hook,
Hugging Face's collect the hidden states it returns): the graph holds them, and they are not run again.

While exporting, the hooks also run on the export's own tensors: their return value is needed, and what they
store may feed the same forward (a U-Net reading its encoder's hooked features). What they left behind is undone
where it can be: the state a hook can reach (its closure, the globals it names, its object's attributes and what
they hold) is put back after the export (`hook_state`), the attributes the hooks set on their modules after each run
(`recorded`), and the export's tensors they received or computed are taken out of any other list or deque holding
them (`forget`). So a counter or a running sum counts each call once, as torch's.

A gradient hook or retain_grad() on a received tensor (Grad-CAM) and an in-place change of one cannot be followed
(`HookError`): the engine refuses the call's schema, naming the tensor.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.overrides import TorchFunctionMode

from .edits import FORWARD_HOOKS
from .stores import Store, Taken, Watching
from .structure import Spec, flatten, unflatten


def from_a_library(hook: Any) -> bool:
    """Whether `hook` (a function, method, partial or callable object) is defined in an installed package."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    code = getattr(getattr(hook, "__func__", hook), "__code__", None)
    if code is not None:
        path = code.co_filename
    else:
        path = getattr(sys.modules.get(type(hook).__module__), "__file__", None) or ""
    return any(part in ("site-packages", "dist-packages") for part in Path(path).parts)


def user_hooks(module: nn.Module, kinds: Sequence[str]) -> Iterator[tuple[str, nn.Module | None, dict[int, Any], int]]:
    """(where, owner, hook dict, handle id) of the hooks of these kinds (`edits.MODULE_HOOKS` attribute names)
    that the user's code defines: on `module` and its submodules (owner: the submodule), then torch's global ones
    (owner None)."""
    for name, mod in module.named_modules():
        for kind in kinds:
            hooks = getattr(mod, kind, {})
            for hid, hook in list(hooks.items()):
                if not from_a_library(hook):
                    yield f"a {kind[1:-1].replace('_', ' ')} on {name or 'the module'}", mod, hooks, hid
    for kind in kinds:
        hooks = getattr(nn_module, f"_global{kind}", {})
        for hid, hook in list(hooks.items()):
            if not from_a_library(hook):
                yield f"a global {kind[1:-1].replace('_', ' ')}", None, hooks, hid


@dataclass(frozen=True)
class HookCall:
    """One call of a hook while exporting: `hook(module, *arguments)`, the arguments' tensors being the call's
    outputs at `indices` (a tensor received twice, by two hooks or as the module's result too, is one output, as in
    torch it is one tensor)."""

    hook: Callable[..., Any]
    module: nn.Module
    arguments: Spec
    indices: tuple[int, ...]
    returned: bool
    """Whether the export's run of the hook returned a value (which the graph then holds)."""
    path: str
    """The module's path in the ORTModule's module ('' for itself)."""
    registry: dict[int, Any]
    hid: int
    """Where the hook is registered: a hook removed since (by itself, as a one-shot hook does) is not run again."""


@dataclass
class Replay:
    """The hook calls of one export, to run again after each of its calls on the call's outputs, and the tensors its
    forward stored in its modules' attributes, lists and dicts, done again before them (`stores.py`)."""

    calls: tuple[HookCall, ...]
    names: tuple[str, ...]
    """A name per extra graph output (`stored.<module path>.<attribute>`, `hooked.<module path>`): the stored and
    received tensors that are not the result's."""
    stores: tuple[Store, ...] = ()

    @functools.cached_property
    def received(self) -> tuple[int, ...]:
        return tuple(sorted({i for c in self.calls for i in c.indices}))

    def __call__(self, values: Sequence[torch.Tensor]) -> None:
        """Run the hooks on `values`, the call's outputs (the result's tensors, then the extra ones)."""
        for store in self.stores:  # first: a hook may read them (`aux.append(m.aux_loss)`)
            store.apply(values)
        versions = [values[i]._version for i in self.received]
        for c in self.calls:
            if c.hid not in c.registry:  # removed since (a one-shot hook, by its run at an earlier call)
                continue
            returned = c.hook(c.module, *unflatten(c.arguments, [values[i] for i in c.indices]))
            if (returned is not None) != c.returned:
                raise HookChanged(f"a forward hook on {c.path or 'the module'} returned "
                                  f"{'a value' if returned is not None else 'None'} where it returned "
                                  f"{'a value' if c.returned else 'None'} while exporting")
        changed = {i for i, v in zip(self.received, versions) if values[i]._version != v}
        if changed:  # the export's run of the hook changed it already: the graph's values hold the change
            path = next(c.path for c in self.calls if changed & set(c.indices))
            raise HookError(f"a forward hook on {path or 'the module'} changed a tensor it received in place, which "
                            "the graph holds as changed already; run again on onnxruntime's values, it would change "
                            "them twice. Return the changed value from the hook instead of changing it in place.")


class HookError(RuntimeError):
    """A forward hook does what its run again on onnxruntime's values cannot follow."""


class HookChanged(RuntimeError):
    """A forward hook returns a value where its export's run returned none, or none where it returned one (an
    ablation switched on in its closure): the graph holds what it returned while exporting."""


@dataclass
class Recorder:
    """The hook calls of one run of the forward, and the tensors they received."""

    paths: dict[int, str]
    tensors: list[torch.Tensor] = field(default_factory=list)
    """The tensors the hooks received, each once."""
    calls: list[HookCall] = field(default_factory=list)
    """The calls in the order they began, their `indices` positions in `tensors`."""
    made: list[torch.Tensor] = field(default_factory=list)
    """The tensors the hooks computed (`output.detach()`, a statistic), which they may have stored too."""
    failed: str = ""
    """The path of the module whose hook raised."""
    taken: list[Taken] = field(default_factory=list)
    """What the forward itself stored in its modules' attributes, lists and dicts (its hooks': `stored`), taken back
    after the run and done again by each call's replay."""
    replaced: list[str] = field(default_factory=list)
    """The paths of those without grad that replaced a value no replay had set (`self.h = h.detach()` over the
    `self.h = None` of `__init__`): state, if the forward reads it, which the graph holds as a constant."""
    watching: Watching | None = None
    """The modules' attributes, lists and dicts before the run: what the hooks put there is theirs."""
    stored: dict[tuple[int, str], tuple[nn.Module, str, Any]] = field(default_factory=dict)
    """Attributes of hooked modules that the hooks set (`module.features = output`, `module.calls += 1`), with their
    values before: put back after the run, as each call's replay sets them (dynamo fails on a module holding its fake
    tensors; the legacy exporter's would be taken for state kept from call to call; a count would count the run)."""

    def wrapped(self, hook: Callable[..., Any], owner: nn.Module | None, registry: dict[int, Any], hid: int
                ) -> Callable[..., Any]:
        def recording(module: nn.Module, *arguments: Any) -> Any:
            path = self.paths.get(id(owner if owner is not None else module))
            if path is None:  # a global hook on torch's own modules (the exporter's subgraphs of a GRU's loop)
                return hook(module, *arguments)
            leaves, spec = flatten(arguments)
            seen = {id(t): i for i, t in enumerate(self.tensors)}
            for t in leaves:
                if id(t) not in seen:
                    seen[id(t)] = len(self.tensors)
                    self.tensors.append(t)
            slot = len(self.calls)
            self.calls.append(None)  # type: ignore[arg-type]  # in the order the calls begin: a hook's own calls after
            before = dict(vars(module))
            _running.depth += 1
            try:
                with _Made(self.made), warnings.catch_warnings(record=True) as caught, \
                        self.watching.hook_running() if self.watching is not None else contextlib.nullcontext():
                    warnings.simplefilter("always")
                    result = hook(module, *arguments)
            except Exception:
                self.failed = self.failed or (path or "the module")
                raise
            finally:
                _running.depth -= 1
            for w in caught:  # a value the hook reads from its tensor (a statistic) is in the graph only if returned
                if result is not None or not issubclass(w.category, torch.jit.TracerWarning):
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
            # the module as the user holds it: torch.export may run a copy of the module it traces
            self.calls[slot] = HookCall(hook, owner if owner is not None else module, spec,
                                        tuple(seen[id(t)] for t in leaves), result is not None, path, registry, hid)
            for k, v in vars(module).items():
                if before.get(k, _MISSING) is not v:
                    self.stored.setdefault((id(module), k), (module, k, before.get(k, _MISSING)))
            return result
        return recording

    def replay(self, result: Sequence[torch.Tensor]) -> tuple[Replay | None, list[torch.Tensor]]:
        """The replay of these calls and stores on outputs `result` + the extra tensors it returns: the stored and
        received tensors that are not among the result's."""
        if not self.calls and not self.taken:
            return None, []
        position = {id(t): i for i, t in enumerate(result)}
        extra: list[torch.Tensor] = []
        names: list[str] = []

        def placed(t: torch.Tensor, name: str) -> int:
            if id(t) not in position:
                position[id(t)] = len(result) + len(extra)
                extra.append(t)
                names.append(name)
            return position[id(t)]

        stores = []
        for t in self.taken:
            leaves, spec = flatten(t.value)
            name = f"stored.{t.where(self.paths.get(id(t.module), ''))}"
            stores.append(Store(t.module, t.name, t.key, spec, tuple(placed(x, name) for x in leaves)))
        owner_path = {j: c.path for c in self.calls for j in c.indices}
        where = [placed(t, ".".join(filter(None, ("hooked", owner_path[j])))) for j, t in enumerate(self.tensors)]
        calls = tuple(replace(c, indices=tuple(where[j] for j in c.indices)) for c in self.calls)
        return Replay(calls, tuple(names), tuple(stores)), extra


class _Running(threading.local):
    depth = 0


_running = _Running()


def in_a_hook() -> bool:
    """Whether a user's forward hook is running in an export (its `output.detach()` is no stop-gradient of the
    forward's: the dynamo exporter's check of those skips it)."""
    return _running.depth > 0


class _Made(TorchFunctionMode):
    """Collects the tensors torch functions return."""

    def __init__(self, into: list[torch.Tensor]) -> None:
        super().__init__()
        self.into = into

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.into.extend(flatten(out)[0])
        return out


def forget(tensors: Sequence[torch.Tensor], ours: Iterable[object], kept: Iterable[torch.Tensor]) -> None:
    """Take `tensors` (the export's, which its runs of the hooks received or made), and the tuples holding them, out
    of the lists and deques holding them but `ours`: a hook appending to a list, which the user clears before each
    call, would otherwise hold the export's tensors besides the call's own (their autograd graph freed by then:
    "backward through the graph a second time"). Only for lists out of `hook_state`'s reach, which puts back what
    the hooks can reach (dicts too: dynamo's fake tensors a statistic rebound there). `kept`: the call's inputs,
    parameters and buffers, which the caller's own lists may hold."""
    kept_ids = {id(t) for t in kept}
    tensors = [t for t in tensors if id(t) not in kept_ids]
    if not tensors:
        return
    gone = {id(t) for t in tensors}
    skip = {id(x) for x in ours}
    holders = gc.get_referrers(*tensors)
    pairs = [h for h in holders if type(h) is tuple]  # `feats.append((name, out))`: the tuples holding them too
    gone.update(id(h) for h in pairs)
    if pairs:
        holders += gc.get_referrers(*pairs)
    skip.update((id(holders), id(pairs)))
    for holder in holders:
        if isinstance(holder, (list, collections.deque)) and id(holder) not in skip:
            left = [x for x in holder if id(x) not in gone]
            if len(left) != len(holder):
                holder.clear()
                holder.extend(left)


_MISSING = object()


_REGISTRIES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")
"""Where torch keeps a module's forward hooks and their flags (`_global` before them: torch's global ones)."""


def _registries(module: nn.Module) -> list[dict[int, Any]]:
    where: list[Any] = [nn_module, *module.modules()]
    return [d for owner in where for name in _REGISTRIES
            if isinstance(d := getattr(owner, f"_global{name}" if owner is nn_module else name, None), dict)]


@contextlib.contextmanager
def recorded(module: nn.Module) -> Iterator[Recorder]:
    """The user's forward hooks on `module`, its submodules and torch's global ones record their calls while the
    block runs. The hooks removed while it ran are put back after it: a one-shot hook that removed itself does so
    again at the call's replay, and the export's next run meets it too."""
    watching = Watching(module)
    recorder = Recorder({id(m): name for name, m in module.named_modules()}, watching=watching)
    registries = [(d, dict(d)) for d in _registries(module)]
    for _, owner, hooks, hid in user_hooks(module, FORWARD_HOOKS):
        hooks[hid] = recorder.wrapped(hooks[hid], owner, hooks, hid)
    try:
        yield recorder
    finally:
        for d, before in registries:  # the hooks of before, in their order; those added since kept (a library's
            # installed at a model's first call: Hugging Face's output recorders)
            if d.keys() != before.keys() or any(d[k] is not v for k, v in before.items()):
                after = {**before, **{k: v for k, v in d.items() if k not in before}}
                d.clear()
                d.update(after)
        for module, name, value in reversed(recorder.stored.values()):
            if value is _MISSING:
                delattr(module, name)
            else:
                setattr(module, name, value)
        for taken in watching.taken():  # the forward's own stores: dynamo's fake tensors, the trace's, left nowhere
            recorder.taken.append(taken)
            if watching.replaced(taken):
                recorder.replaced.append(taken.where(recorder.paths.get(id(taken.module), "")))
