"""One exception family, so the CLI can turn any of them into a message and an exit code."""

from __future__ import annotations


class GradBuilderError(Exception):
    """Base of every error gradbuilder raises on purpose; the message is meant for a person."""

    exit_code = 2


class ModelLoadError(GradBuilderError):
    """The file or bytes are not a readable, well-formed ONNX model."""


class InvalidModelError(GradBuilderError):
    """The model loads but breaks a rule gradbuilder relies on (names, opsets, cycles)."""


class UnknownNameError(GradBuilderError):
    """A name given by the user (wrt, output, loss, freeze) is not in the graph."""


class LossError(GradBuilderError):
    """The loss is not a scalar float graph output."""


class UnsupportedOpError(GradBuilderError):
    """A node on the gradient path has no gradient rule for its op and opset."""


class ControlFlowError(UnsupportedOpError):
    """If/Loop/Scan lie on the gradient path; their bodies are not differentiated."""


class RuleError(GradBuilderError):
    """A gradient rule could not handle a node (bad attributes, unknown ranks)."""


class SaveError(GradBuilderError):
    """A model cannot be written in any form ONNX can store (over 2 GB even with its weights in a data file)."""


class SplitError(GradBuilderError):
    """The model is not a training graph made by gradbuilder (no or several Yield nodes)."""
