"""The autograd bridge: one torch.autograd.Function whose forward and backward are onnxruntime runs.

Gradients come back as torch tensors on onnxruntime's memory and torch's AccumulateGrad adds them to
`.grad` exactly as for eager modules. Output gradients that torch does not compute arrive as None
(`set_materialize_grads(False)`) and are passed on as None, so the TrainingSession can pick a
backward specialised to the outputs that do get gradients.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from onnxruntime.capi import _pybind_state as C

from . import exchange, openmp
from .checks import GradientCheck
from .replay import ReplayMismatch, replayed
from .session import TrainingSession


@dataclass
class Call:
    """One forward call: the session, its feeds, which tensors get gradients, and what came out."""

    session: TrainingSession
    feeds: dict[str, C.OrtValue]
    wrt: list[str]
    """Graph names receiving gradients, in the order of the tensors handed to `apply`."""
    n_user: int
    """The first n_user module outputs are the user's; the rest are BatchNorm statistics."""
    read: tuple[torch.Tensor, ...] = ()
    """The caller's tensors behind the graph inputs backward reads (saved to detect in-place changes)."""
    sparse: tuple[int, ...] = ()
    """Positions in `wrt` whose gradient is handed to torch sparse (embeddings with `sparse=True`)."""
    check: GradientCheck | None = None
    """Run on the first backward of an export, then dropped (`checks.gradient_check`)."""
    after_backward: Callable[[], None] | None = None
    """Run at each backward: what torch's backward changes besides gradients (BatchNorm statistics updated again
    in checkpointed regions: `batchnorm.second_updates`)."""
    watched: tuple[tuple[str, weakref.ref], ...] = ()
    """The outputs that other outputs are computed from (`Exported.internal`), by name: checked at backward for
    gradient hooks and retain_grad() (`reads_its_gradient`), which the backward cannot give their whole gradient."""
    in_torch: Callable[..., tuple[list[Any], list[torch.Tensor]]] | None = None
    """The same call computed again by torch's module (`Engine.in_torch`): its flat outputs and the tensors of
    `wrt`, for a backward with create_graph=True, whose gradients must be differentiable again."""


def reads_its_gradient(t: torch.Tensor | None) -> bool:
    """Whether a gradient hook or retain_grad() is on `t`."""
    return t is not None and (t.retains_grad or bool(t._backward_hooks))


def partial_gradient(name: str) -> str:
    return (f"a gradient hook or retain_grad() is on {name}, which other outputs of the graph are computed from (as "
            "Grad-CAM takes an activation's gradient): torch gives it the gradient through them too, but onnxruntime's "
            "backward computes that part inside the module in one run, so it would see only the gradient reaching it "
            "directly. Take the gradient with respect to an input or parameter instead, or run the module in torch.")


def _keep_graph() -> bool:
    """Whether the running backward was called with retain_graph=True (then the stash must survive it)."""
    try:
        return bool(torch._C._autograd._get_current_graph_task_keep_graph())
    except (AttributeError, RuntimeError):
        return False


class ORTFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        outs, state = call.session.forward_ortvalues(call.feeds)
        values = [exchange.to_torch(v) for v in outs]
        ctx.call = call
        ctx.state = state
        fixed, saved = call.session.output_roles(call.n_user, values)
        if fixed:
            ctx.mark_non_differentiable(*[values[i] for i in fixed])
        ctx.save_for_backward(*[values[i] for i in saved], *call.read)
        call.read = ()
        return tuple(values)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        # create_graph=True: gradients that can be differentiated again; vmap over backward (is_grads_batched,
        # a vectorized jacobian): incoming gradients without storage
        if torch.is_grad_enabled() or not all(map(_has_storage, filter(_given, grads))):
            return _backward_in_torch(ctx, *grads)
        call: Call = ctx.call
        for name, ref in call.watched:
            if reads_its_gradient(ref()):
                raise RuntimeError(f"ORTModule: {partial_gradient(name)}")
        ctx.saved_tensors  # noqa: B018 - raises if a tensor backward reads was modified in place
        n_out = len(call.session.output_names)
        host = [*grads[:call.n_user], *[None] * (n_out - call.n_user)]  # none for the BatchNorm statistics
        openmp.defer_joins()
        try:
            result = call.session.backward_ortvalues(ctx.state, host, retain=_keep_graph(), as_torch=True)
        finally:
            openmp.join()
        out = [result.get(w) for w in call.wrt]
        if call.check is not None:
            check, call.check = call.check, None
            out = check(grads[:call.n_user], out)
        if call.after_backward is not None:
            call.after_backward()
        for i in call.sparse:  # as torch's sparse embedding gradient: the rows, COO over the first axis
            if out[i] is not None:
                out[i] = out[i].to_sparse(1)
        return (None, *out)


_given = functools.partial(operator.is_not, None)
_has_storage = torch._C._has_storage
"""False for functorch's batch of gradients under vmap (is_grads_batched, a vectorized jacobian), which looks
like a plain tensor in a Function's backward but has no memory onnxruntime could read."""


def _backward_in_torch(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """backward(create_graph=True) (a gradient penalty, a physics-informed loss, a Hessian-vector product): the
    call's outputs computed again by torch's own module from the same inputs and parameters, and their gradients
    taken with create_graph=True, so that they have a graph to differentiate again (onnxruntime's have none). The
    values are torch's, as the first-call check holds onnxruntime's to be. Random draws (dropout) are the
    forward's (`replay`); where onnxruntime drew them, refused rather than differentiate other masks. A batch of
    incoming gradients under vmap takes the same way."""
    call: Call = ctx.call
    problem = call.session.replay_problem(ctx.state)
    if problem is not None:
        raise RuntimeError(f"{_REDRAWN}, but {problem}")
    warnings.warn("backward(create_graph=True), or a batched backward (is_grads_batched, a vectorized jacobian), "
                  "through ORTModule: the call is computed again in torch, whose gradients can be differentiated "
                  "again (a torch forward and backward more per such step).",
                  RuntimeWarning, stacklevel=2)  # shown once per process by Python's default filter
    if call.in_torch is None:
        raise RuntimeError("ORTModule cannot compute this call again in torch for backward(create_graph=True)")
    batched = not all(g is None or _has_storage(g) for g in grads)
    redraw = ctx.state.redraw
    try:
        # the forward outside vmap (which refuses random ops), its graph differentiated for the batch of gradients
        with _outside_vmap() if batched else contextlib.nullcontext(), \
                replayed(redraw) if redraw is not None else contextlib.nullcontext():
            outputs, inputs = call.in_torch(not batched)  # aliases: not under vmap
    except ReplayMismatch as e:
        raise RuntimeError(f"{_REDRAWN}, but {e}: its forward draws otherwise than the exported graph (a branch on "
                           "torch.onnx.is_in_onnx_export() or on tracing?). Take the gradients without create_graph, "
                           "or call the module in eval mode.") from e
    pairs = [(o, g) for o, g in zip(outputs, grads[:call.n_user])
             if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
    found = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], create_graph=True,
                                allow_unused=True) if pairs else [None] * len(inputs)
    if call.after_backward is not None:
        call.after_backward()
    return (None, *found)


_REDRAWN = ("ORTModule: backward(create_graph=True), or a batched backward, computes the call again in torch, which "
            "must draw the random numbers its forward drew")


@contextlib.contextmanager
def _outside_vmap() -> Iterator[None]:
    """Out of the vmap a batched backward (is_grads_batched) runs in, which refuses random ops (torch's module's
    dropouts): the forward computed again there is not batched, only the gradients its graph is given."""
    levels = 1
    while torch._C._vmapmode_decrement_nesting() > 0:
        levels += 1
    try:
        yield
    finally:
        for _ in range(levels):
            torch._C._vmapmode_increment_nesting()


_pack_hooks = torch._C._autograd._top_saved_tensors_default_hooks
"""The innermost `saved_tensors_hooks` in force (None without): their pack hook runs as the forward's outputs are
saved."""
_APPLY = super(torch.autograd.Function, ORTFunction).apply
"""The C++ apply under `Function.apply`, whose Python layer (default-argument binding for `setup_context`,
functorch's pytree walk over the arguments) costs ~10 µs a step and does nothing for this Function
outside functorch transforms."""


def apply(call: Call, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run `call` through autograd; returns (user outputs, BatchNorm statistics). Calls under torch.func
    transforms never get here (the engine runs them in torch)."""
    if _pack_hooks(False) is None:  # saved-tensor hooks (user code) are called in there: then joined at once
        openmp.defer_joins()  # the forward's run to autograd's wiring of its outputs: no parallel torch op
    try:
        out = _APPLY(call, *tensors)
    finally:
        openmp.join()
    return list(out[:call.n_user]), list(out[call.n_user:])
