"""The first call of every export checked against torch: its outputs, then its first gradients.

The legacy exporter runs the module eagerly while it traces, and before exporting with dynamo (whose trace runs
fake tensors) the module runs once in torch, so torch's outputs of that call exist, with their autograd graph
(`Exported.reference`). onnxruntime's outputs of the same call are compared with them, dtypes first (a float32
output within rounding of torch's float64 one passed: a float32 module's loss times a float64 buffer)
(`outputs_error`); on its first backward, torch's gradients of those outputs for the same incoming gradients
with onnxruntime's (`gradient_check`). A difference means the exported graph or its gradient computes something
else than the module: a conversion of torch's exporter that is wrong (index_add dropping repeated indices,
pairwise_distance's eps in the exponent, before this runtime wrote them itself), an in-place change through a view
that its tracer misses, a gradient rule of ours. The module then fails as a failed export does. The call's
Dropout masks and the fills the export tags as torch's (randn_like, rand, torch.normal, bernoulli_: `torch_draws`)
are drawn as torch's (`host_dropout`); the float64 arbiter draws them in float32 (`float32_draws`). Not checked
where onnxruntime draws random numbers (the fills torch draws with kernels of its own, cauchy_ and randint_like;
random ops in If/Loop bodies), or the forward changed state in place (`export`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .export import ExportError

CHECK_TOLERANCE = 1e-3
"""An output element differs when it is off by more than this fraction of the output's largest magnitude, and an
output differs when more than this fraction of its elements do (at least one): a rounding or comparison that float
rounding tips the other way (a fake-quantized activation at a .5 boundary, a near tie in a top-k routing) moves
a few elements by a step, while what the check is for moves many (or makes one non-finite)."""


def mismatch(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], what: str = "output", floor: float = 0.0
             ) -> str | None:
    """How onnxruntime's outputs (or gradients) differ from torch's: float ones beyond float32 rounding
    (`CHECK_TOLERANCE`, plus `floor`: an absolute tolerance), integer and boolean ones at all (counts, indices,
    masks); or None. Either differs only where more than `CHECK_TOLERANCE` of its elements do."""
    for i, (a, b) in enumerate(zip(got, want)):
        where = f"{what} {i} of {len(want)} {tuple(b.shape)}"
        if b.is_complex():
            continue
        if a.shape != b.shape:
            return f"{where} has shape {tuple(a.shape)} on onnxruntime"
        a = a.detach()
        problem = _float_difference(a, b, floor) if b.is_floating_point() else _exact_difference(a, b)
        if problem is not None:
            return f"{where} {problem}"
    return None


def _magnitude(t: torch.Tensor) -> float:
    """The largest magnitude of a non-empty float tensor; NaN where it holds one (aminmax: both then), inf where
    it holds one. One pass, 10x `abs().max()` here (GPT-2's 151 first gradients were compared in 4.2 s)."""
    low, high = torch.aminmax(t.detach())
    return max(-float(low), float(high))


def _float_difference(a: torch.Tensor, b: torch.Tensor, floor: float) -> str | None:
    """One float tensor's difference beyond rounding; where torch's is not finite (a NaN of a 0/0 it computes),
    anything goes."""
    if b.numel():  # the common case first: every element of a finite tensor within tolerance
        scale = _magnitude(b)
        if math.isfinite(scale) and _magnitude(a - b) <= CHECK_TOLERANCE * scale + floor:  # NaN: False
            return None
    finite = torch.isfinite(b)
    if not torch.isfinite(a)[finite].all():
        return "is not finite on onnxruntime where torch's is"
    if not finite.any():
        return None
    scale = float(b.abs().masked_fill(~finite, 0).max())
    off = (a - b).abs().masked_fill(~finite, 0)
    differing = int((off > CHECK_TOLERANCE * scale + floor).sum())
    if differing > CHECK_TOLERANCE * b.numel():
        return (f"differs by up to {float(off.max()):.3g} at {differing} of {b.numel()} elements "
                f"(torch's largest magnitude: {scale:.3g})")
    return None


def _exact_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Integers and booleans compare exactly: a count or an index off by one is the graph's error, while a near
    tie that rounding tips (an argmax, a comparison) moves few elements (`CHECK_TOLERANCE`)."""
    off = a != b
    differing = int(off.sum())
    if differing <= CHECK_TOLERANCE * b.numel():
        return None
    at = tuple(int(k) for k in off.nonzero()[0])
    return (f"differs at {differing} of {b.numel()} elements (at {at}: {a[at].item()} on onnxruntime, "
            f"{b[at].item()} in torch)")


GRADIENT_FLOOR = 1e-3
"""The gradient check's absolute tolerance, as a fraction of the largest gradient of the call (`mismatch`):
gradients zero by the math are rounding noise of the others, up to 3e-5 of the largest here (a bias before
cdist's product form, |a|^2 + |b|^2 - 2ab cancelling)."""

OUTPUT_FLOOR = 1e-5
"""The output check's absolute tolerance, as a fraction of the largest output element of the call: an output zero
by the math (the mean of a normalized activation, returned as a statistic next to the logits) is rounding noise
(~1e-9 here), which its own largest magnitude cannot scale."""


def _largest(tensors: Sequence[torch.Tensor]) -> float:
    """The largest finite magnitude of the float tensors."""
    return max((_finite_magnitude(t) for t in tensors if t.is_floating_point() and t.numel()), default=0.0)


def _finite_magnitude(t: torch.Tensor) -> float:
    """`_magnitude`, or where that is not finite, the largest finite magnitude (a pass more for the rare tensor)."""
    largest = _magnitude(t)
    return largest if math.isfinite(largest) else float(t.detach().abs().nan_to_num(0.0, 0.0, 0.0).max())


def gradients_mismatch(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> str | None:
    """`mismatch` for gradients: gradients zero by the math (a bias before a normalization) are rounding noise of
    the others, so the absolute tolerance is `GRADIENT_FLOOR` of the largest gradient of all."""
    return mismatch(got, want, "gradient", GRADIENT_FLOOR * _largest(want))


GradientCheck = Callable[[Sequence[torch.Tensor | None], list[torch.Tensor | None]], list[torch.Tensor | None]]
"""(incoming output gradients, onnxruntime's gradients) -> the gradients to hand to torch."""


def outputs_error(reference: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> ExportError | None:
    """The export's error where onnxruntime's outputs of the call that exported differ from torch's."""
    problem = next((f"output {i} of {len(reference)} {tuple(b.shape)} is {str(a.dtype)[6:]} on onnxruntime, "
                    f"{str(b.dtype)[6:]} in torch" for i, (a, b) in enumerate(zip(outputs, reference))
                    if a.dtype != b.dtype), None)
    if problem is not None:
        cause = ("The export computes it in another type than torch: a type promotion the exporter writes "
                 "otherwise; please report it with the module.")
    else:
        with torch.no_grad():
            problem = mismatch(outputs, reference, floor=OUTPUT_FLOOR * _largest(reference))
        cause = ("The graph does not compute what the module does: torch's tracer misses changes made in place "
                 "through a view (`x.view(...).relu_()`, `x.diagonal().fill_(v)`: write them out of place), and "
                 "some of the exporter's conversions are wrong.")
    if problem is None:
        return None
    return ExportError(f"onnxruntime's outputs of the call that exported the module differ from torch's: {problem}. "
                       f"{cause} ORTModule(module, check_export=False) skips this comparison.")


def _vjp(outputs: list[torch.Tensor], inputs: list[torch.Tensor], grads: list[torch.Tensor]
         ) -> tuple[torch.Tensor | None, ...]:
    """torch.autograd.grad(outputs, inputs, grads, allow_unused=True) without its argument checks, whose first call
    imports sympy (torch.fx's symbolic shapes: 0.4 s of a first step); the gradients come from backward, shaped."""
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:
        return torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
    return run(tuple(outputs), tuple(grads), False, False, tuple(inputs), True, accumulate_grad=False)


ROUNDING_FACTOR = 10.0
"""Where onnxruntime's first gradients differ from torch's, torch's float64 gradients of the call arbitrate: they
pass when each is as close to its float64 one, relatively in L2, as this many times the furthest of torch's own
float32 gradients is from its float64 one (and at least `KINK_TOLERANCE`). A ReLU whose input is within rounding
of 0 passes its gradient in one float32 run and not in the other, and a BatchNorm spreads that one element over
its channel, then every layer below: ResNet-18s on 32x32 images at batch 32 (six seeds), torch's float32
gradients were 0.6e-3 to 7.6e-3 from float64 in L2 (2e-2 to 6e-2 of a tensor's largest magnitude),
onnxruntime's 2e-6 to 4.4e-3, and three of the six had flipped a ReLU torch's had not: refused by the float32
comparison alone."""

KINK_TOLERANCE = 5e-2
"""The L2 distance from torch's float64 gradient, relative to its norm, that `ROUNDING_FACTOR`'s arbitration
allows any gradient, however close torch's float32 ones came: in those ResNets a ReLU only onnxruntime's run
flipped moved its gradients by up to 4.4e-3 where torch's had flipped few (0.6e-3); in a smaller one (16-64
channels on 16x16 images, batch 16) one pre-activation of 7e-7 flipped moved the first layer's weight gradient
by 1.8e-2, torch's float32 ones being 1e-6 from float64. What the check is for moves a gradient by its own
size (a dropped repeated index, a wrong rule: 10-100%)."""


class float32_draws(TorchDispatchMode):
    """torch's random ops drawing in float32 where they would draw in float64, their values cast up: the arbiter's
    float64 run of a call then takes the random numbers torch's float32 run of it drew from the same RNG state
    (randn_like, rand and normal_ draw other numbers in float64, consuming the generator otherwise; a Dropout's
    `bernoulli_(p)` draws the same masks either way). The ops are those torch tags as seeded random."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags or "out" in kwargs:
            return func(*args, **kwargs)
        copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # float32 copy's id: (copy, the float64 tensor)

        def to_float32(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dtype == torch.float64:
                made = value.float()
                copies[id(made)] = (made, value)
                return made
            return torch.float32 if value is torch.float64 else value

        converted = tree_map(to_float32, args), tree_map(to_float32, kwargs)
        result = func(*converted[0], **converted[1])
        for k, argument in enumerate(func._schema.arguments):  # what it fills in place (a fill's self, rrelu's noise)
            if argument.alias_info is not None and argument.alias_info.is_write:
                made = converted[0][k] if k < len(args) else converted[1].get(argument.name)
                if isinstance(made, torch.Tensor) and id(made) in copies:
                    copies[id(made)][1].copy_(made)

        def back(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            return copies[id(t)][1] if id(t) in copies else t.double() if t.dtype == torch.float32 else t

        return tree_map(back, result)


Float64Call = Callable[[], tuple[list[Any], list[torch.Tensor]]]
"""The call computed again by torch in float64 (`Engine.in_torch`): its flat outputs, and the tensors of `wrt`."""


def _float64_gradients(rerun: Float64Call, incoming: Sequence[torch.Tensor | None]
                       ) -> tuple[torch.Tensor | None, ...] | None:
    """torch's float64 gradients of the call for the incoming gradients; None where the module cannot run so (a
    float32 tensor it makes itself meeting a float64 one)."""
    try:
        outputs, inputs = rerun()
        pairs = [(o, g.double()) for o, g in zip(outputs, incoming)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]
        if not pairs:
            return None
        return torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
    except Exception:  # whatever the module's own code raises in float64
        return None


def _within_rounding(ours: Sequence[torch.Tensor], theirs: Sequence[torch.Tensor],
                     exact: Sequence[torch.Tensor | None]) -> tuple[bool, str]:
    """Whether onnxruntime's gradients are within float32 rounding of torch's float64 ones, as far as torch's own
    float32 ones are (`ROUNDING_FACTOR`); and the largest relative distances of each, for the message."""
    trios = [(o.double(), t.double(), e.to_dense() if e.is_sparse else e) for o, t, e in zip(ours, theirs, exact)
             if e is not None and e.is_floating_point() and e.numel()]
    largest = max((float(e.abs().nan_to_num(0.0, 0.0, 0.0).max()) for _, _, e in trios), default=0.0)

    def relative(a: torch.Tensor, e: torch.Tensor) -> float:
        """L2 distance over e's norm, or over `GRADIENT_FLOOR` of the largest gradient an element where e is zero
        by the math (a bias before a BatchNorm), whose rounding noise is no distance. Infinite where a is not finite
        and e is: no rounding does that (the NaNs were read as no distance, and NaN gradients passed)."""
        if not bool(torch.isfinite(a)[torch.isfinite(e)].all()):
            return math.inf
        norm = max(float(e.nan_to_num(0.0, 0.0, 0.0).norm()), GRADIENT_FLOOR * largest * e.numel() ** 0.5)
        return float((a - e).nan_to_num(0.0, 0.0, 0.0).norm()) / norm if norm else 0.0

    noise = max((relative(t, e) for _, t, e in trios), default=0.0)
    allowed = max(ROUNDING_FACTOR * noise, KINK_TOLERANCE)
    ours_off = [relative(o, e) for o, _, e in trios]
    passes = all(off <= allowed for off in ours_off)
    worst = max(ours_off, default=0.0)
    return passes, (f"from torch's float64 gradients of the call, onnxruntime's are up to {worst:.3g} apart "
                    f"relatively in L2, torch's float32 ones {noise:.3g}")


def _or_zeros(gradients: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Zeros where a gradient is None (made for those alone: a model's worth of zeros was 0.15 s of GPT-2's
    first step)."""
    return [g if g is not None else torch.zeros_like(t) for g, t in zip(gradients, like)]


def gradient_check(reference: Sequence[torch.Tensor], wrt: Sequence[torch.Tensor],
                   refuse: Callable[[ExportError], None], hooks: Sequence[str] = (),
                   float64: Float64Call | None = None) -> GradientCheck:
    """The first backward's check: torch's gradients of the traced outputs for the same incoming gradients against
    onnxruntime's. Where they differ, `refuse` (raises, or with fallback lets this step hand torch's gradients).
    Skipped where torch cannot differentiate its trace any more (a tensor it saved changed in place since), and
    where a tensor receiving gradients has hooks (`register_hook`): torch's gradients of the trace would pass
    through them, so they would run twice and differ from onnxruntime's by what they do. `hooks`: the module's
    backward hooks, which torch's gradients pass through and onnxruntime's cannot (named as the cause). `float64`:
    the call again in float64, the arbiter where they differ (`ROUNDING_FACTOR`)."""
    def check(incoming: Sequence[torch.Tensor | None], ours: list[torch.Tensor | None]
              ) -> list[torch.Tensor | None]:
        pairs = [(r, g) for r, g in zip(reference, incoming) if g is not None and r.requires_grad]
        if not pairs or any(t._backward_hooks for t in wrt):
            return ours
        try:
            theirs = _vjp([r for r, _ in pairs], list(wrt), [g for _, g in pairs])
        except RuntimeError:
            return ours
        theirs = [t.to_dense() if t is not None and t.is_sparse else t for t in theirs]  # sparse embeddings
        want, got = _or_zeros(theirs, wrt), _or_zeros(ours, wrt)
        with torch.no_grad():
            problem = gradients_mismatch(got, want)
        if problem is None:
            return ours
        arbiter = ""
        exact = _float64_gradients(float64, incoming) if float64 is not None and not hooks else None
        if exact is not None:
            with torch.no_grad():
                close, arbiter = _within_rounding(got, want, exact)
            if close:
                return ours
            arbiter = f" ({arbiter})"
        if hooks:
            cause = (f"The module has {', '.join(hooks)}, which changed torch's gradients: onnxruntime computes them "
                     "in one graph, where no hook can run. Put such a hook on the ORTModule's inputs or outputs or "
                     "on a parameter (param.register_hook), where it runs, or run the module in torch.")
        else:
            cause = ("Where float rounding alone moves this module's gradients that much (torch's own differ so "
                     "between two runs of slightly different weights), ORTModule(module, check_export=False) skips "
                     "the comparison; otherwise please report it with the module.")
        refuse(ExportError(f"onnxruntime's gradients of the call that exported the module differ from torch's: "
                           f"{problem}{arbiter}. {cause}"))
        return list(theirs)

    return check
