import numpy as np
import onnx
import pytest
import torch
from harness import Trainer, check_op, single_op_model
from onnx import TensorProto, helper

import gradbuilder

rng = np.random.default_rng(0)


def r(*shape):
    return np.asarray(rng.standard_normal(shape))


def f32(x):
    return np.asarray(x, dtype=np.float32)


def away_from_zero(x, gap=0.3):
    return np.where(np.abs(x) < gap, np.copysign(gap + 0.4, x), x)


BROADCAST = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 4)), ((), (2, 3)), ((2, 1, 4), (3, 1))]
OPSETS = [13, 17, 20]


# --- shared checks, also used by test_rules_activations -----------------------------------------------

def typed_model(op, elem_type, n_in=1, *, opset, shape=(2, 3), extra=(), **attrs):
    """One node on `n_in` inputs of `elem_type` (bfloat16 and float16 have no onnxruntime-independent numpy
    path), plus `extra` (name, ONNX type) inputs such as a bool condition put first."""
    ins = [helper.make_tensor_value_info(n, t, list(shape)) for n, t in extra]
    ins += [helper.make_tensor_value_info(f"x{i}", elem_type, list(shape)) for i in range(n_in)]
    node = helper.make_node(op, [i.name for i in ins], ["y"], **attrs)
    graph = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("y", elem_type, list(shape))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def check_typed(op, elem_type, n_in=1, *, opset, n_wrt=None, **kw):
    """The gradient graph of a non-float32/64 model passes the full checker: every emitted op takes the dtype
    at that opset. The first `n_wrt` (default all) inputs get gradients."""
    model = typed_model(op, elem_type, n_in, opset=opset, **kw)
    wrt = [f"x{i}" for i in range(n_in if n_wrt is None else n_wrt)]
    training = gradbuilder.build_gradient_graph(model, wrt=wrt)
    onnx.checker.check_model(training, full_check=True)
    assert set(gradbuilder.read_metadata(training)["gradients"]) == set(wrt)


def check_dynamic(op, inputs, *, consts=(), opset=17, **attrs):
    """Gradients of the same op with the leading dim of every graph input made symbolic equal the static ones."""
    feeds = {n: np.asarray(v) for n, v in inputs if v is not None and n not in consts}
    wrt = [n for n, v in feeds.items() if v.dtype.kind == "f"]
    results = []
    for dynamic in (False, True):
        model = single_op_model(op, inputs, opset=opset, consts=consts, **attrs)
        if dynamic:
            for vi in model.graph.input:
                dims = vi.type.tensor_type.shape.dim
                if len(dims):
                    dims[0].dim_param = "N"
            del model.graph.value_info[:]
            for o in model.graph.output:
                o.type.tensor_type.ClearField("shape")
            model = onnx.shape_inference.infer_shapes(model)
        training = gradbuilder.build_gradient_graph(model, wrt=wrt, outputs=["y0"])
        onnx.checker.check_model(training, full_check=True)
        trainer = Trainer(training)
        outs, _ = trainer.run_forward(feeds)
        cot = np.random.default_rng(1).standard_normal(outs[0].shape).astype(outs[0].dtype)
        results.append(trainer.step(feeds, [cot])[1])
    static, dyn = results
    assert set(static) == set(dyn) == set(wrt)
    for n in wrt:
        np.testing.assert_allclose(dyn[n], static[n], rtol=1e-12, atol=0, err_msg=n)


def backward_reads(op, inputs, **attrs):
    """The forward tensors the backward half reads for a one-node model of `op`."""
    model = single_op_model(op, inputs, **attrs)
    wrt = [n for n, v in inputs if v is not None]
    manifest = gradbuilder.split(gradbuilder.build_gradient_graph(model, wrt=wrt))[2]
    return sorted(e.name for e in manifest.backward_inputs if e.role in ("input", "stash"))


# --- arithmetic ------------------------------------------------------------------------------------

@pytest.mark.parametrize("sa,sb", BROADCAST)
@pytest.mark.parametrize("op,fn", [("Add", torch.add), ("Sub", torch.sub), ("Mul", torch.mul)])
def test_binary_broadcast(op, fn, sa, sb):
    check_op(op, [("a", r(*sa)), ("b", r(*sb))], fn)


@pytest.mark.parametrize("sa,sb", BROADCAST)
def test_div(sa, sb):
    check_op("Div", [("a", r(*sa)), ("b", away_from_zero(r(*sb)))], torch.div)


def test_neg_identity():
    check_op("Neg", [("x", r(3, 4))], torch.neg)
    check_op("Identity", [("x", r(3, 4))], lambda x: x * 1)


def test_same_tensor_twice():
    """x * x: both input slots contribute, summed into one gradient."""
    x = r(3, 4)
    graph = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [3, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    cot = r(3, 4)
    _, grads = Trainer(gradbuilder.build_gradient_graph(model, wrt=["x"])).step({"x": x}, [cot])
    np.testing.assert_allclose(grads["x"], 2 * x * cot, rtol=1e-12)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"])
@pytest.mark.parametrize("sa,sb", [((2, 3, 4), (4,)), ((2, 1, 4), (3, 1)), ((2, 3), (2, 3))])
def test_binary_dynamic_batch(op, sa, sb):
    a, b = r(*sa), r(*sb)
    if op in ("Pow", "Div"):
        a, b = np.abs(a) + 0.5, away_from_zero(b)
    check_dynamic(op, [("a", a), ("b", b)])


@pytest.mark.parametrize("op,fn,ft", [("Sum", lambda *xs: sum(xs), np.float64),
                                      ("Mean", lambda *xs: sum(xs) / len(xs), np.float32)])
@pytest.mark.parametrize("shapes", [[(3, 4)], [(3, 4), (4,)], [(2, 1, 4), (3, 1), ()], [(2, 3)] * 4])
def test_variadic_sum_mean(op, fn, ft, shapes):
    check_op(op, [(f"x{i}", np.asarray(r(*s), ft)) for i, s in enumerate(shapes)], fn)


def test_sum_mean_dynamic():
    check_dynamic("Sum", [("a", r(2, 3, 4)), ("b", r(4)), ("c", r(3, 1))])
    check_dynamic("Mean", [("a", f32(r(2, 3, 4))), ("b", f32(r(3, 1)))])


def test_sum_partial_wrt():
    check_op("Sum", [("a", r(2, 3)), ("b", r(3)), ("c", r(2, 3))], lambda a, b, c: a + b + c, wrt=["b"])


# --- unary math ---------------------------------------------------------------------------------

def _unif(lo, hi, shape=(3, 5)):
    return rng.uniform(lo, hi, shape)


# op, torch fn, input, whether onnxruntime's CPU provider has a double kernel
UNARY = [
    ("Exp", torch.exp, r(3, 5), True),
    ("Log", torch.log, _unif(0.2, 3), True),
    ("Sqrt", torch.sqrt, _unif(0.2, 3), True),
    ("Reciprocal", torch.reciprocal, away_from_zero(r(3, 5)), True),
    ("Sin", torch.sin, r(3, 5), True),
    ("Cos", torch.cos, r(3, 5), True),
    ("Erf", torch.erf, r(3, 5), False),
    ("Tan", torch.tan, _unif(-1.2, 1.2), False),
    ("Sinh", torch.sinh, r(3, 5), False),
    ("Cosh", torch.cosh, r(3, 5), False),
    ("Asin", torch.asin, _unif(-0.9, 0.9), False),
    ("Acos", torch.acos, _unif(-0.9, 0.9), False),
    ("Atan", torch.atan, r(3, 5) * 2, False),
    ("Atanh", torch.atanh, _unif(-0.9, 0.9), False),
    ("Asinh", torch.asinh, r(3, 5) * 2, False),
    ("Acosh", torch.acosh, _unif(1.2, 4), False),
]


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("op,fn,x,double", UNARY, ids=[u[0] for u in UNARY])
def test_unary(op, fn, x, double, opset):
    check_op(op, [("x", x if double else f32(x))], fn, opset=opset)


def test_unary_scalar_input():
    check_op("Exp", [("x", np.asarray(0.3))], torch.exp)
    check_op("Sqrt", [("x", np.asarray(2.0))], torch.sqrt)


@pytest.mark.parametrize("opset", OPSETS)
def test_abs_at_zero(opset):
    x = np.array([[-1.5, 0.0, 2.0], [0.0, -0.0, 0.7]])
    grads = check_op("Abs", [("x", x)], torch.abs, opset=opset, fd_mask={"x": (x != 0).astype(float)})
    assert np.all(grads["x"][x == 0] == 0)


@pytest.mark.parametrize("op,inputs,want", [
    ("Exp", 1, ["y0"]), ("Sqrt", 1, ["y0"]), ("Reciprocal", 1, ["y0"]), ("Tan", 1, ["y0"]), ("Log", 1, ["x0"]),
    ("Max", 2, ["x0", "x1"]), ("Min", 3, ["x0", "x1", "x2", "y0"])])
def test_backward_reads(op, inputs, want):
    """Rules whose derivative is a function of the output read it instead of the input: one stash, not two."""
    assert backward_reads(op, [(f"x{i}", r(3)) for i in range(inputs)]) == want


# --- Pow ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("sa,sb", BROADCAST)
def test_pow_base_and_exponent(sa, sb, opset):
    a = np.abs(r(*sa)) + 0.3
    check_op("Pow", [("a", a), ("b", r(*sb))], torch.pow, opset=opset)


def test_pow_edges_match_torch():
    """a == 0 with b >= 0: both gradients 0 (torch's where); a == 0, b < 0: -inf; a < 0: nan for the exponent."""
    a = np.array([0.0, 0.0, 0.0, -1.5, -2.0, 2.0, 0.0])
    b = np.array([0.0, 2.0, -1.0, 2.0, 3.0, 0.0, 0.5])
    grads = check_op("Pow", [("a", a), ("b", b)], torch.pow, fd=False)
    assert grads["a"][0] == 0 and grads["b"][0] == 0 and grads["b"][1] == 0
    assert np.isnan(grads["b"][3])


@pytest.mark.parametrize("c", [0.0, 1.0, 2.0, 0.5, 3.0, -1.0])
def test_pow_constant_exponent(c):
    a = np.abs(r(3, 4)) + 0.2
    check_op("Pow", [("a", a), ("b", np.asarray(c))], lambda x: torch.pow(x, c), consts=["b"])


def test_pow_constant_exponent_at_zero_base():
    a = np.array([0.0, 1.5, -2.0])
    check_op("Pow", [("a", a), ("b", np.asarray(2.0))], lambda x: x**2, consts=["b"])
    check_op("Pow", [("a", a), ("b", np.asarray(0.0))], lambda x: x**0.0, consts=["b"], fd=False)


def test_pow_constant_array_exponent():
    a = np.abs(r(2, 3)) + 0.2
    b = np.array([0.0, 2.0, -0.5])
    check_op("Pow", [("a", a), ("b", b)], lambda x: torch.pow(x, torch.from_numpy(b)), consts=["b"])


def test_pow_trained_exponent_is_read_at_run_time():
    """An exponent initializer that is itself trained must not be baked into the base's gradient."""
    a = np.abs(r(3, 4)) + 0.2
    model = single_op_model("Pow", [("a", a), ("b", np.asarray(2.0))], consts=["b"])
    training = gradbuilder.build_gradient_graph(model, wrt=["a", "b"])
    b_init = next(t for t in training.graph.initializer if t.name == "b")
    b_init.CopyFrom(onnx.numpy_helper.from_array(np.asarray(3.0), "b"))  # a training step has updated b
    cot = r(3, 4)
    _, grads = Trainer(training).step({"a": a}, [cot])
    np.testing.assert_allclose(grads["a"], 3 * a**2 * cot, rtol=1e-12)
    np.testing.assert_allclose(grads["b"], np.sum(a**3 * np.log(a) * cot), rtol=1e-12)


@pytest.mark.parametrize("opset", [13, 15, 20])
@pytest.mark.parametrize("const", [True, False])
def test_pow_integer_exponent(opset, const):
    a = r(3, 4)
    b = np.array([1, 2, 0, 3], dtype=np.int64)
    check_op("Pow", [("a", a), ("b", b)],
             (lambda x: torch.pow(x, torch.from_numpy(b))) if const else torch.pow,
             consts=["b"] if const else [], opset=opset)


@pytest.mark.parametrize("opset", [13, 15])
def test_pow_bfloat16_base_float_exponent_graph_is_valid(opset):
    """Pow-13 takes a bfloat16 base but no bfloat16 exponent: b - 1 must stay float."""
    ins = [helper.make_tensor_value_info("a", TensorProto.BFLOAT16, [2, 3]),
           helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])]
    graph = helper.make_graph([helper.make_node("Pow", ["a", "b"], ["y"])], "g", ins,
                              [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    training = gradbuilder.build_gradient_graph(model, wrt=["a", "b"])
    onnx.checker.check_model(training, full_check=True)
    assert set(gradbuilder.read_metadata(training)["gradients"]) == {"a", "b"}


def test_pow_mixed_float_types():
    """Pow-15 lets the exponent be another float type: its gradient comes back in its own type."""
    a = f32(np.abs(r(3, 4)) + 0.3)
    b = r(4)
    grads = check_op("Pow", [("a", a), ("b", b)], torch.pow, opset=15, rtol=1e-4)
    assert grads["b"].dtype == np.float64 and grads["a"].dtype == np.float32


# --- Min / Max ---------------------------------------------------------------------------------

def _stacked(red):
    """torch reference for the variadic op: reduce over the broadcast, stacked inputs (ties split equally)."""
    return lambda *xs: red(torch.stack(torch.broadcast_tensors(*xs)), 0)


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("sa,sb", BROADCAST)
@pytest.mark.parametrize("op,fn", [("Max", torch.maximum), ("Min", torch.minimum)])
def test_minmax_binary(op, fn, sa, sb, opset):
    check_op(op, [("a", r(*sa)), ("b", r(*sb))], fn, opset=opset)


@pytest.mark.parametrize("op,fn", [("Max", torch.maximum), ("Min", torch.minimum)])
def test_minmax_ties_split_like_torch(op, fn):
    a = rng.integers(-1, 2, (4, 5)).astype(np.float64)
    b = rng.integers(-1, 2, (5,)).astype(np.float64)
    assert np.any(a == b) and np.any(a != b)
    check_op(op, [("a", a), ("b", b)], fn, fd=False)


@pytest.mark.parametrize("op,fn", [("Max", torch.maximum), ("Min", torch.minimum)])
def test_minmax_nan_like_torch(op, fn):
    """torch gives a NaN pair's gradient to both inputs in full."""
    a = np.array([np.nan, 1.0, np.nan, 2.0])
    b = np.array([1.0, np.nan, np.nan, 2.0])
    grads = check_op(op, [("a", a), ("b", b)], fn, fd=False)
    assert np.all(np.isfinite(grads["a"]))


@pytest.mark.parametrize("op,red", [("Max", torch.amax), ("Min", torch.amin)])
@pytest.mark.parametrize("shapes", [[(3, 4)] * 3, [(2, 3, 4), (4,), (3, 1), ()]])
def test_minmax_variadic(op, red, shapes):
    check_op(op, [(f"x{i}", r(*s)) for i, s in enumerate(shapes)], _stacked(red))


@pytest.mark.parametrize("op,red", [("Max", torch.amax), ("Min", torch.amin)])
def test_minmax_variadic_ties(op, red):
    xs = [rng.integers(0, 2, s).astype(np.float64) for s in [(3, 4), (4,), (3, 4)]]
    check_op(op, [(f"x{i}", x) for i, x in enumerate(xs)], _stacked(red), fd=False)


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_minmax_single_input(op):
    check_op(op, [("x", r(3, 4))], lambda x: x * 1)


def test_max_partial_wrt():
    a, b = r(3, 4), r(4)
    check_op("Max", [("a", a), ("b", b)], torch.maximum, wrt=["b"])


# --- Clip, Where ----------------------------------------------------------------------------------

CLIP_X = np.array([[-2.0, -1.0, -0.5, 0.0], [0.5, 1.0, 1.5, 3.0]])


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("lo,hi", [(-1.0, 1.0), (None, 1.0), (-1.0, None), (None, None), (0.5, 0.5)])
@pytest.mark.parametrize("const", [True, False])
def test_clip(lo, hi, const, opset):
    """Boundaries pass the gradient (x == min or x == max), like torch.clamp."""
    ins = [("x", CLIP_X), ("min", None if lo is None else np.asarray(lo)),
           ("max", None if hi is None else np.asarray(hi))]
    bounds = [n for n, v in ins[1:] if v is not None]
    on_edge = np.isin(CLIP_X, [v for v in (lo, hi) if v is not None])
    def fn(x, mn=None, mx=None):
        if const:
            mn, mx = lo, hi
        return x * 1 if mn is None and mx is None else torch.clamp(x, mn, mx)
    grads = check_op("Clip", ins, fn, opset=opset, consts=bounds if const else [], wrt=["x"],
                     fd_mask={"x": (~on_edge).astype(float)})
    if lo is not None and hi is not None and lo < hi:
        assert np.all(grads["x"][on_edge] != 0)


@pytest.mark.parametrize("lo,hi", [(-0.7, 1.2), (None, 0.7), (-0.7, None), (1.2, 0.3)])
def test_clip_bounds_get_torch_s_gradients(lo, hi):
    """torch.clamp with tensor bounds (a learnable clipping level, PACT's alpha): min's gradient sums dY where
    x < min while min < max, max's where x > max or max < min (min above max clamps all to max)."""
    ins = [("x", CLIP_X), ("min", None if lo is None else np.asarray(lo)),
           ("max", None if hi is None else np.asarray(hi))]
    wrt = ["x", *(n for n, v in ins[1:] if v is not None)]
    check_op("Clip", ins, lambda x, mn=None, mx=None: torch.clamp(x, mn, mx), wrt=wrt)


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("sc,sa,sb", [((3, 4), (3, 4), (3, 4)), ((3, 1), (4,), ()), ((4,), (3, 1), (2, 1, 1)),
                                      ((2, 3, 4), (3, 4), (2, 1, 4))])
def test_where(sc, sa, sb, opset):
    c = rng.random(sc) > 0.5
    check_op("Where", [("c", c), ("a", r(*sa)), ("b", r(*sb))], torch.where, opset=opset)


def test_where_dynamic():
    check_dynamic("Where", [("c", rng.random((3, 1)) > 0.5), ("a", r(2, 3, 4)), ("b", r(4))])


# --- Cast ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("opset", [13, 19, 21])
def test_cast_float_types(opset):
    x = r(3, 4)
    check_op("Cast", [("x", x)], lambda t: t.float(), to=TensorProto.FLOAT, opset=opset, fd_eps=1e-2, fd_rtol=1e-4)
    grads = check_op("Cast", [("x", f32(x))], lambda t: t.double(), to=TensorProto.DOUBLE, opset=opset)
    assert grads["x"].dtype == np.float32
    check_op("Cast", [("x", x)], lambda t: t * 1, to=TensorProto.DOUBLE, opset=opset)


def test_cast_like():
    grads = check_op("CastLike", [("x", r(3, 4)), ("t", f32(np.zeros(1)))], lambda t: t.float(), consts=["t"],
                     opset=15, fd_eps=1e-2, fd_rtol=1e-4)
    assert grads["x"].dtype == np.float64


def test_cast_through_integer_stops_gradient():
    nodes = [helper.make_node("Cast", ["x"], ["i"], to=TensorProto.INT64),
             helper.make_node("Cast", ["i"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    meta = gradbuilder.read_metadata(gradbuilder.build_gradient_graph(model, wrt=["x"]))
    assert meta["gradients"] == {} and "non-float" in meta["no_gradient"]["x"]


# --- dtypes other than float32/64 -----------------------------------------------------------------

TYPED = [("Add", 2), ("Sub", 2), ("Mul", 2), ("Div", 2), ("Neg", 1), ("Identity", 1), ("Sum", 3), ("Mean", 2),
         ("Abs", 1), ("Exp", 1), ("Log", 1), ("Sqrt", 1), ("Reciprocal", 1), ("Pow", 2), ("Erf", 1),
         ("Max", 2), ("Min", 2), ("Max", 3), ("Min", 1), ("Clip", 3), ("Where", 2)]
TRIG = ["Sin", "Cos", "Tan", "Sinh", "Cosh", "Asin", "Acos", "Atan", "Atanh", "Asinh", "Acosh"]


@pytest.mark.parametrize("opset", [13, 15, 16, 22])
@pytest.mark.parametrize("elem_type", [TensorProto.BFLOAT16, TensorProto.FLOAT16])
@pytest.mark.parametrize("op,n_in", TYPED + [(t, 1) for t in TRIG], ids=lambda v: str(v))
def test_low_precision_graphs_are_valid(op, n_in, elem_type, opset):
    """bfloat16 Where/GreaterOrEqual only exist from opset 16: the rules must detour below it."""
    if op in TRIG and elem_type == TensorProto.BFLOAT16 and opset < 22:
        pytest.skip("the forward op itself has no bfloat16 before opset 22")
    if elem_type == TensorProto.BFLOAT16 and opset < {"Where": 16, "Pow": 15}.get(op, 0):
        pytest.skip("the forward op itself has no bfloat16 (Pow: for the exponent) at this opset")
    extra = [("c", TensorProto.BOOL)] if op == "Where" else []
    check_typed(op, elem_type, n_in, opset=opset, extra=extra, n_wrt=1 if op == "Clip" else None)



@pytest.mark.parametrize("fmod,opset,fn", [(1, 17, torch.fmod), (0, 28, torch.remainder)], ids=["fmod", "floor"])
@pytest.mark.parametrize("sa,sb", [((3, 4), (3, 4)), ((2, 3, 4), (4,))])
def test_float_mod(sa, sb, fmod, opset, fn):
    """fmod=1 truncates a/b (torch.fmod); from opset 28 a float Mod may floor it (fmod=0, torch.remainder)."""
    a = r(*sa) * 5
    b = away_from_zero(r(*sb), 0.5)
    # keep the probe off the jumps (where a/b crosses an integer)
    frac = np.abs(np.fmod(a / np.broadcast_to(b, np.broadcast_shapes(a.shape, b.shape)), 1.0))
    near = (frac < 0.05) | (frac > 0.95)
    check_op("Mod", [("a", np.where(near, a + 0.2, a)), ("b", b)], fn, fmod=fmod, fd_eps=1e-8, opset=opset)
