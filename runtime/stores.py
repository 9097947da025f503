"""What the forward stores in its modules' attributes, lists and dicts, done again after each call.

A forward that keeps a value on a module (an MoE layer's `self.aux_loss = ...`, routing kept for plotting, a VQ
layer's commitment loss) or appends to a list it holds (`self.maps.append(attn)`) or sets an entry of a dict it holds
(`self.cache["attn"] = attn`) does it at every call in torch. An export runs the forward once: after it the module
held the export's tensors (dynamo's fake ones), and the list grew once. So what a run of the forward stored is taken
back after the run (`watching`), its tensors become extra outputs of the graph, and each call stores the values the
graph computed (`Store.apply`), the gradients of a loss on them joining the graph's.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .structure import Spec, flatten, unflatten

APPENDED = object()
"""`Store.key` of a value appended to a list."""
_MISSING = object()
TORCHS = frozenset(vars(nn.Module()))
"""torch's own attributes of a module (its parameters, buffers, submodules and hooks by name): the others are the
user's."""


@dataclass(frozen=True)
class Taken:
    """A value a run of the forward stored, taken back after the run."""

    module: nn.Module
    name: str
    key: Any
    """None: the attribute itself; `APPENDED`: appended to the list the attribute holds; else the key of its dict."""
    value: Any

    def where(self, path: str) -> str:
        """`path.name`, `path.name[key]` or `path.name.append()`, for the graph's output names and messages."""
        name = ".".join(filter(None, (path, self.name)))
        return name if self.key is None else f"{name}.append()" if self.key is APPENDED else f"{name}[{self.key!r}]"


@dataclass(frozen=True)
class Store:
    """A store of the forward, done again at each call with the call's outputs at `indices`."""

    module: nn.Module
    name: str
    key: Any
    value: Spec
    indices: tuple[int, ...]

    def apply(self, values: Sequence[torch.Tensor]) -> None:
        value = unflatten(self.value, [values[i] for i in self.indices])
        for t in flatten(value)[0]:
            _stored_by_calls[id(t)] = t
        if self.key is None:
            setattr(self.module, self.name, value)
        elif self.key is APPENDED:
            getattr(self.module, self.name).append(value)
        else:
            getattr(self.module, self.name)[self.key] = value


_stored_by_calls: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
"""The tensors calls stored: a value an export finds in an attribute is then the previous call's, not state the
module began with."""


def stored_by_a_call(t: torch.Tensor) -> bool:
    return _stored_by_calls.get(id(t), _MISSING) is t


class Watching:
    """The modules' plain attributes before a run of the forward, and the lists and dicts they hold."""

    def __init__(self, module: nn.Module) -> None:
        self.before = [(m, dict(vars(m)), {k: _contents(v) for k, v in vars(m).items()
                                            if type(v) in (list, dict) and k not in TORCHS})
                       for m in module.modules()]
        self.by_hooks: set[int] = set()
        """Values the user's forward hooks put in those lists and dicts (`m.feats.append(out)`): their replay does it
        again."""

    @contextlib.contextmanager
    def hook_running(self) -> Iterator[None]:
        """Values put in the lists and dicts of the modules while the block (a hook) runs are the hook's."""
        containers = [v for m, _, _ in self.before for k, v in vars(m).items() if type(v) in (list, dict)
                      and k not in TORCHS]
        then = [_contents(v) for v in containers]
        try:
            yield
        finally:
            for now, before in zip(containers, then):
                old = {id(x) for x in _items(before)}
                self.by_hooks.update(id(x) for x in _items(now) if id(x) not in old)

    def taken(self) -> Iterator[Taken]:
        """What the run stored that holds a tensor, each put back as it was."""
        for m, attributes, contents in self.before:
            for k, v in list(vars(m).items()):
                then = attributes.get(k, _MISSING)
                if then is v and k in contents:
                    yield from _taken_from(m, k, v, contents[k], self.by_hooks)
                elif then is not v and _holds_tensors(v):
                    yield Taken(m, k, None, v)
                    if then is _MISSING:
                        del vars(m)[k]
                    else:
                        vars(m)[k] = then

    def replaced(self, taken: Taken) -> bool:
        """Whether `taken`, an attribute without grad, replaced a value no call stored (`self.h = h.detach()` over
        `__init__`'s `self.h = None`, `self.state = (h, c)`): state, if a later call reads it, which the graph holds
        as a constant."""
        then = next(a for m, a, _ in self.before if m is taken.module).get(taken.name, _MISSING)
        return (taken.key is None and then is not _MISSING
                and not any(t.requires_grad for t in flatten(taken.value)[0])
                and not any(stored_by_a_call(t) for t in flatten(then)[0]))


def _holds_tensors(v: Any) -> bool:
    """A tensor (not a parameter), or a list, tuple or dict of them (`self.maps = []` then appended to, a
    recurrent `(h, c)`)."""
    if isinstance(v, torch.Tensor):
        return not isinstance(v, nn.Parameter)
    return type(v) in (list, tuple, dict) and any(not isinstance(t, nn.Parameter) for t in flatten(v)[0])


def _items(v: list | dict) -> Iterable[Any]:
    return v.values() if isinstance(v, dict) else v


def _contents(v: list | dict) -> list | dict:
    return list(v) if type(v) is list else dict(v)


def _taken_from(m: nn.Module, k: str, now: list | dict, then: list | dict, skip: set[int]) -> Iterator[Taken]:
    """The tensors appended to a list (which grew at its end only) or set in a dict, taken back out; not those in
    `skip`."""
    if type(now) is list:
        assert isinstance(then, list)
        if len(now) <= len(then) or any(a is not b for a, b in zip(now, then)):
            return
        added = [x for x in now[len(then):] if id(x) not in skip]
        if any(flatten(x)[0] for x in added):
            now[len(then):] = [x for x in now[len(then):] if id(x) in skip]
            yield from (Taken(m, k, APPENDED, x) for x in added)
        return
    assert isinstance(now, dict) and isinstance(then, dict)
    for key, x in list(now.items()):
        if then.get(key, _MISSING) is not x and id(x) not in skip and flatten(x)[0]:
            yield Taken(m, k, key, x)
            if key in then:
                now[key] = then[key]
            else:
                del now[key]
