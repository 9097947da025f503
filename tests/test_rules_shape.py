from collections.abc import Sequence
from contextlib import contextmanager

import harness
import numpy as np
import onnx
import pytest
import torch
from harness import check_op, sweep_tests

import gradbuilder

rng = np.random.default_rng(0)


def r(*shape, dtype=np.float64):
    return np.asarray(rng.standard_normal(shape), dtype=dtype)


def i64(*values):
    return np.array(values, dtype=np.int64)


@contextmanager
def symbolic_dims(dims: dict[str, Sequence[int]], out_ranks: dict[str, int] | None = None):
    """Inside, check_op builds its model with the listed input axes symbolic ('<input>_<axis>'), so the
    rules take their run-time shape paths. `out_ranks` declares outputs whose rank inference cannot tell
    (the checker wants a shape on every output) with all dims symbolic."""
    base = harness.single_op_model

    def build(*args, **kwargs):
        m = base(*args, **kwargs)
        for vi in m.graph.input:
            for a in dims.get(vi.name, ()):
                d = vi.type.tensor_type.shape.dim[a]
                d.Clear()
                d.dim_param = f"{vi.name}_{a}"
        del m.graph.value_info[:]
        outs = [o.name for o in m.graph.output]
        del m.graph.output[:]
        m.graph.output.extend(onnx.helper.make_empty_tensor_value_info(o) for o in outs)
        m = onnx.shape_inference.infer_shapes(m)
        del m.graph.output[:]
        for o in outs:
            vi = next((v for v in m.graph.value_info if v.name == o), None)
            vi = vi if vi is not None else onnx.helper.make_empty_tensor_value_info(o)
            if o in (out_ranks or {}) and not vi.type.tensor_type.HasField("shape"):
                vi = onnx.helper.make_tensor_value_info(o, vi.type.tensor_type.elem_type,
                                                        [f"{o}_{k}" for k in range(out_ranks[o])])
            m.graph.output.append(vi)
        symbolic = [d for vi in m.graph.input for d in vi.type.tensor_type.shape.dim if d.dim_param]
        assert len(symbolic) == sum(len(v) for v in dims.values()), "symbolic_dims: unknown input or axis"
        return m

    harness.single_op_model = build
    try:
        yield
    finally:
        harness.single_op_model = base


def check_dynamic(dims: dict[str, Sequence[int]], *args, out_ranks: dict[str, int] | None = None, **kwargs):
    """check_op with symbolic input dims (see `symbolic_dims`)."""
    with symbolic_dims(dims, out_ranks):
        return check_op(*args, **kwargs)


# --- views ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opset", [13, 14, 21])
@pytest.mark.parametrize("shape,torch_shape", [((4, -1), (4, -1)), ((0, 12), (2, 12)), ((24,), (24,))])
def test_reshape(opset, shape, torch_shape):
    check_op("Reshape", [("x", r(2, 3, 4)), ("s", i64(*shape))], lambda x: x.reshape(torch_shape),
             consts=["s"], opset=opset)


def test_reshape_dynamic():
    check_dynamic({"x": [0]}, "Reshape", [("x", r(2, 3, 4)), ("s", i64(-1, 4))], lambda x: x.reshape(-1, 4),
                  consts=["s"])
    # the target shape itself computed at run time (a graph input)
    check_op("Reshape", [("x", r(2, 3, 4)), ("s", i64(6, 4))], lambda x, s: x.reshape(6, 4))


@pytest.mark.parametrize("perm", [None, [1, 2, 0], [0, 2, 1], [2, 0, 1]])
def test_transpose(perm):
    fn = (lambda x: x.permute(2, 1, 0)) if perm is None else (lambda x: x.permute(*perm))
    check_op("Transpose", [("x", r(2, 3, 4))], fn, perm=perm)


def test_transpose_dynamic():
    check_dynamic({"x": [0, 2]}, "Transpose", [("x", r(2, 3, 4))], lambda x: x.permute(1, 2, 0), perm=[1, 2, 0])
    check_dynamic({"x": [1]}, "Transpose", [("x", r(2, 3, 4))], lambda x: x.permute(2, 1, 0))


@pytest.mark.parametrize("axes,fn", [
    ((1,), lambda x: x.squeeze(1)),
    ((-1, 1), lambda x: x.squeeze(3).squeeze(1)),
    (None, lambda x: x.squeeze()),
])
def test_squeeze(axes, fn):
    inputs = [("x", r(2, 1, 3, 1))] + ([("a", i64(*axes))] if axes else [])
    check_op("Squeeze", inputs, fn, consts=["a"], opset=13)


@pytest.mark.parametrize("axes,fn", [
    ((0,), lambda x: x.unsqueeze(0)),
    ((-1, 1), lambda x: x.unsqueeze(1).unsqueeze(-1)),
])
def test_unsqueeze(axes, fn):
    check_op("Unsqueeze", [("x", r(2, 3)), ("a", i64(*axes))], fn, consts=["a"], opset=13)


def test_squeeze_unsqueeze_dynamic():
    check_dynamic({"x": [0]}, "Squeeze", [("x", r(2, 1, 3)), ("a", i64(1))], lambda x: x.squeeze(1),
                  consts=["a"], opset=18)
    check_dynamic({"x": [0, 1]}, "Unsqueeze", [("x", r(2, 3)), ("a", i64(-1))], lambda x: x.unsqueeze(-1),
                  consts=["a"], opset=21)


@pytest.mark.parametrize("axis", [0, 1, 2, 3, -1, -3])
def test_flatten(axis):
    a = axis % 3 if axis < 0 else axis

    def fn(x):
        return x.reshape(int(np.prod(x.shape[:a])), -1)

    check_op("Flatten", [("x", r(2, 3, 4))], fn, axis=axis)
    check_dynamic({"x": [0]}, "Flatten", [("x", r(2, 3, 4))], fn, axis=axis)


# --- broadcasting and copying ---------------------------------------------------------------------------
@pytest.mark.parametrize("xs,shape", [((3, 1), (2, 3, 4)), ((1,), (2, 2)), ((2, 3), (1, 3)), ((2, 1, 4), (3, 1))])
def test_expand(xs, shape):
    out = np.broadcast_shapes(xs, shape)
    check_op("Expand", [("x", r(*xs)), ("s", i64(*shape))], lambda x: x.expand(*out), consts=["s"])


def test_expand_dynamic():
    check_dynamic({"x": [0]}, "Expand", [("x", r(2, 1)), ("s", i64(2, 3))], lambda x: x.expand(2, 3),
                  consts=["s"])
    # shape known only at run time: the output shape is unknown at build time
    check_op("Expand", [("x", r(3, 1)), ("s", i64(2, 3, 4))], lambda x, s: x.expand(2, 3, 4))


@pytest.mark.parametrize(("reps", "opset"), [((2, 1, 3), 17), ((1, 1, 1), 17), ((1, 4, 1), 17), ((2, 0, 1), 17),
                                             ((2, 0, 1), 13)])  # a 0: nothing tiled (runtime replay seeds 0, 144)
def test_tile(reps, opset):
    check_op("Tile", [("x", r(2, 3, 2)), ("k", i64(*reps))], lambda x: x.repeat(*reps), consts=["k"], opset=opset)


def test_tile_dynamic():
    check_dynamic({"x": [0, 2]}, "Tile", [("x", r(2, 3, 2)), ("k", i64(3, 1, 2))], lambda x: x.repeat(3, 1, 2),
                  consts=["k"])
    check_op("Tile", [("x", r(2, 3)), ("k", i64(2, 3))], lambda x, k: x.repeat(2, 3))


# --- concat and split -----------------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(axis):
    shapes = [(2, 3, 4), (2, 3, 4), (2, 3, 4)]
    shapes = [tuple(s if d != axis % 3 else k for d, s in enumerate(shape)) for k, shape in zip((1, 2, 3), shapes)]
    inputs = [(f"x{k}", r(*s)) for k, s in enumerate(shapes)]
    fn = lambda *xs: torch.cat(xs, dim=axis)  # noqa: E731
    check_op("Concat", inputs, fn, axis=axis)
    check_op("Concat", inputs, fn, axis=axis, wrt=["x0", "x2"])  # Slice only the parts needed
    check_op("Concat", inputs, fn, axis=axis, wrt=["x1"])
    check_dynamic({"x0": [1], "x1": [0, 1, 2]}, "Concat", inputs, fn, axis=axis)
    check_dynamic({"x0": [1], "x1": [0, 1, 2]}, "Concat", inputs, fn, axis=axis, wrt=["x1", "x2"])


def test_concat_single():
    check_op("Concat", [("x", r(2, 3))], lambda x: torch.cat([x], 0), axis=0)


@pytest.mark.parametrize("opset", [13, 17, 18])
def test_split_sizes_input(opset):
    x = r(2, 6, 3)
    fn = lambda x: torch.split(x, [1, 2, 3], dim=1)  # noqa: E731
    check_op("Split", [("x", x), ("s", i64(1, 2, 3))], fn, n_out=3, consts=["s"], opset=opset, axis=1)
    check_op("Split", [("x", x), ("s", i64(1, 2, 3))], fn, n_out=3, diff_outputs=[0, 2], consts=["s"],
             opset=opset, axis=-2)
    if opset < 18:  # equal parts without num_outputs
        check_op("Split", [("x", x)], lambda x: torch.split(x, 3, dim=1), n_out=2, opset=opset, axis=1)


@pytest.mark.parametrize("opset", [18, 23])
def test_split_num_outputs(opset):
    x = r(7, 2)
    fn = lambda x: torch.split(x, 3, dim=0)  # noqa: E731  ONNX's uneven num_outputs split: 3, 3, 1
    check_op("Split", [("x", x)], fn, n_out=3, opset=opset, num_outputs=3, axis=0)
    check_op("Split", [("x", x)], fn, n_out=3, diff_outputs=[1], opset=opset, num_outputs=3, axis=0)
    check_dynamic({"x": [0, 1]}, "Split", [("x", x)], fn, n_out=3, diff_outputs=[0, 2], opset=opset,
                  num_outputs=3, axis=0)


# --- slice ----------------------------------------------------------------------------------------------
def _torch_slice(x, starts, ends, axes, steps):
    """numpy basic slicing has ONNX's clamping rules; torch lacks negative steps, so index with numpy's ranges."""
    for s, e, a, st in zip(starts, ends, axes, steps):
        idx = np.arange(x.shape[a])[slice(s, e, st)]
        x = torch.index_select(x, a, torch.from_numpy(idx.copy()))
    return x


SLICES = [
    ((1,), (3,), (1,), None),  # step 1, static: Pad
    ((-3, 0), (100, -1), (-1, 0), None),  # negative indices, clamping, negative axis
    ((0,), (2**62,), (2,), (2,)),  # steps: scatter
    ((-1, 3), (-100, 0), (1, 2), (-1, -2)),  # negative steps
    ((5,), (1,), (2,), (1,)),  # empty slice
    ((0, 1), (2, 3), None, None),  # no axes
]


@pytest.mark.parametrize("starts,ends,axes,steps", SLICES)
@pytest.mark.parametrize("opset", [13, 18])
def test_slice(starts, ends, axes, steps, opset):
    x = r(3, 4, 5)
    inputs = [("x", x), ("s", i64(*starts)), ("e", i64(*ends)), ("a", None if axes is None else i64(*axes)),
              ("t", None if steps is None else i64(*steps))]
    axes_ = axes if axes is not None else range(len(starts))
    steps_ = steps if steps is not None else [1] * len(starts)
    fn = lambda x: _torch_slice(x, starts, ends, axes_, steps_)  # noqa: E731
    check_op("Slice", inputs, fn, consts=["s", "e", "a", "t"], opset=opset)
    check_dynamic({"x": [0, 1, 2]}, "Slice", inputs, fn, consts=["s", "e", "a", "t"], opset=opset)


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_slice_runtime_inputs(dtype):
    x = r(4, 6)
    ref = lambda x: _torch_slice(x, (1, -4), (3, 100), (0, 1), (1, 2))  # noqa: E731
    inputs = [("x", x), ("s", np.array([1, -4], dtype)), ("e", np.array([3, 100], dtype)),
              ("a", np.array([0, 1], dtype)), ("t", np.array([1, 2], dtype))]
    check_op("Slice", inputs, lambda x, s, e: ref(x), consts=["a", "t"])  # starts, ends at run time
    check_op("Slice", inputs, lambda x, s, e, t: ref(x), consts=["a"])  # steps too
    check_op("Slice", inputs, lambda x, s, e, a, t: ref(x))  # and the axes: flat positions
    empty = [("x", r(4, 0)), ("s", np.array([0], dtype)), ("e", np.array([2], dtype)), ("a", np.array([0], dtype)),
             ("t", np.array([1], dtype))]  # flat positions of an input without elements (its Reshapes keep the 0)
    grads = check_op("Slice", empty, lambda x, s, e, a, t: x[0:2], fd=False)
    assert all(np.asarray(v).shape == (4, 0) for v in grads.values())
    step1 = [("x", x), ("s", np.array([-3], dtype)), ("e", np.array([5], dtype)), ("a", np.array([1], dtype))]
    check_dynamic({"x": [0, 1]}, "Slice", step1, lambda x, s: x[:, -3:5], consts=["e", "a"])


def _slice_grad_ops(inputs, consts, dims=()):
    model = harness.single_op_model("Slice", inputs, consts=consts)
    if dims:
        with symbolic_dims({"x": dims}):
            model = harness.single_op_model("Slice", inputs, consts=consts)
    nodes = [n.op_type for n in gradbuilder.build_gradient_graph(model, wrt=["x"]).graph.node]
    return set(nodes[nodes.index("Yield") + 1:])  # the backward part


def test_slice_strategy():
    """Pad for step 1 (static or not), per-axis ScatterND for other steps, flat positions only for run-time axes:
    the costly fallback must stay the fallback."""
    x = ("x", r(3, 4))
    s, e, a, t = ("s", i64(1)), ("e", i64(3)), ("a", i64(1)), ("t", i64(2))
    assert _slice_grad_ops([x, s, e, a], ["s", "e", "a"]) == {"Pad"}
    dynamic = _slice_grad_ops([x, s, e, a], ["s", "e", "a"], dims=[0, 1])
    assert "Pad" in dynamic and "Range" not in dynamic
    steps = _slice_grad_ops([x, s, e, a, t], ["s", "e", "a", "t"], dims=[1])
    assert "ScatterND" in steps and "ReduceProd" not in steps
    flat = _slice_grad_ops([x, s, e, a, t], ["s", "e", "t"])
    assert {"ScatterElements", "ReduceProd"} <= flat


# --- pad ------------------------------------------------------------------------------------------------
def _np_pad_index(d, b, e, mode):
    """Source position of each output position along one axis (-1: the fill value)."""
    if mode != "constant":
        return np.pad(np.arange(d), (b, e), mode=mode)
    idx = np.arange(d)[max(-b, 0): d - max(-e, 0)]  # negative pads crop
    return np.pad(idx, (max(b, 0), max(e, 0)), constant_values=-1)


def _torch_pad(x, pads, mode, axes=None, fill=0.0):
    """Gather through numpy.pad's index map (the same semantics as ONNX Pad), zeros for constant fill."""
    axes = list(range(x.dim())) if axes is None else [a % x.dim() for a in axes]
    k = len(axes)
    for n, a in enumerate(axes):
        idx = _np_pad_index(x.shape[a], pads[n], pads[n + k], mode)
        picked = torch.index_select(x, a, torch.from_numpy(np.maximum(idx, 0)))
        keep = torch.from_numpy((idx >= 0).astype(np.float64)).reshape([-1 if j == a else 1 for j in range(x.dim())])
        x = picked * keep + fill * (1 - keep)
    return x


@pytest.mark.parametrize("pads", [(1, 0, 2, 3), (0, 0, 0, 0), (-1, 2, 1, -2)])
@pytest.mark.parametrize("opset", [13, 18])
def test_pad_constant(pads, opset):
    x = r(3, 4)
    fn = lambda x: _torch_pad(x, pads, "constant")  # noqa: E731
    check_op("Pad", [("x", x), ("p", i64(*pads))], fn, consts=["p"], opset=opset)
    # a fill value does not change x's gradient; pads computed at run time
    check_op("Pad", [("x", x), ("p", i64(*pads)), ("v", np.array(2.0))],
             lambda x: _torch_pad(x, pads, "constant", fill=2.0), consts=["p", "v"], opset=opset)
    check_dynamic({"x": [0]}, "Pad", [("x", x), ("p", i64(*pads))], lambda x, p: fn(x), opset=opset)


@pytest.mark.parametrize("shape,target,axes", [((5, 6, 3), (3, 8), [0, 1]), ((4, 7), (7, 4), None),
                                               ((2, 5, 6), (4, 3), [-1, 1]), ((3, 4), (3, 4), None)])
def test_center_crop_pad(shape, target, axes):
    """CenterCropPad (onnxruntime runs its function body) against the centred crop (start (size - target) // 2)
    and zero pad (as many before) it defines, odd differences included."""
    def ref(x):
        for a, t in zip(axes if axes is not None else range(x.dim()), target):
            a, n = a % x.dim(), x.shape[a % x.dim()]
            if t < n:
                x = x.narrow(a, (n - t) // 2, t)
            elif t > n:
                before = (t - n) // 2
                x = torch.cat([x.new_zeros(*x.shape[:a], before, *x.shape[a + 1:]), x,
                               x.new_zeros(*x.shape[:a], t - n - before, *x.shape[a + 1:])], a)
        return x

    attrs = {} if axes is None else {"axes": axes}
    check_op("CenterCropPad", [("x", r(*shape)), ("t", i64(*target))], ref, consts=["t"], opset=18, **attrs)


def test_pad_constant_axes():
    x = r(2, 3, 4)
    check_op("Pad", [("x", x), ("p", i64(1, 2, 0, 1)), ("v", None), ("a", i64(-1, 0))],
             lambda x, _: _torch_pad(x, (1, 2, 0, 1), "constant", axes=(-1, 0)), consts=["p", "a"], opset=18)


@pytest.mark.parametrize("mode", ["reflect", "edge"])
@pytest.mark.parametrize("opset", [13, 18])
def test_pad_reflect_edge(mode, opset):
    x = r(3, 5)
    pads = (2, 0, 1, 3)
    fn = lambda x: _torch_pad(x, pads, mode)  # noqa: E731
    check_op("Pad", [("x", x), ("p", i64(*pads))], fn, consts=["p"], opset=opset, mode=mode)
    check_dynamic({"x": [0, 1]}, "Pad", [("x", x), ("p", i64(*pads))], lambda x, p: fn(x), opset=opset, mode=mode)


def test_pad_wrap_axes():
    x = r(2, 3, 4)
    pads = (2, 1, 3, 2)
    fn = lambda x, _: _torch_pad(x, pads, "wrap", axes=(2, -2))  # noqa: E731
    check_op("Pad", [("x", x), ("p", i64(*pads)), ("v", None), ("a", i64(2, -2))], fn, consts=["p", "a"],
             opset=19, mode="wrap")


def test_pad_reflect_runtime_axes_is_refused():
    model = harness.single_op_model("Pad", [("x", r(2, 3)), ("p", i64(1, 1)), ("v", None), ("a", i64(1))],
                                    consts=["p"], opset=18, mode="reflect")
    with pytest.raises(gradbuilder.GradBuilderError, match="axes computed at run time"):
        gradbuilder.build_gradient_graph(model, wrt=["x"])


# --- trilu ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [None, 0, 1, -2])
@pytest.mark.parametrize("upper", [0, 1])
def test_trilu(k, upper):
    kk = 0 if k is None else k
    fn = (lambda x: torch.triu(x, kk)) if upper else (lambda x: torch.tril(x, kk))
    inputs = [("x", r(2, 4, 5))] + ([("k", np.array(k, dtype=np.int64))] if k is not None else [])
    check_op("Trilu", inputs, fn, consts=["k"], opset=14, upper=upper)


# --- every opset, float32 ---------------------------------------------------------------------------------
def _sweep(opset, dtype):
    x = r(2, 3, 4, dtype=dtype)
    check_op("Reshape", [("x", x), ("s", i64(4, -1))], lambda x: x.reshape(4, -1), consts=["s"], opset=opset)
    check_op("Transpose", [("x", x)], lambda x: x.permute(1, 0, 2), opset=opset, perm=[1, 0, 2])
    check_op("Squeeze", [("x", r(2, 1, 3, dtype=dtype)), ("a", i64(1))], lambda x: x.squeeze(1), consts=["a"],
             opset=opset)
    check_op("Unsqueeze", [("x", x), ("a", i64(-1))], lambda x: x.unsqueeze(-1), consts=["a"], opset=opset)
    check_op("Flatten", [("x", x)], lambda x: x.reshape(2, -1), opset=opset)
    check_op("Expand", [("x", r(3, 1, dtype=dtype)), ("s", i64(2, 3, 4))], lambda x: x.expand(2, 3, 4),
             consts=["s"], opset=opset)
    check_op("Concat", [("a", x), ("b", r(2, 1, 4, dtype=dtype))], lambda a, b: torch.cat([a, b], 1), opset=opset,
             axis=1)
    attrs = {"num_outputs": 2} if opset >= 18 else {}
    check_op("Split", [("x", x)], lambda x: torch.split(x, 2, 2), n_out=2, opset=opset, axis=2, **attrs)
    sl = [("x", x), ("s", i64(1)), ("e", i64(4)), ("a", i64(2)), ("t", i64(2))]
    check_op("Slice", sl, lambda x: x[:, :, 1::2], consts=["s", "e", "a", "t"], opset=opset)
    check_op("Slice", sl[:4], lambda x: x[:, :, 1:], consts=["s", "e", "a"], opset=opset)
    check_op("Tile", [("x", x), ("k", i64(1, 2, 1))], lambda x: x.repeat(1, 2, 1), consts=["k"], opset=opset)
    pads = (0, 1, 2, 0, 2, 1)
    for mode in ("constant", "reflect", "edge") + (("wrap",) if opset >= 19 else ()):
        check_op("Pad", [("x", x), ("p", i64(*pads))], lambda x, mode=mode: _torch_pad(x, pads, mode), consts=["p"],
                 opset=opset, mode=mode)
    if opset >= 14:
        check_op("Trilu", [("x", x)], torch.triu, opset=opset)


test_every_opset, test_float32 = sweep_tests(_sweep, float32_opsets=(17, 21))


# --- non-differentiable ops -------------------------------------------------------------------------------
def test_nondiff_list_is_registered_from_the_ops_first_opset():
    from gradbuilder.rules import lookup
    from gradbuilder.rules.nondiff import NONDIFFERENTIABLE

    for op in NONDIFFERENTIABLE:
        rule = next(rr for rr in gradbuilder.rules.all_rules() if rr.op_type == op)
        assert rule.all_nondiff and rule.fn is None, op
        onnx.defs.get_schema(op, rule.since)  # the op exists at the first opset its entry claims
        if rule.since > 13:
            with pytest.raises(onnx.defs.SchemaError):
                onnx.defs.get_schema(op, rule.since - 1)
        assert lookup(op, 23) is rule


def _times_nondiff(op, x, **attrs):
    """y = x * op(x): the op's edge carries no gradient, so dy/dx = op(x), as torch says for floor & co."""
    nodes = [onnx.helper.make_node(op, ["x"], ["m"], **attrs), onnx.helper.make_node("Mul", ["x", "m"], ["y"])]
    graph = onnx.helper.make_graph(nodes, "g", [onnx.helper.make_tensor_value_info("x", 11, list(x.shape))],
                                   [onnx.helper.make_tensor_value_info("y", 11, list(x.shape))])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    training = gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y"])
    onnx.checker.check_model(training, full_check=True)
    dy = r(*x.shape)
    _, grads = harness.Trainer(training).step({"x": x}, [dy])
    return grads["x"], dy


@pytest.mark.parametrize("op,fn", [("Floor", torch.floor), ("Ceil", torch.ceil), ("Round", torch.round),
                                   ("Sign", torch.sign), ("EyeLike", lambda t: torch.eye(*t.shape, dtype=t.dtype))])
def test_nondiff_edge_carries_no_gradient(op, fn):
    x = r(3, 4) * 3
    t = torch.from_numpy(x).requires_grad_(True)
    grad, dy = _times_nondiff(op, x)
    (ref,) = torch.autograd.grad(t * fn(t), t, torch.from_numpy(dy))
    np.testing.assert_allclose(grad, ref.numpy(), rtol=1e-12)


@pytest.mark.parametrize(("op", "zeros"), [("Hardmax", False), ("Floor", True)])
def test_nondiff_only_path_gives_no_gradient_and_says_why(op, zeros):
    """Hardmax stops gradients (None, said why); Floor's derivative is zero: torch's zeros, listed as such."""
    nodes = [onnx.helper.make_node(op, ["x"], ["y"])]
    graph = onnx.helper.make_graph(nodes, "g", [onnx.helper.make_tensor_value_info("x", 11, [3])],
                                   [onnx.helper.make_tensor_value_info("y", 11, [3])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    meta = gradbuilder.read_metadata(gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y"]))
    assert meta["gradients"] == {}
    if zeros:
        assert meta["zero_gradient"] == ["x"] and meta["no_gradient"] == {}
    else:
        assert op in meta["no_gradient"]["x"] and meta["zero_gradient"] == []


@pytest.mark.parametrize("opset", [13, 18])
def test_float16(opset):
    x = r(2, 3, 4, dtype=np.float16)
    kw = {"rtol": 1e-2, "atol": 1e-2, "fd": False, "opset": opset}
    pads = (0, 0, 1, 0, 0, 2)
    check_op("Pad", [("x", x), ("p", i64(*pads))], lambda x: _torch_pad(x, pads, "reflect"), consts=["p"],
             mode="reflect", **kw)
    check_op("Slice", [("x", x), ("s", i64(3)), ("e", i64(-100)), ("a", i64(2)), ("t", i64(-2))],
             lambda x: x[:, :, [3, 1]], consts=["s", "e", "a", "t"], **kw)
    check_op("Concat", [("a", x), ("b", x)], lambda a, b: torch.cat([a, b], 1), axis=1, wrt=["b"], **kw)


@pytest.mark.parametrize(("dims", "stashes_shape"), [(["n", 4, 3], False), (["n", "m", 3], True)])
def test_reshape_back_without_a_stashed_shape(dims, stashes_shape):
    """With one symbolic dim the gradient reshapes to a constant holding -1 there: no Shape node, nothing int64
    stashed; with two it needs x's shape from the forward part."""
    f = onnx.TensorProto.FLOAT
    nodes = [onnx.helper.make_node("Flatten", ["x"], ["y"], axis=1), onnx.helper.make_node("Mul", ["y", "y"], ["sq"])]
    graph = onnx.helper.make_graph(nodes, "flat", [onnx.helper.make_tensor_value_info("x", f, dims)],
                                   [onnx.helper.make_tensor_value_info("sq", f, None)])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    training = gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["sq"])
    _, _, manifest = gradbuilder.split(training)
    stash = [e.name for e in manifest.backward_inputs if e.role == "stash"]
    assert sorted(stash) == (["x/Shape", "y"] if stashes_shape else ["y"]), stash
    assert ("Shape" in [n.op_type for n in training.graph.node]) == stashes_shape
