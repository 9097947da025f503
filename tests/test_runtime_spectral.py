"""Short-time Fourier transforms through ORTModule, as audio models use them: a waveform generator trained by a
multi-resolution STFT loss on magnitudes, a classifier on a log power spectrogram, the deprecated real form
(`return_complex=False`, which the legacy exporter writes as ONNX's STFT of a [batch, length] signal), a denoiser
masking a spectrogram and inverting it (torch.istft, `functions._istft`), and the windows, in float64 against torch."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from parity import check_parity, sgd
from torch import nn
from torch.nn import functional as F

from runtime import ExportWarning, ORTModule


class Generator(nn.Module):
    """Convolutions making a waveform, trained towards a target by spectral convergence and log-magnitude distance
    at three resolutions (a vocoder's auxiliary loss)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(1, 8, 7, padding=3), nn.LeakyReLU(0.2), nn.Conv1d(8, 1, 7, padding=3))

    def forward(self, z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        y = self.net(z[:, None])[:, 0]
        loss = y.new_zeros(())
        for n in (32, 64, 128):
            window = torch.hann_window(n, dtype=y.dtype)
            got = torch.stft(y, n, n // 4, window=window, return_complex=True).abs().clamp(min=1e-7)
            want = torch.stft(target, n, n // 4, window=window, return_complex=True).abs().clamp(min=1e-7)
            loss = loss + torch.linalg.norm(want - got) / torch.linalg.norm(want) + F.l1_loss(got.log(), want.log())
        return loss


class Classifier(nn.Module):
    """A learned filter, a Hamming-windowed log power spectrogram (complex, or the real form), a convolution."""

    def __init__(self, complex_form: bool = True):
        super().__init__()
        self.complex_form = complex_form
        self.filter = nn.Conv1d(1, 1, 9, padding=4)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.filter(x[:, None])[:, 0]
        window = torch.hamming_window(64, dtype=h.dtype)
        if self.complex_form:
            spectrum = torch.stft(h, 64, 16, window=window, return_complex=True)
            power = spectrum.real ** 2 + spectrum.imag ** 2
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # return_complex=False is deprecated
                power = torch.stft(h, 64, 16, window=window, return_complex=False).pow(2).sum(-1)
        return self.head(F.relu(self.conv(torch.log1p(power)[:, None])).mean((2, 3)))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_multi_resolution_stft_loss_trains_like_torch(exporter: str) -> None:
    """The legacy exporter has no complex tensors: the module goes to dynamo, with a warning saying why. (Over 300
    samples the steps' gradients part 300x a step from 2e-13, the logarithms of tiny magnitudes amplifying rounding
    as in torch's own float32 run; over 600 they stay within 1e-12.)"""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 600, generator=g, dtype=torch.float64),
                torch.randn(2, 600, generator=g, dtype=torch.float64)) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_parity(lambda: Generator().double(), batches, lambda m, b: m(*b), sgd, rtol=1e-10, exporter=exporter)
    moved = [w for w in caught if issubclass(w.category, ExportWarning) and "complex tensors" in str(w.message)]
    assert len(moved) == (exporter == "torchscript")


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("complex_form", [True, False], ids=["complex", "real form"])
def test_a_spectrogram_classifier_trains_like_torch(complex_form: bool, exporter: str) -> None:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 250, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g))
               for _ in range(3)]
    check_parity(lambda: Classifier(complex_form).double(), batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                 sgd, rtol=1e-10, exporter=exporter)


class Denoiser(nn.Module):
    """A mask over a noisy signal's spectrogram from its magnitudes, the signal made again by torch.istft."""

    def __init__(self, n_fft: int, hop: int, width: int | None = None, full: bool = False, **options: Any):
        super().__init__()
        self.n_fft, self.hop, self.width, self.full, self.options = n_fft, hop, width or n_fft, full, options
        self.mask = nn.Conv1d(n_fft // 2 + 1, n_fft // 2 + 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        window = torch.hann_window(self.width, dtype=x.dtype)
        center, normalized = self.options.get("center", True), self.options.get("normalized", False)
        spectrum = torch.stft(x, self.n_fft, self.hop, self.width, window, center=center, normalized=normalized,
                              return_complex=True)
        spectrum = spectrum * torch.sigmoid(self.mask(spectrum.abs()))
        if self.full:  # the bins past n_fft // 2 too, as a two-sided spectrum (istft reads the first half)
            spectrum = torch.cat([spectrum, spectrum[:, 1:self.n_fft // 2].flip(1).conj()], 1)
        length = x.shape[-1] if self.options.get("length") == "input's" else self.options.get("length")
        return torch.istft(spectrum, self.n_fft, self.hop, self.width, window, center=center, normalized=normalized,
                           onesided=not self.full, length=length)


DENOISERS: dict[str, Callable[[], Denoiser]] = {
    "hop dividing n_fft": lambda: Denoiser(64, 16),
    "the input's length": lambda: Denoiser(64, 16, length="input's"),
    "longer, zero-padded": lambda: Denoiser(64, 16, length=330),
    "hop not dividing n_fft": lambda: Denoiser(60, 25),
    "hop coprime to n_fft (F.fold)": lambda: Denoiser(64, 15),
    "a window narrower than n_fft, normalized": lambda: Denoiser(64, 16, width=48, normalized=True),
    "a two-sided spectrum": lambda: Denoiser(64, 16, full=True),
}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("denoiser", list(DENOISERS))
def test_a_denoiser_inverting_its_spectrogram_trains_like_torch(denoiser: str, exporter: str) -> None:
    """Dynamo wrote torch's istft with one scatter a sample of the window, its indices int32 (no ONNX ScatterND
    takes them: the gradient build refused the graph)."""
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, 300, generator=g, dtype=torch.float64),) for _ in range(2)]
    check_parity(lambda: DENOISERS[denoiser]().double(), batches, lambda m, b: m(b[0]).square().mean(), sgd,
                 rtol=1e-10, exporter=exporter)


def test_an_istft_torch_refuses_is_refused() -> None:
    """A Hann window without center=True: its squares overlap-add to 0 at the signal's first sample."""
    module = ORTModule(Denoiser(64, 16, center=False).double(), exporter="dynamo")
    with pytest.raises(RuntimeError, match="window overlap add min"):
        module(torch.randn(2, 300, dtype=torch.float64))


SPECTRA: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # the second transform reads the first's output, whose last dim (real, complex) dynamo's graph leaves unsized
    "rfft2": lambda h: torch.fft.rfft2(h.reshape(-1, 4, 6)).abs().flatten(1),
    "rfftn, irfftn": lambda h: torch.fft.irfftn(torch.fft.rfftn(h.reshape(-1, 4, 6)) * 1.5, s=(4, 6)).flatten(1),
    # sample frequencies, which dynamo had no conversion of
    "rfftfreq": lambda h: torch.fft.rfft(h).abs() * torch.fft.rfftfreq(24, d=0.5, dtype=h.dtype),
}


class Spectral(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], signed: bool = False):
        super().__init__()
        self.fc, self.fn, self.signed = nn.Linear(24, 24), fn, signed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fn(self.fc(x))
        return y.mean() if self.signed else y.square().mean()


@pytest.mark.parametrize("spectrum", list(SPECTRA))
def test_transforms_of_transforms_and_sample_frequencies_train_like_torch(spectrum: str) -> None:
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(3, 24, generator=g, dtype=torch.float64),) for _ in range(2)]
    check_parity(lambda: Spectral(SPECTRA[spectrum]).double(), batches, lambda m, b: m(b[0]), sgd, rtol=1e-10,
                 exporter="dynamo")


PHASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "rfft": lambda h: torch.fft.rfft(h).angle(),
    "rfft of an odd length, and of n": lambda h: torch.cat([torch.fft.rfft(h[:, :23]).angle(),
                                                            torch.fft.rfft(h, n=30).angle()], 1),
    "rfft2, rfftn": lambda h: torch.cat([torch.fft.rfft2(h.reshape(-1, 4, 6)).angle().flatten(1),
                                         torch.fft.rfftn(h.reshape(-1, 2, 3, 4), dim=(1, 3)).angle().flatten(1)], 1),
    "stft, complex and real forms": lambda h: torch.cat([
        torch.stft(h, 8, 2, window=torch.hann_window(8, dtype=h.dtype), center=False,
                   return_complex=True).angle().flatten(1),
        _phase(torch.stft(h, 8, 2, window=torch.hann_window(8, dtype=h.dtype), center=False,
                          return_complex=False)).flatten(1) * 2], 1),
    # weighted by bin: a real signal's conjugate bins' phases cancel in a plain mean
    "stft, two-sided": lambda h: torch.stft(h, 8, 2, window=torch.hann_window(8, dtype=h.dtype), center=False,
                                            onesided=False, return_complex=True).angle().mul(
        torch.linspace(0.5, 1.5, 8, dtype=h.dtype)[:, None]).flatten(1),
}


def _phase(parts: torch.Tensor) -> torch.Tensor:
    """The phase of a spectrum in real form ([..., 2]: real, imaginary)."""
    return torch.atan2(parts[..., 1], parts[..., 0])


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("phase", list(PHASES))
def test_phases_of_real_transforms_train_like_torch(phase: str, exporter: str) -> None:
    """torch's transforms of real signals are real at their first and middle bins, imaginary parts exactly 0,
    where onnxruntime's leave ~1e-15 of either sign; and dynamo's angle took -pi for pi at +0. Both flipped phases
    by 2 pi where the real part is negative: the first call's check refused every such module."""
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(3, 24, generator=g, dtype=torch.float64),) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # return_complex=False is deprecated
        check_parity(lambda: Spectral(PHASES[phase], signed=True).double(), batches, lambda m, b: m(b[0]), sgd,
                     rtol=1e-10, exporter=exporter)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_phases_over_a_length_read_at_run_time_train_like_torch(exporter: str) -> None:
    """The bins made real are found from the length in the graph: an even and an odd one from one export."""
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(3, n, 24, generator=g, dtype=torch.float64),) for n in (10, 7, 10)]
    phase = lambda h: torch.fft.rfft(h, dim=1).angle()  # noqa: E731
    check_parity(lambda: Spectral(phase, signed=True).double(), batches, lambda m, b: m(b[0]), sgd, rtol=1e-10,
                 exporter=exporter)


WINDOWS: dict[str, Callable[[torch.dtype], torch.Tensor]] = {
    "hann": lambda d: torch.hann_window(40, dtype=d),
    "hamming": lambda d: torch.hamming_window(40, dtype=d),
    "hamming, symmetric, alpha and beta": lambda d: torch.hamming_window(41, False, 0.6, 0.3, dtype=d),
    "blackman, symmetric": lambda d: torch.blackman_window(41, periodic=False, dtype=d),
    "bartlett": lambda d: torch.bartlett_window(40, dtype=d),
    "kaiser": lambda d: torch.kaiser_window(40, dtype=d),
    "signal.windows": lambda d: (torch.signal.windows.kaiser(40, beta=6.0, dtype=d)
                                 + torch.signal.windows.gaussian(40, std=5.0, dtype=d)
                                 + torch.signal.windows.nuttall(40, sym=False, dtype=d)),
}


class Windowed(nn.Module):
    def __init__(self, window: Callable[[torch.dtype], torch.Tensor]):
        super().__init__()
        self.window, self.scale = window, nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.window(x.dtype) * self.scale


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("window", list(WINDOWS))
def test_windows_are_torch_s(window: str, dtype: torch.dtype, exporter: str) -> None:
    """Bit for bit: dynamo's conversion wrote Hamming's with ONNX's 25/46 and 21/46 (torch's 0.54 and 0.46: 0.6%
    off), Blackman's in float32, and had none for the symmetric, Bartlett and Kaiser windows."""
    module = Windowed(WINDOWS[window]).to(dtype)
    x = torch.randn(3, 40 if "symmetric" not in window else 41, dtype=dtype)
    torch.testing.assert_close(ORTModule(module, exporter=exporter)(x), module(x), rtol=0, atol=0)
