"""Edits to a module after its export that its graph does not follow: hooks, submodules, parameters, buffers.

An export holds the module as it was: its forward hooks' effects traced in, each submodule's forward, which
parameters and buffers exist and their sizes. torch reads all of these at every call. A hook registered or removed
later, a submodule replaced (`model.act = nn.Tanh()`), a buffer registered, a bias set to None or pruning's
reparametrization (`weight` becoming `weight_orig` times a mask) then ran the old graph without a word, or failed
naming a parameter. The engine now compares the module's `Layout` with the one its exports were made for, and
exports again where it changed.

Taking the layout walks every submodule, too slow for every call of a large model, so `Watch` takes it again only
after something could have changed it: torch's global registration hooks count every assignment of a submodule,
parameter or buffer anywhere (`edit_count`), every hook registered takes a new handle id (`RemovableHandle.next_id`),
and the hook dicts that were not empty are watched for removals by their length. Sizes changed under a parameter
(`weight.data = bigger`, as `resize_token_embeddings` does) are seen where the engine feeds it anew (`Layout.kinds`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

from .stores import stored_by_a_call

_edits = itertools.count(1)  # next() is atomic: edits in several threads each count
_count = [0]


def _counted(*_: Any) -> None:
    _count[0] = next(_edits)


nn_module.register_module_module_registration_hook(_counted)
nn_module.register_module_parameter_registration_hook(_counted)
nn_module.register_module_buffer_registration_hook(_counted)


def edit_count() -> int:
    """Changes with every submodule, parameter or buffer assigned to any module since the import."""
    return _count[0]


FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks")
BACKWARD_HOOKS = ("_backward_pre_hooks", "_backward_hooks")
MODULE_HOOKS = FORWARD_HOOKS + BACKWARD_HOOKS
"""The attributes holding an nn.Module's hooks by handle id (`_global` before them: torch's on every module)."""
_GLOBAL_HOOKS = tuple(getattr(nn_module, f"_global{name}") for name in MODULE_HOOKS)
"""torch's hooks on every module's call (`register_module_forward_hook`, ...)."""


def _hook_dicts(module: nn.Module) -> list[dict[int, Any]]:
    return [*_GLOBAL_HOOKS, *(getattr(m, name) for m in module.modules() for name in MODULE_HOOKS)]


def grad_attributes(module: nn.Module) -> dict[str, torch.Tensor]:
    """Tensors requiring grad held in plain attributes of the module's submodules, by qualified name: weights set
    from outside the forward (a hypernetwork's `target.w = hyper(z)`, pruning's `weight = weight_orig * mask`
    when its hook runs on the ORTModule itself). They are fed to the graph as inputs, whose gradients go back
    through them as torch's do; held as constants, they had none. Not those an earlier call stored
    (`stores`: a forward's own `self.aux_loss = ...`)."""
    found = {}
    for path, m in module.named_modules():
        for name, value in vars(m).items():
            if type(value) is torch.Tensor and value.requires_grad and not name.startswith("_") and \
                    not stored_by_a_call(value):
                found[f"{path}.{name}" if path else name] = value
    return found


@dataclass(frozen=True)
class Layout:
    """What of a module an export holds besides its tensors' values."""

    tree: tuple[Any, ...]
    """Per submodule (in `named_modules` order, shared ones at each place): its path, identity, hooks' handle ids
    and which parameters and buffers it has (None ones too)."""
    kinds: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    """Each parameter's, buffer's and fed attribute's (`grad_attributes`) dtype and sizes, by qualified name."""

    @classmethod
    def of(cls, module: nn.Module) -> Layout:
        tree: list[Any] = [tuple(tuple(d) for d in _GLOBAL_HOOKS)]
        kinds: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for path, m in module.named_modules(remove_duplicate=False):
            tree.append((path, id(m), *(tuple(getattr(m, name)) for name in MODULE_HOOKS),
                         tuple((k, v is None) for k, v in m._parameters.items()),
                         tuple((k, v is None) for k, v in m._buffers.items())))
            for k, v in itertools.chain(m._parameters.items(), m._buffers.items()):
                if v is not None:
                    kinds[f"{path}.{k}" if path else k] = (v.dtype, tuple(v.shape))
        kinds.update((fqn, (v.dtype, tuple(v.shape))) for fqn, v in grad_attributes(module).items())
        return cls(tuple(tree), kinds)


class Watch:
    """The layout a module's exports were made for, taken again only when it may have changed."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.layout: Layout | None = None
        self._token: tuple[int, int] | None = None
        self._watched: list[tuple[dict[int, Any], int]] = []

    def changed(self) -> bool:
        """Whether the layout differs from the one seen last (False at the first call)."""
        if (_count[0], RemovableHandle.next_id) == self._token and all(len(d) == n for d, n in self._watched):
            return False
        before = self.layout
        self.rebase()
        return before is not None and before != self.layout

    def rebase(self) -> None:
        """Take the layout as it is now: after an export, whose run of the forward may change it for good (Hugging
        Face's models register the hooks that record their outputs at their first call)."""
        self._token = (_count[0], RemovableHandle.next_id)
        self.layout = Layout.of(self.module)
        self._watched = [(d, len(d)) for d in _hook_dicts(self.module) if d]

    def retake(self) -> None:
        """Take the layout again at the next `changed` (after the engine followed a change)."""
        self._token = None

    def kind_changed(self, fqn: str, t: torch.Tensor) -> bool:
        """Whether a parameter or buffer fed anew has another dtype or sizes than the layout's."""
        assert self.layout is not None
        return self.layout.kinds.get(fqn) != (t.dtype, tuple(t.shape))
