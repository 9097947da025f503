"""What ONNX Runtime's old training stack could differentiate, to compare our rule table with."""

from __future__ import annotations

ORT_TRAINING_OPS = frozenset({
    "Abs", "Add", "AveragePool", "BatchNormalization", "Cast", "Clip", "Concat", "Conv", "Div", "Dropout", "Erf",
    "Exp", "Expand", "Flatten", "Gather", "GatherElements", "GatherND", "Gelu", "Gemm", "GlobalAveragePool",
    "Identity", "LayerNormalization", "Log", "LogSoftmax", "MatMul", "Max", "MaxPool", "Min", "Mul", "Neg", "Pad",
    "Pow", "ReduceL2", "ReduceLogSumExp", "ReduceMean", "ReduceSum", "Relu", "Reshape", "Sigmoid", "Sin", "Slice",
    "Softmax", "SoftmaxCrossEntropyLoss", "Split", "Sqrt", "Squeeze", "Sub", "Tanh", "Tile", "TopK", "Transpose",
    "Unsqueeze", "Where",
})
"""Default-domain ops with a gradient builder in onnxruntime's orttraining gradient_builder_registry.cc
(BatchNormalization through its internal BatchNormInternal). Its other entries were com.microsoft ops
(FastGelu, BiasGelu, SoftmaxCrossEntropy, ATenOp, PythonOp, ...) that standard exporters never emit."""

FLOAT_TYPES = "float16, bfloat16, float, double"
