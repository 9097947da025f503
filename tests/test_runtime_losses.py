"""runtime/losses.py: losses the legacy exporter cannot export train through ORTModule with torch's values and
gradients (three Adam steps against torch eager, `check_parity`), every reduction, weights and ignored targets."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from parity import check_parity
from torch import nn
from torch.nn import functional as F

from runtime import losses

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class WithLoss(nn.Module):
    """A small MLP and a loss of its output against a target, both exported."""

    def __init__(self, loss: Loss, outputs: int = 5):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, outputs))
        self.loss = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.net(x), y)


def _batches(target: Callable[[torch.Generator], torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 6, generator=g), target(g)) for _ in range(3)]


def _real(g: torch.Generator) -> torch.Tensor:
    return torch.randn(8, 5, generator=g) * 2


def _binary(g: torch.Generator) -> torch.Tensor:
    return (torch.rand(8, 5, generator=g) > 0.5).float()


def _classes(g: torch.Generator) -> torch.Tensor:
    y = torch.randint(0, 5, (8,), generator=g)
    y[::3] = -100  # ignored
    return y


def _probabilities(g: torch.Generator) -> torch.Tensor:
    return torch.rand(8, 5, generator=g).softmax(-1)


WEIGHT = torch.tensor([0.5, 1.0, 2.0, 1.5, 0.25])


def _nt_xent(z: torch.Tensor, _: torch.Tensor, temperature: float = 0.5) -> torch.Tensor:
    """SimCLR's loss over two views (rows i and i + n), each row's own similarity masked by a boolean eye
    (exported as an EyeLike of bools, which onnxruntime has no kernel for)."""
    z = F.normalize(z, dim=1)
    n = z.shape[0] // 2
    sim = (z @ z.t() / temperature).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    return F.cross_entropy(sim, torch.cat([torch.arange(n, 2 * n), torch.arange(n)]))

CASES: dict[str, tuple[Loss, Callable[[torch.Generator], torch.Tensor]]] = {
    "l1 mean": (F.l1_loss, _real),
    "l1 sum": (lambda a, b: F.l1_loss(a, b, reduction="sum"), _real),
    "smooth l1 beta 0.5": (lambda a, b: F.smooth_l1_loss(a, b, beta=0.5), _real),
    "smooth l1 beta 0 (l1)": (lambda a, b: F.smooth_l1_loss(a, b, beta=0.0), _real),
    "huber delta 2, none": (lambda a, b: F.huber_loss(a, b, delta=2.0, reduction="none").sum(), _real),
    "binary cross-entropy of a sigmoid, weighted": (
        lambda a, b: F.binary_cross_entropy(torch.sigmoid(a), b, weight=WEIGHT), _binary),
    "cross-entropy, label smoothing": (lambda a, b: F.cross_entropy(a, b, label_smoothing=0.1), _classes),
    "cross-entropy, label smoothing, weighted": (
        lambda a, b: F.cross_entropy(a, b, weight=WEIGHT, label_smoothing=0.2), _classes),
    "cross-entropy, label smoothing, sum": (
        lambda a, b: F.cross_entropy(a, b, label_smoothing=0.1, reduction="sum"), _classes),
    "cross-entropy, label smoothing, probability targets": (
        lambda a, b: F.cross_entropy(a, b, label_smoothing=0.1), _probabilities),
    "cross-entropy, probability targets, weighted, none": (
        lambda a, b: F.cross_entropy(a, b, weight=WEIGHT, reduction="none").sum(), _probabilities),
    "soft margin": (F.soft_margin_loss, lambda g: torch.randint(0, 2, (8, 5), generator=g).float() * 2 - 1),
    "hinge embedding": (lambda a, b: F.hinge_embedding_loss(a, b, margin=0.5),
                        lambda g: torch.randint(0, 2, (8, 5), generator=g).float() * 2 - 1),
    "poisson nll, full": (lambda a, b: F.poisson_nll_loss(a, b, full=True),
                          lambda g: torch.randint(0, 5, (8, 5), generator=g).float()),
    "poisson nll of rates": (lambda a, b: F.poisson_nll_loss(a.exp(), b, log_input=False),
                             lambda g: torch.randint(0, 5, (8, 5), generator=g).float()),
    "margin ranking": (lambda a, b: F.margin_ranking_loss(a[:, 0], a[:, 1], b, margin=0.2),
                       lambda g: torch.randint(0, 2, (8,), generator=g).float() * 2 - 1),
    "cosine embedding": (lambda a, b: F.cosine_embedding_loss(a[:, :2], a[:, 2:4], b, margin=0.1),
                         lambda g: torch.randint(0, 2, (8,), generator=g).float() * 2 - 1),
    "triplet margin, swap": (lambda a, b: F.triplet_margin_loss(a[:, :2], a[:, 2:4], b, margin=0.5, swap=True),
                             lambda g: torch.randn(8, 2, generator=g)),
    "triplet margin, p = 1": (lambda a, b: F.triplet_margin_loss(a[:, :2], a[:, 2:4], b, p=1),
                              lambda g: torch.randn(8, 2, generator=g)),
    "multi margin, p = 2, weighted": (lambda a, b: F.multi_margin_loss(a, b, p=2, weight=WEIGHT),
                                      lambda g: torch.randint(0, 5, (8,), generator=g)),
    "NT-Xent": (_nt_xent, _real),
    # confident logits (|x| up to ~100): the exporter's log of a sigmoid is -inf there, onnxruntime's sigmoid 0
    "binary cross-entropy with logits, confident, weighted, pos_weight": (
        lambda a, b: F.binary_cross_entropy_with_logits(40 * a, b, weight=WEIGHT, pos_weight=2 * WEIGHT), _binary),
    "log-sigmoid, confident": (lambda a, b: -(F.logsigmoid(40 * a) * b).mean(), _binary),
    "log of a sigmoid, confident": (lambda a, b: -(torch.log(torch.sigmoid(20 * a)) * b).mean(), _binary),
    "multilabel margin (targets ended by -1, repeats, none)": (
        F.multilabel_margin_loss, lambda g: torch.tensor([[1, 3, -1, 0, 2], [0, -1, 4, 4, 4], [4, 4, 2, -1, -1],
                                                          [-1, 1, 2, 3, 4], [0, 1, 2, 3, 4], [2, 2, 2, -1, 0],
                                                          [3, -1, -1, -1, -1], [1, 0, -1, 3, 3]])),
    "multilabel margin, sum": (lambda a, b: F.multilabel_margin_loss(a, b, reduction="sum"),
                               lambda g: torch.randint(-1, 5, (8, 5), generator=g)),
    "nn.L1Loss module": (nn.L1Loss(), _real),
    "nn.CrossEntropyLoss module, label smoothing": (nn.CrossEntropyLoss(label_smoothing=0.05), _classes),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_trains_like_torch(case: str) -> None:
    loss, target = CASES[case]
    check_parity(lambda: WithLoss(loss), _batches(target), lambda m, b: m(*b), threads=1)
    assert torch._C._nn.l1_loss is not losses._l1  # torch's own again after the export


def test_cross_entropy_with_label_smoothing_over_a_sequence() -> None:
    """Class scores on dim 1 of [N, C, T] (torch's layout for sequences), some targets ignored."""

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Conv1d(3, 5, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.proj(x), y, label_smoothing=0.1, ignore_index=4)

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 7, generator=g), torch.randint(0, 5, (4, 7), generator=g)) for _ in range(3)]
    check_parity(Seq, batches, lambda m, b: m(*b), threads=1)


@pytest.mark.parametrize("case", ["mean", "weighted", "label smoothing", "per position", "nll"])
def test_a_batch_of_ignored_targets_gives_torch_s_zero_gradients(case: str) -> None:
    """Every target ignored (a batch of padding): the mean over no sample is nan in torch and here, but torch's
    gradients are zeros, which an optimizer step survives; nan gradients (0 / 0) would spoil every weight. Then a
    batch with targets trains as torch does."""
    weight = torch.rand(5) + 0.5
    loss: Loss = {"mean": F.cross_entropy,
                  "weighted": lambda s, y: F.cross_entropy(s, y, weight=weight),
                  "label smoothing": lambda s, y: F.cross_entropy(s, y, label_smoothing=0.1),
                  "per position": lambda s, y: F.cross_entropy(s.reshape(2, 4, 5).transpose(1, 2), y.reshape(2, 4)),
                  "nll": lambda s, y: F.nll_loss(F.log_softmax(s, 1), y)}[case]
    g = torch.Generator().manual_seed(0)
    ignored = torch.full((8,), -100)
    batches = [(torch.randn(8, 6, generator=g), ignored), (torch.randn(8, 6, generator=g), _classes(g))]
    om, _, _ = check_parity(lambda: WithLoss(loss), batches, lambda m, b: m(*b).nan_to_num(0.0),
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert all(p.isfinite().all() for p in om.parameters())


def test_binary_cross_entropy_of_saturated_probabilities_keeps_torch_s_finite_gradients() -> None:
    """A sigmoid saturates to exactly 0 or 1 past |x| ~ 17 (float32): torch's binary_cross_entropy clamps the log
    at -100 and its backward divides by max(p (1 - p), 1e-12), finite; the formula's own derivative there is
    0 * inf. A discriminator that grows confident must not turn its weights into nan."""
    class Confident(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(6, 5)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.binary_cross_entropy(torch.sigmoid(self.net(x) * 50), y)

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 6, generator=g), _binary(g)) for _ in range(3)]
    om, _, _ = check_parity(Confident, batches, lambda m, b: m(*b), optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))
    assert all(p.isfinite().all() for p in om.parameters())


FLOAT64: dict[str, tuple[Loss, Callable[[torch.Generator], torch.Tensor]]] = {
    "label smoothing, probability targets, mean": (lambda a, b: F.cross_entropy(a, b, label_smoothing=0.2),
                                                   _probabilities),
    "label smoothing, probability targets, weighted, sum": (
        lambda a, b: F.cross_entropy(a, b, weight=WEIGHT.double(), label_smoothing=0.3, reduction="sum"),
        _probabilities),
    "label smoothing, class indices, weighted, ignored": (
        lambda a, b: F.cross_entropy(a, b, weight=WEIGHT.double(), label_smoothing=0.1), _classes),
    "poisson nll, full": (lambda a, b: F.poisson_nll_loss(a, b, full=True),
                          lambda g: torch.randint(0, 5, (8, 5), generator=g).double()),
}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("case", list(FLOAT64))
def test_float64_losses_keep_double_precision(case: str, exporter: str) -> None:
    """Constants that are not float32 numbers, 1e-8 off in float64 before: label_smoothing / classes with the
    class count traced, which the legacy exporter wrote as a float32 constant (probability targets: every step's
    loss and gradients), and the Stirling term's 2 pi, which dynamo's float64 constants read back as 6.2831855."""
    loss, target = FLOAT64[case]
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 6, generator=g, dtype=torch.float64), target(g)) for _ in range(3)]
    batches = [(x, y.double() if y.is_floating_point() else y) for x, y in batches]
    check_parity(lambda: WithLoss(loss).double(), batches, lambda m, b: m(*b), rtol=1e-10, exporter=exporter)


PER_SAMPLE: dict[str, Loss] = {
    "cross-entropy": lambda a, b: F.cross_entropy(a, b, reduction="none"),
    "cross-entropy, weighted, ignored": lambda a, b: F.cross_entropy(a, b, weight=WEIGHT, reduction="none"),
    "cross-entropy, label smoothing, weighted": lambda a, b: F.cross_entropy(a, b, weight=WEIGHT, label_smoothing=0.1,
                                                                             reduction="none"),
    "nll, weighted, ignored": lambda a, b: F.nll_loss(F.log_softmax(a, 1), b, weight=WEIGHT, reduction="none"),
}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("case", list(PER_SAMPLE))
def test_per_sample_losses_of_score_rows(case: str, exporter: str) -> None:
    """reduction="none" on (N, C) scores (a third of the targets ignored), weighted by position: dynamo declared
    torch's loss 0-d, and the gradient build refused the model ("Inferred shape and existing shape differ in rank")."""
    loss = PER_SAMPLE[case]
    position = torch.arange(8.0) + 1
    check_parity(lambda: WithLoss(lambda a, b: (loss(a, b) * position).sum()), _batches(_classes), lambda m, b: m(*b),
                 exporter=exporter, threads=1)


class ScoresAtTheMargin(nn.Module):
    """Scores as a parameter, each row's class y exactly `margin` above another class (z = 0 there)."""

    def __init__(self) -> None:
        super().__init__()
        self.scores = nn.Parameter(torch.tensor([[2.0, 1.0, 0.0, 1.5], [0.5, 1.5, 2.5, 3.0], [1.0, 3.0, 2.0, 0.0]]))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return F.multi_margin_loss(self.scores * 1, y)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_multi_margin_loss_passes_no_gradient_at_the_margin(exporter: str) -> None:
    """torch's kernel counts a class only where margin - x_y + x_j > 0: clamp(min=0) passed the gradient at 0 (the
    scores one margin apart), silently, and the first call's check compared it with the same clamp."""
    batches = [(torch.tensor([0, 2, 1]),)] * 2
    check_parity(lambda: ScoresAtTheMargin().double(), batches, lambda m, b: m(*b), rtol=1e-10, exporter=exporter,
                 optimizer=lambda params: torch.optim.SGD(params, lr=0.25))


SPANS: dict[str, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] = {
    "mean": lambda s, y, n: F.cross_entropy(s, y, ignore_index=n),
    "sum": lambda s, y, n: F.cross_entropy(s, y, ignore_index=n, reduction="sum"),
    "none": lambda s, y, n: (F.cross_entropy(s, y, ignore_index=n, reduction="none") * (y + 1)).sum(),
    "label smoothing": lambda s, y, n: F.cross_entropy(s, y, ignore_index=n, label_smoothing=0.1),
    "nll": lambda s, y, n: F.nll_loss(F.log_softmax(s, 1), y, ignore_index=n),
}


class SpanScores(nn.Module):
    """Hugging Face's question answering head: start and end scores over the positions, the targets past the
    sequence clamped to its length and ignored by it, `CrossEntropyLoss(ignore_index=start_logits.size(1))`."""

    def __init__(self, loss: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]):
        super().__init__()
        self.head = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
        self.loss = loss

    def forward(self, x: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        scores = self.head(x)
        ignored = scores.size(1)
        pairs = [(scores[..., 0], start.clamp(0, ignored)), (scores[..., 1], end.clamp(0, ignored))]
        return sum(self.loss(s, y, ignored) for s, y in pairs) / 2


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("case", list(SPANS))
def test_an_ignore_index_read_from_a_size(case: str, exporter: str) -> None:
    """An ignore_index read from the scores' size was refused by both exporters' losses, which take a number
    (legacy: "i_(): incompatible function arguments"; dynamo: "Unsupported attribute"). Float64, two sequence
    lengths from one export, a third of the targets past the sequence."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, n, 6, generator=g, dtype=torch.float64), torch.randint(0, n + 3, (4,), generator=g),
                torch.randint(0, n + 3, (4,), generator=g)) for n in (7, 10, 7)]
    check_parity(lambda: SpanScores(SPANS[case]).double(), batches, lambda m, b: m(*b), rtol=1e-10, exporter=exporter)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_float32_targets_of_float64_logits_give_a_float32_loss(exporter: str) -> None:
    """torch computes binary_cross_entropy_with_logits in place on 1 - y: float32 targets of float64 logits
    (ELECTRA's `labels.float()`) give a float32 loss, each step rounded to float32 (ours was float64)."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 6, generator=g, dtype=torch.float64), _binary(g)) for _ in range(3)]
    loss = WithLoss(lambda a, b: F.binary_cross_entropy_with_logits(a, b, reduction="none")).double()
    ort, reference, _ = check_parity(lambda: loss, batches, lambda m, b: (m(*b) * torch.arange(5.0)).sum(), rtol=1e-6,
                                     exporter=exporter)
    got, want = ort(*batches[0]), reference(*batches[0])
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-7, atol=0)
