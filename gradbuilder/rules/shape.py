"""Shape and layout ops: their gradients move, sum or cut the output gradient back into the input's layout.

Shapes come from `g.shape_of` (a constant when static, else a Shape computed in the forward part), so none
of these rules stashes a float tensor; a view's gradient reshapes to `g.reshape_target`, a constant with -1
when a single dim is symbolic, so it stashes nothing at all.
"""

from __future__ import annotations

import numpy as np

from .context import Grad
from .indexing import arange, as_tensor, axis_adjoint, dims_of, int64, nonneg, size_along, zeros
from .registry import rule


def _back_to_shape(g: Grad):
    """Views (Reshape, Flatten, Squeeze, Unsqueeze): the gradient is the output gradient in x's shape."""
    return (g.reshape_like(g.GO(0), g.I(0)),)


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
    dy, axis = g.GO(0), g.axis_of(g.attr("axis"), g.O(0))
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
    return (g.Concat(*[g.GO_or_zeros(j) for j in outs], axis=g.axis_of(g.attr("axis", 0), g.I(0))),)


def _slice_axes(g: Grad, rank: int | None) -> list[int] | None:
    """The sliced axes, non-negative; None when they are only known at run time or the rank is unknown."""
    if rank is None:
        return None
    if g.I(3) is None:
        starts = g.const_input(1)
        n = len(starts) if starts is not None else (g.info(g.I(1)).shape or (None,))[0]
        if isinstance(n, int) and n > rank:
            g.fail(f"it has {n} starts and no axes, so it slices axes 0 to {n - 1} of an input of rank {rank}")
        return list(range(n)) if isinstance(n, int) else None
    axes = g.const_input(3)
    return None if axes is None else [g.axis(a, rank, "axes value") for a in axes.ravel()]


def _unit_steps(g: Grad) -> bool:
    steps = g.const_input(4)
    return g.I(4) is None or (steps is not None and bool(np.all(steps == 1)))


def _slice_pads(g: Grad, axes: list[int], rank: int) -> str:
    """Pads putting a step-1 slice back in place: begin = the clamped start, end = what is left after the
    slice. Numbers when starts, ends and the sliced sizes are static, else computed at run time."""
    x, dy = g.I(0), g.GO(0)
    shape, starts, ends = g.info(x).shape, g.const_input(1), g.const_input(2)
    if starts is not None and ends is not None and all(isinstance(shape[a], int) for a in axes):
        pads = [0] * (2 * rank)
        for a, s, e in zip(axes, starts.ravel().tolist(), ends.ravel().tolist()):
            d = shape[a]
            s = min(max(s + d if s < 0 else s, 0), d)
            e = min(max(e + d if e < 0 else e, 0), d)
            pads[a], pads[a + rank] = s, d - max(e, s)
        return g.ints(pads)
    d = dims_of(g, x, axes)
    begin = g.Min(g.Max(nonneg(g, int64(g, g.I(1)), d), g.ints(0)), d)
    end = g.Sub(g.Sub(d, begin), g.Gather(g.Shape(dy), g.ints(axes)))
    where = g.ints([*axes, *[a + rank for a in axes]])
    return g.ScatterElements(g.ints([0] * (2 * rank)), where, g.Concat(begin, end, axis=0), axis=0)


def _slice_input(g: Grad, i: int, k: int) -> str | None:
    """Entry k of Slice input i (starts, ends, steps) as a 1-element int64 tensor."""
    if g.I(i) is None:
        return None
    value = g.const_input(i)
    if value is not None:
        return g.ints([int(value.ravel()[k])])
    return int64(g, g.Gather(g.I(i), g.ints([k])))


def _slice_flat(g: Grad) -> str:
    """Any slice, even with run-time axes: slice a tensor of flat positions the same way and scatter the
    gradient there. Costs an int64 tensor the size of x, hence the last resort."""
    x, dy = g.I(0), g.GO(0)
    shape = g.shape_of(x)
    n = g.ReduceProd(shape, keepdims=1)
    picked = g.Slice(g.reshape_exact(arange(g, n), shape), *g.node.input[1:])  # x may hold no element
    flat = g.ScatterElements(zeros(g, n, x), g.Reshape(picked, g.ints([-1])), g.Reshape(dy, g.ints([-1])), axis=0)
    return g.reshape_exact(flat, shape)


@rule("Slice", nondiff=(1, 2, 3, 4))
def slice_(g: Grad):
    """Zeros with the gradient put back where the slice read. Step 1: one Pad. Other steps: per sliced
    axis, Slice 0..d-1 the same way (so ONNX's own clamping rules say which positions were read) and
    scatter there. Run-time axes: the flat-position fallback."""
    x, dy = g.I(0), g.GO(0)
    lengths: dict[str, int] = {}
    for i, what in ((1, "starts"), (2, "ends"), (3, "axes"), (4, "steps")):
        value = g.const_input(i) if g.I(i) is not None else None
        if value is not None and value.ndim != 1:
            g.fail(f"its {what} is a {value.ndim}-D constant; Slice takes a 1-D one, a value per sliced axis")
        if value is not None:
            lengths[what] = len(value)
    if len(set(lengths.values())) > 1:
        g.fail(f"its {' and '.join(f'{w} ({n})' for w, n in lengths.items())} differ in length; Slice takes one "
               "value of each per sliced axis")
    rank = g.rank(x)
    axes = _slice_axes(g, rank)
    if axes is None:
        return (_slice_flat(g),)
    if _unit_steps(g):
        return (g.Pad(dy, _slice_pads(g, axes, rank)),)
    t = dy
    for k, a in enumerate(axes):
        d = size_along(g, x, a)
        src = g.Slice(arange(g, d), _slice_input(g, 1, k), _slice_input(g, 2, k),
                      g.ints([0]), _slice_input(g, 4, k))
        t = axis_adjoint(g, t, a, rank, src, d, like=x, add=False)
    return (t,)


@rule("Tile", nondiff=(1,))
def tile(g: Grad):
    """View the gradient as [r0, d0, r1, d1, ...] and sum the repeat axes."""
    x, dy = g.I(0), g.GO(0)
    r = g.require_rank(x)
    reps = g.const_input(1)
    if r == 0 or (reps is not None and np.all(reps == 1)):
        return (dy,)
    static = g.info(x).static_shape
    if (reps is not None and not np.all(reps)) or (static is not None and not all(static)):
        # an empty output: zeros flow back, as torch's, read off dy so that it stays an output that takes a gradient
        # (no Reshape to a 0 size, which copies a size before opset 14)
        return (g.Expand(g.ReduceSum(dy, keepdims=0), g.shape_of(x)),)
    if reps is not None and static is not None:
        split = g.ints(np.stack([reps.ravel(), np.array(static, dtype=np.int64)], axis=1).ravel().tolist())
    else:
        pairs = g.Concat(g.unsqueeze(g.I(1), [1]), g.unsqueeze(g.shape_of(x), [1]), axis=1)
        split = g.Reshape(pairs, g.ints([-1]))
    # a repeat of 0 is a 0 of the split shape, not "x's size there" (refused past x's rank)
    return (g.reduce_sum(g.reshape_exact(dy, split), list(range(0, 2 * r, 2)), keepdims=False),)


@rule("Trilu", since=14, nondiff=(1,))
def trilu(g: Grad):
    """The same triangle of the gradient."""
    return (g.Trilu(g.GO(0), g.I(1), upper=int(g.attr("upper", 1))),)


def _axis_positions(g: Grad, x: str, a: int, pads: str, mode: str) -> tuple[str, int | str]:
    """Which input position along axis `a` each output position of a reflect/edge/wrap Pad reads:
    the same Pad applied to 0..d-1 (pads is that axis' [begin, end])."""
    d = size_along(g, x, a)
    return g.Pad(arange(g, d), pads, mode=mode), d


@rule("CenterCropPad", since=18, nondiff=(1,))
def center_crop_pad(g: Grad):
    """A centred crop or zero pad per axis: the crop's offset (size - target) // 2 is the pad's leading count the
    other way, so the adjoint is the same op taking dY back to x's sizes (cropping what was padded, padding what
    was cropped)."""
    x, dy = g.I(0), g.GO(0)
    axes = g.attr("axes")
    if axes is None:
        sizes = g.shape_of(x)
    else:
        r = g.require_rank(x)
        sizes = g.Gather(g.shape_of(x), g.ints([g.axis(a, r) for a in axes]))
    return (g.CenterCropPad(dy, sizes, axes=axes) if axes is not None else g.CenterCropPad(dy, sizes), None)


@rule("Pad", nondiff=(1, 2, 3))
def pad(g: Grad):
    """Constant mode: the adjoint is the Pad with negated pads (cropping what was added, zero-filling what
    was cropped). Other modes copy input elements to several places: the adjoint sums them back, one axis
    at a time (`indexing.axis_adjoint`)."""
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
        axes = [g.axis(a, r, "axes value") for a in axes_v.ravel()]
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
        t = axis_adjoint(g, t, a, r, src, d, like=x)
    return (t,)
