"""What the user's forward hooks can reach, put back after the runs of the forward that are not the call's own.

An export runs the forward, and so its hooks, once or twice on the export's tensors (the legacy exporter's trace;
dynamo's fake run, then a real one), and so does a backward with create_graph=True, computed again in torch. Each
call's replay then runs the hooks once more on onnxruntime's values (`forward_hooks.Replay`). torch runs them once a
call, so a hook counting calls, summing a statistic into a dict or appending to a list would also count the export's
runs. The state a hook can reach is saved before those runs and put back after them: its closure's cells, the
globals its code names, the attributes of the object it is a method of (or of the callable object it is), and what
these hold: dicts, lists, deques, sets, plain objects' attributes and small tensors, a few levels deep. Only what
changed is put back, in place, so the user's references to those objects stay valid. Modules reached on the way are
not walked (their state is torch's: parameters, buffers, submodules); the hooked modules' own attributes a hook sets
are put back by `forward_hooks.Recorder`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .edits import FORWARD_HOOKS
from .forward_hooks import from_a_library, user_hooks
from .stores import TORCHS

DEPTH = 4
"""Levels walked below a hook's cells, globals and object: `stats["relu"]["dead"]` is two."""
ITEMS = 100_000
"""Values walked at most per export: a hook's list of a whole epoch's activations is not copied further."""
SMALL = 1 << 16
"""Elements of the largest tensor saved (a running sum changed in place: `stats["sum"] += out.sum()`)."""

_MISSING = object()


@dataclass
class Saved:
    """The hooks' reachable state before the runs, to put back after them."""

    holders: list[tuple[Any, Any, frozenset[str] | None]] = field(default_factory=list)
    """(dict, list, deque or set; its shallow copy; the keys saved, None for all)."""
    cells: list[tuple[types.CellType, Any]] = field(default_factory=list)
    tensors: list[tuple[torch.Tensor, int, torch.Tensor]] = field(default_factory=list)
    """(tensor, its version counter, a copy)."""

    def put_back(self) -> None:
        for cell, value in self.cells:
            if _contents(cell) is not value:
                cell.cell_contents = value
        for holder, before, keys in self.holders:
            _put_back(holder, before, keys)
        with torch.no_grad():
            for t, version, copy in self.tensors:
                if t._version != version and t.shape == copy.shape:
                    t.copy_(copy)


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # not bound yet
        return _MISSING


def _put_back(holder: Any, before: Any, keys: frozenset[str] | None) -> None:
    if isinstance(holder, dict):
        now = holder if keys is None else {k: v for k, v in holder.items() if k in keys}
        if now.keys() == before.keys() and all(now[k] is v for k, v in before.items()):
            return
        if keys is None:
            holder.clear()
            holder.update(before)
            return
        for k in now.keys() - before.keys():
            del holder[k]
        for k, v in before.items():
            if holder.get(k, _MISSING) is not v:
                holder[k] = v
    elif isinstance(holder, set):
        if holder != before:
            holder.clear()
            holder.update(before)
    elif len(holder) != len(before) or any(a is not b for a, b in zip(holder, before)):
        holder.clear()  # a list or a deque
        holder.extend(before)


class _Walk:
    """Saves what a hook can reach into `saved`."""

    def __init__(self, saved: Saved) -> None:
        self.saved = saved
        self.seen: set[int] = set()
        self.budget = ITEMS
        self.globals: dict[int, tuple[dict[str, Any], set[str]]] = {}
        """By id, a module's globals and the names the hooks' code reads there (a counter behind `global n`)."""

    def done(self) -> None:
        for namespace, names in self.globals.values():
            keys = frozenset(names)
            self.saved.holders.append((namespace, {k: v for k, v in namespace.items() if k in keys}, keys))

    def hook(self, hook: Any) -> None:
        while isinstance(hook, functools.partial):
            for v in (*hook.args, *hook.keywords.values()):
                self.value(v, 1)
            hook = hook.func
        function = getattr(hook, "__func__", hook)
        owner = getattr(hook, "__self__", None)
        if not isinstance(function, types.FunctionType):  # a callable object
            function, owner = type(hook).__call__, hook
        if owner is not None and not isinstance(owner, types.ModuleType):
            self.attributes(owner, 1)
        if not isinstance(function, types.FunctionType):
            return
        for cell in function.__closure__ or ():
            value = _contents(cell)
            if value is not _MISSING:
                self.saved.cells.append((cell, value))
                self.value(value, 1)
        names = function.__code__.co_names
        namespace = function.__globals__
        self.globals.setdefault(id(namespace), (namespace, set()))[1].update(names)
        for name in names:
            value = namespace.get(name, _MISSING)
            if not isinstance(value, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
                self.value(value, 1)

    def attributes(self, obj: Any, depth: int) -> None:
        """A plain object's attributes, or a module's own (not torch's parameters, buffers, submodules, hooks)."""
        namespace = getattr(obj, "__dict__", None)
        if not isinstance(namespace, dict) or id(namespace) in self.seen:
            return
        self.seen.add(id(namespace))
        keys = frozenset(namespace) - TORCHS if isinstance(obj, nn.Module) else None
        before = dict(namespace) if keys is None else {k: namespace[k] for k in keys}
        self.saved.holders.append((namespace, before, keys))
        self.values(before.values(), depth + 1)

    def values(self, values: Iterable[Any], depth: int) -> None:
        for v in values:
            self.value(v, depth)

    def value(self, v: Any, depth: int) -> None:
        if depth > DEPTH or self.budget <= 0 or id(v) in self.seen:
            return
        self.seen.add(id(v))
        self.budget -= 1
        if isinstance(v, torch.Tensor):
            if v.numel() <= SMALL and not isinstance(v, nn.Parameter) and v.layout == torch.strided:
                self.saved.tensors.append((v, v._version, v.detach().clone()))
        elif isinstance(v, dict):
            self.saved.holders.append((v, dict(v), None))
            self.values(list(v.values()), depth + 1)
        elif isinstance(v, (list, collections.deque)):
            self.saved.holders.append((v, list(v), None))
            self.values(list(v), depth + 1)
        elif isinstance(v, set):
            self.saved.holders.append((v, set(v), None))
        elif isinstance(v, tuple):
            self.values(v, depth + 1)
        elif _plain(v):
            self.attributes(v, depth)


def _plain(v: Any) -> bool:
    """Whether `v` is an object of the user's own class (a statistics holder), or a SimpleNamespace."""
    if isinstance(v, types.SimpleNamespace):
        return True
    if isinstance(v, (nn.Module, type, types.ModuleType)) or not hasattr(v, "__dict__"):
        return False
    return type(v).__module__.partition(".")[0] not in sys.stdlib_module_names and not from_a_library(v)


def reachable(hooks: Iterable[Callable[..., Any]]) -> Saved:
    """The state these hooks can reach, saved."""
    saved = Saved()
    walk = _Walk(saved)
    for hook in hooks:
        walk.hook(hook)
    walk.done()
    return saved


@contextlib.contextmanager
def kept_hook_state(module: nn.Module) -> Iterator[None]:
    """The state the user's forward hooks on `module` (its submodules', torch's global ones) can reach, put back
    after the block, which runs the forward (and its hooks) on tensors that are not the call's own."""
    saved = reachable(hooks[hid] for _, _, hooks, hid in user_hooks(module, FORWARD_HOOKS))
    try:
        yield
    finally:
        saved.put_back()
