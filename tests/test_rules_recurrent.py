"""LSTM, GRU and RNN gradients against a float64 torch reference of the ONNX equations.

onnxruntime has float kernels only for these ops, so they run in float32. The reference is written
step by step from the ONNX spec (gate orders iofc and zrh, peepholes iof, sequence_lens, layout); check_op
compares its forward outputs with onnxruntime's before using its autograd gradients, so it cannot drift
from what the ops compute.
"""

from __future__ import annotations

import harness
import numpy as np
import pytest
import torch
from harness import check_op
from onnx.reference import ReferenceEvaluator

T, B, I, H = 4, 3, 5, 3
ACT = {"Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Relu": torch.relu}
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
DEFAULT_ACTS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"), "RNN": ("Tanh",)}


def _lstm_step(x, h, c, w, r, wb, rb, p, acts):
    f, g, hact = (ACT[a] for a in acts)
    pre = x @ w.T + h @ r.T + wb + rb
    i, o, fg, cc = pre.split(H, dim=-1)
    pi, po, pf = p.split(H) if p is not None else (0, 0, 0)
    i, fg, cc = f(i + pi * c), f(fg + pf * c), g(cc)
    c = fg * c + i * cc
    o = f(o + po * c)
    return o * hact(c), c


def _gru_step(x, h, c, w, r, wb, rb, p, acts, lbr):
    f, g = (ACT[a] for a in acts)
    gx = x @ w.T + wb
    rz, rh = r[:2 * H], r[2 * H:]
    z, rg = f(gx[..., :2 * H] + h @ rz.T + rb[:2 * H]).split(H, dim=-1)
    reset = rg * (h @ rh.T + rb[2 * H:]) if lbr else (rg * h) @ rh.T + rb[2 * H:]
    cand = g(gx[..., 2 * H:] + reset)
    return (1 - z) * cand + z * h, c


def _rnn_step(x, h, c, w, r, wb, rb, p, acts):
    return ACT[acts[0]](x @ w.T + h @ r.T + wb + rb), c


def reference(op, direction="forward", layout=0, acts=None, lbr=0):
    """torch function of (X, W, R, B, sequence_lens, initial_h[, initial_c, P]) -> (Y, Y_h[, Y_c])."""
    step = {"LSTM": _lstm_step, "RNN": _rnn_step,
            "GRU": lambda *a: _gru_step(*a, lbr=lbr)}[op]
    n_dirs = 2 if direction == "bidirectional" else 1
    acts = acts or DEFAULT_ACTS[op] * n_dirs
    per = len(DEFAULT_ACTS[op])

    def fn(x, w, r, b=None, lens=None, h0=None, c0=None, p=None):
        if layout:
            x = x.transpose(0, 1)
            h0, c0 = (s.transpose(0, 1) if s is not None else None for s in (h0, c0))
        steps, batch = x.shape[:2]
        zeros = torch.zeros(batch, H, dtype=x.dtype)
        ys, hs, cs = [], [], []
        for d in range(n_dirs):
            gh = GATES[op] * H
            wb, rb = (b[d, :gh], b[d, gh:]) if b is not None else (torch.zeros(gh, dtype=x.dtype),) * 2
            h = h0[d] if h0 is not None else zeros
            c = c0[d] if c0 is not None else zeros
            out = [None] * steps
            order = range(steps - 1, -1, -1) if direction == "reverse" or d == 1 else range(steps)
            for t in order:
                hn, cn = step(x[t], h, c, w[d], r[d], wb, rb, p[d] if p is not None else None,
                              acts[d * per:(d + 1) * per])
                inside = torch.ones(batch, 1, dtype=torch.bool) if lens is None else (t < lens)[:, None]
                h, c = torch.where(inside, hn, h), torch.where(inside, cn, c)
                out[t] = torch.where(inside, hn, torch.zeros_like(hn))
            ys.append(torch.stack(out))
            hs.append(h)
            cs.append(c)
        y, yh, yc = torch.stack(ys, 1), torch.stack(hs), torch.stack(cs)
        if layout:
            y, yh, yc = y.permute(2, 0, 1, 3), yh.transpose(0, 1), yc.transpose(0, 1)
        return (y, yh, yc) if op == "LSTM" else (y, yh)

    return fn


rng = np.random.default_rng(0)


def f32(*shape, scale=1.0):
    return np.asarray(rng.standard_normal(shape) * scale, dtype=np.float32)


def inputs(op, n_dirs=1, *, bias=True, h0=False, c0=False, peep=False, lens=None, layout=0, batch=B, steps=T):
    g = GATES[op] * H
    x = f32(batch, steps, I) if layout else f32(steps, batch, I)
    state = (batch, n_dirs, H) if layout else (n_dirs, batch, H)
    ins = [("x", x), ("w", f32(n_dirs, g, I, scale=0.5)), ("r", f32(n_dirs, g, H, scale=0.5)),
           ("b", f32(n_dirs, 2 * g, scale=0.5) if bias else None),
           ("lens", None if lens is None else np.asarray(lens, np.int32)),
           ("h0", f32(*state) if h0 else None)]
    if op == "LSTM":
        ins += [("c0", f32(*state) if c0 else None), ("p", f32(n_dirs, 3 * H, scale=0.5) if peep else None)]
    while ins[-1][1] is None:
        ins.pop()
    return ins


def run(op, ins, *, direction="forward", layout=0, acts=None, lbr=0, diff_outputs=None, opset=17, **kw):
    attrs = {"hidden_size": H}
    if direction != "forward":
        attrs["direction"] = direction
    if layout:
        attrs["layout"] = layout
    if acts:
        attrs["activations"] = list(acts)
    if op == "GRU" and lbr:
        attrs["linear_before_reset"] = lbr
    n_out = 3 if op == "LSTM" else 2
    return check_op(op, ins, reference(op, direction, layout, acts, lbr), n_out=n_out, diff_outputs=diff_outputs,
                    opset=opset, **attrs, **kw)


DIRS = ["forward", "reverse", "bidirectional"]


def n_dirs(direction):
    return 2 if direction == "bidirectional" else 1


@pytest.mark.parametrize("direction", DIRS)
@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_directions_with_states(op, direction):
    run(op, inputs(op, n_dirs(direction), h0=True, c0=True), direction=direction)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_no_bias_no_initial_state(op):
    run(op, inputs(op, 1, bias=False), direction="forward")


@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_gru_linear_before_reset(lbr, direction):
    run("GRU", inputs("GRU", n_dirs(direction), h0=True), direction=direction, lbr=lbr)


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_lstm_peepholes(direction):
    run("LSTM", inputs("LSTM", 1, h0=True, c0=True, peep=True), direction=direction)


@pytest.fixture
def forward_on_reference(monkeypatch):
    """onnxruntime has no layout=1 kernels: the forward half runs on onnx's reference evaluator instead
    (check_op still compares its outputs with torch); backward has no recurrent op and stays on onnxruntime."""
    on_ort = harness.session

    def session(model):
        if any(n.op_type in GATES for n in model.graph.node):
            return ReferenceEvaluator(model)
        return on_ort(model)

    monkeypatch.setattr(harness, "session", session)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_layout_1(op, forward_on_reference):
    run(op, inputs(op, 2, h0=True, c0=True, layout=1), direction="bidirectional", layout=1)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_sequence_lens(op):
    ins = inputs(op, 2, h0=True, c0=True, peep=op == "LSTM", lens=[T, 2, 1])
    run(op, ins, direction="bidirectional")


@pytest.mark.parametrize("op,outs", [("LSTM", [0]), ("LSTM", [1]), ("LSTM", [2]), ("LSTM", [1, 2]),
                                     ("GRU", [0]), ("GRU", [1]), ("RNN", [1])])
def test_some_outputs_without_gradient(op, outs):
    run(op, inputs(op, 2, h0=True, c0=True), direction="bidirectional", diff_outputs=outs)


def test_rnn_relu():
    run("RNN", inputs("RNN", 2, h0=True), direction="bidirectional", acts=["Relu", "Tanh"])


def test_lstm_other_activations():
    run("LSTM", inputs("LSTM", 1, h0=True, c0=True), acts=["Tanh", "Sigmoid", "Relu"])


@pytest.mark.parametrize("opset", [13, 14, 23])
def test_opsets(opset):
    run("LSTM", inputs("LSTM", 2, h0=True, c0=True), direction="bidirectional", opset=opset)
