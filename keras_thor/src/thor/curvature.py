"""THOR's curvature rules: which layers get which block, and the coverage.

A layer gets curvature by its Keras class: `Dense`, `EinsumDense` (so
MultiHeadAttention's projections), `Conv1D`/`Conv2D`/`Conv3D` (grouped
too), `DepthwiseConv1D`/`DepthwiseConv2D`, `SeparableConv1D`/
`SeparableConv2D` (two blocks), `Embedding`, `ReversibleEmbedding` (a tied
table from both its uses), and the scale and offset of
`LayerNormalization` (MindSpore's diagonal rule). Batch and group
normalization keep the plain gradient, as in MindSpore's THOR. A user's
subclass of one of these gets the same curvature when it keeps the class's
`call`; one that overrides `call` computes something THOR cannot know, and
stays first-order (named in the coverage report). Layers inside layers
(MultiHeadAttention's projections, a custom layer's Dense) are found by
walking the model's layers.

`attach_curvature(model)` marks every preconditioned variable with its
block (what `THOR.build` reads) and hooks the layers whose calls THOR
records; `curvature_coverage(model)` reports what is and is not covered.
"""

import functools
import math

import keras
from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.thor import capture
from keras_thor.src.thor.blocks import BiasKronecker
from keras_thor.src.thor.blocks import ConvKronecker
from keras_thor.src.thor.blocks import DenseKronecker
from keras_thor.src.thor.blocks import EinsumDenseKronecker
from keras_thor.src.thor.blocks import EmbeddingKronecker
from keras_thor.src.thor.blocks import ExpertsKronecker
from keras_thor.src.thor.blocks import KroneckerBlock
from keras_thor.src.thor.blocks import NormalizationDiagonal
from keras_thor.src.thor.blocks import TiedEmbeddingKronecker
from keras_thor.src.thor.einsum_layout import UnsupportedEinsumError
from keras_thor.src.thor.einsum_layout import einsum_layout
from keras_thor.src.thor.joint_bias import JOINABLE
from keras_thor.src.thor.joint_bias import JointBiasKronecker
from keras_thor.src.thor.keras_hub_layers import KNOWN_FIRST_ORDER
from keras_thor.src.thor.keras_hub_layers import experts_call
from keras_thor.src.thor.keras_hub_layers import experts_kernels
from keras_thor.src.thor.keras_hub_layers import is_rms_normalization
from keras_thor.src.thor.keras_hub_layers import package_and_name
from keras_thor.src.thor.keras_hub_layers import position_call

_PRECONDITIONER = "_keras_thor_preconditioner"
_CURVATURE = "_keras_thor_curvature"

CONVOLUTIONS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
DEPTHWISE = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
SEPARABLE = (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
SUPPORTED = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    *CONVOLUTIONS,
    *DEPTHWISE,
    *SEPARABLE,
    keras.layers.Embedding,
    keras.layers.ReversibleEmbedding,
    keras.layers.LayerNormalization,
)
# MindSpore's THOR gives these the plain gradient (ResNet-50's BNs).
PLAIN_BY_RULE = (
    keras.layers.BatchNormalization,
    keras.layers.GroupNormalization,
)


class LayerCurvature:
    """What THOR does with one layer's own trainable variables.

    Attributes:
        layer: The layer.
        preconditioners: `{variable path: block or NormalizationDiagonal}`.
        reason: Why the layer's variables stay first-order (`None` when
            THOR preconditions some of them).
        capture_call: What the layer runs in place of its `call` while
            THOR records (see `capture.hook_layer`), or `None`.
    """

    def __init__(self, layer, preconditioners, reason=None, capture_call=None):
        self.layer = layer
        self.preconditioners = preconditioners
        self.reason = reason
        self.capture_call = capture_call


class _Unsupported(Exception):
    pass


def _trainable_variable(value, what):
    if not isinstance(value, keras.Variable):
        raise _Unsupported(f"its {what} is not a variable (LoRA or quantized)")
    if not value.trainable:
        raise _Unsupported(f"its {what} is not trainable")
    return value


def _keeps_call_of(layer, classes):
    """The class among `classes` whose `call` the layer runs, else raises."""
    for cls in classes:
        if isinstance(layer, cls):
            if type(layer).call is not cls.call:
                raise _Unsupported(
                    f"{type(layer).__name__} overrides `call` of {cls.__name__}"
                )
            return cls
    raise _Unsupported("no curvature rule for its class")


def _record_outputs(layer, args, kwargs, capture_, block):
    outputs = type(layer).call(layer, *args, **kwargs)
    if not capture_.wants(block):
        return outputs
    outputs = capture_.tap(outputs)
    capture_.record(block, capture.call_inputs(args, kwargs), outputs)
    return outputs


def _separable_call(layer, args, kwargs, capture_, depthwise, pointwise, bias):
    """SeparableConv's depthwise and pointwise convolutions apart, so that
    the tensor between them is recorded (the output of one block, the
    input of the other)."""
    if not any(capture_.wants(b) for b in (depthwise, pointwise, bias)):
        return type(layer).call(layer, *args, **kwargs)
    inputs = capture.call_inputs(args, kwargs)
    middle = capture_.tap(
        ops.depthwise_conv(
            inputs,
            layer.depthwise_kernel,
            strides=layer.strides,
            padding=layer.padding,
            dilation_rate=layer.dilation_rate,
            data_format=layer.data_format,
        )
    )
    outputs = ops.conv(
        middle, layer.pointwise_kernel, data_format=layer.data_format
    )
    if layer.use_bias:
        rank = len(layer.kernel_size)
        if layer.data_format == "channels_last":
            shape = (1,) * (rank + 1) + (layer.filters,)
        else:
            shape = (1, layer.filters) + (1,) * rank
        outputs = ops.add(outputs, ops.reshape(layer.bias, shape))
    outputs = capture_.tap(outputs)
    capture_.record(depthwise, inputs, middle)
    capture_.record(pointwise, middle, outputs)
    if bias is not None:
        capture_.record(bias, middle, outputs)
    return layer.activation(outputs)


def _conv_options(layer, **overrides):
    options = {
        "kernel_size": tuple(layer.kernel_size),
        "strides": tuple(layer.strides),
        "dilation_rate": tuple(layer.dilation_rate),
        "padding": layer.padding,
        "data_format": layer.data_format,
    }
    options.update(overrides)
    return options


def _shared_by_positions(layer, bias):
    """Whether each example adds `layer`'s bias at several positions
    (sequence positions, output pixels): its output holds more entries
    per example than the bias has. Unknown shapes count as shared."""
    shape = keras_internals.built_input_shape(layer)
    if shape is None:
        return True
    try:
        output_shape = layer.compute_output_shape(shape)
    except Exception:  # A layer that cannot say: count it as shared.
        return True
    entries = output_shape[1:]
    if any(size is None for size in entries):
        return True
    return math.prod(entries) > math.prod(bias.shape)


def _bias_block(layer, data_format="channels_last"):
    """The `BiasKronecker` of `layer`'s bias, or `None` (no bias, or not a
    trainable variable)."""
    bias = getattr(layer, "bias", None)
    if not isinstance(bias, keras.Variable) or not bias.trainable:
        return None
    return BiasKronecker(
        layer, bias, data_format, _shared_by_positions(layer, bias)
    )


def _with_bias_block(layer, block):
    """`(blocks, capture_call)` of a layer whose `call` ends in its
    activation: its kernel's `block`, and its bias's block if it has one
    (used with `THOR(precondition_biases=...)`)."""
    bias = _bias_block(layer, getattr(layer, "data_format", "channels_last"))
    blocks = [block] if bias is None else [block, bias]
    return blocks, functools.partial(
        capture.run_recording_pre_activation, blocks=tuple(blocks)
    )


def _blocks(layer):
    """`(blocks, capture_call)` of a layer with Kronecker curvature."""
    if isinstance(layer, keras.layers.Dense):
        _keeps_call_of(layer, (keras.layers.Dense,))
        kernel = _trainable_variable(layer.kernel, "kernel")
        block = DenseKronecker(layer, kernel)
        return _with_bias_block(layer, block)
    if isinstance(layer, keras.layers.EinsumDense):
        _keeps_call_of(layer, (keras.layers.EinsumDense,))
        kernel = _trainable_variable(layer.kernel, "kernel")
        shape = keras_internals.built_input_shape(layer)
        if shape is None:
            raise _Unsupported("its input rank is unknown")
        try:
            layout = einsum_layout(layer.equation, len(shape))
        except UnsupportedEinsumError as error:
            raise _Unsupported(str(error)) from None
        block = EinsumDenseKronecker(layer, kernel, layout)
        return _with_bias_block(layer, block)
    if isinstance(layer, CONVOLUTIONS):
        _keeps_call_of(layer, CONVOLUTIONS)
        kernel = _trainable_variable(layer.kernel, "kernel")
        block = ConvKronecker(
            layer, kernel, _conv_options(layer), layer.groups, False
        )
        return _with_bias_block(layer, block)
    if isinstance(layer, DEPTHWISE):
        _keeps_call_of(layer, DEPTHWISE)
        kernel = _trainable_variable(layer.kernel, "kernel")
        block = ConvKronecker(
            layer, kernel, _conv_options(layer), kernel.shape[-2], True
        )
        return _with_bias_block(layer, block)
    if isinstance(layer, SEPARABLE):
        _keeps_call_of(layer, SEPARABLE)
        depthwise_kernel = _trainable_variable(
            layer.depthwise_kernel, "depthwise kernel"
        )
        pointwise_kernel = _trainable_variable(
            layer.pointwise_kernel, "pointwise kernel"
        )
        depthwise = ConvKronecker(
            layer,
            depthwise_kernel,
            _conv_options(layer),
            depthwise_kernel.shape[-2],
            True,
        )
        ones = (1,) * len(layer.kernel_size)
        pointwise = ConvKronecker(
            layer,
            pointwise_kernel,
            _conv_options(
                layer,
                kernel_size=ones,
                strides=ones,
                dilation_rate=ones,
                padding="valid",
            ),
            1,
            False,
        )
        bias = _bias_block(layer, layer.data_format)
        blocks = [depthwise, pointwise] + ([] if bias is None else [bias])
        return blocks, functools.partial(
            _separable_call, depthwise=depthwise, pointwise=pointwise, bias=bias
        )
    if isinstance(layer, keras.layers.ReversibleEmbedding):
        return _reversible_embedding_blocks(layer)
    if isinstance(layer, keras.layers.Embedding):
        _keeps_call_of(layer, (keras.layers.Embedding,))
        table = _trainable_variable(layer.embeddings, "table")
        block = EmbeddingKronecker(layer, table)
        return [block], functools.partial(_record_outputs, block=block)
    if package_and_name(layer) == ("keras_hub", "PositionEmbedding"):
        table = _trainable_variable(layer.position_embeddings, "table")
        block = EmbeddingKronecker(layer, table)
        return [block], functools.partial(position_call, block=block)
    if package_and_name(layer) == ("keras_hub", "MixtralMoeExperts"):
        kernels = experts_kernels(layer)
        blocks = {
            name: ExpertsKronecker(layer, _trainable_variable(kernel, name))
            for name, kernel in kernels.items()
        }
        return list(blocks.values()), functools.partial(
            experts_call, blocks=blocks
        )
    raise _Unsupported("no curvature rule for its class")


def _reversible_call(layer, args, kwargs, capture_, lookup, head):
    """ReversibleEmbedding's `call`, recording the lookup for `lookup` and
    the head's logits before any soft cap for `head`."""
    reverse = kwargs.get("reverse", args[1] if len(args) > 1 else False)
    if not reverse:
        return _record_outputs(layer, args, kwargs, capture_, lookup)
    if not capture_.wants(head):
        return type(layer).call(layer, *args, **kwargs)
    inputs = capture.call_inputs(args, kwargs)
    if layer.tie_weights:
        kernel = ops.transpose(layer.embeddings)
    else:
        kernel = layer.reverse_embeddings
    if layer.reverse_dtype is not None:
        inputs = ops.cast(inputs, layer.reverse_dtype)
        kernel = ops.cast(kernel, layer.reverse_dtype)
    logits = capture_.tap(ops.matmul(inputs, kernel))
    capture_.record(head, inputs, logits)
    if layer.logit_soft_cap is not None:
        cap = layer.logit_soft_cap
        logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
    return logits


def _reversible_embedding_blocks(layer):
    """A tied table's `TiedEmbeddingKronecker` (curvature from the lookup
    and the head), or an untied layer's lookup `EmbeddingKronecker` and
    head `DenseKronecker` (on the `(W, V)` reverse kernel)."""
    _keeps_call_of(layer, (keras.layers.ReversibleEmbedding,))
    table = _trainable_variable(layer.embeddings, "table")
    if layer.tie_weights:
        block = TiedEmbeddingKronecker(layer, table)
        blocks, lookup, head = [block], block, block
    else:
        reverse = _trainable_variable(layer.reverse_embeddings, "reverse table")
        lookup = EmbeddingKronecker(layer, table)
        head = DenseKronecker(layer, reverse)
        blocks = [lookup, head]
    return blocks, functools.partial(_reversible_call, lookup=lookup, head=head)


def own_trainable_variables(layer):
    """The trainable variables `layer` holds itself (not its sublayers')."""
    inner = {
        id(v)
        for sublayer in keras_internals.sublayers(layer, recursive=False)
        for v in sublayer.trainable_variables
    }
    return [v for v in layer.trainable_variables if id(v) not in inner]


def layer_curvature(layer):
    """THOR's `LayerCurvature` of `layer`: the one attached to it, if any
    (see `attach_curvature`), else what it would be."""
    known = getattr(layer, _CURVATURE, None)
    if known is not None:
        return known
    if isinstance(layer, PLAIN_BY_RULE):
        curvature = LayerCurvature(
            layer,
            {},
            "MindSpore's rule gives normalization layers other "
            "than LayerNormalization the plain gradient",
        )
    elif isinstance(layer, keras.layers.LayerNormalization):
        rule = NormalizationDiagonal(layer)
        preconditioners = {
            v.path: rule for v in (layer.gamma, layer.beta) if v is not None
        }
        curvature = LayerCurvature(layer, preconditioners)
        if not preconditioners:
            curvature.reason = "no scale or offset"
    elif is_rms_normalization(layer):
        rule = NormalizationDiagonal(layer)
        curvature = LayerCurvature(
            layer, {v.path: rule for v in own_trainable_variables(layer)}
        )
    elif package_and_name(layer) in KNOWN_FIRST_ORDER:
        curvature = LayerCurvature(
            layer, {}, KNOWN_FIRST_ORDER[package_and_name(layer)]
        )
    else:
        try:
            blocks, capture_call = _blocks(layer)
        except _Unsupported as error:
            curvature = LayerCurvature(layer, {}, str(error))
        else:
            curvature = LayerCurvature(
                layer,
                {block.kernel.path: block for block in blocks},
                capture_call=capture_call,
            )
    return curvature


def model_layers(model):
    """Every layer inside `model`, nested models' and layers' included."""
    return keras_internals.sublayers(model, recursive=True)


def attach_curvature(model):
    """Gives every layer of `model` its curvature rule and marks the
    preconditioned variables (what `THOR.build` reads).

    A layer keeps the rule it was first given (a layer shared by two
    models keeps the blocks the first model's THOR holds).
    """
    for layer in model_layers(model):
        curvature = layer_curvature(layer)
        object.__setattr__(layer, _CURVATURE, curvature)
        if curvature.capture_call is not None and not capture.is_hooked(layer):
            capture.hook_layer(layer, curvature.capture_call)
        for variable in own_trainable_variables(layer):
            preconditioner = curvature.preconditioners.get(variable.path)
            if preconditioner is not None:
                setattr(variable, _PRECONDITIONER, preconditioner)


def detach_curvature(model):
    """Undoes `attach_curvature`: the layers run their class's `call`
    again and no variable of `model` is marked. Each layer keeps its
    rule, so that converting again gives a THOR built before the same
    blocks."""
    for layer in model_layers(model):
        capture.unhook_layer(layer)
        for variable in layer.weights:
            if hasattr(variable, _PRECONDITIONER):
                delattr(variable, _PRECONDITIONER)


def preconditioner_of(variable):
    """The block (or diagonal rule) of a marked variable, else `None`."""
    return getattr(variable, _PRECONDITIONER, None)


def _joined(preconditioners):
    """`preconditioners` with each Dense or convolution kernel block whose
    layer's bias is among them replaced by a `JointBiasKronecker` (the
    bias's entry then `None`: the block preconditions it)."""
    joined = list(preconditioners)
    kernels = {
        id(block.layer): index
        for index, block in enumerate(preconditioners)
        if isinstance(block, JOINABLE)
        and not isinstance(block.layer, SEPARABLE)
    }
    for index, block in enumerate(preconditioners):
        if isinstance(block, BiasKronecker) and id(block.layer) in kernels:
            kernel = kernels[id(block.layer)]
            joined[kernel] = JointBiasKronecker(
                preconditioners[kernel], block.kernel
            )
            joined[index] = None
    return joined


def preconditioners_of(variables, preconditions_bias, joint=False):
    """`(preconditioners, blocks)` of THOR's trained variables.

    `preconditioners[i]` is variable `i`'s block or diagonal rule, `None`
    for a bias that `preconditions_bias(bias_block)` leaves out (or, if
    `joint`, that joins its kernel's block); `blocks` is `{i: block}` of
    the Kronecker blocks among them (empty for a model that is not
    converted).
    """
    preconditioners = []
    for variable in variables:
        preconditioner = preconditioner_of(variable)
        if isinstance(preconditioner, BiasKronecker):
            if not preconditions_bias(preconditioner):
                preconditioner = None
        preconditioners.append(preconditioner)
    if joint:
        preconditioners = _joined(preconditioners)
    blocks = {
        index: block
        for index, block in enumerate(preconditioners)
        if isinstance(block, KroneckerBlock)
    }
    return preconditioners, blocks


def first_order_indices(variables, preconditioners, blocks):
    """The indices of the variables THOR has no curvature for: no
    preconditioner (as `preconditioners_of` gives them), and not a bias
    preconditioned in its kernel's block (`blocks`)."""
    in_blocks = {
        id(block.bias)
        for block in blocks.values()
        if isinstance(block, JointBiasKronecker)
    }
    return [
        index
        for index, (variable, preconditioner) in enumerate(
            zip(variables, preconditioners)
        )
        if preconditioner is None and id(variable) not in in_blocks
    ]


NOT_CONVERTED = (
    "Convert the model first: `model = "
    "keras_thor.convert_to_thor_model(model)`. The conversion belongs to "
    "the model instance: a copy made by `keras.models.clone_model`, or a "
    "model opened with `keras.models.load_model`, is not converted "
    "(`keras_thor.load_model(path)` opens a saved model converted, with "
    "THOR's state)."
)


def require_curvature(model):
    """Raises a `ValueError` unless some variable `model` trains has a
    curvature block: the message names the frozen layers THOR would
    precondition, or says to convert the model."""
    if any(preconditioner_of(v) is not None for v in model.trainable_weights):
        return
    frozen = [
        layer.name
        for layer in model_layers(model)
        if any(preconditioner_of(v) is not None for v in layer.weights)
        and not layer.trainable_weights
    ]
    if frozen:
        raise ValueError(
            "THOR can precondition none of the variables this model "
            f"trains: the layers with curvature are frozen "
            f"(`trainable=False`): {frozen}. Unfreeze some of them, or "
            f"train with another optimizer. Received: model={model.name}"
        )
    raise ValueError(
        "THOR found no layer with curvature among the "
        f"{len(model.trainable_weights)} variables model {model.name!r} "
        f"trains. {NOT_CONVERTED}"
    )
