"""LSTM, GRU and RNN gradients against a float64 torch reference of the ONNX equations.

onnxruntime has float kernels only for these ops, so they run in float32. The reference is written
step by step from the ONNX spec (gate orders iofc and zrh, peepholes iof, sequence_lens, layout); check_op
compares its forward outputs with onnxruntime's before using its autograd gradients, so it cannot drift
from what the ops compute.
"""

from __future__ import annotations

import io
import warnings

import harness
import numpy as np
import onnx
import pytest
import torch
from harness import check_op
from onnx.reference import ReferenceEvaluator
from test_models import check as check_model
from torch import nn

import gradbuilder

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
            if lens is not None:  # onnxruntime: the last state of an empty sequence is 0, not the initial one
                h, c = (torch.where((lens > 0)[:, None], s, torch.zeros_like(s)) for s in (h, c))
            ys.append(torch.stack(out))
            hs.append(h)
            cs.append(c)
        y, yh, yc = torch.stack(ys, 1), torch.stack(hs), torch.stack(cs)
        if layout:
            y, yh, yc = y.permute(2, 0, 1, 3), yh.transpose(0, 1), yc.transpose(0, 1)
        return (y, yh, yc) if op == "LSTM" else (y, yh)

    return fn


rng = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _reseed():
    """Each test draws the same inputs however the tests are selected or ordered."""
    global rng
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

    def session(model, threads=1):
        if any(n.op_type in GATES for n in model.graph.node):
            return ReferenceEvaluator(model)
        return on_ort(model, threads)

    monkeypatch.setattr(harness, "session", session)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_layout_1(op, forward_on_reference):
    run(op, inputs(op, 2, h0=True, c0=True, layout=1), direction="bidirectional", layout=1)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_other_dtypes(op, dtype, forward_on_reference):
    """Backward is dtype-generic: float64 at tight tolerances, float16 loosely (forward on the reference)."""
    ins = [(n, v if v is None or v.dtype.kind != "f" else v.astype(dtype)) for n, v in inputs(op, 2, h0=True, c0=True)]
    loose = {} if dtype == np.float64 else {"rtol": 3e-2, "atol": 3e-2, "fd": False}
    run(op, ins, direction="bidirectional", lbr=1, **loose)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_sequence_lens(op):
    ins = inputs(op, 2, h0=True, c0=True, peep=op == "LSTM", lens=[T, 2, 1, 0], batch=4)
    run(op, ins, direction="bidirectional")


@pytest.mark.parametrize("op,outs", [("LSTM", [0]), ("LSTM", [1]), ("LSTM", [2]), ("LSTM", [1, 2]),
                                     ("GRU", [0]), ("GRU", [1]), ("RNN", [1])])
def test_some_outputs_without_gradient(op, outs):
    run(op, inputs(op, 2, h0=True, c0=True), direction="bidirectional", diff_outputs=outs)


def test_rnn_relu():
    run("RNN", inputs("RNN", 2, h0=True), direction="bidirectional", acts=["Relu", "Tanh"])


def test_lstm_other_activations():
    run("LSTM", inputs("LSTM", 1, h0=True, c0=True), acts=["Tanh", "Sigmoid", "Relu"], fd_eps=1e-3)


@pytest.mark.parametrize("opset", [13, 14, 23])
def test_opsets(opset):
    run("LSTM", inputs("LSTM", 2, h0=True, c0=True), direction="bidirectional", opset=opset)


# --- graphs check_op does not build --------------------------------------------------------------------

def _grads(model, ins, ref_fn, outputs, cot_seed=1):
    """Training graph of `model` on onnxruntime vs torch autograd through `ref_fn`; `outputs` says which of
    ref_fn's results the graph outputs are. Returns onnxruntime's gradients."""
    assert len(outputs) == len(model.graph.output)
    feeds = {n: v for n, v in ins if v is not None}
    wrt = [n for n, v in feeds.items() if v.dtype.kind == "f"]
    training = gradbuilder.build_gradient_graph(model, wrt=wrt)
    onnx.checker.check_model(training, full_check=True)
    trainer = harness.Trainer(training)
    outs, _ = trainer.run_forward(feeds)
    crng = np.random.default_rng(cot_seed)
    cot = [np.asarray(crng.standard_normal(o.shape), np.float32) for o in outs]
    _, grads = trainer.step(feeds, cot)
    tin = {n: torch.from_numpy(v.astype(np.float64) if n in wrt else v).requires_grad_(n in wrt)
           for n, v in feeds.items()}
    ty = ref_fn(*(tin.get(n) for n, _ in ins))
    for o, j in zip(outs, outputs):
        np.testing.assert_allclose(o, ty[j].detach().numpy(), rtol=2e-4, atol=1e-4)
    ref = torch.autograd.grad([ty[j] for j in outputs], [tin[n] for n in wrt],
                              [torch.from_numpy(c.astype(np.float64)) for c in cot])
    for n, r in zip(wrt, ref):
        np.testing.assert_allclose(grads[n], r.numpy(), rtol=2e-4, atol=1e-4, err_msg=f"gradient of {n}")
    return grads


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_without_y_output(op):
    """Only Y_h (and Y_c) leave the node: backward reruns the op for the hidden states it reads."""
    ins = inputs(op, 2, h0=True, c0=True, peep=op == "LSTM")
    model = harness.single_op_model(op, ins, 3 if op == "LSTM" else 2, hidden_size=H, direction="bidirectional")
    model.graph.node[0].output[0] = ""
    del model.graph.output[0]
    outputs = [1, 2] if op == "LSTM" else [1]
    _grads(model, ins, reference(op, "bidirectional"), outputs)


def _dynamic(model, dims):
    """The model with its inputs' dims named (dims: input -> names per axis, None keeps the size)."""
    for vi in model.graph.input:
        for d, name in zip(vi.type.tensor_type.shape.dim, dims.get(vi.name, ())):
            if name is not None:
                d.dim_param = name
    for vi in model.graph.output:
        for d in vi.type.tensor_type.shape.dim:
            d.Clear()
    return model


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_dynamic_time_and_batch(op):
    """One training graph, built with symbolic sequence length and batch, runs at other sizes."""
    ins = inputs(op, 2, h0=True, c0=True, lens=[T, 2, 1])
    model = harness.single_op_model(op, ins, 3 if op == "LSTM" else 2, hidden_size=H, direction="bidirectional")
    model = _dynamic(model, {"x": ["T", "B"], "lens": ["B"], "h0": [None, "B"], "c0": [None, "B"]})
    for steps, batch in ((2, 5), (6, 1)):
        ins = inputs(op, 2, h0=True, c0=True, lens=np.arange(batch) % steps + 1, batch=batch, steps=steps)
        _grads(model, ins, reference(op, "bidirectional"), [0, 1, 2] if op == "LSTM" else [0, 1])


@pytest.mark.parametrize("attrs,match", [
    ({"clip": 3.0}, "clip"),
    ({"input_forget": 1}, "input_forget"),
    ({"activations": ["Sigmoid", "Elu", "Tanh"]}, "activation 'Elu' is not supported"),
    ({"activations": ["Sigmoid", "Tanh"]}, "needs 3 per direction"),
])
def test_unsupported_attributes_fail_clearly(attrs, match):
    model = harness.single_op_model("LSTM", inputs("LSTM"), 3, hidden_size=H, **attrs)
    with pytest.raises(gradbuilder.errors.RuleError, match=match):
        gradbuilder.build_gradient_graph(model, wrt=["x", "w"])


# --- what torch exports -----------------------------------------------------------------------------

class Classifier(nn.Module):
    """A recurrent layer read at its last step (both exporters emit the ONNX op for LSTM and GRU;
    the dynamo exporter unrolls RNN into MatMul/Tanh)."""

    def __init__(self, kind: str, **kw):
        super().__init__()
        self.rnn = getattr(nn, kind)(4, 6, batch_first=True, **kw)
        self.fc = nn.Linear(6 * (2 if kw.get("bidirectional") else 1), 3)

    def forward(self, x, y):
        out, _ = self.rnn(x)
        logits = self.fc(out[:, -1])
        return nn.functional.cross_entropy(logits, y), logits


@pytest.mark.parametrize("kind,kw,dynamo", [
    ("LSTM", {}, False), ("LSTM", {"bidirectional": True, "num_layers": 2}, False), ("GRU", {"bias": False}, False),
    ("GRU", {"bidirectional": True}, False), ("RNN", {"nonlinearity": "relu"}, False),
    ("LSTM", {"bidirectional": True}, True)])  # the dynamo exporter takes 10-20 s a model: one is enough
def test_exported(kind, kw, dynamo):
    torch.manual_seed(0)
    args = (torch.randn(3, 5, 4), torch.randint(0, 3, (3,)))
    training, _ = check_model(Classifier(kind, **kw), args, dynamo)
    ops = {n.op_type for n in training.graph.node}
    assert kind in ops or (kind == "RNN" and dynamo)


class Packed(nn.Module):
    """Padded batch through pack_padded_sequence: the legacy exporter feeds sequence_lens to the op."""

    def __init__(self, kind: str):
        super().__init__()
        self.rnn = getattr(nn, kind)(4, 5, bidirectional=True)

    def forward(self, x, lens):
        y, _ = self.rnn(nn.utils.rnn.pack_padded_sequence(x, lens, enforce_sorted=False))
        y = nn.utils.rnn.pad_packed_sequence(y, total_length=x.shape[0])[0]
        return (y * torch.linspace(-1, 1, 10)).sum()


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_exported_packed_sequence(kind):
    torch.manual_seed(0)
    m, x, lens = Packed(kind), torch.randn(4, 3, 4), torch.tensor([4, 2, 3])
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (x, lens), f, dynamo=False, opset_version=17, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, input_names=["x", "lens"], output_names=["loss"])
    model = onnx.load_from_string(f.getvalue())
    assert any(n.op_type == kind and n.input[4] for n in model.graph.node), "sequence_lens is fed"
    params = dict(m.named_parameters())
    trainer = harness.Trainer(gradbuilder.build_gradient_graph(model, wrt=list(params), loss="loss"))
    (loss,), grads = trainer.step({"x": x.numpy(), "lens": lens.numpy()})
    ref = m(x, lens)
    ref.backward()
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-5)
    for n, p in params.items():
        np.testing.assert_allclose(grads[n], p.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=n)
