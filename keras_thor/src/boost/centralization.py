"""Gradient centralization (Yong et al., 2020) as MindSpore's boost runs it."""

import keras
from keras import ops

from keras_thor.src.backend.dense import dense
from keras_thor.src.layers.full_norm import is_full_norm_head

# MindSpore centralizes only gradients whose fan-in is a multiple of this.
FAN_IN_MULTIPLE = 16
# MindSpore leaves out parameters whose names hold one of these.
_EXCLUDED_NAMES = ("beta", "gamma", "bias")


def centralize_gradient(gradient):
    """`g − mean(g)` over every axis but the last (the output channels).

    Keras kernels keep the output channels last (`Dense` `(in, out)`,
    `Conv2D` `(kh, kw, in, out)`), so this is MindSpore's per-output-channel
    `Centralization` in Keras layout. An embedding's sparse gradient
    (TensorFlow's `IndexedSlices`) is made dense first: every row moves.
    """
    gradient = dense(gradient)
    axes = tuple(range(len(gradient.shape) - 1))
    return gradient - ops.mean(gradient, axis=axes, keepdims=True)


def is_centralizable(variable, layer):
    """MindSpore's rule: a weight of rank ≥ 2 whose fan-in (`shape[-2]`)
    is a multiple of 16, not a beta/gamma/bias, not in a grouped or
    depthwise convolution, not in a `FullNorm` head."""
    shape = tuple(variable.shape)
    if len(shape) < 2 or shape[-2] % FAN_IN_MULTIPLE:
        return False
    if any(word in variable.path for word in _EXCLUDED_NAMES):
        return False
    grouped = getattr(layer, "groups", 1) != 1
    depthwise = isinstance(
        layer,
        (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D),
    )
    return not (grouped or depthwise or is_full_norm_head(layer))


def owning_layers(model):
    """`{id(variable): layer}` for the innermost layer owning each
    trainable variable of `model` (nested models included)."""
    owners = {}

    def visit(layer):
        for child in getattr(layer, "layers", ()):
            visit(child)
        for variable in layer.trainable_variables:
            owners.setdefault(id(variable), layer)

    visit(model)
    return owners


def centralized_variable_paths(model):
    """The paths of `model`'s trainable variables MindSpore centralizes."""
    owners = owning_layers(model)
    return [
        variable.path
        for variable in model.trainable_variables
        if is_centralizable(variable, owners[id(variable)])
    ]
