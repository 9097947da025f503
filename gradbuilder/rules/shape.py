"""Shape and layout ops: their gradients move, sum or cut the output gradient back into the input's layout.

Shapes come from `g.shape_of` (a constant when static, else a Shape computed in the forward part), so none
of these rules stashes a float tensor.
"""

from __future__ import annotations

import numpy as np

from .context import Grad
from .indexing import as_tensor, rows_adjoint, size_along, zeros
from .registry import rule


def _back_to_shape(g: Grad):
    """Views (Reshape, Flatten, Squeeze, Unsqueeze): the gradient is the output gradient in x's shape.
    allowzero keeps a genuine 0 in x's shape a 0 (opset 14+)."""
    return (g.Reshape(g.GO(0), g.shape_of(g.I(0)), allowzero=1 if g.opset >= 14 else None),)


for _op in ("Reshape", "Squeeze", "Unsqueeze"):
    rule(_op, nondiff=(1,))(_back_to_shape)
rule("Flatten")(_back_to_shape)


@rule("Transpose")
def transpose(g: Grad):
    perm = g.attr("perm", None)
    if perm is None:  # reversed axes: reversing again inverts it, whatever the rank
        return (g.Transpose(g.GO(0)),)
    return (g.Transpose(g.GO(0), perm=[int(p) for p in np.argsort(perm)]),)


@rule("Expand", nondiff=(1,))
def expand(g: Grad):
    return (g.unbroadcast(g.GO(0), like=g.I(0)),)


@rule("Concat")
def concat(g: Grad):
    """Cut the gradient back into the inputs' sizes along the axis: one Split when every input needs its
    part, else one Slice per input that does."""
    dy, axis = g.GO(0), int(g.attr("axis"))
    n = g.n_inputs
    if n == 1:
        return (dy,)
    sizes = [size_along(g, g.I(i), axis) for i in range(n)]
    if all(g.needs(i) for i in range(n)):
        if all(isinstance(s, int) for s in sizes):
            split = g.ints(sizes)
        else:
            split = g.Concat(*[as_tensor(g, s) for s in sizes], axis=0)
        return g.Split(dy, split, axis=axis, n_out=n)
    grads: list[str | None] = []
    start: int | str = 0
    for i, size in enumerate(sizes):
        if isinstance(start, int) and isinstance(size, int):
            end: int | str = start + size
        else:
            end = g.Add(as_tensor(g, start), as_tensor(g, size))
        grads.append(g.Slice(dy, as_tensor(g, start), as_tensor(g, end), g.ints([axis])) if g.needs(i) else None)
        start = end
    return grads


@rule("Split", nondiff=(1,))
def split(g: Grad):
    """Concat of the output gradients; outputs that get none contribute zeros."""
    outs = range(len(g.node.output))
    return (g.Concat(*[g.GO_or_zeros(j) for j in outs], axis=int(g.attr("axis", 0))),)


def _static_slice_pads(g: Grad) -> list[int] | None:
    """Pads that put a step-1 slice back in place, when starts/ends/axes and the sliced sizes are static."""
    x = g.I(0)
    shape = g.info(x).shape
    starts, ends = g.const_input(1), g.const_input(2)
    axes = g.const_input(3) if g.I(3) is not None else None
    steps = g.const_input(4) if g.I(4) is not None else None
    if shape is None or starts is None or ends is None or (g.I(3) is not None and axes is None):
        return None
    if g.I(4) is not None and (steps is None or np.any(steps != 1)):
        return None
    r = len(shape)
    axes = list(range(len(starts))) if axes is None else [int(a) % r for a in axes.ravel()]
    pads = [0] * (2 * r)
    for a, s, e in zip(axes, starts.ravel().tolist(), ends.ravel().tolist()):
        d = shape[a]
        if not isinstance(d, int):
            return None
        s = min(max(s + d if s < 0 else s, 0), d)
        e = min(max(e + d if e < 0 else e, 0), d)
        pads[a], pads[a + r] = s, d - max(e, s)
    return pads


@rule("Slice", nondiff=(1, 2, 3, 4))
def slice_(g: Grad):
    """Zeros with the gradient put back where the slice read. Static step-1 slices are one Pad; anything
    else (steps, run-time starts, dynamic sizes) slices a tensor of flat positions the same way and
    scatters the gradient to them, so ONNX's own clamping rules decide where it goes."""
    x, dy = g.I(0), g.GO(0)
    pads = _static_slice_pads(g)
    if pads is not None:
        return (g.Pad(dy, g.ints(pads)) if any(pads) else dy,)
    shape = g.shape_of(x)
    n = g.ReduceProd(shape, keepdims=0)
    positions = g.Reshape(g.Range(g.ints(0), n, g.ints(1)), shape)
    picked = g.Slice(positions, *g.node.input[1:])
    flat = g.ScatterElements(zeros(g, g.Reshape(n, g.ints([1])), x), g.Reshape(picked, g.ints([-1])),
                             g.Reshape(dy, g.ints([-1])), axis=0)
    return (g.Reshape(flat, shape),)


@rule("Tile", nondiff=(1,))
def tile(g: Grad):
    """View the gradient as [r0, d0, r1, d1, ...] and sum the repeat axes."""
    x, dy = g.I(0), g.GO(0)
    r = g.require_rank(x)
    reps = g.const_input(1)
    if r == 0 or (reps is not None and np.all(reps == 1)):
        return (dy,)
    static = g.info(x).static_shape
    if reps is not None and static is not None:
        split = g.ints(np.stack([reps.ravel(), np.array(static, dtype=np.int64)], axis=1).ravel().tolist())
    else:
        pairs = g.Concat(g.unsqueeze(g.I(1), [1]), g.unsqueeze(g.shape_of(x), [1]), axis=1)
        split = g.Reshape(pairs, g.ints([-1]))
    return (g.reduce_sum(g.Reshape(dy, split), list(range(0, 2 * r, 2)), keepdims=False),)


@rule("Trilu", since=14, nondiff=(1,))
def trilu(g: Grad):
    """The same triangle of the gradient."""
    return (g.Trilu(g.GO(0), g.I(1), upper=int(g.attr("upper", 1))),)


def _axis_positions(g: Grad, x: str, a: int, pads: str, mode: str) -> tuple[str, int | str]:
    """Which input position along axis `a` each output position of a reflect/edge/wrap Pad reads:
    the same Pad applied to 0..d-1 (pads is that axis' [begin, end])."""
    d = size_along(g, x, a)
    n = g.ints(d) if isinstance(d, int) else g.squeeze(d, [0])
    return g.Pad(g.Range(g.ints(0), n, g.ints(1)), pads, mode=mode), d


@rule("Pad", nondiff=(1, 2, 3))
def pad(g: Grad):
    """Constant mode: the adjoint is the Pad with negated pads (cropping what was added, zero-filling what
    was cropped). Other modes copy input elements to several places: the adjoint sums them back, one axis
    at a time (`indexing.rows_adjoint`)."""
    x, dy, pads_in, axes_in = g.I(0), g.GO(0), g.I(1), g.I(3)
    mode = g.attr("mode", "constant")
    pads = g.const_input(1)
    if mode == "constant":
        neg = g.ints((-pads).tolist()) if pads is not None else g.Neg(pads_in)
        return (g.Pad(dy, neg, None, axes_in) if axes_in else g.Pad(dy, neg),)
    r = g.require_rank(x)
    if axes_in is None:
        axes = list(range(r))
    else:
        axes_v = g.const_input(3)
        if axes_v is None:
            g.fail(f"Pad in {mode} mode with axes computed at run time is not supported; make the axes a constant")
        axes = [int(a) % r for a in axes_v.ravel()]
    k = len(axes)
    t = dy
    for i, a in enumerate(axes):
        if pads is not None and pads[i] == 0 and pads[i + k] == 0:
            continue
        if pads is not None:
            axis_pads = g.ints([int(pads[i]), int(pads[i + k])])
        else:
            axis_pads = g.Gather(pads_in, g.ints([i, i + k]))
        src, d = _axis_positions(g, x, a, axis_pads, mode)
        front = [a, *[j for j in range(r) if j != a]]
        moved = g.Transpose(t, perm=front) if a else t
        summed = rows_adjoint(g, g.Flatten(moved, axis=1), src, d, like=x)
        rest = g.Slice(g.Shape(moved), g.ints([1]), g.ints([r]))
        summed = g.Reshape(summed, g.Concat(as_tensor(g, d), rest, axis=0))
        t = g.Transpose(summed, perm=[int(p) for p in np.argsort(front)]) if a else summed
    return (t,)
