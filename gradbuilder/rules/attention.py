"""Sequence ops: Attention (opsets 23-25) and RotaryEmbedding (opset 23), ReverseSequence, Compress.

Attention recomputes its probabilities from Q and K (which its gradient reads anyway) rather than stashing the
[B, H, Sq, T] matrix. Grouped-query heads are handled without repeating K and V: the query heads of one key
head are stacked along the sequence axis, so each MatMul sums over the group by itself.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from .context import Grad
from .indexing import arange, as_tensor, axis_adjoint, rows_adjoint, size_along
from .registry import rule

# --- Attention -------------------------------------------------------------------------------------------


def _heads(g: Grad, t: str, n: int) -> str:
    """[B, S, n*D] -> [B, n, S, D]."""
    return g.Transpose(g.Reshape(t, g.ints([0, 0, n, -1])), perm=[0, 2, 1, 3])


def _merge_heads(g: Grad, t: str, like: str) -> str:
    """[B, n, S, D] -> the 3-D layout of `like`."""
    return g.reshape_like(g.Transpose(t, perm=[0, 2, 1, 3]), like)


def _last_t(g: Grad, t: str) -> str:
    return g.Transpose(t, perm=[0, 1, 3, 2])


class _Attention:
    """The forward of one Attention node, recomputed in backward in the grouped layout [B, Hkv, G*Sq, ...]."""

    def __init__(self, g: Grad):
        self.g = g
        q, k, v = g.I(0), g.I(1), g.I(2)
        rank = g.require_rank(q)
        self.three_d = rank == 3
        if self.three_d:
            self.hq, self.hkv = g.attr("q_num_heads"), g.attr("kv_num_heads")
            if not self.hq or not self.hkv:
                g.fail("3-D inputs need the q_num_heads and kv_num_heads attributes")
            self.q, self.k, self.v = _heads(g, q, self.hq), _heads(g, k, self.hkv), _heads(g, v, self.hkv)
        else:
            self.hq, self.hkv = size_along(g, q, 1), size_along(g, k, 1)
            if not isinstance(self.hq, int) or not isinstance(self.hkv, int):
                g.fail("the head counts (dim 1 of Q and K) must be static")
            self.q, self.k, self.v = q, k, v
        self.group = self.hq // self.hkv
        self.past = g.I(4)
        if self.past is not None:  # read present_key/value when the node has them, else concatenate again
            outs = g.node.output
            self.k = outs[1] if len(outs) > 1 and outs[1] else g.Concat(self.past, self.k, axis=2)
            self.v = outs[2] if len(outs) > 2 and outs[2] else g.Concat(g.I(5), self.v, axis=2)
        self.softcap = float(g.attr("softcap", 0.0))
        self.mask = g.I(3)
        self.bool_mask = self.mask is not None and g.dtype(self.mask) == TensorProto.BOOL
        self.nonpad = g.I(6)  # opset 24: valid keys per sample (an external cache)
        self.causal = bool(int(g.attr("is_causal", 0)))
        self.window = (int(g.attr("left_window_size", -1)), int(g.attr("right_window_size", -1)))  # opset 25
        self.may_mask_rows = self.mask is not None or self.nonpad is not None or max(self.window) >= 0 or (
            self.causal and self.past is not None)

    def split(self, t: str | None, i: int, i_past: int) -> tuple[str | None, str | None]:
        """The gradient of past ++ input i along the sequence axis -> (d past, d input i in its layout)."""
        g = self.g
        if t is None or not (g.needs(i) or g.needs(i_past)):
            return None, None
        d_past = None
        if self.past is not None:
            new = g.Shape(g.I(i), start=1, end=2) if self.three_d else g.Shape(g.I(i), start=2, end=3)
            d_past, t = g.Split(t, g.Concat(g.Shape(g.I(i_past), start=2, end=3), new, axis=0), axis=2, n_out=2)
        return d_past, _merge_heads(g, t, g.I(i)) if self.three_d else t

    def grouped(self, t: str) -> str:
        """[B, Hq, S, X] -> [B, Hkv, G*S, X] (query head h belongs to key head h // G)."""
        return t if self.group == 1 else self.g.Reshape(t, self.g.ints([0, self.hkv, -1, 0]))

    def ungrouped(self, t: str) -> str:
        return t if self.group == 1 else self.g.Reshape(t, self.g.ints([0, self.hq, -1, 0]))

    def scale(self) -> str:
        g, q = self.g, self.g.I(0)
        value = g.attr("scale")
        if value is not None:
            return g.const(float(value), like=q)
        d = g.info(q).shape[-1] if g.info(q).shape else None
        if isinstance(d, int):
            return g.const(1.0 / math.sqrt(d // (self.hq if self.three_d else 1)), like=q)
        return g.Reciprocal(g.Sqrt(g.cast_like(g.Shape(self.q, start=3), q)))

    def _structural(self, scores: str) -> str:
        """The causal frontier, the sliding window and the padded keys, as the op defines them: query i sits at
        p = i + offset (the past's length, or per sample the valid keys less the queries with `nonpad_kv_seqlen`,
        else 0); causal sees keys j <= p, the window p - left <= j <= p + right, and key j exists iff
        j < nonpad_kv_seqlen. Disallowed scores become -inf."""
        g = self.g
        left, right = self.window
        if not (self.causal or self.nonpad is not None or left >= 0 or right >= 0):
            return scores
        shape = g.Shape(scores)
        rows = g.unsqueeze(arange(g, g.Slice(shape, g.ints([2]), g.ints([3]))), [1])  # [Sq, 1]
        keys = g.unsqueeze(arange(g, g.Slice(shape, g.ints([3]), g.ints([4]))), [0])  # [1, T]
        nonpad = None if self.nonpad is None else g.Reshape(g.Cast(self.nonpad, to=TensorProto.INT64),
                                                             g.ints([-1, 1, 1, 1]))  # [B, 1, 1, 1]
        if self.past is not None:
            rows = g.Add(rows, g.Shape(self.past, start=2, end=3))
        elif nonpad is not None:
            rows = g.Add(rows, g.Sub(nonpad, g.Slice(shape, g.ints([2]), g.ints([3]))))  # [B, 1, Sq, 1]
        allowed = []
        if self.causal:
            allowed.append(g.LessOrEqual(keys, rows))
        if right >= 0:
            allowed.append(g.LessOrEqual(keys, g.Add(rows, g.ints(right))))
        if left >= 0:
            allowed.append(g.GreaterOrEqual(keys, g.Sub(rows, g.ints(left))))
        if nonpad is not None:
            allowed.append(g.Less(keys, nonpad))
        both = allowed[0]
        for a in allowed[1:]:
            both = g.And(both, a)
        return g.Where(both, scores, g.const(-np.inf, like=self.g.I(0)))

    def probabilities(self) -> tuple[str, str | None]:
        """(P [B, Hq, Sq, T] with fully masked rows 0, the softcapped scores when softcap is set)."""
        g, q = self.g, self.g.I(0)
        scores = self.ungrouped(g.MatMul(self.grouped(self.q), _last_t(g, self.k)))
        scores = g.Mul(scores, self.scale())
        capped = None
        if self.softcap > 0:
            cap = g.const(self.softcap, like=q)
            scores = capped = g.Mul(cap, g.Tanh(g.Div(scores, cap)))
        scores = self._structural(scores)
        if self.mask is not None:
            if self.bool_mask:
                scores = g.Where(self.mask, scores, g.const(-np.inf, like=q))
            else:
                scores = g.Add(scores, self.mask)
        p = g.Softmax(scores, axis=-1)
        if self.may_mask_rows:  # a row with every key masked is 0, not NaN
            dead = g.Equal(g.ReduceMax(scores, g.ints([-1]), keepdims=1), g.const(-np.inf, like=q))
            p = g.Where(dead, g.const(0.0, like=q), p)
        return p, capped


def _plus(g: Grad, a: str | None, b: str) -> str:
    return b if a is None else g.Add(a, b)


@rule("Attention", since=23, nondiff=(6,), nondiff_outputs=(3,))
def attention(g: Grad):
    """S = scale Q K^T (softcapped, masked), P = softmax(S), Y = P V; present_key/value = past ++ K/V.
    Opset 24 adds the valid keys per sample (`nonpad_kv_seqlen`), opset 25 a sliding window: both mask S.
    dV = P^T dY, dS = P (dP - rowsum(dP P)) with dP = dY V^T, dQ = scale dS K, dK = scale dS^T Q; a float
    mask gets dS summed to its shape; the present outputs' gradients add to those of past ++ K/V."""
    a = _Attention(g)
    q, dy = g.I(0), g.GO(0)
    dk_all, dv_all = g.GO(1), g.GO(2)
    dq = dmask = None
    if dy is not None:
        p, capped = a.probabilities()
        p_g = a.grouped(p)
        dy_g = a.grouped(_heads(g, dy, a.hq) if a.three_d else dy)
        if g.needs(2) or g.needs(5):
            dv_all = _plus(g, dv_all, g.MatMul(_last_t(g, p_g), dy_g))
        dp = g.MatMul(dy_g, _last_t(g, a.v))
        ds = a.ungrouped(g.Mul(p_g, g.Sub(dp, g.ReduceSum(g.Mul(dp, p_g), g.ints([-1]), keepdims=1))))
        if a.mask is not None and not a.bool_mask and g.needs(3):
            dmask = g.unbroadcast(ds, like=a.mask, grad_like=ds)
        if capped is not None:
            ratio = g.Div(capped, g.const(a.softcap, like=q))
            ds = g.Mul(ds, g.Sub(g.const(1.0, like=q), g.Mul(ratio, ratio)))
        ds_g, scale = a.grouped(ds), a.scale()
        if g.needs(0):
            dq = a.ungrouped(g.Mul(g.MatMul(ds_g, a.k), scale))
            dq = _merge_heads(g, dq, q) if a.three_d else dq
        if g.needs(1) or g.needs(4):
            dk_all = _plus(g, dk_all, g.Mul(g.MatMul(_last_t(g, ds_g), a.grouped(a.q)), scale))
    dpast_k, dk = a.split(dk_all, 1, 4)
    dpast_v, dv = a.split(dv_all, 2, 5)
    grads = (dq, dk, dv, dmask, dpast_k, dpast_v)
    # zeros where only some outputs carry a gradient (present_key alone says nothing about Q or V)
    return [d if d is not None or not g.needs(i) else g.zeros_like(g.I(i)) for i, d in enumerate(grads)]


# --- RotaryEmbedding -------------------------------------------------------------------------------------
@rule("RotaryEmbedding", since=23, nondiff=(3,))
def rotary_embedding(g: Grad):
    """A rotation by the cached angles: dX rotates dY back, the same op with sin negated. The caches get
    d1 x1 + d2 x2 (cos) and d2 x1 - d1 x2 (sin) summed over heads, scatter-added to the rows position_ids
    read when given."""
    x, cos, sin, pos, dy = g.I(0), g.I(1), g.I(2), g.I(3), g.GO(0)
    attrs = {n: g.attr(n) for n in ("interleaved", "rotary_embedding_dim", "num_heads") if g.attr(n) is not None}
    dx = g.RotaryEmbedding(dy, cos, g.Neg(sin), pos, **attrs) if g.needs(0) else None
    dcos = dsin = None
    if g.needs(1) or g.needs(2):
        x1, x2, head_axis = _rotated_halves(g, x)
        d1, d2, _ = _rotated_halves(g, dy)
        per_token = {1: g.Add(g.Mul(d1, x1), g.Mul(d2, x2)), 2: g.Sub(g.Mul(d2, x1), g.Mul(d1, x2))}
        out = []
        for i in (1, 2):
            if not g.needs(i):
                out.append(None)
                continue
            t = g.reduce_sum(per_token[i], [head_axis], keepdims=False)  # [B, S, R/2]
            if pos is not None:
                cache = g.I(i)
                half = size_along(g, cache, 1)
                flat = g.Reshape(t, g.Concat(g.ints([-1]), as_tensor(g, half), axis=0))
                t = rows_adjoint(g, flat, g.Reshape(pos, g.ints([-1])), size_along(g, cache, 0), like=cache)
            out.append(t)
        dcos, dsin = out
    return (dx, dcos, dsin, None)


def _rotated_halves(g: Grad, t: str) -> tuple[str, str, int]:
    """The two halves the rotation pairs (x1, x2), as [B, H, S, R/2] (4-D input) or [B, S, H, R/2] (3-D
    input), and the head axis of that layout."""
    rank = g.require_rank(g.I(0))
    if rank == 3:
        heads = g.attr("num_heads")
        if not heads:
            g.fail("a 3-D input needs the num_heads attribute")
        t = g.Reshape(t, g.ints([0, 0, int(heads), -1]))
    head_axis = 1 if rank == 4 else 2
    half = size_along(g, g.I(1), -1)
    if not isinstance(half, int):
        g.fail("the last dim of cos_cache (rotary_embedding_dim / 2) must be static")
    rotated = g.Slice(t, g.ints([0]), g.ints([2 * half]), g.ints([3]))
    if int(g.attr("interleaved", 0)):
        pairs = g.Reshape(rotated, g.ints([0, 0, 0, half, 2]))
        x1, x2 = g.Split(pairs, g.ints([1, 1]), axis=4, n_out=2)
        return g.squeeze(x1, [4]), g.squeeze(x2, [4]), head_axis
    x1, x2 = g.Split(rotated, g.ints([half, half]), axis=3, n_out=2)
    return x1, x2, head_axis


# --- ReverseSequence, Compress -----------------------------------------------------------------------------
@rule("ReverseSequence", since=13, nondiff=(1,))
def reverse_sequence(g: Grad):
    """Reversing the first len[b] steps of each batch entry is its own inverse."""
    return (g.ReverseSequence(g.GO(0), g.I(1), batch_axis=int(g.attr("batch_axis", 1)),
                              time_axis=int(g.attr("time_axis", 0))), None)


@rule("Compress", since=13, nondiff=(1,))
def compress(g: Grad):
    """dY goes back to the positions the condition kept (NonZero of it), zeros elsewhere; without an axis,
    along the flattened input."""
    x, dy = g.I(0), g.GO(0)
    kept = g.Reshape(g.NonZero(g.I(1)), g.ints([-1]))
    axis = g.attr("axis")
    if axis is not None:
        rank = g.require_rank(x)
        axis = g.axis(axis, rank)
        return (axis_adjoint(g, dy, axis, rank, kept, size_along(g, x, axis), like=x, add=False), None)
    static = g.info(x).static_shape
    numel = int(np.prod(static)) if static is not None else g.ReduceProd(g.shape_of(x), keepdims=1)
    flat = axis_adjoint(g, dy, 0, 1, kept, numel, like=x, add=False)
    return (g.reshape_like(flat, x), None)
