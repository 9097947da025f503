"""Train PyTorch modules on stock onnxruntime with gradbuilder's training graphs.

`TrainingSession` runs a training graph (forward, then backward on the stashed state);
`ORTModule` wraps an nn.Module so that forward and backward run on onnxruntime.
"""

from .engine import FallbackWarning, ORTModuleError
from .export import ExportError, ExportOptions, ExportWarning
from .module import ORTModule
from .ort_session import SessionConfig
from .session import ForwardState, TrainingSession

__all__ = [
    "ExportError",
    "ExportOptions",
    "ExportWarning",
    "FallbackWarning",
    "ForwardState",
    "ORTModule",
    "ORTModuleError",
    "SessionConfig",
    "TrainingSession",
]
