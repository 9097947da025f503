"""runtime/feature_major.py: chains of Linear layers rewritten feature-major give torch's values and gradients
(float64), only where every tensor of the chain stays inside it, and ORTModule applies the rewrite."""

import copy

import numpy as np
import onnx
import pytest
import torch
from harness import Trainer
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import gradbuilder
from runtime import ORTModule
from runtime.feature_major import feature_major_chains

RNG = np.random.default_rng(0)
W1, B1 = RNG.standard_normal((5, 6)), RNG.standard_normal(5)
W2, B2 = RNG.standard_normal((5, 4)), RNG.standard_normal(())  # used as h W2 (transB 0); a scalar bias
W3 = RNG.standard_normal((3, 4))
SCALE = RNG.standard_normal(4)
PARAMS = {"w1": W1, "b1": B1, "w2": W2, "b2": B2, "w3": W3}


def _quick_gelu(node, x: str, y: str) -> list[onnx.NodeProto]:
    """x * sigmoid(1.702 x) / (1 + 0): x reaches two nodes, single values come in from constants (onnxruntime
    has no double Erf for the exported GELU)."""
    return [node("Mul", [x, "k"], [f"{y}/k"]), node("Sigmoid", [f"{y}/k"], [f"{y}/s"]),
            node("Mul", [x, f"{y}/s"], [f"{y}/m"]), node("Add", ["zero", "one"], [f"{y}/one"]),
            node("Div", [f"{y}/m", f"{y}/one"], [y])]


def _chain(*, middle_output=False, per_feature=False, trans_a=False, single=False, dropout=False
           ) -> onnx.ModelProto:
    """x [n, 6] -> Linear(W1, b1) -> quick GELU -> x W2 + b2 -> Tanh -> Linear(W3, no bias) -> y [n, 3], in float64.

    middle_output: the Tanh output is a graph output too; per_feature: the Tanh input is scaled by a vector of
    4 (not a single value); trans_a: the last product reads its activations transposed; single: only the first
    Linear (its output is y); dropout: a training Dropout (its mask an unread second output) after the Tanh."""
    node = helper.make_node
    nodes = [node("Gemm", ["x", "w1", "b1"], ["z1"], transB=1), *_quick_gelu(node, "z1", "h1")]
    if single:
        nodes[-1].output[0] = "y"
    else:
        nodes.append(node("Gemm", ["h1", "w2", "b2"], ["z2"]))
        if per_feature:
            nodes.append(node("Mul", ["z2", "scale"], ["z2s"]))
        nodes.append(node("Tanh", ["z2s" if per_feature else "z2"], ["h2"]))
        if dropout:
            nodes.append(node("Dropout", ["h2", "ratio", "training"], ["h2d", "dmask"], seed=5))
            nodes.append(node("Gemm", ["h2d", "w3"], ["y"], transB=1))
        elif trans_a:
            nodes += [node("Transpose", ["h2"], ["h2t"], perm=[1, 0]),
                      node("Gemm", ["h2t", "w3"], ["y"], transA=1, transB=1)]
        else:
            nodes.append(node("Gemm", ["h2", "w3"], ["y"], transB=1))
    f64 = TensorProto.DOUBLE
    consts = [numpy_helper.from_array(np.array(v), n) for n, v in (("k", 1.702), ("one", 1.0),
                                                                    ("zero", 0.0))]
    consts += [numpy_helper.from_array(SCALE, "scale"), numpy_helper.from_array(np.array(0.5), "ratio"),
               numpy_helper.from_array(np.array(True), "training")]
    inputs = [helper.make_tensor_value_info("x", f64, ["n", 6])]
    inputs += [helper.make_tensor_value_info(n, f64, list(v.shape)) for n, v in PARAMS.items()]
    outputs = [helper.make_tensor_value_info("y", f64, None)]
    if middle_output:
        outputs.append(helper.make_tensor_value_info("h2", f64, None))
    graph = helper.make_graph(nodes, "chain", inputs, outputs, initializer=consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _torch_chain(x, p, *, per_feature=False, single=False, mask=None):
    z1 = x @ p["w1"].T + p["b1"]
    h1 = z1 * torch.sigmoid(1.702 * z1)
    if single:
        return [h1]
    z2 = h1 @ p["w2"] + p["b2"]
    h2 = torch.tanh(z2 * torch.tensor(SCALE) if per_feature else z2)
    h2d = h2 if mask is None else h2 * torch.tensor(mask) / 0.5
    return [h2d @ p["w3"].T, h2]


def _check_against_torch(model: onnx.ModelProto, **kind):
    """Forward values and the gradients of every parameter and of x, against torch in float64."""
    names = [o.name for o in model.graph.output]
    trainer = Trainer(gradbuilder.build_gradient_graph(model, wrt=["x", *PARAMS], outputs=names))
    x = RNG.standard_normal((7, 6))
    feeds = {"x": x, **PARAMS}
    tp = {n: torch.tensor(v, requires_grad=True) for n, v in feeds.items()}
    outs, env = trainer.run_forward(feeds)
    if "dmask" in env:  # the Dropout's mask, from the forward (transposed there when feature-major)
        kind["mask"] = env["dmask"] if env["dmask"].shape == (7, 4) else env["dmask"].T
        assert 0 < kind["mask"].sum() < kind["mask"].size
    want = _torch_chain(tp["x"], tp, **kind)[:len(names)]
    dys = [RNG.standard_normal(tuple(w.shape)) for w in want]
    grads = trainer.run_backward(feeds, env, dys)
    torch.autograd.backward(want, [torch.tensor(d) for d in dys])
    for got, w in zip(outs, want):
        np.testing.assert_allclose(got, w.detach().numpy(), rtol=1e-12, atol=1e-12)
    assert set(grads) == {n for n, t in tp.items() if t.grad is not None}  # unused inputs get none
    for n, t in tp.items():
        if t.grad is not None:
            np.testing.assert_allclose(grads[n], t.grad.numpy(), rtol=1e-11, atol=1e-12)


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def test_a_chain_runs_feature_major_with_torchs_values_and_gradients():
    """Three Linears (transB 1, transB 0, no bias) joined by a quick GELU (a small graph of elementwise nodes
    with single values, one of them computed from two constants) and a Tanh: one Transpose in, one out (under
    the output's own name), each product as Gemm(B, hᵀ) with transA = 1 - transB, the vector bias as a
    column; the input model is left alone."""
    model = _chain()
    before = _ops(model)
    rewritten = feature_major_chains(model)
    assert _ops(model) == before
    assert _ops(rewritten).count("Transpose") == 2 and _ops(rewritten).count("Unsqueeze") == 1
    gemms = [n for n in rewritten.graph.node if n.op_type == "Gemm"]
    assert [n.input[:2] for n in gemms] == [["w1", "x/feature_major"], ["w2", "h1"], ["w3", "h2"]]
    assert [helper.get_attribute_value(a) for n in gemms for a in n.attribute if a.name == "transA"] == [0, 1, 0]
    assert gemms[0].input[2] == "b1/column" and gemms[1].input[2] == "b2"  # the scalar broadcasts either way
    producer = {o: n for n in rewritten.graph.node for o in n.output}
    assert producer["y"].op_type == "Transpose"
    _check_against_torch(model)
    _check_against_torch(rewritten)


def test_a_training_dropout_joins_the_chain():
    """A Dropout between two Linears draws its mask feature-major (the mask output keeps the chain's layout,
    stashed that way for its gradient): torch's values and gradients with that same mask."""
    model = _chain(dropout=True)
    rewritten = feature_major_chains(model)
    assert [n.input[:2] for n in rewritten.graph.node if n.op_type == "Gemm"] == \
        [["w1", "x/feature_major"], ["w2", "h1"], ["w3", "h2d"]]
    _check_against_torch(model)
    _check_against_torch(rewritten)


@pytest.mark.parametrize("kind", ["middle_output", "trans_a"])
def test_a_tensor_read_outside_leaves_the_chain_transposed_back(kind):
    """The Tanh output is also a graph output, or read by a Transpose for a product with transA (not a
    Linear): the first two Linears stay a chain whose Tanh output is transposed back under its own name, and
    the last product stays as it was."""
    model = _chain(**{kind: True})
    rewritten = feature_major_chains(model)
    gemms = [n for n in rewritten.graph.node if n.op_type == "Gemm"]
    assert [n.input[0] for n in gemms] == ["w1", "w2", "h2t" if kind == "trans_a" else "h2"]
    producer = {o: n for n in rewritten.graph.node for o in n.output}
    assert producer["h2"].op_type == "Transpose" and producer["h2"].input[0] == "h2/feature_major"
    _check_against_torch(rewritten)


@pytest.mark.parametrize("kind", ["single", "per_feature"])
def test_left_alone(kind):
    """One Linear is not worth two Transposes; a per-feature operand (a vector of the features) would need
    its own column, and splitting the chain there leaves one Linear on each side. Nothing changes."""
    model = _chain(**{kind: True})
    assert feature_major_chains(model) is model
    _check_against_torch(model, **{kind: True})


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8), nn.SiLU(),
                                 nn.Linear(8, 3))

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.net(x), y)


def test_ortmodule_trains_an_mlp_feature_major():
    """ORTModule's forward source has the feature-major products, and two steps give torch's loss and
    gradients in float64."""
    torch.manual_seed(0)
    model = MLP().double()
    reference = copy.deepcopy(model)
    ort = ORTModule(model, threads=1)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randn(16, 3, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g)
        for m in (model, reference):
            for p in m.parameters():
                p.grad = None
        loss = ort(x, y)
        loss.backward()
        want = reference(x, y)
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-11, atol=1e-12)
    source = ort.training_sessions()[0].source
    trans_a = [a.i for n in source.graph.node if n.op_type == "Gemm" for a in n.attribute if a.name == "transA"]
    assert trans_a == [0, 0, 0] and [n.input[0] for n in source.graph.node if n.op_type == "Gemm"] == \
        ["net.1.weight", "net.3.weight", "net.5.weight"]


def test_ortmodule_keeps_host_drawn_dropout_masks_in_a_feature_major_chain():
    """An MLP with a training Dropout between its Linears (float64): the chain spans it and the runtime feeds
    it masks drawn on the host at the transposed shape it records. The second Linear is square, so the
    dropped activations can be recovered from the output; the gradients are those of that mask."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 8)).double()
    ort = ORTModule(net, threads=1)
    x = torch.randn(16, 6, dtype=torch.float64)
    for _ in range(3):  # the second call records the sizes, the third draws on the host
        ort.zero_grad()
        z = ort(x)
        z.square().sum().backward()
    source = ort.training_sessions()[0].source
    assert [n.input[0] for n in source.graph.node if n.op_type == "Gemm"] == ["0.weight", "3.weight"]
    runner = ort.training_sessions()[0]._fwd
    assert runner.shapes and all(s == (8, 16) for sizes in runner.shapes.values() for s in sizes.values())
    w2, b2 = net[3].weight.detach(), net[3].bias.detach()
    h = torch.linalg.solve(w2, (z.detach() - b2).T).T  # z = h W2^T + b2
    kept = h.abs() > 1e-9
    assert 0.2 < kept.double().mean() < 0.8
    dz = 2 * z.detach()
    dz1 = (dz @ w2) * kept * 2.0  # 1 / (1 - p)
    torch.testing.assert_close(net[3].weight.grad, dz.T @ h, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(net[0].weight.grad, dz1.T @ x, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(net[0].bias.grad, dz1.sum(0), rtol=1e-9, atol=1e-9)


def test_ortmodule_inference_runs_feature_major_too(monkeypatch):
    """Eval mode without grad runs the export through the same source rewrites: torch's outputs (float64),
    from a forward whose products are feature-major."""
    from runtime import feature_major

    seen = []

    def spy(model, rows, dropouts=True):
        out = feature_major_chains(model, rows, dropouts)
        seen.append([n.input[0] for n in out.graph.node if n.op_type == "Gemm"])
        return out

    monkeypatch.setattr(feature_major, "feature_major_chains", spy)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double().eval()
    ort = ORTModule(copy.deepcopy(net), threads=1).eval()
    x = torch.randn(16, 6, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(ort(x), net(x), rtol=1e-12, atol=1e-12)
    assert seen == [["0.weight", "2.weight"]]


def test_batches_that_leave_mlas_strips_part_empty_stay_batch_major():
    """A chain goes feature-major only for a batch filling MLAS's strips of 16 columns (`fills_strips`): rows the
    graph fixes, else the batch the caller expects. Small batches and those off the multiples of 16 (50, 100)
    stay as they are, 16, 64 and 127 (a last strip 15/16 full) do not. An ORTModule whose first call has 2
    samples keeps its Linears batch-major, and its gradients are torch's."""
    model = _chain()
    for rows in (2, 8, 15, 50, 60, 100, 200):
        assert feature_major_chains(model, rows=rows) is model, rows
    for rows in (16, 64, 127, 128, 512):
        assert feature_major_chains(model, rows=rows) is not model, rows
    assert feature_major_chains(model) is not model  # no batch known: feature-major
    fixed = _chain()
    fixed.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 50  # x [50, 6]: fixed rows win
    assert feature_major_chains(fixed, rows=64) is fixed
    fixed.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 32
    assert feature_major_chains(fixed, rows=50) is not fixed
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    reference = copy.deepcopy(net)
    ort = ORTModule(net, threads=1)
    x = torch.randn(2, 6, dtype=torch.float64)
    ort(x).square().sum().backward()
    reference(x).square().sum().backward()
    source = ort.training_sessions()[0].source
    assert [n.input[1] for n in source.graph.node if n.op_type == "Gemm"] == ["0.weight", "2.weight"]
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


def test_bias_free_linears_join_too():
    """torch exports a bias-free Linear as a MatMul of its weight's Transpose, with no rank on the activations:
    ranks follow from the input through Flatten and the chain's ops, the Transpose folds into the product, and
    a weight used by two layers gets each its own. Gradients are torch's (float64)."""
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.c = nn.Linear(12, 12, bias=False), nn.Linear(12, 3, bias=False)

        def forward(self, x):
            return self.c(torch.sigmoid(self.a(torch.tanh(self.a(x.flatten(1))))))

    net = Tied().double()
    reference = copy.deepcopy(net)
    ort = ORTModule(net, threads=1)
    x = torch.randn(16, 3, 4, dtype=torch.float64)
    ort(x).square().sum().backward()
    reference(x).square().sum().backward()
    source = ort.training_sessions()[0].source
    assert "MatMul" not in _ops(source) and _ops(source).count("Transpose") == 2  # in and out, no weight's
    assert [n.input[0] for n in source.graph.node if n.op_type == "Gemm"] == ["a.weight", "a.weight", "c.weight"]
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
