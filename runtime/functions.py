"""Layers torch's legacy exporter refuses, or refuses for inputs of run-time sizes, written in ops it exports.

The runtime exports with every dimension dynamic (one export serves every batch and image size), and the
exporter then stops at `adaptive_avg_pool2d` to any size but 1x1 ("input size not accessible": VGG's and
AlexNet's heads), at a `threshold` other than 0 ("non-zero threshold"), and at `channel_shuffle` (ShuffleNet);
`local_response_norm` exports with an If on the gradient path, which gradbuilder does not differentiate.
While exporting, `exportable_functions` computes them as torch defines them:

- adaptive average pooling to k cells along an axis of n: window i covers [floor(i n / k), ceil((i + 1) n / k)),
  as torch's; written as a product with a [k, n] matrix of 1 / (window size) over each window, built from the
  run-time n (Range, comparisons), once per pooled axis;
- threshold(x, t, v): x where x > t, else v;
- channel shuffle in g groups: channels [g, C/g] transposed to [C/g, g];
- local response norm: x / (k + alpha * mean of x^2 over `size` channels around, zeros past the ends)^beta.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn import functional as F

from .patching import replaced


def _pooling_matrix(n: Any, k: int, like: torch.Tensor) -> torch.Tensor:
    """[k, n]: 1 / (window size) over window i of adaptive pooling from n to k, 0 elsewhere."""
    cells = torch.arange(k)
    start = cells * n // k
    end = ((cells + 1) * n + k - 1) // k
    positions = torch.arange(n)[None, :]
    inside = (positions >= start[:, None]) & (positions < end[:, None])
    return inside.to(like.dtype) / (end - start)[:, None].to(like.dtype)


def _adaptive_avg_pool(original: Callable[..., torch.Tensor], dims: int) -> Callable[..., torch.Tensor]:
    def pool(x: torch.Tensor, output_size: Sequence[int | None] | int) -> torch.Tensor:
        sizes = [output_size] * dims if isinstance(output_size, int) else list(output_size)
        if all(k == 1 for k in sizes):  # exported as GlobalAveragePool
            return original(x, output_size)
        rank = x.dim()
        # non-negative axes: the exporter writes a negative movedim axis into a Transpose's perm as it is
        for axis, k in zip(range(rank - dims, rank), sizes):
            if k is None:  # the input's own size: nothing pooled
                continue
            moved = x.movedim(axis, rank - 2)  # the pooled axis second to last, for the product
            x = torch.matmul(_pooling_matrix(x.shape[axis], k, x), moved).movedim(rank - 2, axis)
        return x

    return pool


def _threshold(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def threshold(x: torch.Tensor, t: float, value: float) -> torch.Tensor:
        if t == 0 and value == 0:
            return original(x, t, value)
        return torch.where(x > t, x, torch.full((), value, dtype=x.dtype))

    return threshold


def _local_response_norm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def local_response_norm(x: torch.Tensor, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0
                            ) -> torch.Tensor:
        if x.dim() < 3:
            return original(x, size, alpha, beta, k)
        squares = F.pad(x * x, [0, 0] * (x.dim() - 2) + [size // 2, (size - 1) // 2])  # zero channels around
        channels = x.shape[1]
        total = squares[:, :channels]
        for j in range(1, size):
            total = total + squares[:, j:j + channels]
        return x / (total / size * alpha + k) ** beta

    return local_response_norm


def _channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    n, c = x.shape[0], x.shape[1]
    grouped = x.reshape(n, groups, c // groups, *x.shape[2:])
    return grouped.transpose(1, 2).reshape(x.shape)


def exportable_functions() -> contextlib.AbstractContextManager[None]:
    """The functions above replaced for the duration (the export, under its lock); threshold's in-place form traced
    out of place."""
    nn_ops = torch._C._nn
    return replaced([
        (nn_ops, "adaptive_avg_pool2d", _adaptive_avg_pool(nn_ops.adaptive_avg_pool2d, 2)),
        (F, "adaptive_avg_pool1d", _adaptive_avg_pool(F.adaptive_avg_pool1d, 1)),
        (torch._VF, "threshold", _threshold(torch.threshold)), (torch._VF, "threshold_", _threshold(torch.threshold)),
        (F, "channel_shuffle", _channel_shuffle),
        (F, "local_response_norm", _local_response_norm(F.local_response_norm))])
