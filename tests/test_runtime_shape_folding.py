"""runtime/shape_folding.py: shape arithmetic over a symbolic batch folds to constants (a Reshape target to -1
in the batch's place) and the folded model computes what the original does, at every batch size; Ifs the known
sizes decide are replaced by their branch."""


import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from parity import RTOL, check_parity, sgd
from torch import nn
from torch.nn import functional as F

from runtime import shape_folding
from runtime.partial_ints import Value


def _ints(name: str, values) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def _attention_like() -> onnx.ModelProto:
    """x [batch, 8, 4] reshaped to [batch, 32] through Shape/Gather/Unsqueeze/Concat, scaled by 1/sqrt(last dim)
    computed from Shape, as torch's exporters write multi-head attention."""
    n = helper.make_node
    nodes = [
        n("Shape", ["x"], ["shape"]),
        n("Gather", ["shape", "zero"], ["batch"], axis=0),
        n("Unsqueeze", ["batch", "axes0"], ["batch1"]),
        n("Gather", ["shape", "one"], ["rows"], axis=0),
        n("Gather", ["shape", "two"], ["cols"], axis=0),
        n("Mul", ["rows", "cols"], ["width"]),
        n("Unsqueeze", ["width", "axes0"], ["width1"]),
        n("Concat", ["batch1", "width1"], ["target"], axis=0),
        n("Reshape", ["x", "target"], ["flat"]),
        n("Shape", ["x"], ["last"], start=-1),
        n("Cast", ["last"], ["lastf"], to=TensorProto.FLOAT),
        n("Sqrt", ["lastf"], ["root"]),
        n("Div", ["flat", "root"], ["y"]),
        n("Slice", ["shape", "one1", "big"], ["tail"]),  # [8, 4]
        n("Div", ["tail", "two"], ["halves"]),  # [4, 2]
        n("Concat", ["halves", "minus"], ["spare"], axis=0),  # [4, 2, -1]: known, read by nothing else
        n("Reshape", ["spare", "flat1"], ["spare_flat"]),
        n("Cast", ["spare_flat"], ["sparef"], to=TensorProto.FLOAT),
        n("ReduceSum", ["sparef"], ["offset"], keepdims=0),  # 5.0
        n("Size", ["x"], ["count"]),  # depends on the batch: stays
        n("Cast", ["count"], ["countf"], to=TensorProto.FLOAT),
        n("Mul", ["y", "countf"], ["scaled"]),
        n("Add", ["scaled", "offset"], ["z"]),
    ]
    inits = [_ints("zero", 0), _ints("one", 1), _ints("two", 2), _ints("axes0", [0]), _ints("big", [9]),
             _ints("minus", [-1]), _ints("flat1", [-1]), _ints("one1", [1])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 4])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 32])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_batch_only_shape_arithmetic_folds_and_computes_the_same_at_every_batch():
    model = _attention_like()
    folded = shape_folding.fold_shapes(model)
    ops = [n.op_type for n in folded.graph.node]
    assert ops.count("Shape") == 0 and "Gather" not in ops and "Concat" not in ops and "Slice" not in ops
    assert "Size" in ops  # the element count depends on the batch
    reshape = next(n for n in folded.graph.node if n.op_type == "Reshape")
    target = next(t for t in folded.graph.initializer if t.name == reshape.input[1])
    assert onnx.numpy_helper.to_array(target).tolist() == [-1, 32]
    onnx.checker.check_model(folded)
    for batch in (1, 3, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 8, 4)).astype(np.float32)
        np.testing.assert_array_equal(_run(folded, {"x": x})[0], _run(model, {"x": x})[0])


def test_graph_outputs_and_models_without_shapes_stay():
    model = _attention_like()
    model.graph.output.append(helper.make_tensor_value_info("width1", TensorProto.INT64, [1]))
    folded = shape_folding.fold_shapes(model)
    assert any(n.output[0] == "width1" for n in folded.graph.node)  # a graph output keeps its node
    plain = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]), opset_imports=[helper.make_opsetid("", 17)])
    assert shape_folding.fold_shapes(plain) is plain


def _squeeze_if(length) -> onnx.ModelProto:
    """x [batch, 4, length] -> Relu -> squeeze(-1) as the legacy exporter writes it for a dim it cannot size:
    If(shape[-1] == 1, Squeeze, Identity), each branch reading the outer Relu."""
    n = helper.make_node
    then = helper.make_graph([n("Squeeze", ["r", "axes"], ["s"])], "then", [],
                             [helper.make_tensor_value_info("s", TensorProto.FLOAT, None)], [_ints("axes", [-1])])
    other = helper.make_graph([n("Identity", ["r"], ["i"])], "else", [],
                              [helper.make_tensor_value_info("i", TensorProto.FLOAT, None)])
    nodes = [n("Relu", ["x"], ["r"]), n("Shape", ["r"], ["shape"]), n("Gather", ["shape", "last"], ["size"], axis=0),
             n("Equal", ["size", "one"], ["is_one"]),
             n("If", ["is_one"], ["y"], then_branch=then, else_branch=other)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, length])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [_ints("last", -1), _ints("one", 1)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("length,kept", [(1, "Squeeze"), (5, "Identity")])
def test_ifs_the_known_sizes_decide_are_replaced_by_their_branch(length, kept):
    model = _squeeze_if(length)
    inlined = shape_folding.inline_constant_ifs(model)
    ops = [n.op_type for n in inlined.graph.node]
    assert "If" not in ops and kept in ops and ops[-1] == kept and inlined.graph.node[-1].output[0] == "y"
    x = np.random.default_rng(0).standard_normal((3, 4, length)).astype(np.float32)
    sized_at_run_time = _squeeze_if("length")  # onnxruntime refuses the static one: a branch it cannot take
    want = ort.InferenceSession(sized_at_run_time.SerializeToString()).run(None, {"x": x})[0]
    got = ort.InferenceSession(inlined.SerializeToString()).run(None, {"x": x})[0]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_ifs_left_open_stay():
    model = _squeeze_if("length")  # the size is only known at run time
    assert shape_folding.inline_constant_ifs(model) is model


def test_ifs_decided_through_sizes_inference_learns_from_the_evaluation():
    """torch.distributions.Categorical's log_prob: its index is broadcast to the logits by an Expand to a computed
    shape, then sliced to one column, gathered and squeezed (an If). Inference alone sizes neither the Expand nor
    what follows; the dims the evaluation finds, declared back, decide the If."""
    n = helper.make_node
    then = helper.make_graph([n("Squeeze", ["picked", "axes"], ["s"])], "then", [],
                             [helper.make_tensor_value_info("s", TensorProto.FLOAT, None)], [_ints("axes", [-1])])
    other = helper.make_graph([n("Identity", ["picked"], ["i"])], "else", [],
                              [helper.make_tensor_value_info("i", TensorProto.FLOAT, None)])
    nodes = [n("Unsqueeze", ["a", "last"], ["column"]), n("Shape", ["x"], ["target"]),
             n("Expand", ["column", "target"], ["wide"]), n("Slice", ["wide", "zero", "one", "one"], ["index"]),
             n("GatherElements", ["x", "index"], ["picked"], axis=1), n("Shape", ["picked"], ["shape"]),
             n("Gather", ["shape", "last"], ["size"], axis=0), n("Equal", ["size", "one"], ["is_one"]),
             n("If", ["is_one"], ["y"], then_branch=then, else_branch=other)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
                                           helper.make_tensor_value_info("a", TensorProto.INT64, ["rows"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [_ints("last", [-1]), _ints("zero", [0]), _ints("one", [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inlined = shape_folding.inline_constant_ifs(model)
    assert "If" not in [node.op_type for node in inlined.graph.node]
    x, a = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32), np.array([2, 0, 3])
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x, "a": a})[0]
    got = ort.InferenceSession(inlined.SerializeToString()).run(None, {"x": x, "a": a})[0]
    assert got.shape == want.shape == (3,)
    np.testing.assert_array_equal(got, want)


class Policy(nn.Module):
    """A policy gradient's loss (REINFORCE with an entropy bonus) from torch.distributions.Categorical."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, obs: torch.Tensor, actions: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        policy = torch.distributions.Categorical(logits=self.net(obs))
        return -(policy.log_prob(actions) * advantages).mean() - 0.01 * policy.entropy().mean()


def test_a_categorical_policy_trains_like_torch():
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g), torch.randn(n, generator=g))
               for n in (8, 5, 8)]
    check_parity(Policy, batches, lambda m, b: m(*b), optimizer=sgd, threads=1)


def test_an_expand_from_one_to_an_unknown_size_stays_unknown():
    """A dim of 1 expanded to a size known only at run time (the batch) is that size, not 1: taken for 1, it would
    decide an If on it (a squeeze's) for every batch."""
    assert shape_folding._expanded_dims([1, 3], Value.partly([None, 3])) == [None, 3]
    assert shape_folding._expanded_dims([1, 1, 8], Value.partly([None, 1, 1])) == [None, 1, 8]
    assert shape_folding._expanded_dims([5, 3], Value.partly([None, 3])) == [5, 3]
    assert shape_folding._expanded_dims([1, 3], Value.partly([4, 1])) == [4, 3]


class ExpandedRow(nn.Module):
    """A row expanded over the batch, then squeezed: the legacy exporter writes the expand's sizes as
    Where(sizes == -1, 1, sizes) and the squeeze of the dim it then cannot size as an If."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3).view(1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w.expand(x.shape[0], 3).squeeze(0) * x).sum(-1)


@pytest.mark.parametrize("batch,kept", [(1, "Squeeze"), (4, "Identity")])
def test_ifs_on_the_legacy_exporters_expand_sizes_are_decided(tmp_path, batch, kept):
    """The Where, its Equal and its ConstantOfShape are evaluated: exported for any batch, then pinned to one, the
    squeeze's If is decided (it was left for the build, which refused control flow), and the model computes what
    it did."""
    path = tmp_path / "expanded.onnx"
    x = torch.randn(batch, 3)
    torch.onnx.export(ExpandedRow(), (x,), str(path), dynamo=False, opset_version=17, input_names=["x"],
                      keep_initializers_as_inputs=True, dynamic_axes={"x": {0: "batch"}})
    model = onnx.load(str(path))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = batch
    inlined = shape_folding.inline_constant_ifs(model)
    ops = [n.op_type for n in inlined.graph.node]
    assert "If" not in ops and kept in ops, ops
    feeds = {"x": x.numpy(), "w": ExpandedRow().w.detach().numpy()}
    want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    got = ort.InferenceSession(inlined.SerializeToString()).run(None, feeds)[0]
    np.testing.assert_array_equal(got, want)


def test_reshapes_sized_from_computed_targets():
    """A 0 copies the input's dim (unknown where that is), unless allowzero; a -1 takes what the other dims leave
    of a size fully known."""
    sized = shape_folding._reshaped_dims
    assert sized([2, 3, 4], Value.partly([None, 4, 10]), False) == [None, 4, 10]
    assert sized([2, 3, 4], Value.partly([-1, 4]), False) == [6, 4]
    assert sized([None, 5], Value.partly([0, -1]), False) == [None, None]
    assert sized(None, Value.partly([0, 4]), False) == [None, 4]
    assert sized([3, 5], Value.partly([0, 5]), True) == [0, 5]
    assert sized([3, 5], Value.of(15), False) is None  # a Reshape's target is a vector


class PaddedGlobalPool(nn.Module):
    """A global pool (its kernel the traced length) after a padding, squeezed: the legacy exporter writes F.pad's
    pads through a 2-D Reshape, a reversing Slice and a Transpose, and the squeeze of the length it cannot size as
    an If; a float64 convolution with padding pads by F.pad too (`functions._conv_by_taps`)."""

    def __init__(self, pad: tuple[int, int], conv_padding: int, pool: str):
        super().__init__()
        self.conv, self.pad, self.pool = nn.Conv1d(2, 3, 3, padding=conv_padding, stride=2), pad, pool
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.pad(self.conv(x), self.pad)
        pool = F.max_pool1d if self.pool == "max" else F.avg_pool1d  # looked up here: the export replaces them
        return self.head(pool(y, y.shape[-1]).squeeze(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("pad, conv_padding, pool", [((1, 2), 0, "max"), ((0, 0), 1, "avg"),
                                                     ((2, 0), 1, "avg")])
def test_squeezes_after_padded_global_pools_are_decided(dtype, pad, conv_padding, pool):
    """The pads are evaluated and the Pad sized from them: the squeeze's If is decided (the build refused it as
    control flow on the gradient path), and the module trains as torch's."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(n, 2, 17, generator=g, dtype=dtype),) for n in (4, 3)]
    check_parity(lambda: PaddedGlobalPool(pad, conv_padding, pool).to(dtype), batches,
                 lambda m, b: m(*b).square().sum(), optimizer=sgd, threads=1,
                 rtol=1e-10 if dtype == torch.float64 else RTOL)


class ResampledGlobalPool(nn.Module):
    """A global pool after an interpolation by a scale factor, squeezed: the exporter writes the scales as a
    Concat of constants, which inference does not read, so it left the length, and the squeeze's If, unknown."""

    def __init__(self, mode: str, scale: float):
        super().__init__()
        self.conv, self.mode, self.scale, self.head = nn.Conv1d(2, 3, 3), mode, scale, nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.interpolate(self.conv(x), scale_factor=self.scale, mode=self.mode)
        return self.head(F.max_pool1d(y, y.shape[-1]).squeeze(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode, scale", [("nearest", 2.0), ("linear", 1.5), ("linear", 0.7)])
def test_squeezes_after_resampling_are_decided(mode, scale, dtype):
    """The Resize sized from its computed scales (float64 resampling, written out as products, from its Ranges'
    computed lengths): the squeeze's If is decided, and the module trains as torch's."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(n, 2, 17, generator=g, dtype=dtype),) for n in (4, 3)]
    check_parity(lambda: ResampledGlobalPool(mode, scale).to(dtype), batches, lambda m, b: m(*b).square().sum(),
                 optimizer=sgd, threads=1, rtol=1e-10 if dtype == torch.float64 else RTOL)


RESHAPING = {
    "reflect pad": lambda y: F.pad(y, (2, 1), mode="reflect"),
    "negative pad": lambda y: F.pad(y, (-1, -2)),
    "unfold": lambda y: y.unfold(-1, 4, 4).mean(-1),
    "repeat": lambda y: y.repeat(1, 1, 2),
    "reversed and strided": lambda y: torch.cat([y, y.flip(-1)], -1)[..., ::3],
    "split by a size read": lambda y: torch.split(y, y.shape[-1] // 3, -1)[-1],
}
"""Layers between a convolution and a global pool that change the length through shape arithmetic."""


class ReshapedGlobalPool(nn.Module):
    def __init__(self, layer: str):
        super().__init__()
        self.conv, self.layer, self.head = nn.Conv1d(2, 4, 3, padding=1), layer, nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = RESHAPING[self.layer](self.conv(x))
        return self.head(F.max_pool1d(y, y.shape[-1]).squeeze(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layer", list(RESHAPING))
def test_squeezes_after_layers_that_change_the_length_are_decided(layer, dtype):
    """Each wrote its length through shape arithmetic the evaluation did not follow (tensors of two axes, a Tile's
    repeats, a Slice's reversal, a Split's computed sizes): the squeeze's If was left, and the build refused it
    (all twelve cases at f8238b4 but the float32 reversal). The split's last part also needs its rank declared to
    the build (`_declare_found`): its pool's rule refused an unknown one."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(n, 2, 17, generator=g, dtype=dtype),) for n in (4, 3)]
    check_parity(lambda: ReshapedGlobalPool(layer).to(dtype), batches, lambda m, b: m(*b).square().sum(),
                 optimizer=sgd, threads=1, rtol=1e-10 if dtype == torch.float64 else RTOL)
