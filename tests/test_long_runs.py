"""ORTModule over long runs and under failure: flat memory, recovery after errors, threads."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from runtime import ORTModule


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return float(loss)


def test_thousand_steps_keep_memory_flat():
    """Each step stashes ~0.5 MB (batch 256 through 256-wide layers): a leak of the stash or of sessions would
    grow RSS by hundreds of MB over 1000 steps."""
    model = ORTModule(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    for _ in range(100):
        _step(model, opt, x, y)
    before = _rss_bytes()
    for _ in range(900):
        _step(model, opt, x, y)
    grown = _rss_bytes() - before
    assert grown < 40 * 2**20, f"RSS grew by {grown / 2**20:.1f} MB over 900 steps"


def test_error_in_forward_leaves_the_module_usable():
    torch.manual_seed(1)
    ref = _mlp(1)
    model = ORTModule(copy.deepcopy(ref))
    x = torch.randn(8, 64)
    model(x).sum().backward()
    with pytest.raises(Exception, match=r"(?i)shape|dimension|size|rank"):
        model(torch.randn(8, 63))  # wrong feature size: onnxruntime refuses it
    model.zero_grad()
    model(x).sum().backward()
    ref(x).sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_error_in_backward_leaves_the_module_usable():
    ref = _mlp(2)
    model = ORTModule(copy.deepcopy(ref))
    x = torch.randn(8, 64)

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("hook failed")

    out = model(x)
    handle = out.register_hook(fail)
    with pytest.raises(RuntimeError, match="hook failed"):
        out.sum().backward()
    handle.remove()
    model.zero_grad()
    model(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_backward_twice_raises_like_torch():
    model = ORTModule(_mlp(3))
    loss = model(torch.randn(4, 64)).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def test_two_modules_in_two_threads():
    """Two ORTModules trained at the same time from two threads give each its own torch gradients."""
    refs = [_mlp(10), _mlp(11)]
    mods = [ORTModule(copy.deepcopy(r)) for r in refs]
    inputs = [torch.randn(16, 64, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for _ in range(20):
                mods[k].zero_grad()
                mods[k](inputs[k]).pow(2).mean().backward()
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):
        refs[k].zero_grad()
        refs[k](inputs[k]).pow(2).mean().backward()
        for p, q in zip(mods[k].parameters(), refs[k].parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
