"""runtime/accumulation.py: sums at repeated indices (a graph network's messages into their target nodes) train
through ORTModule like torch: index_add, index_put with accumulate=True and scatter_reduce's sum, whose exports
overwrote all but one of the values an index repeats (index_add, index_put) or failed to build
(scatter_reduce: an If typed by its other branch); scatter_reduce's mean, and its sum, max and min without self,
which the exporter refuses (runtime/functions.py); its max and min with self (ScatterElements' reductions)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from parity import check_parity
from torch import nn

NODES, FEATURES = 6, 5
SRC = torch.tensor([0, 1, 2, 3, 4, 5, 0, 2, 4, 1])
DST = torch.tensor([1, 1, 1, 0, 0, 2, 3, 3, 1, 5])
"""Edges with repeated targets (node 1 gets four messages, node 4 none)."""

Aggregate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(node states [N, F], messages [E, F]) -> new node states [N, F]."""


def _index_put_pairs(h: torch.Tensor, msg: torch.Tensor) -> torch.Tensor:
    """An adjacency built by (target, source) pairs, a pair repeated: weights summed where it repeats."""
    weights = torch.sigmoid(msg.sum(1))
    dst, src = torch.cat([DST, DST[:3]]), torch.cat([SRC, SRC[:3]])
    adjacency = torch.zeros(NODES, NODES).index_put((dst, src), torch.cat([weights, weights[:3]]), accumulate=True)
    return adjacency @ h


AGGREGATES: dict[str, Aggregate] = {
    "index_add_ into zeros": lambda h, msg: torch.zeros(NODES, FEATURES).index_add_(0, DST, msg),
    "index_add onto the states, alpha": lambda h, msg: h.index_add(0, DST, msg, alpha=0.5),
    "index_add along dim 1": lambda h, msg: h.t().index_add(1, DST, msg.t()).t(),
    "index_put accumulating": lambda h, msg: h.clone().index_put_((DST,), msg, accumulate=True),
    "index_put accumulating pairs": _index_put_pairs,
    "index_put accumulating a mask": lambda h, msg: h.index_put((h > 0,), msg[:1, :1].squeeze(), accumulate=True),
    "scatter_reduce sum": lambda h, msg: torch.zeros(NODES, FEATURES).scatter_reduce(
        0, DST.unsqueeze(1).expand_as(msg), msg, "sum"),
    "scatter_reduce mean without self": lambda h, msg: h.scatter_reduce(
        0, DST.unsqueeze(1).expand_as(msg), msg, "mean", include_self=False),
    "scatter_reduce mean with self": lambda h, msg: torch.scatter_reduce(
        h, 0, DST.unsqueeze(1).expand_as(msg), msg, "mean"),
    "scatter_reduce_ sum without self": lambda h, msg: torch.zeros(NODES, FEATURES).scatter_reduce_(
        0, DST.unsqueeze(1).expand_as(msg), msg, "sum", include_self=False) + h,
    # max and min pooling of messages (ScatterElements' max/min reductions, opset 18)
    "scatter_reduce amax with self": lambda h, msg: h.scatter_reduce(
        0, DST.unsqueeze(1).expand_as(msg), msg, "amax"),
    "scatter_reduce amax without self": lambda h, msg: h.scatter_reduce(
        0, DST.unsqueeze(1).expand_as(msg), msg, "amax", include_self=False),
    "scatter_reduce_ amin without self": lambda h, msg: h.clone().scatter_reduce_(
        0, DST.unsqueeze(1).expand_as(msg), msg, "amin", include_self=False),
}


class MessagePassing(nn.Module):
    """Node states from features, a message per edge from its source's state, aggregated at the targets, a
    graph-level regression."""

    def __init__(self, aggregate: Aggregate):
        super().__init__()
        self.embed = nn.Linear(3, FEATURES)
        self.message = nn.Linear(FEATURES, FEATURES)
        self.head = nn.Linear(FEATURES, 1)
        self.aggregate = aggregate

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        out = torch.tanh(self.aggregate(h, self.message(h)[SRC]))
        return (self.head(out).sum() - y).square()


@pytest.mark.parametrize("aggregate", list(AGGREGATES))
def test_repeated_indices_sum_like_torch(aggregate: str) -> None:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(NODES, 3, generator=g), torch.randn((), generator=g)) for _ in range(3)]
    check_parity(lambda: MessagePassing(AGGREGATES[aggregate]), batches, lambda m, b: m(*b), threads=1)


class ScatterSum(nn.Module):
    """Per-target sums returned as the module's output: the export's If typed that output by its other branch."""

    def __init__(self):
        super().__init__()
        self.message = nn.Linear(3, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        msg = self.message(x)[SRC]
        return torch.zeros(NODES, FEATURES).scatter_reduce(0, DST.unsqueeze(1).expand_as(msg), msg, "sum")


def test_scatter_reduce_output_trains_like_torch() -> None:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(NODES, 3, generator=g), torch.randn(NODES, FEATURES, generator=g)) for _ in range(3)]
    check_parity(ScatterSum, batches, lambda m, b: (m(b[0]) * b[1]).sum(), threads=1)


class TokenTypes(nn.Module):
    """BERT's embeddings at their size: word and token-type tables, the token types all 0 but for a few, so one row
    of that table is read ~1000 times; and a histogram of the embeddings by index_put(accumulate=True) into a few
    bins."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.words = nn.Embedding(500, width)
        self.types = nn.Embedding(2, width)
        self.head = nn.Linear(width, 1)

    def forward(self, ids: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.words(ids) + self.types(types)).flatten(0, 1)
        bins = torch.zeros(4, h.shape[1]).index_put((ids.flatten() % 4,), h, accumulate=True)
        return self.head(h).mean() + bins.square().mean()


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_rows_read_a_thousand_times_on_threads(exporter: str) -> None:
    """Rows added to ~1000 times on four onnxruntime threads (the token-type table's gradient, the histogram's
    forward) train like torch. Its ScatterND split such updates among the threads and lost some where they ran at
    once (BERT-sized models failed the first-gradient check on a quiet machine); on a busy one the threads seldom
    overlap, so `test_ordered_scatters` and the indexing rule's test pin the rewrite itself."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 500, (8, 128), generator=g), (torch.rand(8, 128, generator=g) > 0.9).long())
               for _ in range(3)]
    check_parity(TokenTypes, batches, lambda m, b: m(*b), threads=4, exporter=exporter)
