"""Models exported from torch by both exporters: build + split + onnxruntime give torch's parameter gradients."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
import torch
from harness import Trainer
from torch import nn

import gradbuilder


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(20, 32), nn.Linear(32, 16), nn.Linear(16, 5)

    def forward(self, x, y):
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        logits = self.fc3(h)
        return nn.functional.cross_entropy(logits, y), logits


class LeNet(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(1, 6, 5, padding=2), nn.BatchNorm2d(6)
        self.c2 = nn.Conv2d(6, 16, 5)
        self.f1, self.f2 = nn.Linear(16 * 5 * 5, 64), nn.Linear(64, 10)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, y):
        x = nn.functional.max_pool2d(torch.relu(self.bn(self.c1(x))), 2)
        x = nn.functional.avg_pool2d(torch.relu(self.c2(x)), 2)
        x = self.drop(torch.relu(self.f1(torch.flatten(x, 1))))
        logits = self.f2(x)
        return nn.functional.cross_entropy(logits, y), logits


def export(module: nn.Module, args, dynamo: bool) -> onnx.ModelProto:
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            prog = torch.onnx.export(module, args, dynamo=True, optimize=False, verbose=False,
                                     dynamic_shapes=({0: "batch"}, {0: "batch"}))
            return prog.model_proto
        torch.onnx.export(module, args, f, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, opset_version=17, input_names=["x", "y"],
                          output_names=["loss", "logits"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return onnx.load_from_string(f.getvalue())


def torch_grads(module, args):
    module.zero_grad()
    loss, logits = module(*args)
    loss.backward()
    return loss, logits, {n: p.grad.detach().numpy().copy() for n, p in module.named_parameters()}


def check(module: nn.Module, args, dynamo: bool):
    torch.manual_seed(0)
    model = export(module, args, dynamo)
    params = dict(module.named_parameters())
    trainable = [t.name for t in model.graph.initializer if t.name in params]
    assert sorted(trainable) == sorted(params), "every parameter must map to exactly one initializer"
    loss_name = model.graph.output[0].name
    training = gradbuilder.build_gradient_graph(model, wrt=trainable, loss=loss_name)
    onnx.checker.check_model(training, full_check=True)
    trainer = Trainer(training)
    feeds = {i.name: a.numpy() for i, a in zip(model.graph.input, args)}
    outs, grads = trainer.step(feeds)
    loss, logits, ref = torch_grads(module, args)
    np.testing.assert_allclose(outs[0], loss.detach().numpy(), rtol=1e-5)
    np.testing.assert_allclose(outs[1], logits.detach().numpy(), rtol=1e-4, atol=1e-5)
    assert set(grads) == set(ref)
    top = max(np.abs(r).max() for r in ref.values())
    for n, r in ref.items():
        # a floor on the scale: a conv bias before training-mode BatchNorm has an exactly-zero gradient,
        # which both sides only approximate in float32 (|g| ~ 1e-8)
        scale = max(np.abs(r).max(), 1e-2 * top)
        err = np.abs(grads[n] - r).max() / scale
        assert err < 1e-4, f"{n}: relative error {err:.2e}"
    return training, trainer


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
def test_mlp(dynamo):
    torch.manual_seed(0)
    check(MLP(), (torch.randn(8, 20), torch.randint(0, 5, (8,))), dynamo)


def test_mlp_new_batch_size_same_graph():
    """Exported at batch 8 with a dynamic batch axis, trained at batch 3."""
    torch.manual_seed(1)
    m = MLP()
    model = export(m, (torch.randn(8, 20), torch.randint(0, 5, (8,))), dynamo=False)
    trainer = Trainer(gradbuilder.build_gradient_graph(model, loss="loss"))
    args = (torch.randn(3, 20), torch.randint(0, 5, (3,)))
    _, grads = trainer.step({"x": args[0].numpy(), "y": args[1].numpy()})
    _, _, ref = torch_grads(m, args)
    for n, r in ref.items():
        np.testing.assert_allclose(grads[n], r, rtol=1e-4, atol=1e-6)


def test_lenet_training_mode_batchnorm_legacy():
    """Legacy export keeps BatchNorm in training mode: batch statistics, like torch's train()."""
    torch.manual_seed(0)
    m = LeNet().train()
    args = (torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,)))
    check(m, args, dynamo=False)


def test_lenet_eval_mode_dynamo():
    """The dynamo exporter emits inference-mode BatchNorm: compare with torch in eval()."""
    torch.manual_seed(0)
    m = LeNet().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
    args = (torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,)))
    training, _ = check(m, args, dynamo=True)
    meta = gradbuilder.read_metadata(training)
    assert not any("running" in w for w in meta["gradients"])
