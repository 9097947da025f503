"""DFT against torch.fft in float64: full and one-sided, forward and inverse, real and complex inputs, a
dft_length that pads or truncates the signal, the axis as an attribute (opset 17) or an input (opset 20, a
constant or fed at run time)."""

import numpy as np
import pytest
import torch
from harness import check_op

import gradbuilder


def _reference(axis: int, inverse: bool, onesided: bool, length: int | None):
    def fn(x, *_):
        signal = x[..., 0] if x.shape[-1] == 1 else torch.view_as_complex(x)
        if onesided:
            y = torch.fft.rfft(signal, n=length, dim=axis)
        else:
            y = (torch.fft.ifft if inverse else torch.fft.fft)(signal, n=length, dim=axis)
        return torch.view_as_real(y.resolve_conj())
    return fn


@pytest.mark.parametrize("opset", [17, 20])
@pytest.mark.parametrize("axis", [1, 2])
@pytest.mark.parametrize("inverse,onesided,complex_input", [(0, 0, False), (0, 0, True), (1, 0, True), (1, 0, False),
                                                            (0, 1, False)])
@pytest.mark.parametrize("length", [None, 9, 5])
def test_dft(opset, axis, inverse, onesided, complex_input, length):
    x = np.random.default_rng(8).standard_normal((2, 7, 6, 2 if complex_input else 1))
    inputs = [("x", x), ("n", None if length is None else np.array(length, np.int64))]
    attrs = {"inverse": inverse, "onesided": onesided}
    if opset >= 20:
        inputs.append(("axis", np.array(axis, np.int64)))
    else:
        attrs["axis"] = axis
    check_op("DFT", inputs, _reference(axis, bool(inverse), bool(onesided), length), consts=["n", "axis"],
             opset=opset, **attrs)


def test_dft_axis_fed_at_run_time():
    """Opset 20's axis as a graph input: the gradient reads it at run time too (negative, counted from the back,
    the complex axis included)."""
    x = np.random.default_rng(9).standard_normal((2, 5, 6, 2))
    check_op("DFT", [("x", x), ("n", None), ("axis", np.array(-3, np.int64))],
             lambda t, *_: torch.view_as_real(torch.fft.fft(torch.view_as_complex(t), dim=1)), opset=20)


def test_dft_refuses_the_inverse_one_sided_transform():
    from harness import single_op_model

    x = np.zeros((1, 4, 3, 2), np.float32)
    model = single_op_model("DFT", [("x", x)], opset=17, axis=1, inverse=1, onesided=1)
    with pytest.raises(gradbuilder.GradBuilderError, match="IRFFT"):
        gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y0"])
