"""DFT against torch.fft in float64: full and one-sided, forward and inverse (IRFFT too), real and complex inputs, a
dft_length that pads or truncates the signal, the axis as an attribute (opset 17) or an input (opset 20, a
constant or fed at run time)."""

import numpy as np
import pytest
import torch
from harness import check_op


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


@pytest.mark.parametrize("op,complex_input", [("fft", False), ("fft", True), ("rfft", False), ("irfft", True)])
def test_dft_of_an_input_whose_parts_the_graph_does_not_size(op, complex_input):
    """The last dim (1: real, 2: complex) read at run time where the graph leaves it symbolic: rfft2's second
    transform reads the first's output, whose last dim dynamo's graph did not size."""
    x = np.random.default_rng(13).standard_normal((2, 6, 3, 2 if complex_input else 1))
    attrs = {"axis": 1, "inverse": int(op == "irfft"), "onesided": int(op != "fft")}
    if op == "irfft":
        reference = lambda t, *_: torch.fft.irfft(torch.view_as_complex(t), dim=1)[..., None]  # noqa: E731
    else:
        reference = _reference(1, False, op == "rfft", None)
    check_op("DFT", [("x", x), ("n", None)], reference, symbolic={"x": [3]}, **attrs)


@pytest.mark.parametrize("opset", [17, 20])
@pytest.mark.parametrize("bins,length", [(6, None), (6, 10), (6, 11), (4, 6), (4, 7)])
def test_dft_inverse_one_sided(opset, bins, length):
    """IRFFT against torch.fft.irfft, which ignores the imaginary parts of bins 0 and L/2 as onnxruntime does, for
    even and odd lengths."""
    x = np.random.default_rng(10).standard_normal((2, bins, 3, 2))
    inputs = [("x", x), ("n", None if length is None else np.array(length, np.int64))]
    attrs = {"inverse": 1, "onesided": 1}
    if opset >= 20:
        inputs.append(("axis", np.array(1, np.int64)))
    else:
        attrs["axis"] = 1
    check_op("DFT", inputs, lambda t, *_: torch.fft.irfft(torch.view_as_complex(t), n=length, dim=1)[..., None],
             consts=["n", "axis"], opset=opset, **attrs)


def test_dft_inverse_one_sided_refuses_other_bin_counts():
    """onnxruntime's IRFFT of a spectrum longer or shorter than dft_length // 2 + 1 bins is not numpy's: refused."""
    from harness import single_op_model

    import gradbuilder

    model = single_op_model("DFT", [("x", np.zeros((1, 5, 3, 2), np.float32)), ("n", np.array(12, np.int64))],
                            consts=["n"], opset=17, axis=1, inverse=1, onesided=1)
    with pytest.raises(gradbuilder.GradBuilderError, match="5 bins to 12 samples"):
        gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y0"])


def _stft_reference(step: int, length: int, onesided: bool):
    def fn(x, window=None):
        signal = x if x.dim() == 2 else x[..., 0] if x.shape[-1] == 1 else torch.view_as_complex(x)
        y = torch.stft(signal, length, step, win_length=length, window=window, center=False, onesided=onesided,
                       return_complex=True)
        return torch.view_as_real(y).transpose(1, 2)
    return fn


@pytest.mark.parametrize("opset", [17, 20])
@pytest.mark.parametrize("step,length,samples", [(4, 16, 53), (5, 12, 40), (16, 16, 48), (20, 8, 50)],
                         ids=["overlapping", "step not dividing", "adjacent", "gaps"])
@pytest.mark.parametrize("onesided,parts", [(1, 1), (0, 1), (0, 2), (1, None)],
                         ids=["one-sided", "full", "complex", "[batch, length]"])
def test_stft(opset, step, length, samples, onesided, parts):
    """STFT against torch.stft (center=False) in float64, the signal's and the window's gradients: frames that
    overlap (summed back), that do not, with gaps between them, and samples past the last frame (no gradient).
    A real signal also as [batch, length], as torch's exporter writes it and onnxruntime reads it."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, samples) if parts is None else (2, samples, parts))
    inputs = [("x", x), ("step", np.array(step, np.int64)), ("window", rng.standard_normal(length)),
              ("length", np.array(length, np.int64))]
    check_op("STFT", inputs, _stft_reference(step, length, bool(onesided)), consts=["step", "length"], opset=opset,
             onesided=onesided)


@pytest.mark.parametrize("given", ["window", "length"])
def test_stft_frame_length_from_the_window_or_given(given):
    """frame_length read off the window where it is left out; a rectangular window where the window is."""
    rng = np.random.default_rng(12)
    x, window = rng.standard_normal((3, 30, 1)), rng.standard_normal(10)
    inputs = [("x", x), ("step", np.array(3, np.int64)), ("window", window if given == "window" else None),
              ("length", np.array(10, np.int64) if given == "length" else None)]
    reference = _stft_reference(3, 10, True)
    rectangular = lambda t, _: reference(t, torch.ones(10, dtype=t.dtype))  # noqa: E731
    check_op("STFT", inputs, reference if given == "window" else rectangular, consts=["step", "length"], onesided=1)
