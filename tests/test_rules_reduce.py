import numpy as np
import onnx
import pytest
import torch
from harness import Trainer, check_op, single_op_model, sweep_tests
from test_rules_shape import check_dynamic

import gradbuilder

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



def _torch_cumprod(x, axis, exclusive, reverse):
    """torch reference: cumprod (whose backward handles zeros), flipped for reverse, shifted by one for exclusive."""
    if reverse:
        x = x.flip(axis)
    y = x.cumprod(axis)
    if exclusive:
        n = x.shape[axis]
        y = torch.cat([torch.ones_like(x.narrow(axis, 0, 1)), y.narrow(axis, 0, n - 1)], axis)
    return y.flip(axis) if reverse else y


CUMPROD_ZEROS = {  # zero positions along the axis (of n), one line each; the other lines keep no zero
    "random": [],
    "one zero": [lambda n: [n // 2], lambda n: [0], lambda n: [n - 1]],
    "several zeros": [lambda n: [0, n - 1], lambda n: [1, 2], lambda n: [1, n - 2], lambda n: [0, 1, n - 1],
                      lambda n: [n // 2, n - 1], lambda n: list(range(n))],
}


def _with_zeros(shape, axis, *patterns):
    """Random values, the first lines along `axis` given the zeros of the CUMPROD_ZEROS `patterns` in turn (as
    many as there are lines)."""
    x = np.moveaxis(r(*shape), axis, -1).copy()
    lines = x.reshape(-1, x.shape[-1])
    wheres = [where for p in patterns for where in CUMPROD_ZEROS[p]]
    for line, where in zip(lines, wheres):
        line[where(x.shape[-1])] = 0.0
    return np.moveaxis(lines.reshape(x.shape), -1, axis)


def _cumprod_check(x, axis, exclusive, reverse, **kw):
    return check_op("CumProd", [("x", x), ("a", np.array(axis, dtype=np.int64))],
                    lambda x: _torch_cumprod(x, axis, exclusive, reverse), consts=["a"], opset=26,
                    exclusive=exclusive, reverse=reverse, **kw)


@pytest.mark.parametrize("pattern", list(CUMPROD_ZEROS))
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cumprod(pattern, axis, exclusive, reverse):
    """torch's gradients where x has no zero, one (first, middle, last along the axis) or several: before the
    first zero the product runs into, at it (the product of the others), and 0 past it; finite differences too
    (the function is a polynomial, smooth at zeros)."""
    x = _with_zeros((5, 6, 7), axis, pattern)
    g = _cumprod_check(x, axis, exclusive, reverse)
    assert np.all(np.isfinite(g["x"]))


@pytest.mark.parametrize("shape,axis", [((7,), 0), ((7,), -1), ((2, 3, 5, 4), 2), ((5, 2, 3, 4), -4)])
def test_cumprod_ranks(shape, axis):
    x = _with_zeros(shape, axis, "several zeros")
    for exclusive in (0, 1):
        for reverse in (0, 1):
            _cumprod_check(x, axis, exclusive, reverse)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cumprod_low_precision(dtype):
    x = np.asarray(_with_zeros((4, 6, 3), 1, "one zero", "several zeros"), dtype)
    kw = {"rtol": 1e-2, "atol": 1e-2, "fd": False} if dtype == np.float16 else {}
    for exclusive in (0, 1):
        for reverse in (0, 1):
            _cumprod_check(x, -2, exclusive, reverse, **kw)


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 1)])
def test_cumprod_runtime_axis_dynamic(exclusive, reverse):
    """The axis a graph input (int32, as in onnx's node tests) and the dims symbolic: the rule needs neither."""
    x = _with_zeros((4, 5), 1, "several zeros")
    check_dynamic({"x": [0, 1]}, "CumProd", [("x", x), ("a", np.array(-1, dtype=np.int32))],
                  lambda x, a: _torch_cumprod(x, 1, exclusive, reverse), opset=26, exclusive=exclusive,
                  reverse=reverse)


def test_cumprod_backward_reads_x_only():
    """The product at the first zero comes from a running product of x in backward: y is not kept for it."""
    model = single_op_model("CumProd", [("x", r(3, 4)), ("a", np.array(1, dtype=np.int64))], consts=["a"], opset=26)
    manifest = gradbuilder.split(gradbuilder.build_gradient_graph(model, wrt=["x"]))[2]
    assert sorted(e.name for e in manifest.backward_inputs if e.role in ("input", "stash")) == ["x"]


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
    if opset >= 26:
        check_op("CumProd", [("x", x), ("a", np.array(-1, dtype=np.int64))], lambda x: _torch_cumprod(x, -1, 1, 0),
                 consts=["a"], opset=opset, exclusive=1)


test_every_opset, test_float32 = sweep_tests(_sweep, float32_opsets=(17, 20))


@pytest.mark.parametrize("opset", [13, 18])
def test_float16(opset):
    x = np.asarray(rng.permutation(24).reshape(2, 3, 4) / 10.0, dtype=np.float16)
    kw = {"rtol": 1e-2, "atol": 1e-2, "fd": False}
    for op, fn in [("ReduceSum", SUM), ("ReduceMean", MEAN), ("ReduceMax", lambda x, d, k: torch.amax(x, d, bool(k))),
                   ("ReduceL2", L2)]:
        _reduce_check(op, fn, x, (1,), 0, opset, **kw)


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("op, axes", [(op, axes) for op in ("ReduceSum", "ReduceMean", "ReduceMax")
                                      for axes in ("computed", "constant", "attribute")
                                      if (op, axes) != ("ReduceSum", "attribute")])  # an input from opset 13
def test_reduce_axes_of_a_scalar_of_unknown_rank(op, keepdims, axes):
    """A scalar whose rank the build cannot see, reduced over axes computed at run time or given: onnxruntime
    reduces it to itself whatever the axes, so its gradient is the output's. Computed axes were made non-negative
    modulo the rank, a division by zero at run time (found by tests/fuzz/test_runtime_replay.py at seed 2); given
    ones unsqueezed the gradient to [1, 1] (seed 104)."""
    helper = onnx.helper
    x = helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, None)  # no shape: rank unknown
    a = helper.make_tensor_value_info("a", onnx.TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y0", onnx.TensorProto.DOUBLE, None)
    opset = 13 if axes == "attribute" else 18
    given = {"axes": [0, -1]} if axes == "attribute" else {}
    node = helper.make_node(op, ["x"] + ([] if given else ["a"]), ["y0"], keepdims=keepdims, **given)
    constants = [helper.make_tensor("a", onnx.TensorProto.INT64, [2], [0, -1])] if axes == "constant" else []
    graph = helper.make_graph([node], "g", [x] + ([a] if axes == "computed" else []), [y], constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    training = gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y0"])
    trainer = Trainer(training)
    for value in (np.float64(1.5), np.arange(6.0).reshape(2, 3)):  # the scalar, then a matrix over both axes
        feeds = {"x": np.asarray(value)}
        if axes == "computed":
            feeds["a"] = i64(5, -7) if value.ndim == 0 else i64(1, -2)
        outs, _ = trainer.run_forward(feeds)
        dy = np.asarray(np.full(outs[0].shape, 2.0))
        _, grads = trainer.step(feeds, [dy])
        tx = torch.tensor(value, requires_grad=True)
        ty = {"ReduceSum": SUM, "ReduceMean": MEAN, "ReduceMax": lambda t, d, k: t.amax(d, keepdim=bool(k))}[op](
            tx, (0, 1), keepdims) if value.ndim else tx * 1
        (want,) = torch.autograd.grad(ty, tx, torch.from_numpy(dy))
        assert grads["x"].shape == value.shape
        np.testing.assert_allclose(grads["x"], want.numpy(), rtol=1e-12)
