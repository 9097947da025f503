"""torch's module computing a call again with the random numbers the call's forward drew.

A backward with create_graph=True (a gradient penalty, a Hessian-vector product), or a batched one, computes the
call again in torch (`function._backward_in_torch`), whose Dropouts and fills would draw other numbers than the
forward did: the gradients of another function (a critic with a Dropout: 0.44-0.50 apart, of ~1). The forward's
draws are the host's (`host_dropout`), whose `Redraw` draws them again (or onnxruntime's at the first call at new
sizes, which the runner keeps: `Kept`). Each of torch's seeded random ops hands back
the host's value of the draw at its place in the forward's order, which is the trace's and so torch's (the order
`MaskedRunner._draw_as_torch` relies on): a Dropout's `bernoulli_` its mask, a randn_like its values,
torch.normal(mean, std) mean plus its values (times std). An op that does not match the draw at its place (another
fill, another shape) stops the recompute rather than differentiate other numbers. Its checkpoints run plainly
(`checkpoints.plain_checkpoints`): a backward computing a region again would draw anew (torch's own from the state
it saved, not numpy's), and the gradient penalty through a checkpointed Dropout was 0.23-0.33 off.

torch's module runs as it ran for the export, with its replacements of attention and dropout (`lean_attention`,
`exportable_dropouts`): each mask is then laid out as the graph's Dropout input. Eager torch lays some out
otherwise: a batch-first TransformerEncoderLayer's dropout1 reads the attention's output transposed, whose mask
torch draws in that memory order, and the lean export outside `torch_dropout` stores it batch-major. So not torch's
generator set back to the state the draws came from where they were torch's: the create_graph gradient of such an
encoder's exporting call was 0.09 off its own backward's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import exchange
from .attention import lean_attention
from .checkpoints import plain_checkpoints
from .dropouts import exportable_dropouts
from .export import EXPORT_LOCK
from .host_dropout import Kept, Mask, Redraw

aten = torch.ops.aten

DRAWN_BY = {None: {aten.bernoulli_},
            "bernoulli_": {aten.bernoulli_},
            "normal_": {aten.normal_, aten.normal, aten.randn_like, aten.randn},
            "uniform_": {aten.uniform_, aten.rand_like, aten.rand},
            "exponential_": {aten.exponential_}}
"""torch's ops that draw each kind of the host's draws (`Mask.draw`'s fill; None: a Dropout's mask)."""


class ReplayMismatch(RuntimeError):
    """torch's module drew other random numbers than the forward's, in kind, shape or count."""


@contextlib.contextmanager
def replayed(redraw: Redraw | Kept) -> Iterator[None]:
    """torch's module, run inside, computes what was exported (laid out as the runner's `torch_masks` says; its
    checkpoints plainly, so that no later backward draws anew) and draws the numbers `redraw`'s call drew."""
    drawn = redraw()
    mode = _Replayed([(m, exchange.to_torch(drawn[m.input])) for m in redraw.runner.masks])
    with EXPORT_LOCK, lean_attention(redraw.runner.torch_masks), exportable_dropouts(), plain_checkpoints(), mode:
        yield  # the replacements are process-wide: under the export's lock
    if mode.taken != len(mode.draws):
        raise ReplayMismatch(f"torch's module drew {mode.taken} random tensors, the forward {len(mode.draws)}")


class _Replayed(TorchDispatchMode):
    """Each seeded random op's result replaced by the forward's draw at its place."""

    def __init__(self, draws: list[tuple[Mask, torch.Tensor]]):
        super().__init__()
        self.draws = draws
        self.taken = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return result
        if self.taken == len(self.draws):
            raise ReplayMismatch(f"torch's module drew with {func} after the forward's {len(self.draws)} draws")
        mask, value = self.draws[self.taken]
        self.taken += 1
        fill = mask.draw[0] if mask.draw is not None else None
        if func.overloadpacket not in DRAWN_BY[fill]:
            raise ReplayMismatch(f"torch's module drew with {func} where the forward drew "
                                 f"{fill or 'a Dropout mask'} (for {mask.output})")
        value = as_torch_computes(func, args, mask, value)
        if not isinstance(result, torch.Tensor) or value.shape != result.shape:
            raise ReplayMismatch(f"torch's module drew with {func} a tensor of shape "
                                 f"{tuple(getattr(result, 'shape', ()))} where the forward drew {tuple(value.shape)} "
                                 f"(for {mask.output})")
        result.copy_(value)
        return result


def as_torch_computes(func: Any, args: tuple, mask: Mask, value: torch.Tensor) -> torch.Tensor:
    """torch's result of `func` for the host's draw `value`: a Dropout's mask in torch's layout, bernoulli_'s
    draws from the uniforms fed (u = 1 - b), torch.normal of tensors the draws moved by the mean (and scaled by the
    std, where they were drawn standard), as torch computes them (`normal_(0, std)` then `add_(mean)`)."""
    if mask.draw is None:
        return value.permute(*reversed(range(value.dim()))) if mask.transposed else value
    if mask.draw[0] == "bernoulli_":
        return 1 - value
    if func.overloadpacket is aten.normal and func._overloadname in ("Tensor_float", "float_Tensor", "Tensor_Tensor"):
        mean, std = args[0], args[1] if len(args) > 1 else 1.0
        return value + mean if func._overloadname == "Tensor_float" else value * std + mean
    return value
