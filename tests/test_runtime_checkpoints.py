"""torch's activation checkpointing through ORTModule (runtime/checkpoints.py, runtime/recompute.py): the same
outputs and gradients as torch, and a stash holding the checkpointed regions' inputs instead of their activations,
as torch's saved tensors do. Under the legacy exporter, and under dynamo for one case (`GRADBUILDER_SLOW=1`: both)."""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential, create_selective_checkpoint_contexts

from benchmarks.measure import ort_stash_bytes, torch_saved_bytes
from runtime import ORTModule
from runtime.checkpoints import OP_TYPE
from runtime.recompute import region

SLOW = [pytest.mark.slow,
        pytest.mark.skipif(os.environ.get("GRADBUILDER_SLOW") != "1", reason="dynamo export; set GRADBUILDER_SLOW=1")]

Wrap = Callable[[nn.Module, torch.Tensor], torch.Tensor]
WRAPS: dict[str, Wrap | None] = {
    "non-reentrant": lambda block, x: checkpoint(block, x, use_reentrant=False),
    "reentrant": lambda block, x: checkpoint(block, x, use_reentrant=True),
    "none": None,
}


class Block(nn.Module):
    def __init__(self, d: int, p: float = 0.0):
        super().__init__()
        self.norm, self.up, self.down, self.p = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(3 * d, d), p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(self.norm(x)), approximate="tanh")
        return x + F.dropout(self.down(torch.tanh(h) * h), self.p, self.training)


class Stack(nn.Module):
    """Checkpointed residual blocks between a projection (so that the first region's input requires grad, as the
    reentrant checkpoint needs) and a head."""

    def __init__(self, wrap: Wrap | None, d: int = 16, depth: int = 3, p: float = 0.0):
        super().__init__()
        self.wrap = wrap
        self.embed, self.head = nn.Linear(5, d), nn.Linear(d, 3)
        self.blocks = nn.ModuleList([Block(d, p) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) if self.wrap is None else self.wrap(block, h)
        return self.head(h)


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    for p in model.parameters():
        p.grad = None
    out = model(x)
    (out.square().mean() + out[..., 0].sum()).backward()
    return out.detach(), [p.grad for p in model.parameters()]


def _matches_torch(make: Callable[[], nn.Module], x: torch.Tensor, tol: float, exporter: str = "torchscript"
                   ) -> ORTModule:
    torch.manual_seed(0)
    reference = make()
    model = ORTModule(copy.deepcopy(reference), exporter=exporter)
    for _ in range(2):  # the export's step, then a step on the built sessions
        want, want_grads = _step(reference, x)
        got, got_grads = _step(model, x)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        for g, w in zip(got_grads, want_grads, strict=True):
            assert (g is None) == (w is None)
            if w is not None:
                torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    return model


@pytest.mark.parametrize(("kind", "exporter"), [
    ("non-reentrant", "torchscript"), ("reentrant", "torchscript"), ("non-reentrant", "dynamo"),
    pytest.param("reentrant", "dynamo", marks=SLOW)])
def test_checkpointed_blocks_match_torch_and_stash_what_torch_saves(kind: str, exporter: str) -> None:
    x = torch.randn(4, 6, 5, dtype=torch.float64)
    model = _matches_torch(lambda: Stack(WRAPS[kind]).double(), x, 1e-10, exporter)
    torch.manual_seed(0)
    reference = Stack(WRAPS[kind]).double()
    plain = ORTModule(Stack(None).double())
    _step(plain, x)
    stash, saved, unmarked = ort_stash_bytes(model, (x,)), torch_saved_bytes(reference, (x,)), ort_stash_bytes(
        plain, (x,))
    assert stash <= saved, (stash, saved)
    assert stash * 3 < unmarked, (stash, unmarked)


def test_checkpoint_sequential_matches_torch() -> None:
    class Sequential(Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint_sequential(nn.Sequential(*self.blocks), 2, self.embed(x), use_reentrant=False))

    _matches_torch(lambda: Sequential(None).double(), torch.randn(3, 4, 5, dtype=torch.float64), 1e-10)


def test_nested_regions_and_a_region_output_returned() -> None:
    class Nested(Stack):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            def pair(h: torch.Tensor) -> torch.Tensor:
                return checkpoint(self.blocks[1], self.blocks[0](h), use_reentrant=False)

            h = checkpoint(pair, self.embed(x), use_reentrant=False)
            last = checkpoint(self.blocks[2], h, use_reentrant=False)
            return self.head(h) + self.head(last), last

    torch.manual_seed(0)
    reference = Nested(None).double()
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    for m in (reference, model):
        out, last = m(x)
        (out.square().sum() + last.sum()).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("kind", "exporter"), [
    ("non-reentrant", "torchscript"), ("reentrant", "torchscript"),
    pytest.param("non-reentrant", "dynamo", marks=SLOW)])
def test_batchnorm_statistics_in_a_region_are_updated_again_in_backward_as_torch_does(kind: str, exporter: str
                                                                                       ) -> None:
    """torch's backward runs a checkpointed region's forward again, and its BatchNorms update their running
    statistics a second time (torchvision's memory-efficient DenseNet trains so): the same buffers after each
    step, and after a forward without backward (one update there)."""
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Linear(5, 8), nn.Linear(8, 3)
            cumulative = None if exporter == "torchscript" else 0.3  # torch.export cannot trace momentum=None
            self.norms = nn.ModuleList([nn.BatchNorm1d(8), nn.BatchNorm1d(8, momentum=cumulative)])

        def block(self, h: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.norms[1](torch.relu(self.norms[0](h))))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(WRAPS[kind](self.block, self.embed(x)))  # type: ignore[misc]

    torch.manual_seed(0)
    reference = Normed().double()
    model = ORTModule(copy.deepcopy(reference), exporter=exporter)
    for step in range(3):
        x = torch.randn(16, 5, dtype=torch.float64)
        for m in (reference, model):
            out = m(x)
            if step != 1:
                out.square().mean().backward()
        for (name, got), want in zip(model.named_buffers(), reference.buffers(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"step {step}: {name}")
    assert [int(n.num_batches_tracked) for n in model.norms] == [5, 5]


def test_the_export_tags_each_region_and_drops_the_markers(tmp_path: Path) -> None:
    model = ORTModule(Stack(WRAPS["non-reentrant"], depth=3), save_onnx=tmp_path)
    _step(model, torch.randn(2, 3, 5))
    exported = onnx.load(next(tmp_path.glob("*/exported.onnx")))
    assert not [n for n in exported.graph.node if n.op_type == OP_TYPE]
    tags = [region(n) for n in exported.graph.node]
    assert sorted({t for t in tags if t is not None}) == [0, 1, 2]
    assert not any(region(n) is not None for n in exported.graph.node if "embed" in n.name or "head" in n.name)


def test_a_reentrant_checkpoint_of_inputs_without_grad_gives_no_gradients_inside() -> None:
    """torch runs it under no_grad, so nothing inside gets a gradient (with a warning); ORTModule does the same."""
    class Frozen(Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(self.blocks[0], x @ torch.ones(5, 16, dtype=x.dtype), use_reentrant=True))

    with pytest.warns(UserWarning, match="requires_grad"):
        model = _matches_torch(lambda: Frozen(None).double(), torch.randn(2, 3, 5, dtype=torch.float64), 1e-10)
    assert all(p.grad is None for p in model.module.blocks[0].parameters())


def test_selective_checkpointing_is_left_to_a_plain_export() -> None:
    """A `context_fn` picks which ops torch saves: not a region to recompute whole; the module still trains."""
    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> bool:
        return op is torch.ops.aten.mm.default

    def selective(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(block, x, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, policy))

    _matches_torch(lambda: Stack(selective).double(), torch.randn(2, 3, 5, dtype=torch.float64), 1e-10)


def test_a_dropout_inside_a_region_gets_the_forward_mask_back() -> None:
    """Backward recomputes tanh(dropout(x * w)) with the forward's mask: with y = 1.5 tanh(2 x w m) (m the mask),
    the gradient of sum(c * y) with respect to w is sum(c * 1.5 (1 - (y / 1.5)^2) * 2 x [y != 0]), taken over the
    forward's own y. The host draws the mask again from the forward's seed (from the second call on), so the stash
    holds no more than torch saves; another mask would give another gradient."""
    class Dropped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.rand(64) + 0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(lambda h: torch.tanh(F.dropout(h * self.w, 0.5, self.training)) * 1.5, x,
                              use_reentrant=False)

    model = ORTModule(Dropped())
    x, c = torch.rand(32, 64) + 0.5, torch.randn(32, 64)
    for _ in range(3):
        model.module.w.grad = None
        y = model(x)
        (y * c).sum().backward()
        assert 0.3 < (y == 0).float().mean() < 0.7
        want = (c * 1.5 * (1 - (y / 1.5).square()) * 2 * x * (y != 0)).sum(0)
        torch.testing.assert_close(model.module.w.grad, want, rtol=1e-5, atol=1e-5)
    stash = ort_stash_bytes(model, (x,))
    assert stash <= torch_saved_bytes(Dropped(), (x,)), stash  # the mask drawn again, as torch does
    (backward,) = model.training_sessions()[0]._backwards.values()
    ops = [(n.op_type, n.name) for n in backward.program.backward.graph.node]
    assert any(op == "Tanh" and "__remat" in name for op, name in ops)
    assert not any(op == "Dropout" for op, _ in ops)


def test_hugging_face_gradient_checkpointing_stashes_what_torch_saves() -> None:
    """Hugging Face binds torch's `checkpoint` in a `functools.partial` before ORTModule exists (reentrant, as its
    default); its attention's backward reads shapes the builder takes in the forward, which must not keep the
    regions' activations."""
    pytest.importorskip("transformers")
    from zoo_models import CASES

    case = CASES["hf-bert-checkpointing"]

    class Loss(nn.Module):
        def __init__(self, model: nn.Module):
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
                    ) -> torch.Tensor:
            return case.loss(self.model, {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})

    torch.manual_seed(0)
    reference = Loss(case.make()).train()
    (batch,) = case.batches(1)
    args = (batch["input_ids"], batch["attention_mask"], batch["labels"])
    model = ORTModule(copy.deepcopy(reference))
    model(*args).backward()
    stash, saved = ort_stash_bytes(model, args), torch_saved_bytes(reference, args)
    assert stash <= saved, (stash, saved)
