import harness
import numpy as np
import onnx
import pytest
import torch
from harness import check_op

from gradbuilder.rules.linalg import MICROSOFT

rng = np.random.default_rng(0)


def r(*shape):
    return np.asarray(rng.standard_normal(shape))


def symbolic(monkeypatch, **dims: dict[int, str]) -> None:
    """symbolic(monkeypatch, name={axis: "sym"}) makes check_op's models give those input dims the named
    symbolic size; unlike check_op(symbolic=...), inputs can share a symbol (the same batch size)."""
    make = onnx.helper.make_tensor_value_info

    def patched(name, elem_type, shape, *args, **kwargs):
        if shape is not None and name in dims:
            shape = [dims[name].get(i, d) for i, d in enumerate(shape)]
        return make(name, elem_type, shape, *args, **kwargs)

    monkeypatch.setattr(harness.helper, "make_tensor_value_info", patched)


MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((4,), (4, 5)),
    ((3, 4), (4,)),
    ((4,), (4,)),
    ((2, 3, 4), (4, 5)),
    ((3, 4), (2, 4, 5)),
    ((2, 3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (5, 4, 2)),
    ((1, 3, 4), (2, 4, 5)),
    ((4,), (2, 4, 5)),
    ((2, 3, 4), (4,)),
    ((2, 2, 3, 4), (4, 5)),
]


@pytest.mark.parametrize("sa,sb", MATMUL_SHAPES)
def test_matmul(sa, sb):
    check_op("MatMul", [("a", r(*sa)), ("b", r(*sb))], torch.matmul)


@pytest.mark.parametrize("sa,sb", MATMUL_SHAPES[:2])
def test_matmul_one_side(sa, sb):
    """Only one operand needs a gradient: the other branch is not emitted (and the result still checks)."""
    check_op("MatMul", [("a", r(*sa)), ("b", r(*sb))], torch.matmul, wrt=["b"])
    check_op("MatMul", [("a", r(*sa)), ("b", r(*sb))], torch.matmul, wrt=["a"])


@pytest.mark.parametrize("sa,sb,dims", [
    ((3, 3, 4), (4, 5), {"a": {0: "B"}}),
    ((3, 3, 4), (3, 4, 5), {"a": {0: "B"}, "b": {0: "B"}}),
    ((3, 3, 4), (1, 4, 5), {"a": {0: "B"}}),
    ((3, 4), (2, 4, 5), {"b": {0: "B"}}),
    ((3, 1, 3, 4), (2, 4, 5), {"a": {0: "B"}}),
    ((3, 3, 4), (3, 4, 5), {"a": {0: "B"}, "b": {0: "C"}}),  # may or may not broadcast: run-time axes
    ((3, 3, 4), (1, 4, 5), {"a": {0: "B"}, "b": {0: "C"}}),
])
def test_matmul_symbolic(monkeypatch, sa, sb, dims):
    symbolic(monkeypatch, **dims)
    check_op("MatMul", [("a", r(*sa)), ("b", r(*sb))], torch.matmul)


def test_matmul_float32():
    check_op("MatMul", [("a", r(2, 3, 4).astype(np.float32)), ("b", r(4, 5).astype(np.float32))], torch.matmul)


C_SHAPES = [None, (), (5,), (3, 1), (1, 5), (3, 5), (1, 1), (1,)]


def _gemm_ref(ta, tb, alpha, beta):
    def fn(a, b, c=None):
        y = alpha * ((a.T if ta else a) @ (b.T if tb else b))
        return y if c is None else y + beta * c
    return fn


@pytest.mark.parametrize("cs", C_SHAPES, ids=str)
@pytest.mark.parametrize("ta,tb", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_gemm(ta, tb, cs):
    a = r(4, 3) if ta else r(3, 4)
    b = r(5, 4) if tb else r(4, 5)
    inputs = [("a", a), ("b", b)] + ([("c", r(*cs))] if cs is not None else [])
    check_op("Gemm", inputs, _gemm_ref(ta, tb, 0.7, 1.3), transA=ta, transB=tb, alpha=0.7, beta=1.3)


@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (2.0, 0.0), (1.0, -0.5)])
def test_gemm_scales(alpha, beta):
    check_op("Gemm", [("a", r(3, 4)), ("b", r(5, 4)), ("c", r(5))], _gemm_ref(0, 1, alpha, beta),
             transB=1, alpha=alpha, beta=beta)


def test_gemm_default_attributes():
    check_op("Gemm", [("a", r(3, 4)), ("b", r(4, 5)), ("c", r(3, 5))], _gemm_ref(0, 0, 1.0, 1.0))


@pytest.mark.parametrize("ta", [0, 1])
@pytest.mark.parametrize("cs", [(5,), (1, 5), ()])
def test_gemm_symbolic_batch(ta, cs):
    """torch.nn.Linear as exported: a dynamic batch dim, weight transposed, bias broadcast."""
    a = r(4, 3) if ta else r(3, 4)
    check_op("Gemm", [("a", a), ("b", r(5, 4)), ("c", r(*cs))], _gemm_ref(ta, 1, 1.0, 1.0), transA=ta, transB=1,
             symbolic={"a": [1 if ta else 0]})


def test_gemm_only_weight():
    grads = check_op("Gemm", [("a", r(3, 4)), ("b", r(5, 4)), ("c", r(5))], _gemm_ref(0, 1, 1.0, 1.0),
                     transB=1, wrt=["b", "c"])
    assert set(grads) == {"b", "c"}


EINSUM = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("ij,jk", [(3, 4), (4, 5)]),  # implicit output: ik
    ("ba,ac", [(3, 4), (4, 5)]),  # implicit output sorted: bc
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (1, 4, 5)]),  # ellipsis broadcasting
    ("...ij,jk->...ik", [(2, 2, 3, 4), (4, 5)]),
    ("i...,i...->...", [(3, 2, 4), (3, 2, 4)]),
    ("ij->", [(3, 4)]),
    ("ij->j", [(3, 4)]),
    ("ij->ji", [(3, 4)]),
    ("ii->i", [(4, 4)]),
    ("ii->", [(4, 4)]),
    ("ii", [(4, 4)]),  # implicit trace
    ("bii->bi", [(2, 3, 3)]),
    ("iij->ji", [(3, 3, 2)]),
    ("iii->i", [(3, 3, 3)]),
    ("i,j->ij", [(3,), (4,)]),
    ("i,i", [(3,), (3,)]),  # implicit dot
    ("ij,ij->ij", [(3, 4), (3, 4)]),
    ("ij,k->ik", [(3, 4), (5,)]),  # j only in the first operand, summed away
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
    ("ij,jj->i", [(3, 4), (4, 4)]),
    ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),  # attention scores
    ("ij,jk->ik", [(1, 1), (5, 3)]),  # a contracted label of size 1 broadcast against 5 (replay seed 199)
    ("ij,jk->ik", [(2, 5), (1, 3)]),  # the same, the other operand
]


@pytest.mark.parametrize("eq,shapes", EINSUM, ids=[e for e, _ in EINSUM])
def test_einsum(eq, shapes):
    inputs = [(f"x{i}", r(*s)) for i, s in enumerate(shapes)]
    check_op("Einsum", inputs, lambda *xs: torch.einsum(eq, *xs), equation=eq)


def test_einsum_symbolic_batch(monkeypatch):
    symbolic(monkeypatch, x0={0: "B"}, x1={0: "B"})
    eq = "bij,bjk->bik"
    check_op("Einsum", [("x0", r(2, 3, 4)), ("x1", r(2, 4, 5))], lambda a, b: torch.einsum(eq, a, b), equation=eq)


@pytest.mark.parametrize("shapes", [[(2, 3, 4), (2, 4, 5)], [(2, 3, 4), (1, 4, 5)], [(1, 3, 4), (2, 4, 5)],
                                    [(3, 2, 2, 3), (3, 1, 3, 2)]])
def test_einsum_symbolic_ellipsis_broadcasts_at_run_time(shapes):
    """Run-time sizes inside the ellipsis, 1 against the other operand's or not (LongT5's local attention,
    `...qhd,...khd->...hqk` over blocks of a batch whose size inference lost): the gradient summed where they
    broadcast."""
    eq = "...ij,...jk->...ik"
    dims = list(range(len(shapes[0]) - 2))
    check_op("Einsum", [("x0", r(*shapes[0])), ("x1", r(*shapes[1]))], lambda a, b: torch.einsum(eq, a, b),
             equation=eq, symbolic={"x0": dims, "x1": dims})


@pytest.mark.parametrize("opset", [13, 23, 28])
def test_opset_range_ends(opset):
    check_op("MatMul", [("a", r(2, 3, 4)), ("b", r(4, 5))], torch.matmul, opset=opset)
    check_op("Gemm", [("a", r(4, 3)), ("b", r(5, 4)), ("c", r(5))], _gemm_ref(1, 1, 0.5, 2.0), opset=opset,
             transA=1, transB=1, alpha=0.5, beta=2.0)
    check_op("Einsum", [("x0", r(2, 3, 3)), ("x1", r(3, 4))], lambda a, b: torch.einsum("bii,ij->bj", a, b),
             opset=opset, equation="bii,ij->bj")
    check_op("Det", [("a", r(2, 3, 3).astype(np.float32))], torch.linalg.det, opset=opset)


def test_einsum_symbolic_diagonal():
    """A repeated label of symbolic size: the diagonal mask is sized at run time."""
    eq = "bii->bi"
    check_op("Einsum", [("x0", r(2, 3, 3))], lambda a: torch.einsum(eq, a), equation=eq, symbolic={"x0": [0, 1, 2]})


def test_matmul_float16():
    half = np.float16
    check_op("MatMul", [("a", r(2, 3, 4).astype(half)), ("b", r(4, 5).astype(half))], torch.matmul, fd=False,
             rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("shape,dims", [
    ((1, 1), None),
    ((2, 2), None),
    ((3, 3), None),
    ((5, 5), None),
    ((2, 3, 4, 4), None),
    ((4, 3, 3), {"a": [0]}),  # a symbolic batch dim
    ((2, 3, 3), {"a": [1, 2]}),  # matrices of run-time size: the minors' indices computed
    ((1, 1), {"a": [0, 1]}),
], ids=str)
def test_det(shape, dims):
    """float32: onnxruntime's Det has no double kernel."""
    check_op("Det", [("a", r(*shape).astype(np.float32))], torch.linalg.det, symbolic=dims)


class _SingularSafeDet(torch.autograd.Function):
    """torch.linalg.det with the backward torch takes under create_graph (through an SVD where A is singular): its
    first-order backward returns 0 where det(A) is exactly 0, not the cofactor matrix (pytorch#104675)."""

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return torch.linalg.det(a)

    @staticmethod
    def backward(ctx, dy):
        (a,) = ctx.saved_tensors
        with torch.enable_grad():
            x = a.detach().requires_grad_()
            return torch.autograd.grad(torch.linalg.det(x), x, dy, create_graph=True)[0].detach()


def test_det_singular():
    """Rank n-1 (two equal rows): det is 0 but its gradient, the cofactor matrix, is not; rank n-2: it is 0."""
    a = np.random.default_rng(1).standard_normal((2, 4, 4)).astype(np.float32)  # not the shared draws: fixed values
    a[0, 2] = a[0, 0]
    a[1, 2:] = a[1, :2]
    grads = check_op("Det", [("a", a)], _SingularSafeDet.apply)
    assert np.abs(grads["a"][0]).max() > 1e-2  # 100 times check_op's atol
    np.testing.assert_allclose(grads["a"][1], 0, atol=1e-5)


def test_det_of_large_matrices_fails_clearly():
    """Its cost grows as n^5: refused above 32 where n is static, naming the size."""
    import gradbuilder
    from gradbuilder.errors import RuleError

    model = harness.single_op_model("Det", [("a", r(33, 33).astype(np.float32))])
    with pytest.raises(RuleError, match=r"33x33 matrices are too large .* n <= 32"):
        gradbuilder.build_gradient_graph(model, wrt=["a"], outputs=["y0"])


def _invertible(*shape: int, dtype: type = np.float64) -> np.ndarray:
    """Well-conditioned [..., n, n] matrices (fixed draws): a random perturbation of 3 I."""
    n = shape[-1]
    return (np.random.default_rng(2).standard_normal(shape) + 3 * np.eye(n)).astype(dtype)


@pytest.mark.parametrize("shape,dims", [
    ((1, 1), None),
    ((3, 3), None),
    ((2, 4, 4), None),
    ((3, 2, 3, 3), {"a": [0]}),  # a symbolic batch dim
    ((2, 3, 3), {"a": [0, 1, 2]}),  # every dim symbolic (as the runtime exports them)
], ids=str)
def test_inverse(shape, dims):
    """onnxruntime's contrib Inverse (what the runtime exports torch.linalg.inv as); onnx does not know it, so the
    output's rank is declared."""
    check_op("Inverse", [("a", _invertible(*shape))], torch.linalg.inv, domain=MICROSOFT, symbolic=dims,
             out_ranks={"y0": len(shape)})


def test_inverse_float32():
    check_op("Inverse", [("a", _invertible(2, 3, 3, dtype=np.float32))], torch.linalg.inv, domain=MICROSOFT,
             out_ranks={"y0": 3})
