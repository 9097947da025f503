"""torch's stop-gradients kept through the legacy exporter, as gradbuilder's StopGradient op.

The exporter erases `detach` (ONNX is inference-only to it) and records what runs under `torch.no_grad()` like
any other op, so a detached tensor, or one computed without grad (a teacher's or a momentum encoder's output), would
pass gradients on to what made it. While exporting, `detach` becomes a StopGradient (the identity without a
gradient: gradbuilder/stop_gradient.py), and `WithoutGrad` detaches every float tensor a torch function returns
while grad is disabled in the module's forward, so both reach the gradient builder as stop edges. A parameter
changed in place while grad is disabled takes its new value with the identity as gradient, as in torch.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gradbuilder.stop_gradient import OP_TYPE
from gradbuilder.yield_op import DOMAIN

from .forward_hooks import in_a_hook
from .patching import untraced_ints
from .symbolics import registered

OPSET = 9
"""The default-domain opset from which the symbolic applies (every opset the legacy exporter writes)."""


def _stop_gradient(g: Any, x: Any) -> Any:
    out = g.op(f"{DOMAIN}::{OP_TYPE}", x)
    out.setType(x.type())
    return out


def exported_detach() -> contextlib.AbstractContextManager[None]:
    """`aten::detach` exported as StopGradient while the block lasts (the exporter imports the domain at version
    1 where one is written)."""
    return registered({"aten::detach": _stop_gradient}, OPSET)


_IN_FUNCTIONS = [0]
"""How many torch.autograd.Function forwards are running (torch runs them without grad; `in_function`)."""


@contextlib.contextmanager
def in_function() -> Iterator[None]:
    """A Function's forward runs: what it computes is not a stop-gradient, though grad is off (the export decides
    whether its ops may be differentiated: runtime/custom_functions.py)."""
    _IN_FUNCTIONS[0] += 1
    try:
        yield
    finally:
        _IN_FUNCTIONS[0] -= 1


class WithoutGrad(TorchFunctionMode):
    """Float tensors returned by torch functions while grad is disabled come back detached (traced as `detach`);
    what a function returns of its own arguments (in-place ops, views returned as is) is left alone. Counts the
    gradient hooks the forward puts on tensors (`tensor_hooks`), which a graph cannot hold."""

    def __init__(self) -> None:
        super().__init__()
        self.tensor_hooks = 0
        self.changed_parameters: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Parameters an in-place op changed while grad was disabled (`_changed_parameter`), each with a copy of
        its value before, in call order."""
        self._aliases: dict[int, tuple[torch.Tensor, nn.Parameter]] = {}
        """A parameter's `.data` as read in the forward, by id (the alias kept: ids are not reused meanwhile)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.register_hook:
            self.tensor_hooks += 1
        if args and not _IN_FUNCTIONS[0]:
            if getattr(func, "__self__", None) is DATA:
                return self._data(func, args)
            target = self._parameter(args[0])  # changed in place without grad, or through `.data` with it too
            if target is not None and _in_place(func) and (
                    args[0] is not target or not torch.is_grad_enabled() or not target.requires_grad):
                with torch.no_grad():
                    return self._changed_parameter(func, (target, *args[1:]), kwargs or {})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = func(*args, **(kwargs or {}))
        if caught:  # the tracer's warnings name the code that called the function, as without this mode
            caller = sys._getframe(1)
            for w in caught:
                warnings.warn_explicit(w.message, w.category, caller.f_code.co_filename, caller.f_lineno)
        if torch.is_grad_enabled() or _IN_FUNCTIONS[0]:
            return out
        given = {id(a) for a in args if isinstance(a, torch.Tensor)}
        if _changed_in_place(func, out, given):
            out.copy_(out.detach())  # traced: later reads of the buffer go through a StopGradient
        return _detached(out, given)

    def _parameter(self, t: Any) -> nn.Parameter | None:
        """The parameter `t` is, or whose `.data` it is."""
        if isinstance(t, nn.Parameter):
            return t
        alias = self._aliases.get(id(t))
        return alias[1] if alias is not None and alias[0] is t else None

    def _data(self, func: Any, args: tuple) -> Any:
        """A parameter's `.data`, read or assigned in the forward (a momentum encoder's `pk.data.mul_(m).add_(pq.data,
        alpha=1 - m)` or `pk.data = pk.data * m + ...`, as in MoCo's code). The trace took a read as a constant,
        the value at the export; here it is the parameter's detach(), whose in-place ops are the parameter's own
        (`_changed_parameter`), and an assignment of a value of its shape a copy_ into it. The parameter then
        changes at each call, as torch's does (the key encoder stopped moving after the export)."""
        param = args[0]
        if func.__name__ == "__get__" and isinstance(param, nn.Parameter):
            alias = param.detach()  # traced from the parameter's graph input (`.data` was traced as a constant)
            self._aliases[id(alias)] = (alias, param)
            return alias
        if func.__name__ == "__set__" and isinstance(param, nn.Parameter) and isinstance(args[1], torch.Tensor) and \
                untraced_ints(*args[1].shape) == untraced_ints(*param.shape) and args[1].dtype == param.dtype:
            with torch.no_grad():
                self._changed_parameter(torch.Tensor.copy_, (param, args[1]), {})
            return None
        return func(*args)

    def _changed_parameter(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """An in-place op on a parameter while grad is disabled (an embedding's max_norm renorm, a weight clipped or
        normalized in forward): torch changes its value, and its gradient is still the parameter's own. The trace
        would record the op's arithmetic of the weight, which the gradient builder differentiates. Here the op
        runs on a detached copy and the parameter takes copy + (itself - itself detached): its new value exactly,
        and the identity as gradient. Later reads in the forward see the new value; the export carries it back
        to the parameter (`export.Exported.updates`)."""
        target = args[0]
        scratch = target.detach().clone()
        self.changed_parameters.append((target, scratch.clone()))
        func(scratch, *args[1:], **kwargs)
        with torch.enable_grad():
            now = scratch.detach() + (target - target.detach())  # no gradient to what the op read (copy_'s source)
        target.copy_(now)
        return target


_IN_PLACE_OPERATORS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift"))


_NOT_VALUES = frozenset({"requires_grad_", "share_memory_", "detach_", "retain_grad_", "resize_", "set_"})
"""In-place by name, but changing no value (flags, storage): left to torch."""


def _in_place(func: Any) -> bool:
    """An op changing its first argument's values, by torch's naming (`clamp_`, `index_copy_`, `embedding_renorm_`)
    and Python's (`+=`, item assignment)."""
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or name in _IN_PLACE_OPERATORS or (
        name.endswith("_") and not name.startswith("_") and name not in _NOT_VALUES)


DATA = torch._C.TensorBase.__dict__["data"]
"""The `data` descriptor, whose `__get__` and `__set__` reach a TorchFunctionMode as method wrappers."""


def _changed_in_place(func: Any, out: Any, given: set[int]) -> bool:
    """A float tensor without grad (a buffer, not a view) that an in-place op changed while grad is disabled: an
    EMA of the weights (`ema.mul_(d).add_(w, alpha=1 - d)`, mean teacher's, BYOL's) that the forward then reads.
    torch's autograd sees the result as a constant; the trace records its arithmetic of the weights, which the
    gradient builder would differentiate."""
    return isinstance(out, torch.Tensor) and id(out) in given and out.is_floating_point() and \
        not out.requires_grad and out._base is None and getattr(func, "__name__", "").endswith("_") and \
        func is not torch.Tensor.copy_


def _detached(out: Any, given: set[int]) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach() if out.is_floating_point() and id(out) not in given else out
    if isinstance(out, tuple):  # plain, a namedtuple, or torch.return_types (max's values and indices)
        items = [_detached(o, given) for o in out]
        if type(out) is tuple:
            return tuple(items)
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, list):
        return [_detached(o, given) for o in out]
    return out


class Finder(TorchFunctionMode):
    """Records the first stop-gradient the dynamo exporter loses in a forward: a float result computed without grad
    from a tensor that requires grad (a `no_grad` block, which torch.export's graph does not mark). Its `detach`
    is a StopGradient (`dynamo_translations`). A torch.autograd.Function's forward runs without grad too, but is
    no stop-gradient: its ops are differentiated where its backward agrees with them (`custom_functions`; Bloom's
    GELU was refused)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.found is None and not in_a_hook() and not _IN_FUNCTIONS[0] and \
                any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            name = getattr(func, "__name__", str(func))
            if not torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.is_floating_point():
                self.found = f"{name} computed under torch.no_grad() from a tensor that requires grad"
        return out
