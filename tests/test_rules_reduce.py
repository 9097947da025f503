import numpy as np
import pytest
import torch
from harness import check_op, sweep_tests
from test_rules_shape import check_dynamic

rng = np.random.default_rng(0)


def r(*shape):
    return np.asarray(rng.standard_normal(shape))


def i64(*values):
    return np.array(values, dtype=np.int64)


def _reduced(fn, axes, keepdims, x):
    """torch reference: fn over `axes` (all when empty), keepdims like ONNX."""
    dims = tuple(axes) if axes else tuple(range(x.dim()))
    return fn(x, dims, keepdims)


def _reduce_check(op, torch_fn, x, axes, keepdims, opset, **kw):
    """One Reduce node with axes as an attribute (opset < 18, not ReduceSum) or as a constant input."""
    ref = lambda x: _reduced(torch_fn, axes, keepdims, x)  # noqa: E731
    if op != "ReduceSum" and opset < 18:
        attrs = {"axes": list(axes)} if axes else {}
        return check_op(op, [("x", x)], ref, opset=opset, keepdims=keepdims, **attrs, **kw)
    inputs = [("x", x)] + ([("a", i64(*axes))] if axes else [])
    return check_op(op, inputs, ref, consts=["a"], opset=opset, keepdims=keepdims, **kw)


SUM = lambda x, d, k: x.sum(d, keepdim=bool(k))  # noqa: E731
MEAN = lambda x, d, k: x.mean(d, keepdim=bool(k))  # noqa: E731
AXES = [(1,), (-1,), (0, 2), (-3, -1), ()]


@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("opset", [13, 18])
def test_reduce_sum(axes, keepdims, opset):
    _reduce_check("ReduceSum", SUM, r(2, 3, 4), axes, keepdims, opset)


@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("opset", [13, 17, 18, 20])
def test_reduce_mean(axes, keepdims, opset):
    _reduce_check("ReduceMean", MEAN, r(2, 3, 4), axes, keepdims, opset)


SUM_MEAN = pytest.mark.parametrize("op,fn", [("ReduceSum", SUM), ("ReduceMean", MEAN)])


@SUM_MEAN
@pytest.mark.parametrize("axes", [(1,), (-1, 0)])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_runtime_axes(op, fn, axes, keepdims):
    """Axes computed at run time (a graph input): Unsqueeze and the count are built from them."""
    check_dynamic({}, op, [("x", r(2, 3, 4)), ("a", i64(*axes))], lambda x, a: fn(x, axes, keepdims), opset=18,
                  keepdims=keepdims, out_ranks={"y0": 3 if keepdims else 3 - len(axes)})


@SUM_MEAN
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_repeated_axes(op, fn, keepdims):
    """[0, -3, 2] names axis 0 twice: onnxruntime reduces it once, and the Unsqueeze putting the axes back
    refused the repeat (constant axes deduplicated when building, run-time ones by a Unique of the axes made
    non-negative; found by tests/fuzz/test_runtime_replay.py)."""
    x, axes = r(2, 3, 4), (0, -3, 2)
    check_op(op, [("x", x), ("a", i64(*axes))], lambda x: fn(x, (0, 2), keepdims), consts=["a"], opset=18,
             keepdims=keepdims)
    check_dynamic({}, op, [("x", x), ("a", i64(*axes))], lambda x, a: fn(x, (0, 2), keepdims), opset=18,
                  keepdims=keepdims, out_ranks={"y0": 3 if keepdims else 1})


@SUM_MEAN
def test_reduce_runtime_empty_axes(op, fn):
    """Empty at run time: everything reduced, or nothing with noop_with_empty_axes."""
    x = r(2, 3, 4)
    check_dynamic({}, op, [("x", x), ("a", i64())], lambda x, a: fn(x, (0, 1, 2), False), opset=18, keepdims=0,
                  out_ranks={"y0": 0})
    check_dynamic({}, op, [("x", x), ("a", i64())], lambda x, a: x * 1, opset=18, keepdims=0,
                  noop_with_empty_axes=1, out_ranks={"y0": 3})


@SUM_MEAN
@pytest.mark.parametrize("axes,dyn", [((1,), [0, 2]), ((-1, 0), [0, 1])])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_dynamic(op, fn, axes, dyn, keepdims):
    check_dynamic({"x": dyn}, op, [("x", r(2, 3, 4)), ("a", i64(*axes))], lambda x: fn(x, axes, keepdims),
                  consts=["a"], opset=18, keepdims=keepdims)


def test_reduce_noop_empty_axes():
    x = r(2, 3)
    check_op("ReduceSum", [("x", x)], lambda x: x * 1, opset=13, noop_with_empty_axes=1)
    for op, fn in [("ReduceMean", lambda x: x * 1), ("ReduceMax", lambda x: x * 1), ("ReduceL1", torch.abs),
                   ("ReduceL2", torch.abs), ("ReduceSumSquare", torch.square), ("ReduceLogSumExp", lambda x: x * 1),
                   ("ReduceProd", lambda x: x * 1)]:
        check_op(op, [("x", x)], fn, opset=18, noop_with_empty_axes=1)


def _with_ties(shape, axis):
    """Values with the extremes tied in some rows along `axis` (and a mask keeping the probe off them)."""
    x = np.round(r(*shape) * 4) / 4
    x = np.moveaxis(x, axis, -1).copy()
    x[..., 0, 1] = x[..., 0, :].max()  # a tied max in the first row
    x[..., 0, 2] = x[..., 0, :].min()  # and a tied min
    x = np.moveaxis(x, -1, axis)
    return x


@pytest.mark.parametrize("op,fn", [("ReduceMax", torch.amax), ("ReduceMin", torch.amin)])
@pytest.mark.parametrize("axes", [(1,), (-1,), (0, 2), ()])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("opset", [13, 18])
def test_reduce_max_min_ties(op, fn, axes, keepdims, opset):
    x = _with_ties((3, 4, 5), (axes or (0,))[0])
    ext = np.asarray(fn(torch.from_numpy(x), dim=axes or tuple(range(3)), keepdim=True))
    tied = (x == ext)
    mask = np.where(tied, 0.0, 1.0)  # at the extremes the function has a kink
    g = _reduce_check(op, lambda x, d, k: fn(x, dim=d, keepdim=bool(k)), x, axes, keepdims, opset,
                      fd_mask={"x": mask})
    assert np.count_nonzero(g["x"]) == np.count_nonzero(tied)  # ties share: every tied element gets a part


def test_reduce_max_runtime_axes():
    x = _with_ties((3, 4), 1)
    check_dynamic({"x": [0]}, "ReduceMax", [("x", x), ("a", i64(-1))], lambda x, a: torch.amax(x, -1), opset=18,
                  keepdims=0, out_ranks={"y0": 1}, fd=False)


def test_reduce_prod_zeros():
    x = r(4, 5)
    x[1, 2] = 0.0  # one zero in the row: only it gets a gradient
    x[2, 0] = x[2, 3] = 0.0  # two zeros: no gradient at all
    for opset in (13, 18):
        for keepdims in (0, 1):
            _reduce_check("ReduceProd", lambda x, d, k: x.prod(d[0], keepdim=bool(k)), x, (1,), keepdims, opset)
            _reduce_check("ReduceProd", lambda x, d, k: x.prod(d[0], keepdim=bool(k)), x, (-2,), keepdims, opset)
    _reduce_check("ReduceProd", lambda x, d, k: x.prod(), r(2, 3), (), 0, 13)
    check_dynamic({}, "ReduceProd", [("x", x), ("a", i64(1))], lambda x, a: x.prod(1), opset=18, keepdims=0,
                  out_ranks={"y0": 1})


L2 = lambda x, d, k: torch.linalg.vector_norm(x, 2, d, bool(k))  # noqa: E731
L1 = lambda x, d, k: x.abs().sum(d, keepdim=bool(k))  # noqa: E731
SUMSQ = lambda x, d, k: (x * x).sum(d, keepdim=bool(k))  # noqa: E731
LSE = lambda x, d, k: torch.logsumexp(x, d, keepdim=bool(k))  # noqa: E731
LOGSUM = lambda x, d, k: torch.log(x.sum(d, keepdim=bool(k)))  # noqa: E731


@pytest.mark.parametrize("axes", [(1,), (-1, 0), ()])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("opset", [13, 18])
def test_reduce_log_sum(axes, keepdims, opset):
    _reduce_check("ReduceLogSum", LOGSUM, np.abs(r(2, 3, 4)) + 0.1, axes, keepdims, opset)


@pytest.mark.parametrize("op,fn", [("ReduceL2", L2), ("ReduceL1", L1), ("ReduceSumSquare", SUMSQ),
                                   ("ReduceLogSumExp", LSE)])
@pytest.mark.parametrize("axes", [(1,), (-1, 0), ()])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("opset", [13, 18])
def test_reduce_norms(op, fn, axes, keepdims, opset):
    _reduce_check(op, fn, r(2, 3, 4), axes, keepdims, opset)


def test_reduce_l2_zero_norm():
    x = r(3, 4)
    x[1] = 0.0  # torch: gradient 0 where the norm is 0
    mask = np.ones_like(x)
    mask[1] = 0.0
    g = _reduce_check("ReduceL2", L2, x, (1,), 0, 18, fd_mask={"x": mask})
    assert np.all(np.isfinite(g["x"]))


def test_reduce_dynamic_others():
    x = r(2, 3, 4)
    for op, fn in [("ReduceL2", L2), ("ReduceLogSumExp", LSE), ("ReduceProd", lambda x, d, k: x.prod(1, bool(k)))]:
        check_dynamic({"x": [0, 1]}, op, [("x", x), ("a", i64(1))], lambda x, fn=fn: fn(x, (1,), 0),
                      consts=["a"], opset=18, keepdims=0)
    check_dynamic({"x": [0]}, "ReduceMax", [("x", x)], lambda x: torch.amax(x, (1,)), opset=13, axes=[1],
                  keepdims=0)


def _torch_cumsum(x, axis, exclusive, reverse):
    if reverse:
        x = x.flip(axis)
    y = x.cumsum(axis)
    if exclusive:
        y = y - x
    return y.flip(axis) if reverse else y


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cumsum(axis, exclusive, reverse):
    fn = lambda x: _torch_cumsum(x, axis, exclusive, reverse)  # noqa: E731
    check_op("CumSum", [("x", r(3, 4)), ("a", np.array(axis, dtype=np.int64))], fn, consts=["a"],
             exclusive=exclusive, reverse=reverse)


def test_cumsum_runtime_axis_dynamic():
    check_dynamic({"x": [0]}, "CumSum", [("x", r(3, 4)), ("a", np.array(1, dtype=np.int32))],
                  lambda x, a: _torch_cumsum(x, 1, 1, 0), exclusive=1)


# --- every opset, float32 ---------------------------------------------------------------------------------
REDUCTIONS = [("ReduceSum", SUM), ("ReduceMean", MEAN), ("ReduceL2", L2), ("ReduceL1", L1),
              ("ReduceSumSquare", SUMSQ), ("ReduceLogSumExp", LSE), ("ReduceLogSum", LOGSUM),
              ("ReduceProd", lambda x, d, k: x.prod(d[0], keepdim=bool(k))),
              ("ReduceMax", lambda x, d, k: torch.amax(x, d, bool(k))),
              ("ReduceMin", lambda x, d, k: torch.amin(x, d, bool(k)))]


def _sweep(opset, dtype):
    x = np.asarray(rng.permutation(24).reshape(2, 3, 4) / 10.0 + 0.05, dtype=dtype)  # distinct, no zeros
    for op, fn in REDUCTIONS:
        _reduce_check(op, fn, x, (-2,), 0, opset)
    check_op("CumSum", [("x", x), ("a", np.array(1, dtype=np.int64))], lambda x: _torch_cumsum(x, 1, 0, 1),
             consts=["a"], opset=opset, reverse=1)


test_every_opset, test_float32 = sweep_tests(_sweep, float32_opsets=(17, 20))


@pytest.mark.parametrize("opset", [13, 18])
def test_float16(opset):
    x = np.asarray(rng.permutation(24).reshape(2, 3, 4) / 10.0, dtype=np.float16)
    kw = {"rtol": 1e-2, "atol": 1e-2, "fd": False}
    for op, fn in [("ReduceSum", SUM), ("ReduceMean", MEAN), ("ReduceMax", lambda x, d, k: torch.amax(x, d, bool(k))),
                   ("ReduceL2", L2)]:
        _reduce_check(op, fn, x, (1,), 0, opset, **kw)
