"""gradbuilder: backward graphs for ONNX models, in standard ONNX ops."""

from .builder import build_gradient_graph, grad_name, read_metadata
from .errors import GradBuilderError
from .graph import load_model, save_model_atomic
from .split import Manifest, split
from .yield_op import DOMAIN as YIELD_DOMAIN

__all__ = [
    "YIELD_DOMAIN",
    "GradBuilderError",
    "Manifest",
    "build_gradient_graph",
    "grad_name",
    "load_model",
    "read_metadata",
    "save_model_atomic",
    "split",
]
