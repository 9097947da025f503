"""Train a small CNN on scikit-learn's digits through ORTModule next to the same model in torch eager.

Both start from the same weights and see the same batches; the demo prints the two loss curves side by
side, the largest gradient difference over all steps, the test accuracy, and the step time of each.
Run: `python -m runtime.demo` (or `make demo`). The digits ship with scikit-learn: no download.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .module import ORTModule


class DigitsCNN(nn.Module):
    """8x8 grey digits: two conv + BatchNorm blocks, then a small classifier (with a dropout before its last layer
    at rate `dropout`, if any)."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        drop = [nn.Dropout(dropout)] if dropout else []
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), *drop, nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class DigitsMLP(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        drop = [nn.Dropout(dropout)] if dropout else []
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), *drop, nn.Linear(128, 64), nn.ReLU(),
                                 *drop, nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


MODELS = {"cnn": DigitsCNN, "mlp": DigitsMLP}


def load_digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train images, train labels, test images, test labels); images (N, 1, 8, 8) scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sk_digits

    digits = sk_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_test = len(x) // 6
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


@dataclass
class Run:
    """One model's training record."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        start = time.perf_counter()
        self.optimizer.zero_grad()
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.times.append(time.perf_counter() - start)
        self.losses.append(loss.item())

    @torch.no_grad()
    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.model.eval()
        acc = float((self.model(x).argmax(1) == y).float().mean())
        self.model.train()
        return acc


def grad_difference(a: nn.Module, b: nn.Module) -> tuple[float, float]:
    """Largest absolute gradient difference, and that difference relative to the largest torch gradient."""
    diff = max(float((p.grad - q.grad).abs().max()) for p, q in zip(a.parameters(), b.parameters()))
    scale = max(float(q.grad.abs().max()) for q in b.parameters())
    return diff, diff / scale


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="cnn")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="dropout rate in the classifier; ORTModule then draws torch's own masks "
                             "(torch_dropout=True), so both runs drop the same units (they drift apart once float "
                             "rounding flips a ReLU, which Adam amplifies)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads of both torch and onnxruntime (models this small gain nothing from "
                             "more, and spinning thread pools fight over the cores of a busy machine)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = load_digits()
    model = MODELS[args.model](args.dropout)
    reference = copy.deepcopy(model)
    ort_model = ORTModule(model, threads=args.threads, torch_dropout=args.dropout > 0)
    runs = [Run("onnxruntime", ort_model, torch.optim.Adam(ort_model.parameters(), lr=args.lr)),
            Run("torch eager", reference, torch.optim.Adam(reference.parameters(), lr=args.lr))]
    print(f"digits: {len(x_train)} train / {len(x_test)} test images, {type(model).__name__} with "
          f"{sum(p.numel() for p in model.parameters())} parameters, dropout {args.dropout}, Adam lr={args.lr}, "
          f"batch {args.batch}, "
          f"{torch.get_num_threads()} threads\n")

    worst_abs, worst_rel = 0.0, 0.0
    steps_per_epoch = (len(x_train) + args.batch - 1) // args.batch
    print(f"{'epoch':>5} {'step':>5} | {'loss onnxruntime':>16} {'loss torch':>11} {'|diff|':>9}")
    shuffle = torch.Generator().manual_seed(1)
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=shuffle)
        for k in range(steps_per_epoch):
            idx = order[k * args.batch:(k + 1) * args.batch]
            start = torch.random.get_rng_state()  # each run's dropout masks from the same generator state
            for run in runs:
                torch.random.set_rng_state(start)
                run.step(x_train[idx], y_train[idx])
            d_abs, d_rel = grad_difference(ort_model, reference)
            worst_abs, worst_rel = max(worst_abs, d_abs), max(worst_rel, d_rel)
            step = epoch * steps_per_epoch + k
            if k % max(1, steps_per_epoch // 3) == 0 or k == steps_per_epoch - 1:
                a, b = runs[0].losses[-1], runs[1].losses[-1]
                print(f"{epoch:>5} {step:>5} | {a:>16.6f} {b:>11.6f} {abs(a - b):>9.2e}")

    print(f"\nlargest gradient difference over {len(runs[0].losses)} steps: {worst_abs:.3e} "
          f"({worst_rel:.2e} of the largest gradient)")
    drift = max(float((p - q).detach().abs().max()) for p, q in zip(ort_model.parameters(), reference.parameters()))
    print(f"largest parameter difference after training: {drift:.3e}")
    for run in runs:
        later = run.times[1:]
        print(f"{run.name:>12}: test accuracy {run.accuracy(x_test, y_test):6.2%}, step time median "
              f"{statistics.median(later) * 1e3:6.2f} ms (p90 {np.percentile(later, 90) * 1e3:6.2f} ms), "
              f"first step {run.times[0] * 1e3:7.1f} ms")
    stats = ort_model.stats
    print(f"\nORTModule: {stats['exports']} exports (one per call schema: train and eval mode), {stats['builds']} "
          f"gradient build, {stats['fallbacks']} fallbacks; its first step includes export, gradient build and "
          "session creation")


if __name__ == "__main__":
    main()
