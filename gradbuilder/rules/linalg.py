"""Matrix products: MatMul (numpy semantics), Gemm, Einsum; determinants (Det); inverses (com.microsoft Inverse)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from onnx import TensorProto

from ..graph import Dim
from .context import Grad, broadcast_axes
from .registry import rule


def _swap_last(g: Grad, x: str, rank: int) -> str:
    """x with its last two axes swapped (matrix transpose of every batch entry)."""
    perm = [*range(rank - 2), rank - 1, rank - 2]
    return g.Transpose(x, perm=perm)


def _batch(shape: tuple[Dim, ...] | None, rank: int, matrix: bool) -> tuple[Dim, ...] | None:
    if shape is None:
        return None
    return tuple(shape[:rank - 2]) if matrix else ()


def _sum_to(g: Grad, full: str, like: str, like_batch: tuple[Dim, ...] | None,
            full_batch: tuple[Dim, ...] | None) -> str:
    """Reduce the broadcast batch axes of `full` (batch dims `full_batch`, then two matrix dims) and reshape
    to `like`, which also drops the axis a 1-D operand was promoted with.

    Static batch shapes give one ReduceSum; symbolic dims that may or may not broadcast fall back to
    run-time axes (only possible when `like` is itself a batched matrix).
    """
    rank = g.require_rank(like)
    plan = broadcast_axes(like_batch, full_batch)
    if plan is not None:
        axes, lead = plan
        out = g.reduce_sum(full, axes, keepdims=True) if axes else full
        return g.reshape_like(out, like) if lead or rank < 2 else out
    return g.unbroadcast(full, like=like, grad_like=full)  # grad_like unknown to shape inference: run time


@rule("MatMul", since=13)
def matmul(g: Grad):
    """numpy matmul: 1-D operands are promoted (A to a row, B to a column) and batch dims broadcast."""
    a, b, dy = g.I(0), g.I(1), g.GO(0)
    ra, rb = g.require_rank(a), g.require_rank(b)
    if ra == 1 and rb == 1:
        return (g.Mul(dy, b) if g.needs(0) else None, g.Mul(dy, a) if g.needs(1) else None)
    # promote dy to (batch..., M, N) with the 1-D operands' removed axes restored
    dy2 = g.unsqueeze(dy, [-2]) if ra == 1 else dy
    dy2 = g.unsqueeze(dy2, [-1]) if rb == 1 else dy2
    ry = max(ra, rb, 2)
    y_shape = g.info(g.O(0)).shape
    y_batch = tuple(y_shape[:ry - 2]) if y_shape is not None else None
    da = db = None
    if g.needs(0):
        b_t = g.unsqueeze(b, [0]) if rb == 1 else _swap_last(g, b, rb)  # (..., N, K)
        da = _sum_to(g, g.MatMul(dy2, b_t), a, _batch(g.info(a).shape, ra, ra > 1), y_batch)
    if g.needs(1):
        if rb == 2 and ra >= 2:
            # a 2-D weight (shared across the batch: one product over the flattened batch, no reduction); Gemm
            # reads A transposed itself (onnxruntime's MatMul of a Transpose was 1.3-1.9x slower)
            a_flat, dy_flat = (g.Flatten(a, axis=ra - 1), g.Flatten(dy2, axis=ry - 1)) if ra > 2 else (a, dy2)
            db = g.Gemm(a_flat, dy_flat, transA=1)
        else:
            a_t = g.unsqueeze(a, [-1]) if ra == 1 else _swap_last(g, a, ra)  # (..., K, M)
            db = _sum_to(g, g.MatMul(a_t, dy2), b, _batch(g.info(b).shape, rb, rb > 1), y_batch)
    return (da, db)


@rule("Gemm", since=13)
def gemm(g: Grad):
    """Y = alpha * A' B' + beta * C with A' = A or A^T, B' = B or B^T; the transposes fold into Gemm itself."""
    a, b, c, dy = g.I(0), g.I(1), g.I(2), g.GO(0)
    alpha, beta = float(g.attr("alpha", 1.0)), float(g.attr("beta", 1.0))
    ta, tb = int(g.flag("transA")), int(g.flag("transB"))
    scale = alpha if alpha != 1.0 else None
    da = db = dc = None
    if g.needs(0):
        # dA' = alpha dY B'^T; dA = dA'^T = alpha B' dY^T when transA
        da = (g.Gemm(b, dy, alpha=scale, transA=tb, transB=1) if ta
              else g.Gemm(dy, b, alpha=scale, transB=1 - tb))
    if g.needs(1):
        # dB' = alpha A'^T dY; dB = dB'^T = alpha dY^T A' when transB
        db = (g.Gemm(dy, a, alpha=scale, transA=1, transB=ta) if tb
              else g.Gemm(a, dy, alpha=scale, transA=1 - ta))
    if c is not None and g.needs(2):
        if beta == 0.0:
            dc = g.zeros_like(c)
        else:
            dc = g.unbroadcast(dy, like=c)
            dc = g.Mul(dc, g.const(beta, like=c)) if beta != 1.0 else dc
    return (da, db, dc)


def _einsum_terms(g: Grad, equation: str, ranks: Sequence[int]) -> tuple[list[str], str, str]:
    """Operand and output subscripts with '...' spelled out as fresh letters (also returned) and an implicit
    output made explicit (numpy's rule: ellipsis, then the labels used once, sorted)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        g.fail(f"the equation has {len(terms)} operands but the node has {len(ranks)} inputs")
    used = set(eq) - set(",->.")
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in used]
    n_ell = max((r - (len(t) - 3) for t, r in zip(terms, ranks) if "..." in t), default=0)
    ell = "".join(spare[:n_ell])
    out_terms = []
    for t, r in zip(terms, ranks):
        if "..." in t:
            k = r - (len(t) - 3)
            t = t.replace("...", ell[n_ell - k:] if k else "")
        if len(t) != r:
            g.fail(f"subscripts '{t}' do not match an operand of rank {r}")
        out_terms.append(t)
    if arrow:
        out = rhs.replace("...", ell)
    else:
        counts = {ch: "".join(out_terms).count(ch) for ch in set("".join(out_terms))}
        out = ell + "".join(sorted(ch for ch, n in counts.items() if n == 1 and ch not in ell))
    return out_terms, out, ell


def _einsum_operand_grad(g: Grad, k: int, terms: list[str], out: str, ell: str, dy: str) -> str:
    """Gradient of operand k: an Einsum of dY with the other operands onto k's labels, then k's own
    structure restored: dims it broadcast (size 1 against the others') summed, repeated labels put on the
    diagonal, labels only k has (summed away in the forward pass) broadcast back."""
    x, sub = g.I(k), terms[k]
    others = [(terms[j], g.I(j)) for j in range(len(terms)) if j != k]
    avail = set(out) | {ch for t, _ in others for ch in t}
    first = [i for i, ch in enumerate(sub) if sub.index(ch) == i]
    keep = [i for i in first if sub[i] in avail]
    eq = ",".join([out, *(t for t, _ in others)]) + "->" + "".join(sub[i] for i in keep)
    grad = dy if not others and eq == f"{out}->{out}" else g.Einsum(dy, *(n for _, n in others), equation=eq)
    x_shape = g.info(x).shape or (None,) * len(sub)
    broadcast, maybe = [], []
    for axis, i in enumerate(keep):
        ch, dx = sub[i], x_shape[i]
        if isinstance(dx, int) and dx > 1:
            continue
        if dx == 1:  # numpy's einsum (and onnxruntime's) broadcast a label of size 1 against the others' size
            if ch in ell or _wider(g, ch, k, terms):
                broadcast.append(axis)
            continue
        if ch in ell and not _same_size(g, ch, k, terms, dx):
            maybe.append(axis)  # a run-time size inside the ellipsis: 1 broadcast against the others', or not
    if broadcast:
        grad = g.reduce_sum(grad, broadcast, keepdims=True)
    if maybe:
        grad = _sum_where_broadcast(g, grad, g.Gather(g.shape_of(x), g.ints(keep)), maybe, len(keep))
    if any(x_shape[i] != 1 and sub[i] not in out and _only_ones(g, sub[i], k, terms) for i in keep):
        grad = g.Expand(grad, g.Gather(g.shape_of(x), g.ints(keep)))  # read from operands of size 1 there
    placed = [i for i in range(len(sub)) if i not in keep]
    if placed:
        grad = g.unsqueeze(grad, placed)
    for i in first:
        for j in (j for j in range(i + 1, len(sub)) if sub[j] == sub[i]):
            grad = g.Mul(grad, _diagonal_mask(g, x, i, j, len(sub)))
    if len(keep) < len(first):
        grad = g.Expand(grad, g.shape_of(x))
    return grad


def _sum_where_broadcast(g: Grad, grad: str, sizes: str, axes: list[int], rank: int) -> str:
    """`grad` summed over those of `axes` where the operand's run-time `sizes` (1 there, broadcast) differ from its
    own, the axes kept (LongT5's local attention: `...qhd,...khd->...hqk` over blocks of a batch whose size shape
    inference lost in a Concat)."""
    return g.sum_where_sizes_differ(grad, sizes, g.Shape(grad),
                                    among=g.const(np.isin(np.arange(rank), axes), elem_type=TensorProto.BOOL))


def _same_size(g: Grad, ch: str, k: int, terms: list[str], size: Dim) -> bool:
    """Whether every other operand with label `ch` has it at operand k's symbolic `size` (the same name: the same
    run-time size, so nothing broadcast there; the output's inferred size proves nothing, onnx's inference takes
    one operand's)."""
    for j, t in enumerate(terms):
        if j != k and ch in t:
            shape = g.info(g.I(j)).shape
            if size is None or shape is None or shape[t.index(ch)] != size:
                return False
    return True


def _wider(g: Grad, ch: str, k: int, terms: list[str]) -> bool:
    """Whether another operand has label `ch` at a size that is not known to be 1 (a size-1 label of operand k
    then broadcast: replay seed 199, `ij,jk->ik` with i, j of 1 against j of 5)."""
    for j, t in enumerate(terms):
        if j == k or ch not in t:
            continue
        shape = g.info(g.I(j)).shape
        if shape is None or shape[t.index(ch)] != 1:
            return True
    return False


def _only_ones(g: Grad, ch: str, k: int, terms: list[str]) -> bool:
    """Whether every other operand with label `ch` has it at size 1: operand k's own size there then came from
    it alone, and its gradient, contracted from those operands, must be broadcast back to it."""
    sizes = []
    for j, t in enumerate(terms):
        if j != k and ch in t:
            shape = g.info(g.I(j)).shape
            sizes.append(shape[t.index(ch)] if shape is not None else None)
    return bool(sizes) and all(n == 1 for n in sizes)


def _diagonal_mask(g: Grad, x: str, p: int, q: int, rank: int) -> str:
    """1 where index p equals index q (p < q), shaped to broadcast against a rank-`rank` tensor."""
    shape = g.info(x).shape
    n = shape[p] if shape is not None else None
    if isinstance(n, int):
        square = g.ints([n, n])
    else:
        side = g.Gather(g.shape_of(x), g.ints([p]))
        square = g.Concat(side, side, axis=0)
    eye = g.EyeLike(g.ConstantOfShape(square), dtype=g.dtype(x) or None)
    return g.unsqueeze(eye, [i for i in range(rank) if i not in (p, q)])


@rule("Einsum", since=13)
def einsum(g: Grad):
    """Each operand's gradient is another einsum: dY and the other operands contracted onto its labels."""
    n = g.n_inputs
    ranks = [g.require_rank(g.I(i)) for i in range(n)]
    terms, out, ell = _einsum_terms(g, g.attr("equation"), ranks)
    dy = g.GO(0)
    return tuple(_einsum_operand_grad(g, k, terms, out, ell, dy) if g.needs(k) else None for k in range(n))


DET_MAX_SIZE = 32
"""Largest static n the Det rule differentiates: its n^2 minors of (n-1)^2 take O(n^4) memory and O(n^5) work a
matrix (onnxruntime, one core: 16 ms and 4 MB of float32 minors a 32x32 matrix, 0.3 s and 64 MB at 64)."""


def _minor_indices(g: Grad, a: str) -> tuple[str, str]:
    """For a's [..., n, n] matrices: [n, n-1] int64 whose row i lists every index but i (k + (k >= i)), and the
    signs (-1)^(i+j) [n, n] in a's type. Constants where n is static; from a's run-time size where it is not (the
    runtime exports every input dim dynamic, and a slice of one stays unknown to shape inference)."""
    shape = g.info(a).shape
    n = next((d for d in (shape or ())[-2:] if isinstance(d, int)), None)
    if n is not None:
        if n > DET_MAX_SIZE:
            g.fail(f"its {n}x{n} matrices are too large for the cofactor gradient, which takes O(n^5) work (n^2 "
                   f"minors); it is limited to n <= {DET_MAX_SIZE}")
        others = [[k for k in range(n) if k != i] for i in range(n)]
        return g.ints(others), g.const(1 - 2 * (np.add.outer(np.arange(n), np.arange(n)) % 2), like=a)
    size = g.Gather(g.shape_of(a), g.ints(-1))  # a scalar
    zero, one = g.ints(0), g.ints(1)
    i = g.Range(zero, size, one)  # [n]
    k = g.unsqueeze(g.Range(zero, g.Sub(size, one), one), [0])  # [1, n-1]
    rows = g.unsqueeze(i, [1])  # [n, 1]
    others = g.Add(k, g.Cast(g.GreaterOrEqual(k, rows), to=TensorProto.INT64))
    parity = g.Mod(g.Add(rows, g.unsqueeze(i, [0])), g.ints(2))  # [n, n]
    return others, g.cast_like(g.Sub(one, g.Mul(g.ints(2), parity)), a)


@rule("Det", since=13)
def det(g: Grad):
    """d det(A) / dA is the cofactor matrix, C_ij = (-1)^(i+j) det(M_ij): exact also where A is singular (of rank
    n-1 it is not 0), unlike det(A) inverse(A)^T, and standard ONNX has no Inverse anyway. The n^2 minors (M_ij: A
    without row i and column j) come from two Gathers and go through one Det (of 0x0 matrices, 1, where n = 1)."""
    a, dy = g.I(0), g.GO(0)
    batch = g.require_rank(a) - 2
    others, signs = _minor_indices(g, a)
    cut = g.Gather(g.Gather(a, others, axis=batch), others, axis=batch + 2)  # [..., i, n-1, j, n-1]
    minors = g.Det(g.Transpose(cut, perm=[*range(batch), batch, batch + 2, batch + 1, batch + 3]))  # [..., i, j]
    return (g.Mul(minors, g.Mul(signs, g.unsqueeze(dy, [batch, batch + 1]))),)


MICROSOFT = "com.microsoft"
"""onnxruntime's contrib domain: its Inverse (opset 1) is the only matrix inverse stock onnxruntime runs (what
runtime/symbolics.py writes for torch.linalg.inv and solve)."""


@rule("Inverse", domain=MICROSOFT)
def inverse(g: Grad):
    """Y = A^{-1}: dA = -Y^T dY Y^T (each matrix of the batch), from the forward output Y, so backward inverts
    nothing again, and in standard ops (MatMul, Transpose, Neg): the backward half needs no contrib kernel."""
    y_t = _swap_last(g, g.O(0), g.require_rank(g.I(0)))
    return (g.Neg(g.MatMul(g.MatMul(y_t, g.GO(0)), y_t)),)
