"""The last training call's decisions, reused while nothing they rest on has changed.

A training loop calls its module again and again with tensors of the same kinds and sizes, in the same modes:
each call finds the same export, the same session and the same parameter OrtValues as the one before. Finding
that out the general way (binding the arguments, hashing a schema key, looking up the session for the tensors
requiring grad and these sizes, checking each parameter against its cached OrtValue) was a third of the Python a
tiny model's step pays. `Steady` keeps what such a call found and checks only what can differ at the next one,
with loops in C where there is one per tensor:

- the arguments: plain CPU tensors, as many, the same keywords in the same order, of the same dtypes and sizes,
  requiring grad as before;
- every submodule's train/eval flag, and grad mode;
- each parameter and buffer fed: the same tensor in the same slot of its module, on the same memory (`.data`
  assigned anew moves it), of the same sizes and contiguous (a view assigned to `.data` may keep the memory),
  requiring grad as before;
- the Python values the export holds as constants (`scalars`).

What is not checked here is checked before it at every call (the module's layout: `edits.Watch`; torch.func
transforms), or drops the record (`Engine.invalidate`). The export stays right for the recorded call's kinds and
sizes even where the engine's cache no longer holds it (a call of other sizes that made the module's exports per
size re-keys the cache). A steady call updates BatchNorm's running statistics as the general path does. Calls
whose export has more to do per call (buffers it updates, BatchNorm statistics updated again by a checkpointed
region's recomputation, forward hooks, outputs other outputs are computed from, tied weights, per-size exports)
and the second call of an export (`Engine._new_values` checks it) never get a `Steady`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from onnxruntime.capi import _pybind_state as C

from . import exchange

_training = operator.attrgetter("training")
_requires_grad = operator.attrgetter("requires_grad")
_data_ptr = torch.Tensor.data_ptr
_shape = operator.attrgetter("shape")
_contiguous = torch.Tensor.is_contiguous


def argument_kinds(args: Sequence[Any]) -> list[tuple[Any, ...]] | None:
    """What a call's positional tensors must share with the recorded call's: None where one is not a plain CPU
    tensor (a subclass, a Parameter, another device: the general path decides)."""
    kinds = [(type(a), a.dtype, a.shape, a.requires_grad, a.is_cpu) if type(a) is torch.Tensor else None
             for a in args]
    return None if None in kinds else kinds


@dataclass(slots=True, eq=False)
class Steady:
    """One recorded training call: what the engine found, and what to compare the next call with."""

    schema: Any
    """The engine's `Schema` the call found."""
    session: Any
    """The `TrainingSession` the call ran."""
    kinds: list[tuple[Any, ...]]
    """`argument_kinds` of the call's tensors as given, positional then keyword."""
    modules: list[torch.nn.Module]
    training: list[bool]
    holders: list[dict[str, Any]]
    """Per parameter or buffer fed: the dict holding it in its module (`_parameters`, `_buffers`, or `__dict__` for a
    tensor in a plain attribute)."""
    attrs: list[str]
    tensors: list[torch.Tensor]
    pointers: list[int]
    shapes: list[torch.Size]
    grads: list[bool]
    """Whether each of `tensors` required grad."""
    state_feeds: dict[str, C.OrtValue]
    inputs: list[tuple[str, int]]
    """Graph inputs fed from the call's tensors (flattened: the signature's order): (name, position)."""
    names: list[str]
    """The graph name of each of the call's tensors followed by each of `tensors` (`Engine.in_torch`'s names)."""
    wrt: list[str]
    differentiated: list[int]
    """Where each of `wrt` is among the call's tensors followed by `tensors`."""
    read: list[int]
    """Likewise, the tensors behind the graph inputs backward reads (`Call.read`)."""
    sparse: tuple[int, ...]
    in_spec: Any
    """The arguments' structure (`Engine.in_torch` rebuilds the call from it)."""
    keywords: tuple[str, ...]
    """The keywords the call gave, in its order."""
    order: list[int] | None
    """Where each flattened argument (the signature's order) is among the tensors given (positional, then keyword,
    as `kinds`); None where in the same order."""
    statistics: Any = None
    """The BatchNorms' running statistics the call updates, as one tensor (`batchnorm.FlatStatistics`), where they
    can be."""

    def holds(self, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """Whether a call of `args` and `kwargs` would find everything this one found."""
        tensors = self.tensors
        return (tuple(kwargs) == self.keywords and torch.is_grad_enabled()
                and argument_kinds([*args, *kwargs.values()] if kwargs else args) == self.kinds
                and list(map(_training, self.modules)) == self.training
                and all(map(operator.is_, map(dict.get, self.holders, self.attrs), tensors))
                and list(map(_data_ptr, tensors)) == self.pointers
                and list(map(_shape, tensors)) == self.shapes and all(map(_contiguous, tensors))
                and list(map(_requires_grad, tensors)) == self.grads
                and not self.schema.exported.unchecked
                and (self.schema.exported.scalars is None or not self.schema.exported.scalars.held
                     or self.schema.exported.scalars.changed() is None))

    def feeds(self, leaves: Sequence[torch.Tensor]) -> dict[str, C.OrtValue]:
        """The graph's feeds for a call of these flattened tensors: the recorded parameters' and the call's."""
        feeds = dict(self.state_feeds)
        for name, k in self.inputs:
            feeds[name] = exchange.to_ortvalue(leaves[k])
        return feeds
