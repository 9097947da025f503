"""runtime.workload: the forward work that decides whether a model's sessions get more than one thread."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from runtime import nchwc, workload
from runtime.workload import GEMM_WEIGHT, forward_work, mac_weight

PRODUCT = GEMM_WEIGHT * mac_weight()
"""What a product's multiply-add counts for here."""


def _model(nodes: list[onnx.NodeProto], inputs: dict[str, list[int | str]], output: str) -> onnx.ModelProto:
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, f, s) for n, s in inputs.items()],
                              [helper.make_tensor_value_info(output, f, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_products_count_multiply_adds_and_the_rest_elements() -> None:
    """A product's multiply-adds at GEMM_WEIGHT (they gain less from a second thread than a convolution's)."""
    m = _model([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
               {"x": ["n", 16], "w": [16, 8]}, "z")
    assert forward_work(m, {"x": (5, 16)}) == PRODUCT * 5 * 8 * 16 + 5 * 8
    gemm = _model([helper.make_node("Gemm", ["x", "w"], ["y"], transA=1)], {"x": [16, "n"], "w": [16, 8]}, "y")
    assert forward_work(gemm, {"x": (16, 5)}) == PRODUCT * 5 * 8 * 16


def test_recurrent_layers_count_their_products() -> None:
    """Per step, sample and direction, each gate's product with the input and with the hidden state."""
    lstm = _model([helper.make_node("LSTM", ["x", "w", "r"], ["y"], hidden_size=8, direction="bidirectional")],
                  {"x": ["t", "n", 6], "w": [2, 32, 6], "r": [2, 32, 8]}, "y")
    assert forward_work(lstm, {"x": (7, 3, 6)}) == PRODUCT * 7 * 3 * 2 * 32 * (6 + 8)
    gru = _model([helper.make_node("GRU", ["x", "w", "r"], ["y", "h"], hidden_size=8)],
                 {"x": ["t", "n", 6], "w": [1, 24, 6], "r": [1, 24, 8]}, "h")
    assert forward_work(gru, {"x": (7, 3, 6)}) == PRODUCT * 7 * 3 * 24 * (6 + 8)


def test_convolutions() -> None:
    conv = _model([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
                  {"x": ["n", 2, 8, 8], "w": [4, 2, 3, 3]}, "y")
    assert forward_work(conv, {"x": (3, 2, 8, 8)}) == mac_weight() * 3 * 4 * 8 * 8 * (2 * 3 * 3)
    up = _model([helper.make_node("ConvTranspose", ["x", "w"], ["y"], strides=[2, 2])],
                {"x": ["n", 4, 5, 5], "w": [4, 2, 3, 3]}, "y")
    assert forward_work(up, {"x": (3, 4, 5, 5)}) == mac_weight() * 3 * 4 * 5 * 5 * (2 * 3 * 3)


def test_unsized_is_unknown() -> None:
    m = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": ["n", 16], "w": [16, "k"]}, "y")
    assert forward_work(m, {"x": (5, 16)}) is None


def test_unsized_elementwise_nodes_count_nothing() -> None:
    """A node shape inference cannot size (a Reshape to a run-time shape here, a slice with computed bounds in an
    encoder) adds nothing; the products are still counted."""
    m = _model([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Reshape", ["y", "s"], ["z"])],
               {"x": ["n", 16], "w": [16, 8]}, "z")
    m.graph.input.append(helper.make_tensor_value_info("s", TensorProto.INT64, [2]))
    assert forward_work(m, {"x": (5, 16)}) == PRODUCT * 5 * 8 * 16


def test_multiply_adds_weigh_by_the_machine(monkeypatch) -> None:
    """AVX2 machines (onnxruntime's NCHWc block of 8 floats) count multiply-adds at AVX2_WEIGHT; AVX-512 ones (16,
    where the thresholds were measured) and others (no NCHWc kernels) at 1."""
    try:
        for width, weight in ((16, 1.0), (8, workload.AVX2_WEIGHT), (0, 1.0)):
            monkeypatch.setattr(nchwc, "block_size", lambda width=width: width)
            workload.mac_weight.cache_clear()
            assert workload.mac_weight() == weight
    finally:
        monkeypatch.undo()
        workload.mac_weight.cache_clear()


def test_dense_forwards_split_their_threads_without_a_trial(monkeypatch) -> None:
    """A forward whose products are all Gemms (an MLP) on an AVX-512 machine runs on one thread below `SMALL` times
    `DENSE_SPLIT` and on the configured threads from it, without a trial; with a MatMul or a Conv among them, or on
    an AVX2 machine, one thread below `SMALL / TRIAL_BOTTOM` and a trial up to `TRIAL_TOP`; the engine's config
    follows."""
    from runtime.engine import ExportOptions, Options

    mlp = _model([helper.make_node("Gemm", ["x", "w"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["z"])],
                 {"x": ["n", 16], "w": [8, 16]}, "z")
    matmul = _model([helper.make_node("Gemm", ["x", "w"], ["h"], transB=1),
                     helper.make_node("MatMul", ["h", "v"], ["z"])], {"x": ["n", 16], "w": [8, 16], "v": [8, 4]}, "z")
    conv = _model([helper.make_node("Conv", ["x", "w"], ["z"])], {"x": ["n", 2, 8, 8], "w": [4, 2, 3, 3]}, "z")
    none = _model([helper.make_node("Relu", ["x"], ["z"])], {"x": ["n", 16]}, "z")
    assert workload.gemms_only(mlp) and not any(workload.gemms_only(m) for m in (matmul, conv, none))
    options = Options(ExportOptions(), threads=2, specialise=True, fallback=False, save_dir=None)
    dense, usual = (workload.DENSE_SPLIT,) * 2, workload.BAND
    for weight, bands in ((1.0, (dense, usual)), (3.0, (usual, usual))):
        monkeypatch.setattr(workload, "mac_weight", lambda weight=weight: weight)
        assert (workload.trial_band(mlp, 1.0), workload.trial_band(matmul, 1.0)) == bands
        assert workload.trial_band(conv, 1.0) == usual
        for bottom, top in set(bands):
            cases = [(workload.SMALL * bottom * 0.9, 1, False), (workload.SMALL * max(bottom, top) * 1.1, 2, False)]
            if bottom < top:
                cases.append((workload.SMALL * (bottom + top) / 2, 2, True))
            for work, threads, choose in cases:
                config = options.config_for(work, (bottom, top))
                assert (config.threads, config.choose_threads) == (threads, choose), (weight, bottom, top, work)


def test_mlps_streaming_their_weights_split_from_two_rows(monkeypatch) -> None:
    """An MLP on an AVX-512 machine whose Gemms' weights outgrow `STREAMED_BYTES` runs on the configured threads from
    `STREAMED_ROWS` rows of its batch, whatever its work: one row stays on one thread, and so do smaller weights."""
    from runtime.engine import ExportOptions, Options

    monkeypatch.setattr(workload, "mac_weight", lambda: 1.0)
    options = Options(ExportOptions(), threads=2, specialise=True, fallback=False, save_dir=None)
    rows = workload.STREAMED_BYTES // 4 // 1000 + 1  # float32 weights of [rows, 1000]: just past the bytes
    for out_rows, streamed in ((rows, True), (rows - 1, False)):
        mlp = _model([helper.make_node("Gemm", ["x", "w"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["z"])],
                     {"x": ["n", 1000], "w": [out_rows, 1000]}, "z")
        assert (workload.gemm_weight_bytes(mlp) > workload.STREAMED_BYTES) == streamed
        per_row = forward_work(mlp, {"x": (1, 1000)})
        band = workload.trial_band(mlp, per_row)
        for n in (1, workload.STREAMED_ROWS, 4):
            config = options.config_for(n * per_row, band)
            want = 2 if streamed and n >= workload.STREAMED_ROWS else 1
            assert (config.threads, config.choose_threads) == (want, False), (out_rows, n)
