"""Resampling and rearranging: Resize, DepthToSpace, SpaceToDepth, Col2Im, GridSample, AffineGrid.

Resize is linear in X and separable: along each resized axis, output position o is a weighted sum of input
positions, with weights that depend only on that axis' sizes, scale and roi and on the node's attributes. The
rule asks Resize itself for them: the same Resize applied to an identity matrix, along one axis, gives the
[m, n] matrix F with Y = F X along that axis, whatever the mode, coordinate transformation, rounding, cubic
coefficient, exclude_outside or antialias; then dX = F^T dY, one MatMul per resized axis. Nearest modes read
each output position's source index instead (the same Resize of 0..n-1) and scatter-add dY there. With
static sizes those small Resizes only read constants, so onnxruntime folds them when the session starts.
The matrices are dense, [m, n] per axis: fine for feature maps, quadratic in the side of large images.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from ..graph import KNOWN_TYPES
from .context import Grad
from .indexing import as_tensor, axis_adjoint, size_along, zeros
from .registry import rule

Entry = Any
"""One entry of a folded 1-D tensor: a number, or (tensor, axis) for a dim that a Shape node read."""


# --- build-time values of small shape computations ------------------------------------------------------
def _folded(g: Grad, i: int) -> list[Entry] | None:
    """Input i of g's node as a list of entries when constants and Shape/Slice/Gather/Concat/Cast of them
    give it (what the exporters emit for Resize's scales and sizes), else None."""
    value = g.const_input(i)
    if value is not None:
        return value.ravel().tolist()
    fg = g.em.fg
    k = fg.producer.get(g.I(i) or "")
    if k is None:
        return None
    p = Grad(g.em, fg.nodes[k], (), ())
    op = p.op_type
    if op == "Shape":
        x = p.I(0)
        shape = p.info(x).shape
        if shape is None:
            return None
        lo, hi, _ = slice(p.attr("start", 0), p.attr("end", len(shape))).indices(len(shape))
        return [shape[a] if isinstance(shape[a], int) else (x, a) for a in range(lo, hi)]
    if op == "Concat":
        parts = [_folded(p, j) for j in range(p.n_inputs)]
        return None if any(v is None for v in parts) else [e for v in parts for e in v]  # type: ignore[union-attr]
    vals = _folded(p, 0)
    if vals is None:
        return None
    if op in ("Identity", "Squeeze", "Unsqueeze", "Reshape"):
        return vals
    if op == "Cast":
        to = int(p.attr("to"))
        if to not in KNOWN_TYPES:
            return None
        kind = float if helper.tensor_dtype_to_np_dtype(to).kind == "f" else int
        return [e if isinstance(e, tuple) else kind(e) for e in vals]
    if op == "Gather" and int(p.attr("axis", 0)) == 0 and (index := p.const_input(1)) is not None:
        return [vals[int(j)] for j in index.ravel()]
    if op == "Slice" and _first_axis(p):
        starts, ends, steps = p.const_input(1), p.const_input(2), p.const_input(4)
        if starts is None or ends is None or (p.I(4) is not None and steps is None):
            return None
        step = 1 if steps is None else int(steps.ravel()[0])
        return vals[slice(int(starts.ravel()[0]), int(ends.ravel()[0]), step)]
    return None


def _first_axis(p: Grad) -> bool:
    """A Slice of a 1-D tensor: its axes input, if any, names axis 0."""
    axes = p.const_input(3)
    return p.I(3) is None or (axes is not None and int(axes.ravel()[0]) in (0, -1))


# --- Resize ---------------------------------------------------------------------------------------
RESIZE_COPIED = ("mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a", "exclude_outside",
                 "antialias")
"""The attributes the per-axis Resizes share with the forward node (not axes, keep_aspect_ratio_policy, or
extrapolation_value, whose extrapolated outputs do not depend on X: 0 in the weights)."""


@dataclass(frozen=True)
class _Axis:
    """One resized axis: its position in x, its entry in scales/sizes/roi, and the 1-D scales or sizes a
    Resize of a tensor along it takes (a number, or a 1-element tensor computed at run time)."""

    axis: int
    k: int
    scale: float | str | None
    size: int | str | None


class _ResizePlan:
    def __init__(self, g: Grad):
        self.g = g
        x = g.I(0)
        self.x = x
        self.rank = g.require_rank(x)
        self.axes = [int(a) % self.rank for a in g.attr("axes", range(self.rank))]
        self.mode = g.attr("mode", "nearest")
        self.transform = g.attr("coordinate_transformation_mode", "half_pixel")
        self.crop = self.transform == "tf_crop_and_resize"
        scales, known = g.I(2), g.const_input(2)
        if scales is not None and (g.info(scales).shape == (0,) or (known is not None and known.size == 0)):
            scales = None  # an empty scales tensor next to sizes (the opset 11 form, still exported)
        self.scales = scales
        self.sizes = g.I(3) if scales is None else None
        if self.scales is None and self.sizes is None:
            g.fail("neither scales nor sizes is given")
        self.values = _folded(g, 2 if scales is not None else 3)
        self.roi = _folded(g, 1) if self.crop and g.I(1) is not None else None
        if self.crop and g.I(1) is not None and self.roi is None:
            g.fail("tf_crop_and_resize with a roi computed at run time is not supported; make the roi a constant")

    def _roi_trivial(self, k: int) -> bool:
        if not self.crop:
            return True
        n = len(self.axes)
        return self.roi is None or (self.roi[k] == 0 and self.roi[k + n] == 1)

    def resized(self) -> list[_Axis]:
        """The axes the node resizes, each with the 1-D scales or sizes that resize one tensor along it the
        same way; axes that provably keep their size and mapping are left out."""
        policy = self.g.attr("keep_aspect_ratio_policy", "stretch")
        if self.sizes is not None and policy != "stretch":
            return self._keep_aspect(policy)
        out = []
        for k, a in enumerate(self.axes):
            e = self.values[k] if self.values is not None else None
            if self.scales is not None:
                if e == 1 and self._roi_trivial(k):
                    continue
                out.append(_Axis(a, k, float(e) if isinstance(e, (int, float)) else None, None))
                continue
            n = (self.g.info(self.x).shape or [None] * self.rank)[a]
            if (e == (self.x, a) or (isinstance(e, int) and e == n)) and self._roi_trivial(k):
                continue
            out.append(_Axis(a, k, None, int(e) if isinstance(e, int) else None))
        return out

    def _keep_aspect(self, policy: str) -> list[_Axis]:
        """not_larger / not_smaller: one scale for all axes (min / max of the size ratios, in float as
        onnxruntime does) and sizes rounded from it. A Resize by that scale gives the same mapping but
        truncates the size, so the rule needs the two to agree, which it checks at build time."""
        shape = self.g.info(self.x).shape
        dims = [shape[a] if shape is not None else None for a in self.axes]
        if self.values is None or not all(isinstance(v, int) for v in [*self.values, *dims]):
            self.g.fail(f"keep_aspect_ratio_policy={policy} needs constant sizes and static resized dims")
        ratios = [np.float32(v) / np.float32(n) for v, n in zip(self.values, dims)]  # type: ignore[arg-type]
        s = np.float32(min(ratios) if policy == "not_larger" else max(ratios))
        out = []
        for k, (a, n) in enumerate(zip(self.axes, dims)):
            m = int(np.floor(s * np.float32(n) + np.float32(0.5)))
            if int(s * np.float32(n)) != m:
                self.g.fail(f"keep_aspect_ratio_policy={policy} rounds axis {a} to {m} while the scale {s} "
                            f"gives {int(s * np.float32(n))} positions; no Resize reproduces its weights")
            if s != 1 or not self._roi_trivial(k):
                out.append(_Axis(a, k, float(s), None))
        return out

    # --- what one axis' small Resize takes -------------------------------------------------------------
    def _per_axis_inputs(self, ax: _Axis, n: int | str, two_d: bool) -> list[str | None]:
        """roi, scales and sizes for a Resize of an [n] (or [n, n], the second axis kept) tensor along ax."""
        g = self.g
        roi = None
        if self.crop and self.roi is not None:
            lo, hi = self.roi[ax.k], self.roi[ax.k + len(self.axes)]
            roi = g.em.const(np.array([lo, 0.0, hi, 1.0] if two_d else [lo, hi]), TensorProto.FLOAT)
        kept = [1.0] if two_d else []
        if ax.scale is not None:
            return [roi, g.em.const(np.array([ax.scale, *kept]), TensorProto.FLOAT)]
        if self.scales is not None:
            scale = g.Gather(self.scales, g.ints([ax.k]))
            return [roi, g.Concat(scale, g.em.const(np.array(kept), TensorProto.FLOAT), axis=0) if two_d else scale]
        size = g.ints([ax.size]) if ax.size is not None else g.Gather(self.sizes, g.ints([ax.k]))
        return [roi, None, g.Concat(size, as_tensor(g, n), axis=0) if two_d else size]

    def _resize(self, t: str, inputs: Sequence[str | None]) -> str:
        attrs = {name: self.g.attr(name) for name in RESIZE_COPIED if self.g.attr(name) is not None}
        return self.g.Resize(t, *inputs, **attrs)

    def weights(self, ax: _Axis) -> str:
        """F [m, n] (float): row o holds the weight of each input position in output position o."""
        g = self.g
        n = size_along(g, self.x, ax.axis)
        square = g.ints([n, n]) if isinstance(n, int) else g.Concat(n, n, axis=0)
        eye = g.EyeLike(g.ConstantOfShape(square))  # not an n*n initializer: onnxruntime folds it at load
        return self._resize(eye, self._per_axis_inputs(ax, n, two_d=True))

    def sources(self, ax: _Axis) -> str:
        """Nearest modes: the input position each output position copies (int64 [m])."""
        g = self.g
        n = size_along(g, self.x, ax.axis)
        if isinstance(n, int):
            positions = g.em.const(np.arange(n), TensorProto.FLOAT)
        else:
            positions = g.Cast(g.Range(g.ints(0), g.squeeze(n, [0]), g.ints(1)), to=TensorProto.FLOAT)
        picked = self._resize(positions, self._per_axis_inputs(ax, n, two_d=False))
        return g.Cast(picked, to=TensorProto.INT64)


def _contract(g: Grad, t: str, f: str, axis: int, rank: int) -> str:
    """t with its `axis` (of size m) replaced by sum_o t[..., o, ...] f[o, i] (f is [m, n])."""
    if axis == rank - 1:
        return g.MatMul(t, f)
    if axis == rank - 2:
        return g.MatMul(g.Transpose(f, perm=[1, 0]), t)
    perm = [j for j in range(rank) if j != axis] + [axis]
    moved = g.MatMul(g.Transpose(t, perm=perm), f)
    return g.Transpose(moved, perm=[int(p) for p in np.argsort(perm)])


@rule("Resize", since=13, nondiff=(1, 2, 3))
def resize(g: Grad):
    """dX = the transposed interpolation, axis by axis (see the module docstring)."""
    plan = _ResizePlan(g)
    x, t = plan.x, g.GO(0)
    nearest = plan.mode == "nearest" and not plan.crop and not int(g.attr("antialias", 0))
    for ax in reversed(plan.resized()):
        if nearest:
            t = axis_adjoint(g, t, ax.axis, plan.rank, plan.sources(ax), size_along(g, x, ax.axis), like=x)
            continue
        f = plan.weights(ax)
        if g.dtype(x) != TensorProto.FLOAT:
            f = g.cast_like(f, x)
        t = _contract(g, t, f, ax.axis, plan.rank)
    return (t,)


# --- rearranging ----------------------------------------------------------------------------------
def _blocksize(g: Grad) -> int:
    return int(g.attr("blocksize"))


@rule("SpaceToDepth")
def space_to_depth(g: Grad):
    """A permutation whose inverse is DepthToSpace in the same order (DCR, or from opset 28 its `mode`)."""
    return (g.DepthToSpace(g.GO(0), blocksize=_blocksize(g), mode=g.attr("mode", "DCR")),)


@rule("DepthToSpace")
def depth_to_space(g: Grad):
    """DCR: SpaceToDepth is the inverse permutation. CRD reads channel c*b*b + k where DCR reads
    k*C' + c: SpaceToDepth, then that channel permutation undone."""
    x, b = g.I(0), _blocksize(g)
    back = g.SpaceToDepth(g.GO(0), blocksize=b)
    if g.attr("mode", "DCR") == "DCR":
        return (back,)
    channels = size_along(g, x, 1)
    per_block = (g.ints([channels // (b * b)]) if isinstance(channels, int)
                 else g.Div(channels, g.ints([b * b])))
    grouped = g.Reshape(back, g.Concat(g.ints([0, b * b]), per_block, g.ints([-1]), axis=0))
    return (g.reshape_like(g.Transpose(grouped, perm=[0, 2, 1, 3]), x),)


@rule("Col2Im", since=18, nondiff=(1, 2))
def col2im(g: Grad):
    """The adjoint of Col2Im is im2col: a Conv of each channel of dY with one one-hot kernel per block
    position, which puts block position k of sliding window l at [n, c*K + k, l]."""
    x, dy = g.I(0), g.GO(0)
    image, block = g.const_input(1), g.const_input(2)
    if image is None or block is None:
        g.fail("image_shape and block_shape must be constants")
    image, block = [int(v) for v in image.ravel()], [int(v) for v in block.ravel()]  # type: ignore[union-attr]
    nd, taps = len(block), int(np.prod(block))
    kernel = g.const(np.eye(taps).reshape(taps, 1, *block), like=x)
    per_channel = g.Reshape(dy, g.ints([-1, 1, *image]))
    cols = g.Conv(per_channel, kernel, kernel_shape=block, strides=list(g.attr("strides", [1] * nd)),
                  dilations=list(g.attr("dilations", [1] * nd)), pads=list(g.attr("pads", [0] * 2 * nd)))
    return (g.reshape_like(cols, x), None, None)


# --- GridSample ------------------------------------------------------------------------------------------
_GRID_MODES = {"bilinear": "linear", "linear": "linear", "bicubic": "cubic", "cubic": "cubic", "nearest": "nearest"}
"""GridSample's modes by their names before opset 20 and after (the same interpolations)."""
_CUBIC_A = -0.75
"""The cubic convolution coefficient of torch's bicubic sampling and of GridSample's cubic mode."""


@dataclass
class _Tap:
    """One input position an output reads along one spatial axis: its coordinate (float, integral), its weight
    and the weight's derivative with respect to the sampled position (None: the weight is 1, the derivative 0)."""

    coord: str
    weight: str | None
    slope: str | None


def _unnormalize(g: Grad, coord: str, size: str, align: bool, like: str) -> tuple[str, str]:
    """(the input position a normalised grid coordinate in [-1, 1] reads, d position / d coordinate), as torch's
    grid_sampler: align_corners maps -1 and 1 to the first and last positions' centres, else to the outer edges."""
    one, half = g.const(1.0, like=like), g.const(0.5, like=like)
    if align:
        scale = g.Mul(g.Sub(size, one), half)
        return g.Mul(g.Add(coord, one), scale), scale
    scale = g.Mul(size, half)
    return g.Mul(g.Sub(g.Mul(g.Add(coord, one), size), one), half), scale


def _clip(g: Grad, pos: str, size: str, like: str, strict: bool = False) -> tuple[str, str]:
    """(pos clipped into [0, size - 1], whether it was inside (bool); `like`: a forward tensor of pos' type).
    `strict` counts the borders themselves as outside, as torch's clip_coordinates_set_grad does for the
    gradient of padding (a grid point exactly on the first or last centre gets none)."""
    zero, last = g.const(0.0, like=like), g.Sub(size, g.const(1.0, like=like))
    above, below = ("Greater", "Less") if strict else ("GreaterOrEqual", "LessOrEqual")
    inside = g.And(g.op(above, pos, zero), g.op(below, pos, last))
    return g.Min(g.Max(pos, zero), last), inside


def _reflect(g: Grad, pos: str, size: str, align: bool, like: str) -> tuple[str, str]:
    """(pos reflected off the input's edges, d reflected / d pos: +-1), as torch's reflect_coordinates: about the
    first and last centres with align_corners, else about the outer edges; a single position with align_corners
    has no span to reflect in (position 0, derivative 0)."""
    one, two, zero = (g.const(v, like=like) for v in (1.0, 2.0, 0.0))
    low = zero if align else g.const(-0.5, like=like)
    span = g.Sub(size, one) if align else size
    spans = g.Cast(g.Greater(span, zero), to=g.dtype(like))
    span = g.Max(span, one)  # a span of 0 reflects nothing: masked below
    d = g.Sub(pos, low)
    a = g.Abs(d)
    extra = g.Mod(a, span, fmod=1)
    odd = g.Mod(g.Floor(g.Div(a, span)), two, fmod=1)  # 1.0 on odd flips, where the position runs backwards
    flip = g.Sub(one, g.Mul(two, odd))
    out = g.Add(g.Add(extra, low), g.Mul(odd, g.Sub(span, g.Mul(two, extra))))
    sign = g.Sub(one, g.Mul(two, g.Cast(g.Less(d, zero), to=g.dtype(like))))
    return g.Mul(out, spans), g.Mul(g.Mul(sign, flip), spans)


def _padded(g: Grad, pos: str, size: str, padding: str, align: bool, like: str) -> tuple[str, str | None]:
    """(pos under border or reflection padding, d padded / d pos; None for zeros padding, which leaves pos)."""
    if padding == "zeros":
        return pos, None
    mult = None
    if padding == "reflection":
        pos, mult = _reflect(g, pos, size, align, like)
    pos, inside = _clip(g, pos, size, like, strict=True)
    inside = g.Cast(inside, to=g.dtype(like))
    return pos, inside if mult is None else g.Mul(mult, inside)


def _cubic_taps(g: Grad, pos: str, like: str) -> list[_Tap]:
    """The four positions around pos and their cubic convolution weights (Keys', a = -0.75) with derivatives."""
    a = _CUBIC_A
    base = g.Floor(pos)
    t = g.Sub(pos, base)
    one, two = g.const(1.0, like=like), g.const(2.0, like=like)

    def poly(x: str, coeffs: Sequence[float]) -> str:  # Horner: coeffs from the highest power
        acc = g.const(coeffs[0], like=like)
        for c in coeffs[1:]:
            acc = g.Add(g.Mul(acc, x), g.const(c, like=like))
        return acc

    outer, inner = (a, -5 * a, 8 * a, -4 * a), (a + 2, -(a + 3), 0.0, 1.0)
    d_outer, d_inner = (3 * a, -10 * a, 8 * a), (3 * (a + 2), -2 * (a + 3), 0.0)
    taps = []
    for k, (x, coeffs, slopes, sign) in enumerate([(g.Add(t, one), outer, d_outer, 1.0), (t, inner, d_inner, 1.0),
                                                   (g.Sub(one, t), inner, d_inner, -1.0),
                                                   (g.Sub(two, t), outer, d_outer, -1.0)]):
        slope = poly(x, slopes)
        coord = g.Add(base, g.const(float(k - 1), like=like)) if k != 1 else base
        taps.append(_Tap(coord, poly(x, coeffs), slope if sign > 0 else g.Neg(slope)))
    return taps


@rule("GridSample", since=16)
def grid_sample(g: Grad):
    """Sampling of X [N, C, D1..Dr] at grid [N, O1..Or, r] (its last axis: the coordinate of Dr first), linear
    (bilinear, trilinear), nearest or cubic, with zeros, border or reflection padding, as torch's grid_sampler.
    Each output is a weighted sum of input elements at taps around its position, a product of one weight per axis
    (linear: (1 - f, f); cubic: Keys' four; nearest: the rounded position, weight 1). dX scatter-adds dY times the
    weights to the taps (those outside the input read nothing); d grid is, per axis, the sum over taps of the
    channels' dY * X there times that axis' weight derivative and the other axes' weights, times d position /
    d coordinate. Linear and nearest pad the position (border clips it, reflection folds it back), cubic pads each
    tap, as torch does; nearest is piecewise constant in the grid, whose gradient is then zeros, as torch's."""
    x, grid, dy = g.I(0), g.I(1), g.GO(0)
    named = g.attr("mode", "bilinear" if g.opset < 20 else "linear")
    mode, padding = _GRID_MODES.get(named), g.attr("padding_mode", "zeros")
    if mode is None or padding not in ("zeros", "border", "reflection"):
        g.fail(f"mode='{named}', padding_mode='{padding}' has no gradient rule")
    r = g.require_rank(x) - 2
    align = bool(g.attr("align_corners", 0))
    like = g.dtype(x)
    shape = g.shape_of(x)
    sizes = [g.Gather(shape, g.ints([2 + axis])) for axis in range(r)]
    taps: list[list[_Tap]] = []  # per axis of X
    scales: list[str] = []  # d position / d coordinate, per axis
    for axis in range(r):
        k = r - 1 - axis  # the grid's coordinate of this axis
        coord = g.Squeeze(g.Slice(grid, g.ints([k]), g.ints([k + 1]), g.ints([r + 1])), g.ints([r + 1]))
        size = g.Cast(sizes[axis], to=like)
        pos, scale = _unnormalize(g, coord, size, align, x)
        if mode == "cubic":
            axis_taps = _cubic_taps(g, pos, x)
            if padding != "zeros":
                axis_taps = [_Tap(_padded(g, t.coord, size, padding, align, x)[0], t.weight, t.slope)
                             for t in axis_taps]
        else:
            pos, mult = _padded(g, pos, size, padding, align, x)
            scale = scale if mult is None else g.Mul(scale, mult)
            if mode == "nearest":  # half to even, as torch's nearbyint
                axis_taps = [_Tap(g.Round(pos), None, None)]
            else:
                one = g.const(1.0, like=x)
                base = g.Floor(pos)
                f = g.Sub(pos, base)
                axis_taps = [_Tap(base, g.Sub(one, f), g.const(-1.0, like=x)), _Tap(g.Add(base, one), f, one)]
        taps.append(axis_taps)
        scales.append(scale)
    floats = [g.Cast(n, to=like) for n in sizes]
    corners = []  # (flat index [N, 1, P] int64, in-bounds mask [N, 1, P], the corner's taps)
    for combo in itertools.product(*taps):
        flat = inside = None
        for axis, tap in enumerate(combo):
            clipped, within = _clip(g, tap.coord, floats[axis], x)
            index = g.Cast(clipped, to=TensorProto.INT64)  # integers held exactly
            inside = within if inside is None else g.And(inside, within)
            flat = index if flat is None else g.Add(g.Mul(flat, sizes[axis]), index)
        flat = g.Reshape(flat, g.ints([0, 1, -1]))
        valid = g.Reshape(g.Cast(inside, to=like), g.ints([0, 1, -1]))
        corners.append((flat, valid, combo))
    dy_flat = g.Reshape(dy, g.ints([0, 0, -1]))  # [N, C, P]
    expand_to = g.Shape(dy_flat)
    dx = dgrid = None
    if g.needs(0):
        indices, values = [], []
        for flat, valid, combo in corners:
            weights = [t.weight for t in combo if t.weight is not None]
            weight = valid
            if weights:
                weight = g.Mul(g.Reshape(functools.reduce(g.Mul, weights), g.ints([0, 1, -1])), valid)
            indices.append(g.Expand(flat, expand_to))
            values.append(g.Mul(dy_flat, weight))
        planes = g.Concat(g.Slice(shape, g.ints([0]), g.ints([2])),
                          g.ReduceProd(g.Slice(shape, g.ints([2]), g.ints([r + 2])), keepdims=1), axis=0)
        summed = g.ScatterElements(zeros(g, planes, x), g.Concat(*indices, axis=2), g.Concat(*values, axis=2), axis=2,
                                   reduction="add")
        dx = g.Reshape(summed, shape)
    if g.needs(1) and mode == "nearest":
        dgrid = g.zeros_like(grid)
    elif g.needs(1):
        x_flat = g.Reshape(x, g.ints([0, 0, -1]))  # [N, C, prod(D)]
        out_shape = g.Shape(taps[0][0].weight)  # [N, O1..Or]
        per_axis: list[str | None] = [None] * r
        for flat, valid, combo in corners:
            v = g.ReduceSum(g.Mul(g.Mul(g.GatherElements(x_flat, g.Expand(flat, expand_to), axis=2), valid),
                                  dy_flat), g.ints([1]), keepdims=0)  # [N, P]: sum over C of dY * the tap's value
            v = g.Reshape(v, out_shape)
            for axis in range(r):
                factors = [combo[axis].slope] + [t.weight for b, t in enumerate(combo) if b != axis]
                term = functools.reduce(g.Mul, factors, v)
                per_axis[axis] = term if per_axis[axis] is None else g.Add(per_axis[axis], term)
        parts = [g.Unsqueeze(g.Mul(per_axis[r - 1 - k], scales[r - 1 - k]), g.ints([r + 1])) for k in range(r)]
        dgrid = g.Concat(*parts, axis=r + 1) if r > 1 else parts[0]
    return (dx, dgrid)


# --- AffineGrid ------------------------------------------------------------------------------------------
@rule("AffineGrid", since=20, nondiff=(1,))
def affine_grid(g: Grad):
    """grid[n, p] = theta[n] [x_p, y_p, (z_p,) 1]: linear in theta, so d theta[n] = sum over positions p of
    d grid[n, p] outer [x_p, y_p, (z_p,) 1]. The base positions are AffineGrid's own, of the identity transform
    at a batch of 1 (align_corners as the node's), so they match the forward's to the bit: one MatMul."""
    theta, size, dgrid = g.I(0), g.I(1), g.GO(0)
    shape = g.info(theta).shape
    r = shape[1] if shape is not None and len(shape) == 3 and isinstance(shape[1], int) else None
    sizes = g.info(size).shape
    if r is None and sizes is not None and len(sizes) == 1 and isinstance(sizes[0], int):
        r = sizes[0] - 2
    if r not in (2, 3):
        g.fail("the number of spatial axes (theta's [N, 2, 3] or [N, 3, 4], size's length) must be known")
    identity = g.const(np.eye(r, r + 1)[None], like=theta)
    one = g.Concat(g.ints([1]), g.Slice(size, g.ints([1]), g.ints([r + 2])), axis=0)
    base = g.Reshape(g.AffineGrid(identity, one, align_corners=g.attr("align_corners", 0)), g.ints([1, -1, r]))
    homogeneous = g.Concat(base, g.Expand(g.const(1.0, like=theta), g.Concat(g.Shape(base, end=2), g.ints([1]),
                                                                              axis=0)), axis=2)  # [1, P, r + 1]
    flat = g.Reshape(dgrid, g.Concat(g.Shape(theta, end=1), g.ints([-1, r]), axis=0))  # [N, P, r]
    return (g.MatMul(g.Transpose(flat, perm=[0, 2, 1]), homogeneous), None)
