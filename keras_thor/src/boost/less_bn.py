"""`LessBN`: MindSpore's batch-normalization pruning of residual blocks,
done in place: the matched BatchNormalizations are bypassed, the head
`Dense` computes a `FullNorm`."""

import types

import keras
from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.boost.boost_model import LESS_BN_RECORD
from keras_thor.src.boost.boost_model import check_built_model
from keras_thor.src.boost.boost_model import to_boost_model
from keras_thor.src.layers.full_norm import make_full_norm_head
from keras_thor.src.utils.validation import check_bool


def _producer(tensor):
    """`(layer, input tensor)` of the single-input layer making `tensor`."""
    history = getattr(tensor, "_keras_history", None)
    if history is None:
        return None, None
    layer = history.operation
    node = keras_internals.inbound_nodes(layer)[history.node_index]
    inputs = node.input_tensors
    return layer, (inputs[0] if len(inputs) == 1 else None)


def _is_relu(layer):
    if isinstance(layer, keras.layers.ReLU):
        return (
            layer.max_value is None
            and not layer.negative_slope
            and not layer.threshold
        )
    return isinstance(layer, keras.layers.Activation) and (
        layer.activation is keras.activations.relu
    )


_CHECKS = {
    "bn": lambda layer: isinstance(layer, keras.layers.BatchNormalization),
    "conv": lambda layer: isinstance(layer, keras.layers.Conv2D),
    "relu": _is_relu,
}
# The main branch read backwards from the residual `Add`.
_MAIN_BRANCH = ("bn", "conv", "relu", "bn", "conv", "relu", "bn", "conv")


def _walk(tensor, kinds):
    """The layers of the chain `kinds` ending at `tensor` and the chain's
    input, or `(None, None)` if the graph differs."""
    layers = []
    for kind in kinds:
        layer, tensor = _producer(tensor)
        if layer is None or tensor is None or not _CHECKS[kind](layer):
            return None, None
        layers.append(layer)
        if kind == "conv":
            tensor = _through_padding(tensor)
    return layers, tensor


def _through_padding(tensor):
    """The input of the `ZeroPadding2D` making `tensor` (a convolution's
    explicit padding, as keras-hub's strided blocks have), else `tensor`."""
    layer, padded = _producer(tensor)
    if isinstance(layer, keras.layers.ZeroPadding2D) and padded is not None:
        return padded
    return tensor


def _removable_in_block(main, shortcut):
    """The first two BNs of a bottleneck's main branch, if it matches."""
    chain, block_input = _walk(main, _MAIN_BRANCH)
    if chain is None:
        return []
    projection, _ = _walk(shortcut, ("bn", "conv"))
    identity, _ = _walk(shortcut, ("relu",))
    block_input_relu, _ = _walk(block_input, ("relu",))
    if projection is None and not (identity and block_input_relu):
        return []
    return [chain[3], chain[6]]


def removable_batch_normalizations(model):
    """Names of the BatchNormalization layers `LessBN` removes from the
    Functional `model` (not from nested models)."""
    names = []
    for layer in model.layers:
        if not isinstance(layer, keras.layers.Add):
            continue
        for node in keras_internals.inbound_nodes(layer):
            inputs = node.input_tensors
            if len(inputs) != 2:
                continue
            removable = _removable_in_block(inputs[0], inputs[1])
            removable = removable or _removable_in_block(inputs[1], inputs[0])
            names.extend(bn.name for bn in removable if bn.name not in names)
    return names


def _models_in(model):
    """`model` and the models nested in it, depth first."""
    found = [model]
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            found.extend(_models_in(layer))
    return found


def removable_layers(model):
    """The BatchNormalization layers `LessBN` bypasses in `model` and in
    the Functional models nested in it."""
    removable = []
    for inner in _models_in(model):
        if keras_internals.is_functional(inner) and not isinstance(
            inner, keras.Sequential
        ):
            names = removable_batch_normalizations(inner)
            removable.extend(inner.get_layer(name) for name in names)
    return removable


def _full_norm_heads(model):
    """MindSpore's choice of the `Dense` layers a `FullNorm` replaces: in
    a model with `Dense` layers of its own, the last of them; in one
    without, those of the models nested in it."""
    dense = [
        layer for layer in model.layers if type(layer) is keras.layers.Dense
    ]
    if dense:
        return [dense[-1]]
    return [
        head
        for layer in model.layers
        if isinstance(layer, keras.Model)
        for head in _full_norm_heads(layer)
    ]


def _passed_through(layer, inputs, training=None, mask=None):
    return inputs


def is_bypassed(layer):
    """Whether `LessBN` bypassed the BatchNormalization `layer`."""
    call = layer.__dict__.get("call")
    return getattr(call, "__func__", None) is _passed_through


def bypass_batch_normalization(layer):
    """Makes the BatchNormalization `layer` pass its inputs through: its
    `call` returns them, it is frozen, and its weights are set to those of
    the identity (`γ = 1, β = 0, μ = 0, σ² = 1 − ε`), so that the saved
    model computes the same where the layer runs again (a file opened
    without keras_thor), in inference."""
    identity = {
        "gamma": 1.0,
        "beta": 0.0,
        "moving_mean": 0.0,
        "moving_variance": 1.0 - layer.epsilon,
    }
    for name, value in identity.items():
        variable = getattr(layer, name)
        if variable is not None:
            variable.assign(ops.full(variable.shape, value, variable.dtype))
    layer.trainable = False
    object.__setattr__(layer, "call", types.MethodType(_passed_through, layer))


@keras_thor_export
def LessBN(model, fn_flag=False):
    """Bypasses the batch normalizations inside residual bottlenecks.

    MindSpore's `less_batch_normalization` graph pass, on a Keras model,
    in place: for every `Add` of a bottleneck block whose main branch is
    `conv-BN-ReLU-conv-BN-ReLU-conv-BN` and whose shortcut is a projection
    (`conv-BN`) or an identity coming from a ReLU, the first two BNs of
    the main branch are bypassed (their convolutions feed the ReLUs
    directly); the BN before the `Add`, the shortcut's BN and every BN
    outside matched blocks stay. Both `Add` input orders match (Keras's
    ResNets put the shortcut first, MindSpore's second); convolution
    biases stay, and a `ZeroPadding2D` right before a convolution counts
    as its padding (keras-hub's strided blocks). Functional models nested
    in `model` (a keras-hub Backbone in its Task) are searched too. On
    `keras.applications.ResNet50` this bypasses 32 of the 53 BNs.

    A bypassed BatchNormalization stays in the model, frozen, with the
    weights of the identity: the model keeps its class, layers and
    config, so a keras-hub model or any other model that cannot be
    rebuilt from its config works, and saves and loads as before
    (`keras_thor.load_model` bypasses the same layers again).

    With `fn_flag`, the last `Dense` of the model (MindSpore: of each
    container with `Dense` layers of its own, else of the models nested
    in it) computes a `keras_thor.layers.FullNorm` with its kernel: a
    trainable multiplier (1.0) is added, the bias is set to zero and
    frozen.

    The model is given boost's training steps (`to_boost_model`).

    Args:
        model: A built `keras.Model`.
        fn_flag: Whether the head becomes a `FullNorm`.

    Returns:
        `model`.
    """
    check_built_model(model, "LessBN")
    check_bool("fn_flag", fn_flag)
    for layer in removable_layers(model):
        if not is_bypassed(layer):
            bypass_batch_normalization(layer)
    if fn_flag:
        for dense in _full_norm_heads(model):
            make_full_norm_head(dense)
    record = getattr(model, LESS_BN_RECORD, None) or {"fn_flag": False}
    object.__setattr__(
        model, LESS_BN_RECORD, {"fn_flag": record["fn_flag"] or fn_flag}
    )
    # Functions traced before run the layers' former calls.
    model.train_function = model.test_function = None
    model.predict_function = None
    return to_boost_model(model)
