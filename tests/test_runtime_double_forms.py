"""runtime/double_forms.py: the elementwise ops onnxruntime computes in float only, written out for float64, give
torch's values to a few units in the last place (nan, infinities and the domains' edges included), and float64
modules using them train through ORTModule as torch's, under both exporters."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from parity import check_parity, sgd
from torch import nn
from torch.nn import functional as F

from runtime import ORTModule, double_forms, vectorized

F32 = float(np.float32(0.3))
"""An attribute as ONNX stores it (float32)."""
ANY = np.concatenate([np.random.default_rng(0).standard_normal(400) * 3, np.logspace(-300, 2.8, 120),
                      -np.logspace(-300, 2.8, 120), [0.0, 1.0, -1.0, 3.0, -3.0, 0.3, 5.9, 6.0, 7.0, 1e300, -1e300,
                                                    math.inf, -math.inf, math.nan]])
UNIT = np.concatenate([np.random.default_rng(1).uniform(-1, 1, 400), 1 - np.logspace(-16, -0.1, 60),
                       -1 + np.logspace(-16, -0.1, 60), np.logspace(-300, -0.1, 60), [0.0, 1.0, -1.0, 1.5, -1.5,
                                                                                      math.nan]])
FROM_ONE = np.concatenate([1 + np.abs(ANY[np.isfinite(ANY)]), 1 + np.logspace(-16, 0, 60), [1.0, 0.5, math.inf]])
MODERATE = ANY[np.abs(ANY) < 700]
"""Within exp's range (torch's sinh and cosh are finite a little further on)."""

T = torch.Tensor
CASES: dict[str, tuple[dict, Callable[[T], T], np.ndarray]] = {
    "Erf": ({}, torch.erf, ANY),
    "Atan": ({}, torch.atan, ANY),
    "Asin": ({}, torch.asin, UNIT),
    "Acos": ({}, torch.acos, UNIT),
    "Sinh": ({}, torch.sinh, MODERATE),
    "Cosh": ({}, torch.cosh, MODERATE),
    "Tan": ({}, torch.tan, ANY[np.abs(ANY) < 1e6]),
    "Asinh": ({}, torch.asinh, ANY),
    "Acosh": ({}, torch.acosh, FROM_ONE),
    "Atanh": ({}, torch.atanh, UNIT),
    "HardSigmoid": ({"alpha": F32, "beta": 0.25}, lambda x: torch.clamp(F32 * x + 0.25, 0, 1), ANY),
    "HardSwish": ({}, F.hardswish, ANY),
    "Gelu": ({}, F.gelu, ANY),
    "Gelu tanh": ({"approximate": "tanh"}, lambda x: F.gelu(x, approximate="tanh"), ANY),
    "Softsign": ({}, F.softsign, ANY),
    "ThresholdedRelu": ({"alpha": F32}, lambda x: torch.where(x > F32, x, 0.0), ANY),
    "LeakyRelu": ({"alpha": F32}, lambda x: F.leaky_relu(x, F32), ANY),
    "Elu": ({"alpha": F32}, lambda x: F.elu(x, F32), MODERATE),
    "Selu": ({}, lambda x: vectorized.SELU_GAMMA * F.elu(x, vectorized.SELU_ALPHA), MODERATE),
    "Celu": ({"alpha": F32}, lambda x: F.celu(x, F32), MODERATE),
    "Softplus": ({}, F.softplus, MODERATE),
    "Mish": ({}, F.mish, MODERATE),
}
ULPS = 4
"""The forms' error bound, units in the last place of torch's value (the worst measured against mpmath: asin's 4)."""
ABSOLUTE = {"Elu", "Selu", "Celu", "Softplus", "Mish", "Gelu", "Gelu tanh"}
"""`vectorized`'s forms take exp(x) - 1 for torch's expm1, and torch's GELU cancels in 1 + erf(x / sqrt(2)) (or 1 +
tanh(...)) for x below -5: right there to a few units in the last place of x's size, torch's too."""


def _single_node(op: str, attributes: dict) -> onnx.ModelProto:
    node = helper.make_node(op.split()[0], ["x"], ["y"], **attributes)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [None])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [None])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)


@pytest.mark.parametrize("op", list(CASES))
def test_forms_give_torchs_values_to_the_last_places(op: str) -> None:
    attributes, reference, x = CASES[op]
    written = double_forms.written_out(_single_node(op, attributes))
    assert op.split()[0] not in {n.op_type for n in written.graph.node}
    session = ort.InferenceSession(written.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x})[0]
    want = reference(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"nan where torch's is not, at {x}")
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)])
    error = np.abs(got[finite] - want[finite])
    allowed = ULPS * np.spacing(np.abs(want[finite]))
    if op in ABSOLUTE:
        allowed = np.maximum(allowed, ULPS * np.spacing(np.maximum(1.0, np.abs(x[finite]))))
    worst = int(np.argmax(error / allowed))
    assert error[worst] <= allowed[worst], (f"{op}({x[finite][worst]!r}) = {got[finite][worst]!r}, torch's "
                                            f"{want[finite][worst]!r}")


def test_only_float64_nodes_are_written_out() -> None:
    """A float32 Erf keeps onnxruntime's kernel; a graph without candidates comes back as itself."""
    erf32 = _single_node("Erf", {})
    for v in (*erf32.graph.input, *erf32.graph.output):
        v.type.tensor_type.elem_type = TensorProto.FLOAT
    assert double_forms.written_out(erf32) is erf32
    plain = _single_node("Exp", {})
    assert double_forms.written_out(plain) is plain


class Activated(nn.Module):
    """A Linear, the function under test, a Linear: the first Linear's gradients pass through its derivative."""

    def __init__(self, fn: Callable[[T], T]):
        super().__init__()
        self.fn, self.inner, self.outer = fn, nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: T) -> T:
        return self.outer(self.fn(self.inner(x)))


MODULES: dict[str, Callable[[T], T]] = {
    "gelu": F.gelu,
    "erf, erfc": lambda h: torch.erf(h) + torch.erfc(h / 2) * h,
    "hardswish": F.hardswish,
    "atan": torch.atan,
    "asin, acos": lambda h: torch.asin(torch.tanh(h)) + torch.acos(torch.tanh(h / 3)) * h,
    "sinh, cosh, tan": lambda h: torch.sinh(h) + torch.cosh(h / 2) + torch.tan(h / 4),
    "asinh, acosh, atanh": lambda h: torch.asinh(h) + torch.acosh(1 + h * h) + torch.atanh(torch.tanh(h) * 0.9),
}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("fn", list(MODULES))
def test_float64_modules_using_them_train_like_torch(fn: str, exporter: str) -> None:
    """These modules were refused at their session's load ("Could not find an implementation for Erf(13)")."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(5, 6, generator=g, dtype=torch.float64) * 2, torch.randint(0, 3, (5,), generator=g))
               for _ in range(2)]
    check_parity(lambda: Activated(MODULES[fn]).double(), batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                 sgd, rtol=1e-10, exporter=exporter, threads=1)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_float64_hardsigmoid_is_torch_s(exporter: str) -> None:
    """Its values are torch's relu6(x + 3) / 6 to the last bits (the exporters' HardSigmoid holds 1/6 as a float32
    attribute: 4e-9 off), its gradients torch's own: hardsigmoid's backward multiplies by 1/6 rounded to float32
    (1.7e-8 relative above the formula's, which ours were)."""
    torch.manual_seed(0)
    reference = Activated(F.hardsigmoid).double()
    module = ORTModule(copy.deepcopy(reference), exporter=exporter)
    x = torch.randn(64, 6, dtype=torch.float64) * 4
    got, want = module(x), reference(x)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    got.square().sum().backward()
    want.square().sum().backward()
    for a, b in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_float64_celu_is_torch_s(exporter: str) -> None:
    """torch's celu backward scales x by 1 / alpha with alpha rounded to float32, its forward by the exact 1 / alpha:
    at alpha 0.3 or 1.3 its gradients are 6e-9 off the formula's, which ours were. In place, and as a module."""
    torch.manual_seed(0)
    reference = Activated(lambda h: F.celu(h, 0.3) + F.celu(2 * h, 1.3, inplace=True) + nn.CELU(0.7)(h)
                          + F.celu(h / 2)).double()
    module = ORTModule(copy.deepcopy(reference), exporter=exporter)
    x = torch.randn(64, 6, dtype=torch.float64) * 4
    got, want = module(x), reference(x)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)
    got.square().sum().backward()
    want.square().sum().backward()
    for a, b in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-13, atol=1e-14)
