"""runtime/nchwc.py: Convs with weight inputs and stride-1 ConvTransposes rewritten into onnxruntime's blocked
NCHWc kernels compute what they replace, on the layers the rule picks and no others; through ORTModule the
gradients still match torch's."""

import copy
import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

import gradbuilder
from runtime import ORTModule, lowering, nchwc
from runtime.ort_session import SessionConfig
from tests.harness import single_op_model

BLOCK = nchwc.block_size()
needs_nchwc = pytest.mark.skipif(not BLOCK, reason="this onnxruntime build has no NCHWc kernels")


def _model(op: str, x_shape: list[int], w_shape: list[int], bias: int | None, elem=TensorProto.FLOAT,
           constant_weight: bool = False, **attrs) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info("x", elem, x_shape)]
    inits = []
    if constant_weight:
        inits.append(onnx.numpy_helper.from_array(np.ones(w_shape, np.float32), "w"))
    else:
        inputs.append(helper.make_tensor_value_info("w", elem, w_shape))
    names = ["x", "w"]
    if bias is not None:
        inputs.append(helper.make_tensor_value_info("b", elem, [bias]))
        names.append("b")
    graph = helper.make_graph([helper.make_node(op, names, ["y"], **attrs)], "g", inputs,
                              [helper.make_tensor_value_info("y", elem, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _session(model: onnx.ModelProto, threads: int = 1) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), SessionConfig(threads=threads).options(),
                                providers=["CPUExecutionProvider"])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return _session(model).run(None, feeds)[0]


def _blocked(model: onnx.ModelProto) -> int:
    return sum(n.op_type == "Conv" and n.domain == nchwc.DOMAIN for n in model.graph.node)


def _feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in model.graph.input}


def test_block_size_is_one_mlas_knows():
    assert BLOCK in (0, 8, 16)


# (N, C, M, H, K, P, stride, dilation, bias): input channels from 2 (read as NCHW) to two blocks (reordered),
# output channels padded to the block or not, strides, dilations, pads, with and without bias
CONVS = [
    (2, 16, 32, 9, 3, 1, 1, 1, True),
    (3, 32, 24, 8, 3, 0, 2, 1, False),
    (2, 16, 6, 10, 5, 2, 1, 1, True),
    (2, 32, 16, 11, 3, 2, 1, 2, True),
    (2, 6, 16, 12, 5, 0, 1, 1, True),
    (1, 3, 6, 13, 5, 1, 2, 1, False),
    (2, 2, 8, 9, 5, 2, 1, 1, True),
    (2, 1, 6, 12, 5, 2, 1, 1, True),  # one channel (a LeNet's first layer)
]


@needs_nchwc
@pytest.mark.parametrize("n,c,m,h,k,p,s,d,bias", CONVS)
def test_blocked_conv_matches_conv(n, c, m, h, k, p, s, d, bias):
    c, m = c * BLOCK // 16 if c >= 16 else c, m * BLOCK // 16 if m >= 16 else m  # the same layouts on AVX2
    model = _model("Conv", [n, c, h, h], [m, c, k, k], m if bias else None, pads=[p] * 4, strides=[s, s],
                   dilations=[d, d])
    blocked = nchwc.blocked_convs(model)
    assert _blocked(blocked) == 1
    assert any(o.domain == nchwc.DOMAIN for o in blocked.opset_import)
    assert sum(n.op_type == "ReorderInput" for n in blocked.graph.node) == (c >= BLOCK)
    feeds = _feeds(model)
    want, got = _run(model, feeds), _run(blocked, feeds)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# (N, M, C, Ho, K, P, bias): dY channels M, dX channels C; 'same' pads, none (dX larger than dY), uneven pads
TRANSPOSED = [
    (2, 32, 16, 8, 3, 1, False),
    (2, 16, 32, 7, 3, 0, True),
    (3, 64, 32, 10, 5, 0, False),
    (2, 16, 16, 9, 5, 2, True),
]


@needs_nchwc
@pytest.mark.parametrize("n,m,c,ho,k,p,bias", TRANSPOSED)
def test_stride_one_conv_transpose_becomes_a_flipped_blocked_conv(n, m, c, ho, k, p, bias):
    m, c = m * BLOCK // 16, c * BLOCK // 16
    model = _model("ConvTranspose", [n, m, ho, ho], [m, c, k, k], c if bias else None, pads=[p, p + 1 if k > 3 else p,
                                                                                              p, p])
    blocked = nchwc.blocked_convs(model)
    assert _blocked(blocked) == 1
    assert not any(n.op_type == "ConvTranspose" for n in blocked.graph.node)
    feeds = _feeds(model, seed=1)
    want, got = _run(model, feeds), _run(blocked, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_nchwc
@pytest.mark.parametrize("case", [
    "constant weight", "grouped", "double", "3x3 over 3 channels", "3x3 over 1 channel",
    "input channels not a multiple of 4",
    "input channels padded by 60%", "1x1 output", "strided transpose", "dilated transpose",
    "LeNet's input gradient (dX 14x14 from 10x10, 6 of 16 channels)",
    "5x5 input gradient onto channels that do not fill a block", "auto_pad", "3-D",
    "5x5 input gradient onto 12x12 from 8x8",
])
def test_layers_that_do_not_pay_or_cannot_stay(case):
    b = BLOCK
    model = {
        "constant weight": lambda: _model("Conv", [2, b, 8, 8], [b, b, 3, 3], None, constant_weight=True),
        "grouped": lambda: _model("Conv", [2, 2 * b, 8, 8], [2 * b, b, 3, 3], None, group=2),
        "double": lambda: _model("Conv", [2, b, 8, 8], [b, b, 3, 3], None, elem=TensorProto.DOUBLE),
        "3x3 over 3 channels": lambda: _model("Conv", [2, 3, 8, 8], [b, 3, 3, 3], None),
        "3x3 over 1 channel": lambda: _model("Conv", [2, 1, 8, 8], [b, 1, 3, 3], None),
        "input channels not a multiple of 4": lambda: _model("Conv", [2, b + 2, 8, 8], [b, b + 2, 3, 3], None),
        "input channels padded by 60%": lambda: _model("Conv", [2, b + 4, 8, 8], [b, b + 4, 3, 3], None),
        "1x1 output": lambda: _model("Conv", [2, b, 5, 5], [b, b, 5, 5], None),
        "strided transpose": lambda: _model("ConvTranspose", [2, b, 4, 4], [b, b, 3, 3], None, strides=[2, 2]),
        "dilated transpose": lambda: _model("ConvTranspose", [2, b, 4, 4], [b, b, 3, 3], None,
                                                        strides=[1, 1], output_padding=[0, 0], pads=[0, 0, 0, 0],
                                                        dilations=[2, 2]),
        "LeNet's input gradient (dX 14x14 from 10x10, 6 of 16 channels)":
            lambda: _model("ConvTranspose", [2, b, 10, 10], [b, 6, 5, 5], None),
        "5x5 input gradient onto channels that do not fill a block":
            lambda: _model("ConvTranspose", [2, 2 * b, 14, 14], [2 * b, b + 4, 5, 5], None, pads=[2, 2, 2, 2]),
        "auto_pad": lambda: _model("Conv", [2, b, 8, 8], [b, b, 3, 3], None, auto_pad="SAME_UPPER"),
        "3-D": lambda: _model("Conv", [2, b, 4, 4, 4], [b, b, 3, 3, 3], None),
        "5x5 input gradient onto 12x12 from 8x8": lambda: _model("ConvTranspose", [2, 2 * b, 8, 8], [2 * b, b, 5, 5],
                                                                  None),
    }[case]()
    if case in ("1x1 output", "5x5 input gradient onto 12x12 from 8x8"):  # sizes only value_info tells
        side = 1 if case == "1x1 output" else 12
        model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, b, side, side]))
    assert nchwc.blocked_convs(model) is model


def _swapped_weight_gradient(c: int, m: int, size: int, k: int, pad: int, batch: int | str = "N") -> onnx.ModelProto:
    """A Conv layer's weight gradient as the Conv rule writes it from 4 input channels on: x and dY with batch
    and channels swapped, so the batch is the channel axis (symbolic unless given), dY's transpose typed by
    value_info."""
    out = size + 2 * pad - k + 1
    swap = [1, 0, 2, 3]
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=swap),
             helper.make_node("Transpose", ["dy"], ["dyt"], perm=swap),
             helper.make_node("Conv", ["xt", "dyt"], ["dwt"], pads=[pad] * 4),
             helper.make_node("Transpose", ["dwt"], ["dw"], perm=swap)]
    typed = functools.partial(helper.make_tensor_value_info, elem_type=TensorProto.FLOAT)
    graph = helper.make_graph(nodes, "g", [typed("x", shape=[batch, c, size, size]),
                                           typed("dy", shape=[batch, m, out, out])],
                              [typed("dw", shape=None)], value_info=[typed("dyt", shape=[m, batch, out, out])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@needs_nchwc
@pytest.mark.parametrize("c,m,size,k,pad", [(6, 16, 14, 5, 0), (4, 6, 9, 3, 1), (20, 50, 12, 5, 0), (8, 16, 12, 5, 2)])
def test_a_batch_of_channels_is_padded_to_the_block_at_run_time(c, m, size, k, pad):
    model = _swapped_weight_gradient(c, m, size, k, pad)
    blocked = nchwc.blocked_convs(model)
    assert _blocked(blocked) == 1
    conv = next(n for n in blocked.graph.node if n.domain == nchwc.DOMAIN and n.op_type == "Conv")
    assert not any(a.name == "pads" for a in conv.attribute)  # the channels' Pad frames x too: no padded borders
    # the filter reads dY itself: the swap's Transpose is gone, one axis move per output block beyond the first
    assert not any("dyt" in (*n.input, *n.output) for n in blocked.graph.node)
    moves = sum(n.op_type == "Transpose" for n in blocked.graph.node) - 2  # x's swap and dW's
    assert moves == (1 if m <= BLOCK else 2)
    rng = np.random.default_rng(0)
    out = size + 2 * pad - k + 1
    for batch in (1, BLOCK, 2 * BLOCK + 3):  # padded by BLOCK - 1, not at all, by BLOCK - 3
        feeds = {"x": rng.standard_normal((batch, c, size, size)).astype(np.float32),
                 "dy": rng.standard_normal((batch, m, out, out)).astype(np.float32)}
        want, got = _run(model, feeds), _run(blocked, feeds)
        assert got.shape == want.shape == (m, c, k, k)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_nchwc
@pytest.mark.parametrize("batch", [6, 3 * BLOCK - 4])  # under one block (read as NCHW), blocked with padding
def test_a_static_batch_of_channels_reads_dy_before_its_swap(batch):
    model = _swapped_weight_gradient(6, 2 * BLOCK, 14, 5, 0, batch)
    blocked = nchwc.blocked_convs(model)
    assert _blocked(blocked) == 1 and not any("dyt" in (*n.input, *n.output) for n in blocked.graph.node)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((batch, 6, 14, 14)).astype(np.float32),
             "dy": rng.standard_normal((batch, 2 * BLOCK, 10, 10)).astype(np.float32)}
    want, got = _run(model, feeds), _run(blocked, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_nchwc
def test_run_time_channels_need_two_images_and_a_typed_weight():
    one_image = _swapped_weight_gradient(1, 16, 14, 5, 0)
    assert nchwc.blocked_convs(one_image) is one_image
    untyped = _swapped_weight_gradient(6, 16, 14, 5, 0)
    del untyped.graph.value_info[:]  # dY's transpose is then of unknown size (its producer's here is known)
    untyped.graph.input[1].type.tensor_type.ClearField("shape")
    assert nchwc.blocked_convs(untyped) is untyped


def _unfolded_weight_gradient(c: int, m: int, size: int, k: int, pad: int, stride: int, dilation: int
                              ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One Conv layer's backward graph, its batch symbolic, with the weight gradient the Conv rule writes for 3x3
    kernels (x unfolded by a one-hot Conv, then per-sample products), and the values of the forward's
    initializers it reads."""
    zeros = np.zeros
    model = single_op_model("Conv", [("x", zeros((2, c, size, size), np.float32)),
                                     ("w", zeros((m, c, k, k), np.float32))],
                            pads=[pad] * 4, strides=[stride] * 2, dilations=[dilation] * 2, symbolic={"x": [0]})
    forward, backward, manifest = gradbuilder.split(gradbuilder.build_gradient_graph(model, wrt=["w"]))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in forward.graph.initializer}
    return backward, {e.name: inits[e.name] for e in manifest.backward_inputs if e.name in inits}


@pytest.mark.parametrize("c,m,size,k,pad,stride,dilation", [
    (16, 8, 10, 3, 1, 1, 1),  # a 3x3 layer: its unfold stays a grouped Conv, chunked
    (3, 6, 13, 3, 0, 2, 2),   # strided and dilated, from 3 channels
])
def test_unfolded_weight_gradient_in_chunks(c, m, size, k, pad, stride, dilation):
    backward, known = _unfolded_weight_gradient(c, m, size, k, pad, stride, dilation)
    assert nchwc.unfolded_weight_grads(backward, known) is backward  # no batch expected: as it is
    chunked = nchwc.unfolded_weight_grads(backward, known, rows=10**6)
    convs = [n for n in chunked.graph.node if n.op_type == "Conv"]
    assert len(convs) == nchwc.MAX_CHUNKS and not any(n.domain for n in convs)
    assert [len(n.output) for n in chunked.graph.node if n.op_type == "Split"] == [nchwc.MAX_CHUNKS] * 2
    _check_weight_gradient(backward, chunked, known, c, m, size, k, pad, stride, dilation)


def _check_weight_gradient(backward: onnx.ModelProto, rewritten: onnx.ModelProto, known: dict[str, np.ndarray],
                           c: int, m: int, size: int, k: int, pad: int, stride: int, dilation: int) -> None:
    """The rewritten backward's weight gradient against torch's (float64) and the rule's own graph, at batches of
    one, five and one more than the block (one session)."""
    out = (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1
    rng = np.random.default_rng(0)
    reference, session = _session(backward), _session(rewritten, threads=2)
    names = [i.name for i in backward.graph.input]
    for batch in (1, 5, max(BLOCK, 8) + 1):
        x = rng.standard_normal((batch, c, size, size))
        dy = rng.standard_normal((batch, m, out, out))
        feeds = {**{n: v for n, v in known.items() if n in names}, "x": x.astype(np.float32),
                 next(n for n in names if n not in known and n != "x"): dy.astype(np.float32)}
        got = session.run(None, feeds)[0]
        want = torch.ops.aten.convolution_backward(
            torch.from_numpy(dy), torch.from_numpy(x), torch.zeros(m, c, k, k, dtype=torch.float64), None,
            [stride] * 2, [pad] * 2, [dilation] * 2, False, [0, 0], 1, [False, True, False])[1].numpy()
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale)
        np.testing.assert_allclose(got, reference.run(None, feeds)[0], rtol=0, atol=2e-6 * scale)


def test_unfold_chunks_follow_the_expected_batch():
    layer = (16, 9, 16 * 16)  # channels, 3x3 taps, positions: 147 KB a sample
    assert [nchwc._chunks(rows, *layer) for rows in (None, 16, 64, 128, 256, 10**6)] == [1, 1, 1, 9, 16, 16]
    assert nchwc._chunks(256, 16, 9, None) == 1  # positions unknown: one unfold
    assert nchwc._chunks(64, 16, 9, 32 * 32) == 16  # over 32x32: 38 MB at batch 64


def test_only_the_rules_unfold_is_chunked():
    """The batch sum's axes may be a constant of the forward (an input of backward): known, the unfold is chunked,
    unknown, it stays; a one-hot weight in another order than the unfold's is another Conv."""
    layer, known = _unfolded_weight_gradient(16, 8, 10, 3, 1, 1, 1)
    shared = onnx.ModelProto()
    shared.CopyFrom(layer)
    axes = next(n for n in shared.graph.node if n.op_type == "ReduceSum" and n.input[0].endswith("MatMul")).input[1]
    [init] = [t for t in shared.graph.initializer if t.name == axes]
    shared.graph.initializer.remove(init)
    shared.graph.input.append(helper.make_tensor_value_info(axes, TensorProto.INT64, [1]))
    assert nchwc.unfolded_weight_grads(shared, known, rows=10**6) is shared
    chunked = nchwc.unfolded_weight_grads(shared, {**known, axes: onnx.numpy_helper.to_array(init)}, rows=10**6)
    assert sum(n.op_type == "Conv" for n in chunked.graph.node) == nchwc.MAX_CHUNKS
    conv = next(n for n in layer.graph.node if n.op_type == "Conv")
    onehot = next(t for t in layer.graph.initializer if t.name == conv.input[1])
    shifted = onnx.numpy_helper.to_array(onehot)[::-1].copy()  # one-hot, but not the unfold's order
    onehot.CopyFrom(onnx.numpy_helper.from_array(shifted, onehot.name))
    assert nchwc.unfolded_weight_grads(layer, known, rows=10**6) is layer


def test_no_nchwc_kernels_leaves_the_graph():
    model = _model("Conv", [2, 16, 8, 8], [16, 16, 3, 3], None)
    assert nchwc.blocked_convs(model, block=0) is model


def _lowered_backward(session) -> onnx.ModelProto:
    """A training session's one backward graph as `lowering.backward` rewrites it, with the forward's constants
    the session feeds it."""
    [bw] = session._backwards.values()
    consts = {k: v.numpy() for k, v in bw.consts.items()}
    return lowering.backward(bw.program.backward, consts, session.config, session.rows)


class Cnn(nn.Module):
    """3x3 layers of block-multiple widths (blocked forward and input gradients) and a 5x5 one from 3 channels."""

    def __init__(self, width: int):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, width, 5, padding=2), nn.ReLU(),
                                 nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Conv2d(2 * width, width, 3), nn.ReLU(), nn.Flatten(), nn.Linear(width * 4 * 4, 5))

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.net(x), y)


@needs_nchwc
def test_ortmodule_gradients_match_torch_through_blocked_convs():
    torch.manual_seed(0)
    model = Cnn(BLOCK)
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, threads=2)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 5, (4,), generator=g)
    for _ in range(2):  # a second step: the reordered filters follow the updated weights
        for m in (wrapped, reference):
            m.zero_grad()
        loss, want = wrapped(x, y), reference(x, y)
        loss.backward()
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        for p, q in zip(wrapped.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            for p, q in zip(wrapped.parameters(), reference.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
    wrapped.eval()
    reference.eval()
    with torch.no_grad():  # inference runs the blocked forward too
        torch.testing.assert_close(wrapped(x, y), reference(x, y), rtol=1e-5, atol=1e-6)
    session = wrapped.training_sessions()[0]
    config = session.config
    assert _blocked(lowering.forward(session.full.forward, config)) == 3
    # the input gradients of the 3x3 layers, and two weight gradients as the swapped Conv, the batch as its blocked
    # channels: the last layer's (3x3 over 4x4 positions) and the first layer's (5x5 from 3 channels, 'same')
    lowered = _lowered_backward(session)
    windows = {t.name for t in lowered.graph.initializer if list(t.dims[:1]) == [25] and len(t.dims) == 2}
    assert _blocked(lowered) == 4 and not any(n.op_type == "Gather" and n.input[1] in windows
                                              for n in lowered.graph.node)


def _train_like_torch(model: nn.Module, shapes: list[tuple[int, ...]]) -> list:
    """The model's gradients on ORTModule against torch's for one random batch of each shape (sum of squares of
    the output); returns ORTModule's training sessions."""
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, threads=2)
    g = torch.Generator().manual_seed(0)
    for shape in shapes:
        x = torch.randn(*shape, generator=g)
        for m in (wrapped, reference):
            m.zero_grad()
            m(x).square().sum().backward()
        for p, q in zip(wrapped.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4 * q.grad.abs().max().item())
    return wrapped.training_sessions()


@needs_nchwc
def test_ortmodule_weight_gradient_with_the_batch_as_blocked_channels():
    """LeNet's second layer (6 -> 16, 5x5): its weight gradient runs as a blocked Conv over the batch, padded to
    the block at run time: the batch stays symbolic, so one session takes a multiple of the block and another
    batch. The pool after that layer hides dY's sizes from shape inference: the rule's declared type (carried
    by split into the backward graph) is what lets the pass block it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 5 * 5, 3))  # dY's sizes behind a pool
    [session] = _train_like_torch(model, [(batch, 1, 28, 28) for batch in (BLOCK, BLOCK + 5)])
    lowered = _lowered_backward(session)
    padded = [n for n in lowered.graph.node if n.op_type == "Mod"]  # (-batch) mod BLOCK zero channels
    assert len(padded) == 1  # (that layer's input gradient stays a ConvTranspose)
    assert _blocked(lowered) == 1  # (the first layer's gathers its windows)


def test_ortmodule_unfolds_a_large_batch_in_chunks(monkeypatch):
    """A 3x3 layer from 16 channels over 32x32 at batch 64 unfolds 38 MB: the first call's batch reaches the
    backward's rewrite, which makes the unfold in chunks of the batch; a later smaller batch runs the same graph
    with some chunks empty."""
    lowered_backwards = []
    backward = lowering.backward

    def spy(*args):
        lowered_backwards.append(backward(*args))
        return lowered_backwards[-1]

    monkeypatch.setattr(lowering, "backward", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 4, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(4), nn.Flatten(), nn.Linear(4 * 8 * 8, 3))
    [session] = _train_like_torch(model, [(64, 3, 32, 32), (5, 3, 32, 32)])
    assert session.rows == 64
    chunks = nchwc._chunks(64, 16, 9, 32 * 32)
    assert chunks > 1 and nchwc._chunks(64, 3, 9, 32 * 32) == 1  # the first layer's unfold stays whole
    [lowered] = lowered_backwards  # the graph the session runs
    assert [len(n.output) for n in lowered.graph.node if n.op_type == "Split"] == [chunks, chunks]


@needs_nchwc
@pytest.mark.parametrize("layer", ["strided", "dilated", "transposed"])
def test_ortmodule_blocked_weight_gradients_of_other_windows(layer):
    """The batch-as-channels weight gradient of a strided or dilated 5x5 Conv (the swapped Conv's dilations and
    strides exchanged) and of a 5x5 ConvTranspose (its input as the kernel) matches torch at a batch the block
    does not divide."""
    torch.manual_seed(0)
    second = {"strided": nn.Conv2d(8, 8, 5, stride=2), "dilated": nn.Conv2d(8, 8, 5, dilation=2),
              "transposed": nn.ConvTranspose2d(8, 8, 5)}[layer]
    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.Tanh(), second, nn.Flatten())
    [session] = _train_like_torch(model, [(BLOCK + 3, 1, 15, 15)])
    lowered = _lowered_backward(session)
    assert any(n.op_type == "Mod" for n in lowered.graph.node)  # a blocked Conv over the padded batch


# (blocks of channels, H, K, P, stride, dilation, bias): ConvNeXt's 7x7 'same', MobileNet's 3x3 and its stride 2,
# dilated, uneven pads, two blocks of channels; one and a half blocks (padded with zero channels to two)
DEPTHWISE = [(1, 9, 7, (3, 3, 3, 3), 1, 1, True), (2, 8, 3, (1, 1, 1, 1), 2, 1, False),
             (1, 10, 3, (2, 0, 1, 2), 1, 2, True), (2, 5, 5, (2, 2, 2, 2), 1, 1, False),
             (1.5, 9, 7, (3, 3, 3, 3), 1, 1, True), (1.5, 8, 3, (1, 1, 1, 1), 2, 1, False)]


@needs_nchwc
@pytest.mark.parametrize("blocks,h,k,p,s,d,bias", DEPTHWISE)
def test_depthwise_conv_and_its_input_gradient_become_blocked(blocks, h, k, p, s, d, bias):
    c = int(blocks * BLOCK)
    model = _model("Conv", [3, c, h, h], [c, 1, k, k], c if bias else None, pads=list(p), strides=[s, s],
                   dilations=[d, d], group=c)
    blocked = nchwc.blocked_convs(model)
    assert _blocked(blocked) == 1 and not any(n.op_type == "Conv" and not n.domain for n in blocked.graph.node)
    feeds = _feeds(model)
    want = _run(model, feeds)
    np.testing.assert_allclose(_run(blocked, feeds), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    if s == 1 and d == 1:  # the input gradient: a ConvTranspose of the same weight, flipped into a Conv
        model = _model("ConvTranspose", [3, c, h, h], [c, 1, k, k], c if bias else None, pads=list(p), group=c)
        blocked = nchwc.blocked_convs(model)
        assert _blocked(blocked) == 1 and not any(n.op_type == "ConvTranspose" for n in blocked.graph.node)
        feeds = _feeds(model, seed=1)
        want = _run(model, feeds)
        np.testing.assert_allclose(_run(blocked, feeds), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_nchwc
def test_depthwise_weight_gradient_kernel_of_run_time_height():
    """The Conv rule's depthwise weight gradient convolves the batch stacked along rows with dY stacked the same
    way: its kernel's height (the batch's rows) is known only at run time."""
    c, rows, width = BLOCK + BLOCK // 2, "K", 6  # padded to two blocks
    typed = functools.partial(helper.make_tensor_value_info, elem_type=TensorProto.FLOAT)
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], group=c)], "g",
                              [typed("x", shape=[1, c, "R", 12]), typed("w", shape=[c, 1, rows, width])],
                              [typed("y", shape=None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    blocked = nchwc.blocked_convs(model)
    assert _blocked(blocked) == 1
    rng = np.random.default_rng(0)
    for height in (20, 33):
        feeds = {"x": rng.standard_normal([1, c, height + 6, 12], np.float32),
                 "w": rng.standard_normal([c, 1, height, width], np.float32)}
        want = _run(model, feeds)
        assert want.shape == (1, c, 7, 7)
        np.testing.assert_allclose(_run(blocked, feeds), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_nchwc
@pytest.mark.parametrize("case", ["under half a block of channels", "channel multiplier 2",
                                  "strided transpose", "double"])
def test_depthwise_layers_that_stay(case):
    b = BLOCK
    model = {
        "under half a block of channels": lambda: _model("Conv", [2, b // 2 - 1, 8, 8], [b // 2 - 1, 1, 3, 3], None,
                                                         group=b // 2 - 1),
        "channel multiplier 2": lambda: _model("Conv", [2, b, 8, 8], [2 * b, 1, 3, 3], None, group=b),
        "strided transpose": lambda: _model("ConvTranspose", [2, b, 4, 4], [b, 1, 3, 3], None, strides=[2, 2],
                                            group=b),
        "double": lambda: _model("Conv", [2, b, 8, 8], [b, 1, 3, 3], None, elem=TensorProto.DOUBLE, group=b),
    }[case]()
    assert nchwc.blocked_convs(model) is model


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: a 7x7 depthwise Conv, LayerNorm over channels last, an inverted MLP, the residual."""

    def __init__(self, c: int):
        super().__init__()
        self.dw, self.ln = nn.Conv2d(c, c, 7, padding=3, groups=c), nn.LayerNorm(c)
        self.mlp = nn.Sequential(nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c))

    def forward(self, x):
        return x + self.mlp(self.ln(self.dw(x).permute(0, 2, 3, 1))).permute(0, 3, 1, 2)


@needs_nchwc
@pytest.mark.parametrize("blocks", [2, 1.5])
def test_ortmodule_depthwise_layers_run_blocked_and_match_torch(blocks):
    """ConvNeXt's blocks and a MobileNet-style strided 3x3 depthwise layer: forward, input gradients and weight
    gradients all on the blocked depthwise kernels, at two batch sizes (the weight gradient's stacked rows), over
    whole blocks of channels and over one and a half (padded)."""
    c = int(blocks * BLOCK)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, c, 2, stride=2), ConvNeXtBlock(c), ConvNeXtBlock(c),
                          nn.Conv2d(c, c, 3, stride=2, padding=1, groups=c), nn.Flatten())
    [session] = _train_like_torch(model, [(3, 3, 18, 18), (5, 3, 18, 18)])
    assert _blocked(lowering.forward(session.full.forward, session.config)) >= 3
    lowered = _lowered_backward(session)
    depthwise = [n for n in lowered.graph.node if n.op_type == "Conv" and n.domain == nchwc.DOMAIN and
                 int(next(a.i for a in n.attribute if a.name == "group")) == nchwc._up(c, BLOCK)]
    assert len(depthwise) == 3 + 2  # three weight gradients, the blocks' two input gradients (the last is strided)
    assert not any(n.op_type == "Conv" and not n.domain and  # (the first layer's unfold is a grouped Conv of 3)
                   next((a.i for a in n.attribute if a.name == "group"), 1) == c for n in lowered.graph.node)
