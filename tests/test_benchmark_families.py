"""The benchmark's three model families at shapes no benchmark list holds, called at batch sizes the first call did
not have: torch's loss and gradients. These are the shapes a benchmark of "other shapes of the same families" picks,
and the ones whose runs take the shape-dependent lowerings: the blocked swapped Conv with the batch padded to the
block at run time (3-channel 5x5 layers), unfolded 3x3 weight gradients, feature-major products of odd widths, a
one-head attention over a shorter sequence than the position table."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from parity import relative

from benchmarks.models import _encoder_case, _lenet_case, _mlp_case
from runtime import ORTModule

FAMILIES = {
    "lenet-3ch-5x5": (_lenet_case((3, 12, 24), 32, 5, (120, 84), 48), [(1, None), (7, None), (33, None)]),
    "lenet-3x3": (_lenet_case((1, 20, 40), 28, 3, (200,), 64), [(1, None), (33, None)]),
    "mlp-odd-widths": (_mlp_case((777, 333, 10), 64), [(1, None), (7, None)]),
    "encoder-one-head": (_encoder_case(1000, 72, 1, 2, 64, 200, 0.0, False, 8), [(1, 64), (5, 17)]),
}
"""Each family's case (first call at its own batch) and the (batch, sequence) sizes of the calls after it."""


def _cut(batch: tuple[torch.Tensor, ...], n: int, seq: int | None) -> tuple[torch.Tensor, ...]:
    return tuple(t[:n] if seq is None else t[:n, :seq] for t in batch)


def _float64_gradients(reference: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """torch's gradients of the call in float64 (on an AVX-512 EPYC, torch's float32 weight gradient of the 3-channel
    5x5 LeNet's first Conv was 1.2e-3 of the largest gradient off its float64 one; onnxruntime's 7.6e-8)."""
    double = copy.deepcopy(reference).double()
    double.zero_grad(set_to_none=True)
    double(*(a.double() if a.is_floating_point() else a for a in args)).backward()
    return {name: p.grad for name, p in double.named_parameters()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_shapes_of_the_benchmark_families_get_torchs_gradients(family: str) -> None:
    case, later = FAMILIES[family]
    torch.manual_seed(0)
    reference = case.make()
    module = copy.deepcopy(reference)
    ort_module = ORTModule(module, threads=2)
    first = case.batch(torch.Generator().manual_seed(0))
    calls = [first, *(_cut(case.batch(torch.Generator().manual_seed(k + 1)), n, seq) for k, (n, seq) in
                      enumerate(later))]
    for args in calls:
        for m in (reference, module):
            m.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # onnxruntime's and the exporter's chatter
            loss = ort_module(*args)
        loss.backward()
        expected = reference(*args)
        expected.backward()
        where = f"{case.name}, batch {tuple(args[0].shape)}"
        assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item()) + 1e-6, \
            f"{where}: loss {loss.item()} against torch's {expected.item()}"
        top = max(p.grad.abs().max().item() for p in reference.parameters())
        exact: dict[str, torch.Tensor] | None = None
        for (name, p), q in zip(reference.named_parameters(), module.parameters()):
            error, bound = relative(q.grad, p.grad, top), 1e-4  # of the largest gradient
            if error >= bound:  # torch's float32 is not the truth either: its float64 arbitrates, as `runtime.checks`
                exact = exact or _float64_gradients(reference, args)
                error, bound = relative(q.grad, exact[name], top), max(bound, relative(p.grad, exact[name], top))
            assert error < bound, f"{where}: {name}'s gradient differs by {error:.1e} of the largest gradient"
    stats = ort_module.stats  # the calls ran on onnxruntime, none of them in torch
    assert stats["fallbacks"] == 0 and stats["builds"] >= 1 and ort_module.training_sessions(), stats
