"""torch.autograd.Function subclasses a module applies while it is exported: their own backward is lost.

Both exporters trace through a Function's forward (or write its `symbolic`), and the gradient builder then
differentiates those ops, not what the Function's backward computes: a straight-through estimator (round in
forward, the gradient passed on unchanged) would get zero gradients, a gradient reversal layer the unreversed
gradient, silently. So the export records every Function applied to a tensor that requires grad, and refuses
the module when one is not torch's own (`refusal`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .patching import replaced


def _own(cls: type) -> bool:
    """torch's own Functions (its modules are exported as torch defines them)."""
    return cls.__module__.split(".", 1)[0] == "torch"


@contextlib.contextmanager
def applied_functions() -> Iterator[list[type]]:
    """The Function classes applied to tensors requiring grad while the block runs, in call order (not torch's
    own). Holds under the export lock (`Function.apply` is replaced process-wide)."""
    applied: list[type] = []
    original = vars(torch.autograd.Function)["apply"].__func__

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not _own(cls) and cls not in applied and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())):
            applied.append(cls)
        return original(cls, *args, **kwargs)

    with replaced([(torch.autograd.Function, "apply", classmethod(apply))]):
        yield applied


def refusal(module: str, applied: list[type]) -> str | None:
    """The export error for a module that applied `applied`, or None when it applied none."""
    if not applied:
        return None
    names = ", ".join(f"{cls.__module__}.{cls.__qualname__}" for cls in applied)
    return (f"{module} applies torch.autograd.Function {names} to tensors that require grad. Its backward() is "
            "Python code the exported graph cannot hold: onnxruntime would differentiate the ops of its forward "
            "instead, and the gradients would differ from torch's (a straight-through estimator's would be zero). "
            "Run the module in torch (ORTModule(module, fallback=True) does so for such calls, with a warning), or "
            "write the gradient with detach(), which the export keeps: `x + (f(x) - x).detach()` computes f(x) and "
            "passes x's gradient straight through; `(c + 1) * x.detach() - c * x` for a gradient scaled by -c.")
