"""runtime/fused.py: a module whose only differentiable output is a scalar runs forward and backward in one
onnxruntime run, and computes what the split sessions compute, for any gradient the host sends."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from harness import random_body_model
from onnx import helper, numpy_helper
from torch import nn

from runtime import ORTModule, fused
from runtime.session import TrainingSession


class LeNetLoss(nn.Module):
    """Convolutions, max pools (their offsets found in the forward part), dropout and a BatchNorm whose running
    statistics are module outputs, then cross-entropy, plus a non-differentiable output."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Conv2d(6, 16, 5), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                 nn.Linear(400, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.net(x)
        return nn.functional.cross_entropy(scores, y), scores.argmax(1)


class WideRows(LeNetLoss):
    """Few weights over many rows (its activations outweigh its weights, so it fuses), in double: onnxruntime's
    CPU Conv has no double kernel."""

    def __init__(self, dropout: float = 0.0):
        nn.Module.__init__(self)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(24, 10))


def _batch(step: int, dtype: torch.dtype = torch.float32, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 1, 28, 28, generator=g, dtype=dtype), torch.randint(0, 10, (rows,), generator=g)


def _run(model: nn.Module, steps: int, backward: Callable[[torch.Tensor, nn.Module], None], dtype: torch.dtype
         ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list[bool]]:
    om = ORTModule(model)
    losses, grads, fusing = [], [], []
    for step in range(steps):
        om.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)  # the host's dropout masks
        loss, _ = om(*_batch(step, dtype, rows=16 if dtype == torch.float32 else 512))
        fusing.append(loss.grad_fn.state.gradients is not None)
        backward(loss, om)
        losses.append(loss.detach().clone())
        grads.append([p.grad.clone() for p in om.parameters()])
    return losses, grads, fusing


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("how", ["backward", "scaled", "grad_outputs", "retained"])
def test_fused_steps_compute_the_split_ones(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, how: str) -> None:
    """From the second call on (the first decides), each step is one run whose gradients are the split
    sessions' for the same masks, bit for bit for `loss.backward()` and scaled by the host's gradient otherwise
    (a loss scaled by 2.5, `torch.autograd.grad` with -3, three backwards through a retained graph); the running
    statistics follow torch's as well."""
    def backward(loss: torch.Tensor, om: nn.Module) -> None:
        if how == "backward":
            loss.backward()
        elif how == "scaled":
            (loss * 2.5).backward()
        elif how == "grad_outputs":
            params = list(om.parameters())
            for p, g in zip(params, torch.autograd.grad(loss, params, grad_outputs=torch.tensor(-3.0, dtype=dtype))):
                p.grad = g
        else:
            for _ in range(3):
                loss.backward(retain_graph=True)

    torch.manual_seed(0)
    model = (LeNetLoss if dtype == torch.float32 else WideRows)(dropout=0.3).to(dtype)
    split_model = copy.deepcopy(model)
    fused_run = _run(model, 4, backward, dtype)
    monkeypatch.setattr(fused, "MAX_KEPT", -1.0)  # never fused
    split_run = _run(split_model, 4, backward, dtype)
    assert fused_run[2] == [False, True, True, True] and split_run[2] == [False] * 4
    # otherwise g G against G seeded with g: apart by rounding, relative to the step's largest gradient (a bias
    # before a BatchNorm has gradient 0 up to the others' rounding)
    exact = how in ("backward", "retained")
    eps = 0.0 if exact else 1e-5 if dtype == torch.float32 else 1e-12
    for step in range(4):
        torch.testing.assert_close(fused_run[0][step], split_run[0][step], rtol=0, atol=0)
        largest = max(float(b.abs().max()) for b in split_run[1][step])
        for a, b in zip(fused_run[1][step], split_run[1][step]):
            torch.testing.assert_close(a, b, rtol=eps, atol=eps * largest)
    for name, a in model.named_buffers():
        torch.testing.assert_close(a, dict(split_model.named_buffers())[name], rtol=0, atol=0, msg=name)


def test_fused_gradients_are_torch_s_and_released() -> None:
    """Against torch eager (float64, no dropout): micro-batches summed before one backward, each call fused;
    after backward the call's gradients are dropped, as a split call's stash is."""
    torch.manual_seed(1)
    model = WideRows().double()
    ref = copy.deepcopy(model)
    om = ORTModule(model)
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _batch(step, torch.float64, 512)

    om(*batch(0))[0].backward()  # the deciding call
    om.zero_grad(set_to_none=True)
    (l1, _), (l2, _) = om(*batch(1)), om(*batch(2))
    states = [l1.grad_fn.state, l2.grad_fn.state]
    assert all(s.gradients is not None for s in states)
    (l1 + 0.5 * l2).backward()
    assert all(s.gradients is None and s.released for s in states)
    ref(*batch(0))[0].backward()  # the same running statistics
    ref.zero_grad(set_to_none=True)
    (ref(*batch(1))[0] + 0.5 * ref(*batch(2))[0]).backward()
    for (name, p), q in zip(om.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_only_where_gradients_are_no_larger_than_the_stash() -> None:
    """A CNN keeps fewer bytes of gradients than of stash: fused, and what it keeps is at most the split stash;
    an MLP's weights outweigh its activations: split. Two scalar outputs, or a non-scalar one: split."""
    torch.manual_seed(0)
    cnn = ORTModule(LeNetLoss())
    split = cnn(*_batch(0))[0]
    kept = cnn(*_batch(1))[0]
    session = split.grad_fn.call.session
    assert session.runs_fused and kept.grad_fn.state.gradients is not None
    assert 0 < session.stash_bytes(kept.grad_fn.state) <= session.stash_bytes(split.grad_fn.state)

    class Wide(nn.Module):
        def __init__(self, outputs: str):
            super().__init__()
            self.fc, self.outputs = nn.Linear(256, 256), outputs

        def forward(self, x: torch.Tensor):
            h = self.fc(x)
            return {"one": h.square().mean(), "two": (h.mean(), h.std()), "rows": h.sum(1)}[self.outputs]

    x = torch.randn(8, 256)
    for outputs in ("one", "two", "rows"):
        om = ORTModule(Wide(outputs))
        for _ in range(2):
            out = om(x)
            torch.autograd.backward(out, [torch.ones_like(t) for t in out] if isinstance(out, tuple)
                                    else torch.ones_like(out))
        assert not om.training_sessions()[0].runs_fused, outputs


def test_training_session_fuses_for_numpy_callers(tmp_path) -> None:
    """TrainingSession's own API: numpy in and out, the output gradient given as an array or None, `retain`."""
    torch.manual_seed(0)
    model = LeNetLoss().eval()
    x, y = _batch(0)
    path = tmp_path / "lenet.onnx"
    torch.onnx.export(model, (x, y), path, input_names=["x", "y"], output_names=["loss", "label"], dynamo=False)
    session = TrainingSession.from_forward(str(path))
    feeds = [x.numpy(), y.numpy()]
    (loss, _), state = session.forward(feeds)
    expected = session.backward(state, [np.float32(2.0), None])
    (loss2, _), state = session.forward(feeds)
    assert state.gradients is not None and loss2 == loss
    twice = session.backward(state, [np.array(2.0, dtype=np.float32), None], retain=True)
    assert session.backward(state, [None, None]) == {}
    assert state.released
    assert expected.keys() == twice.keys() and expected
    for name in expected:
        np.testing.assert_allclose(twice[name], expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_forwards_without_backward_pause_fused_runs() -> None:
    """A loss computed with grad enabled and dropped (validation without no_grad) pays for a backward in a fused
    run: after `MAX_UNUSED` such forwards in a row the session runs split, and fused again after as many steps with
    a backward; the gradients are torch's throughout. A forward dropped now and then (every other call) does not
    pause it."""
    torch.manual_seed(0)
    model = LeNetLoss()
    ref = copy.deepcopy(model)
    om = ORTModule(model)
    k = fused.MAX_UNUSED
    plan = ["step", "step", "drop", "step"] + ["drop"] * (k + 2) + ["step"] * (k + 3)
    seen = []
    for step, what in enumerate(plan):
        om.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss, _ = om(*_batch(step))
        expected, _ = ref(*_batch(step))
        seen.append("fused" if loss.grad_fn.state.gradients is not None else "split")
        if what == "drop":
            del loss
            continue
        loss.backward()
        expected.backward()
        for (name, p), q in zip(om.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"{step} {name}")
    assert seen == ["split", "fused", "fused", "fused"] + ["fused"] * k + ["split"] * 2 + ["split"] * k + ["fused"] * 3


def test_a_joined_graph_onnxruntime_refuses_runs_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Should onnxruntime refuse the joined graph (here: an op it does not know), the session warns and runs split
    from then on, with torch's gradients; inputs requiring grad get theirs either way."""
    def refused(*args, **kwargs):
        model = joined(*args, **kwargs)
        model.graph.node[0].op_type = "NoSuchOp"
        return model

    joined = fused.fused_model
    torch.manual_seed(0)
    model = LeNetLoss()
    ref = copy.deepcopy(model)
    for broken in (False, True):
        if broken:
            monkeypatch.setattr(fused, "fused_model", refused)
        om = ORTModule(copy.deepcopy(model))
        for step in range(3):
            x, y = _batch(step)
            xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
            om.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            if broken and step == 1:
                with pytest.warns(RuntimeWarning, match="joined in one onnxruntime run failed"):
                    loss, _ = om(xo, y)
            else:
                loss, _ = om(xo, y)
            assert (loss.grad_fn.state.gradients is not None) == (step > 0 and not broken)
            loss.backward()
            ref(xr, y)[0].backward()
            torch.testing.assert_close(xo.grad, xr.grad, rtol=1e-4, atol=1e-7)
            for (name, p), q in zip(om.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"{step} {name}")


def test_a_joined_run_that_computes_otherwise_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first fused run is compared with the split runs of the same call: a joined graph computing another
    gradient (here: one scaled by 1.5, as an optimization across the halves' boundary might) warns, hands that call
    the split runs' gradients and runs split from then on."""
    def wrong(*args, **kwargs):
        model = joined(*args, **kwargs)
        last = model.graph.output[-1].name
        for n in model.graph.node:
            n.output[:] = [o + "/right" if o == last else o for o in n.output]
        model.graph.node.append(helper.make_node("Mul", [last + "/right", "one_and_a_half"], [last]))
        model.graph.initializer.append(numpy_helper.from_array(np.array(1.5, dtype=np.float32), "one_and_a_half"))
        return model

    joined = fused.fused_model
    monkeypatch.setattr(fused, "fused_model", wrong)
    torch.manual_seed(0)
    model = LeNetLoss()
    ref = copy.deepcopy(model)
    om = ORTModule(model)
    for step in range(3):
        om.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        if step == 1:
            with pytest.warns(RuntimeWarning, match="differs from the two runs it joins"):
                loss, _ = om(*_batch(step))
        else:
            loss, _ = om(*_batch(step))
        assert loss.grad_fn.state.gradients is None
        loss.backward()
        ref(*_batch(step))[0].backward()
        for (name, p), q in zip(om.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"{step} {name}")


def test_random_numbers_drawn_in_a_body_are_not_checked_against_split_runs() -> None:
    """A joined graph whose If body draws random numbers fuses without the composition check: split runs draw
    others (each session seeds its own), so comparing them warned that the joined run was wrong and split the
    module for good. Its gradient still comes from the draw its loss did: loss = 2 sum(h) with w all ones, and the
    gradient of w is h's column sums."""
    rows = 4096  # the activations outweigh w's gradient, so the module fuses
    session = TrainingSession.from_forward(random_body_model(rows), wrt=["w"])
    x = np.random.default_rng(0).random((rows, 3), dtype=np.float32)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            (loss,), state = session.forward([x])
            assert (state.gradients is not None) == (step > 0), step  # the first call runs split, then fused
            grad = session.backward(state, [np.float32(1.0)])["w"]
            np.testing.assert_allclose(grad[:, 0], grad[:, 1])
            np.testing.assert_allclose(2 * grad[:, 0].sum(), loss, rtol=1e-5)
            losses.append(float(loss))
    assert session._fused is not None and session._fused.random_ops
    assert len(set(losses)) == 3  # a new draw each step
