"""torch.autograd.Function subclasses a module applies while it is exported: their own backward is lost.

Both exporters trace through a Function's forward (or write its `symbolic`), and the gradient builder then
differentiates those ops, not what the Function's backward computes. Many Functions only compute their
forward's own derivative faster (transformers' Bloom GELU, memory-saving activations): differentiating the
forward is then right. Others define another gradient on purpose: a straight-through estimator (round in
forward, the gradient passed on unchanged) would get zero gradients, a gradient reversal layer the unreversed
one, silently. (Reentrant activation checkpointing, torch's CheckpointFunction, which the exporter fails in with
"unordered_map::at", runs its function directly, its outputs detached where no input requires grad as torch's
are: Hugging Face's `gradient_checkpointing_enable()`.) So the export
records the first call of every Function applied to a float tensor (not torch's own), and for those applied to a
tensor that requires grad compares the Function's backward with autograd's gradient of its forward's ops
on that call's inputs (one random cotangent); a Function whose two differ, or that cannot be checked, refuses the
module (`refusal`). An export whose call differentiated nothing (every parameter frozen) cannot tell which
Functions matter, and is not used for gradients (`unchecked`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import checkpoint
from torch.utils._pytree import tree_map_only

from . import stop_gradients
from .patching import replaced


@dataclass
class Applied:
    """A Function's first call while exporting."""

    cls: type
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    differentiated: bool = True
    """Whether a tensor it was applied to required grad (a first call with the parameters frozen, or under no_grad
    with only buffers and inputs, applies it to none: its backward matters once they require grad)."""


def _own(cls: type) -> bool:
    """torch's own Functions (its modules are exported as torch defines them), and the runtime's (which only run
    inside its exports)."""
    return cls.__module__.split(".", 1)[0] in ("torch", __name__.split(".", 1)[0])


_APPLY = vars(torch.autograd.Function)["apply"].__func__


@contextlib.contextmanager
def applied_functions() -> Iterator[list[Applied]]:
    """The Functions applied to float tensors while the block runs, in call order, each with its first call (not
    torch's own). Holds under the export lock (`Function.apply` is replaced process-wide)."""
    applied: list[Applied] = []

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls is checkpoint.CheckpointFunction:  # reentrant activation checkpointing: the function itself
            out = args[0](*args[2:])  # (the exporter fails inside it; the graph keeps what backward needs)
            if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args[2:]):
                return out
            # as torch's: with no input requiring grad, its outputs do not, and what it reads gets no gradient
            return tree_map_only(torch.Tensor, torch.Tensor.detach, out)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not _own(cls) and all(a.cls is not cls for a in applied) and any(t.is_floating_point() for t in tensors):
            applied.append(Applied(cls, args, kwargs, any(t.requires_grad for t in tensors)))
        with stop_gradients.in_function():
            return _APPLY(cls, *args, **kwargs)

    with replaced([(torch.autograd.Function, "apply", classmethod(apply))]):
        yield applied


class _Context:
    """What a Function's forward may call on its ctx, when it runs outside `apply` (nothing is kept)."""

    def __init__(self, needs: Sequence[bool]):
        self.needs_input_grad = tuple(needs)
        self.saved_tensors: tuple[torch.Tensor, ...] = ()

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors

    def mark_dirty(self, *tensors: torch.Tensor) -> None:
        pass

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _tensors(out: Any) -> list[torch.Tensor]:
    items = out if isinstance(out, tuple | list) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


def _forward_ops(call: Applied, args: list[Any]) -> Any:
    """The Function's forward run as plain ops (autograd records them)."""
    cls = call.cls
    if getattr(cls, "setup_context", None) is not getattr(torch.autograd.Function, "setup_context", None):
        return cls.forward(*args, **call.kwargs)  # a forward without ctx (its setup_context only saves)
    return cls.forward(_Context([isinstance(a, torch.Tensor) and a.requires_grad for a in args]), *args,
                       **call.kwargs)


def derivative_consistent(call: Applied, rtol: float = 1e-3) -> bool:
    """Whether the Function's backward gives autograd's gradient of its forward's ops on the call's inputs,
    along one random cotangent; False when either cannot be computed."""
    try:
        with torch.enable_grad():
            args = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                    for a in call.args]
            inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            custom, plain = _tensors(_APPLY(call.cls, *args, **call.kwargs)), _tensors(_forward_ops(call, args))
            if len(custom) != len(plain) or not custom:
                return False
            g = torch.Generator().manual_seed(0)
            cotangents = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in custom]
            want = torch.autograd.grad(plain, inputs, cotangents, allow_unused=True)
            got = torch.autograd.grad(custom, inputs, cotangents, allow_unused=True)
    except Exception:
        return False
    for x, a, b in zip(inputs, got, want):
        a = torch.zeros_like(x) if a is None else a
        b = torch.zeros_like(x) if b is None else b
        scale = float(torch.maximum(a.abs().max(), b.abs().max())) if a.numel() else 0.0
        if not torch.allclose(a, b, rtol=rtol, atol=rtol * scale):
            return False
    return True


def refusal(module: str, applied: Sequence[Applied]) -> str | None:
    """The export error for a module that applied Functions to tensors requiring grad whose backward is not their
    forward's derivative, or None."""
    wrong = [a.cls for a in applied if a.differentiated and not derivative_consistent(a)]
    if not wrong:
        return None
    names = ", ".join(f"{cls.__module__}.{cls.__qualname__}" for cls in wrong)
    return (f"{module} applies torch.autograd.Function {names} to tensors that require grad, and its backward() "
            "gives other gradients than the ops of its forward (compared on this call's inputs), or cannot be "
            "compared with them. Its backward is Python code the exported graph cannot hold: onnxruntime would "
            "differentiate the forward's ops instead (a straight-through estimator's gradients would be zero). "
            "Run the module in torch (ORTModule(module, fallback=True) does so for such calls, with a warning), or "
            "write the gradient with detach(), which the export keeps: `x + (f(x) - x).detach()` computes f(x) and "
            "passes x's gradient straight through; `(c + 1) * x.detach() - c * x` for a gradient scaled by -c.")


def unchecked(applied: Sequence[Applied]) -> bool:
    """Whether Functions were applied to tensors none of which required grad: unchecked (`refusal`), so an export
    made with every parameter frozen (a warm-up) cannot serve a gradient build once they require grad."""
    return any(not a.differentiated for a in applied)
