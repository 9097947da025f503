"""The fuzz mutator's models through the runtime: where plain onnxruntime runs a mutated model, TrainingSession
must build it (or refuse it with a GradBuilderError), give onnxruntime's own outputs, and run its backward.

The atheris harness stops at the builder; the runtime's passes, sessions and tensor exchange get the same odd
graphs here. Replaying the atheris corpus this way found a 0-d numpy gradient reaching onnxruntime as [1], a
Gemm flag of 7, and a declared `type {}` that stopped shape inference. GRADBUILDER_RUNTIME_FUZZ sets how many
mutations are tried (default 20000, ~2400 of them run, 20 s; deterministic), GRADBUILDER_RUNTIME_FUZZ_SEED which
(default 0): other seeds explore.
"""

from __future__ import annotations

import os
import random
import warnings

import fuzz_models
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx.reference import ReferenceEvaluator

from gradbuilder import build_gradient_graph
from gradbuilder.errors import GradBuilderError
from runtime import passes
from runtime.session import TrainingSession

CASES = int(os.environ.get("GRADBUILDER_RUNTIME_FUZZ", "20000"))
SEED = int(os.environ.get("GRADBUILDER_RUNTIME_FUZZ_SEED", "0"))
RANDOM = {"Dropout", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
          "Multinomial"}
NUMPY = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
         "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


def _mutations(count: int) -> list[bytes]:
    """The models among `count` mutations that the builder accepts, in a fixed order. Each is one structural
    mutation of a seed or of an earlier accepted mutation, so changes pile up while the models stay buildable
    (most mutations break a model: the atheris harness covers those)."""
    r = random.Random(SEED)
    pool = [m.SerializeToString() for m in fuzz_models.seeds().values()]
    out = []
    for i in range(count):
        data = fuzz_models.mutate_bytes(r.choice(pool), SEED * count + i, rounds=1)
        if data is None:
            continue
        try:
            build_gradient_graph(data)
        except GradBuilderError:
            continue
        pool.append(data)
        out.append(data)
    return out


def _feeds(session: ort.InferenceSession, rng: np.random.Generator) -> dict[str, np.ndarray] | None:
    """Random inputs of each input's declared type and shape (symbolic dims 2); None where a rank or type is
    not declared (no input would be the right one)."""
    feeds = {}
    for i in session.get_inputs():
        if i.type not in NUMPY or i.shape is None:
            return None
        shape = [d if isinstance(d, int) and d >= 0 else 2 for d in i.shape]
        t = NUMPY[i.type]
        feeds[i.name] = (rng.standard_normal(shape).astype(t) if np.issubdtype(t, np.floating)
                         else rng.integers(0, 2, shape).astype(t))
    return feeds


def _declares(model: onnx.ModelProto, feeds: dict[str, np.ndarray], outputs: list[np.ndarray]) -> bool:
    """Whether the inputs fed and the outputs onnxruntime computed have the ranks and sizes the model declares,
    a symbolic size one value throughout (a model declaring others is wrong, and its backward's gradient inputs,
    declared alike, refuse the real ones, or onnxruntime plans their buffers by the symbol and fails)."""
    sizes: dict[str, int] = {}
    values = [*(feeds[vi.name] for vi in model.graph.input if vi.name in feeds), *outputs]
    declared = [*(vi for vi in model.graph.input if vi.name in feeds), *model.graph.output]
    for vi, value in zip(declared, values):
        t = vi.type.tensor_type
        if not t.HasField("shape"):
            continue
        if len(t.shape.dim) != value.ndim:
            return False
        for d, n in zip(t.shape.dim, value.shape):
            if (d.HasField("dim_value") and d.dim_value != n) or (
                    d.HasField("dim_param") and sizes.setdefault(d.dim_param, n) != n):
                return False
    return True


def _reference(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray] | None:
    """onnx's reference implementation's outputs; None where the model has no meaning it can compute, the
    operands of an op not fitting it (a Concat of [0, 5] and [5, 3] on axis 1, which onnxruntime ran, its mean
    nan or 0.125 by the batch, and whose gradient cannot run: replay seed 287). Raises where it fails otherwise."""
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            return list(ReferenceEvaluator(onnx.load_from_string(model)).run(None, feeds))
    except ValueError as e:
        if "must match" in str(e) or "could not be broadcast" in str(e):
            return None
        raise


def _undefined(model: bytes, feeds: dict[str, np.ndarray]) -> bool:
    if _invalid_at(model, feeds):
        return True
    try:
        return _reference(model, feeds) is None
    except Exception:
        return False


def _invalid_at(model: bytes, feeds: dict[str, np.ndarray]) -> bool:
    """Whether onnx's strict shape inference refuses the model once its inputs have the feeds' shapes: an axis out
    of range for a rank known only then (a Softmax over axis 2 of a matrix whose rank a Squeeze without axes hid,
    which onnxruntime ran on an empty matrix, and whose gradient's ReduceSum over that axis cannot run: replay seed
    272)."""
    m = onnx.load_from_string(model)
    for i in m.graph.input:
        if i.name in feeds and i.type.HasField("tensor_type"):
            shape = i.type.tensor_type.shape
            shape.ClearField("dim")
            for n in np.shape(feeds[i.name]):
                shape.dim.add().dim_value = n
    try:
        onnx.shape_inference.infer_shapes(m, strict_mode=True)
    except Exception:
        return True
    return False


def _reference_verdict(model: bytes, feeds: dict[str, np.ndarray], i: int, got: np.ndarray) -> str:
    """Where onnxruntime's output i and the runtime's differ, onnx's reference implementation decides: "agrees"
    where it gives the runtime's (onnxruntime's Sigmoid is 0 below about -18, a rational approximation, so
    Pow(Sigmoid(-54.5), -0.04) was inf there and 7.39 through the runtime, as in numpy: replay seed 181),
    "undefined" where the model has no meaning (`_reference`), else "differs"."""
    try:
        want = _reference(model, feeds)
    except Exception:
        return "differs"
    if want is None:
        return "undefined"
    got, ref = got.astype(np.float64), np.asarray(want[i], np.float64)
    if got.shape != ref.shape:
        return "differs"
    # where the reference is not finite, any non-finite value agrees: products over infinities of both signs are
    # nan in numpy and inf or -inf in onnxruntime's kernels, which differ by the order they add in (a Gemm with
    # beta=inf, then a MatMul: replay seed 311)
    lost = ~np.isfinite(ref)
    if np.isfinite(got[lost]).any():
        return "differs"
    try:
        np.testing.assert_allclose(got[~lost], ref[~lost], rtol=1e-3, atol=1e-5)
    except AssertionError:
        return "differs"
    return "agrees"


def test_mutated_models_run_as_onnxruntime_runs_them() -> None:
    rng = np.random.default_rng(0)
    ran = refused = 0
    for k, data in enumerate(_mutations(CASES)):  # built first: onnxruntime crashes on some models the builder
        model = onnx.load_from_string(data)  # refuses (Max with an empty input)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                options = ort.SessionOptions()  # the reference unoptimized: some optimizers crash on odd graphs
                options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
                # the spelling onnxruntime reads right (it returns garbage for a Cast to int64 with saturate=7)
                canonical = passes.canonical_forms(model).SerializeToString()
                plain = ort.InferenceSession(canonical, options, providers=["CPUExecutionProvider"])
                feeds = _feeds(plain, rng)
                want = None if feeds is None else plain.run(None, feeds)
        except Exception:  # onnxruntime itself cannot load or run it: nothing to compare with
            continue
        if want is None:
            continue
        declared = _declares(model, feeds, want)
        what = f"mutation {k} ({onnx.printer.to_text(model.graph)[:600]})"
        try:
            session = TrainingSession.from_forward(data, threads=1)
        except GradBuilderError:
            continue
        except Exception as e:
            raise AssertionError(f"{what}: {e}") from e
        try:
            got, state = session.forward(feeds)
        except GradBuilderError as e:  # only the outputs' declared shapes are checked at the first forward
            if declared:
                raise AssertionError(f"{what}: {e}") from e
            refused += 1
            continue
        except Exception as e:
            raise AssertionError(f"{what}: {e}") from e
        assert declared, f"{what}: the outputs break their declared shapes, and the first forward let them pass"
        got = [np.asarray(v) for v in (got.values() if isinstance(got, dict) else got)]
        undefined = False
        if not any(n.op_type in RANDOM for n in model.graph.node):
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                assert a.shape == b.shape, f"{what}: output {i} is {a.shape}, onnxruntime's {b.shape}"
                # 1e-3: the runtime's rewrites may round otherwise, and more exactly (log(sigmoid(x)) at x = -11.8
                # is -11.7900 through the runtime, as in torch, and -11.7874 in onnxruntime): wrong graphs are off
                # by far more
                try:
                    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-3, atol=1e-5,
                                               equal_nan=True, err_msg=f"{what}: output {i}")
                except AssertionError:  # onnxruntime's kernels approximate: onnx's reference decides
                    verdict = _reference_verdict(canonical, feeds, i, a)
                    if verdict == "differs":
                        raise
                    undefined = undefined or verdict == "undefined"
        if undefined:  # a model without a meaning has no gradient to check either
            continue
        try:
            grads = session.backward(state, [np.ones_like(a) if a.dtype.kind == "f" else None for a in got])
        except Exception as e:
            if _undefined(canonical, feeds):  # its forward ran by chance
                continue
            raise AssertionError(f"{what}: {e}") from e
        for name, g in grads.items():
            assert g is None or np.asarray(g).dtype.kind == "f", f"{what}: gradient of {name}"
        ran += 1
    assert refused, "no mutation broke its outputs' declared shapes: the check at the first forward went untried"
    # other seeds' pools may drift to models onnxruntime cannot run (seed 183: 981 of 30,000 ran)
    assert ran >= CASES // 20 or SEED != 0, f"only {ran} of {CASES} mutations ran: the mutator or the filters changed"


@pytest.mark.parametrize("count", [40])
def test_mutations_are_deterministic(count: int) -> None:
    assert _mutations(count) == _mutations(count)
