"""runtime.gelus: torch's exported GELU (erf and tanh forms) as onnxruntime's contrib Gelu and FastGelu, with the
same values, and torch's gradients through ORTModule."""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from runtime import ORTModule
from runtime.gelus import fused_gelus


class Gelus(nn.Module):
    """torch's two forms, and Hugging Face's NewGELU (GPT-2's), written with a Pow and 0.5 * x first."""

    def forward(self, x):
        y = 3 * x
        new_gelu = 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))
        return F.gelu(x) + F.gelu(2 * x, approximate="tanh") + new_gelu


def _exported(module: nn.Module, dtype: torch.dtype = torch.float32) -> onnx.ModelProto:
    buf = io.BytesIO()
    torch.onnx.export(module, (torch.randn(3, 4, dtype=dtype),), buf, dynamo=False, opset_version=17,
                      input_names=["x"], dynamic_axes={"x": {0: "n"}})
    return onnx.load_from_string(buf.getvalue())


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("reread,fused", [(False, ["Gelu", "FastGelu", "FastGelu"]), (True, ["FastGelu", "FastGelu"])])
def test_both_forms_become_one_node(reread: bool, fused: list[str]) -> None:
    model = _exported(Gelus())
    if reread:  # an intermediate value of the erf form read elsewhere (a graph output): that GELU stays as it is
        erf = next(n for n in model.graph.node if n.op_type == "Erf")
        model.graph.output.append(onnx.helper.make_tensor_value_info(erf.output[0], onnx.TensorProto.FLOAT, ["n", 4]))
    out = fused_gelus(model)
    onnx.checker.check_model(out, full_check=True)
    assert sorted(n.op_type for n in out.graph.node if n.domain == "com.microsoft") == sorted(fused)
    assert ("Erf" in {n.op_type for n in out.graph.node}) == reread
    assert "Tanh" not in {n.op_type for n in out.graph.node}
    x = (np.random.default_rng(0).standard_normal((50, 4)) * 4).astype(np.float32)
    want = Gelus()(torch.from_numpy(x).double()).numpy()
    np.testing.assert_allclose(_run(out, x), want, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(_run(out, x), _run(model, x), rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_double_is_left_written_out() -> None:
    """FastGelu's CPU kernel is float32's: a float64 module's GELU stays in elementwise ops."""
    model = _exported(Gelus().double(), torch.float64)
    assert fused_gelus(model) is model


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_mlp_trains_as_torch(approximate: str) -> None:
    """Through ORTModule (a feature-major chain around the contrib node): torch's loss and gradients, and the
    graphs onnxruntime runs hold the contrib node, not the written-out form."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), nn.GELU(approximate=approximate), nn.Linear(16, 16),
                        nn.GELU(approximate=approximate), nn.Linear(16, 3))
    reference, model = copy.deepcopy(net), ORTModule(net, threads=1)
    x = torch.randn(16, 12) * 3  # 16 rows fill MLAS's strips: feature-major
    for m in (model, reference):
        m(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    [session] = model.training_sessions()
    op = "Gelu" if approximate == "none" else "FastGelu"
    assert [n.domain for n in session.source.graph.node if n.op_type == op] == ["com.microsoft"] * 2
