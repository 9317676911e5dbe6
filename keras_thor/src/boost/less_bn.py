"""`LessBN`: MindSpore's batch-normalization pruning of residual blocks."""

import keras

from keras_thor.src import keras_internals
from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.boost.boost_model import BoostFunctional
from keras_thor.src.boost.boost_model import BoostSequential
from keras_thor.src.layers.full_norm import FullNorm
from keras_thor.src.utils.rebuild import check_rewritable
from keras_thor.src.utils.rebuild import rebuild
from keras_thor.src.utils.rebuild import registered_class
from keras_thor.src.utils.validation import check_bool

_KERAS_MODULES = ("keras.layers", "keras.src.layers")


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
    return layers, tensor


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


def _rewired(layer_configs, removed):
    """Functional `layer_configs` without the `removed` (single-input)
    layers, their consumers reading the removed layers' inputs."""
    sources = {}
    for config in layer_configs:
        if config["name"] in removed:
            argument = config["inbound_nodes"][0]["args"][0]
            sources[config["name"]] = argument["config"]["keras_history"]

    def rewire(value):
        if isinstance(value, dict):
            history = value.get("config", {}).get("keras_history")
            if value.get("class_name") == "__keras_tensor__" and history:
                if history[0] in sources:
                    value = {**value, "config": dict(value["config"])}
                    value["config"]["keras_history"] = sources[history[0]]
                return value
            return {key: rewire(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(rewire(item) for item in value)
        return value

    kept = [c for c in layer_configs if c["name"] not in removed]
    return [{**c, "inbound_nodes": rewire(c["inbound_nodes"])} for c in kept]


def _full_norm_config(dense_config):
    settings = dense_config["config"]
    return {
        **dense_config,
        "module": None,
        "class_name": "FullNorm",
        "registered_name": "keras_thor>FullNorm",
        "config": {
            "name": settings["name"],
            "trainable": settings.get("trainable", True),
            "dtype": settings.get("dtype"),
            "units": settings["units"],
            "activation": settings.get("activation"),
            "kernel_initializer": settings.get("kernel_initializer"),
        },
    }


def _is_keras_dense(layer_config):
    module = layer_config.get("module") or ""
    return layer_config.get("class_name") == "Dense" and module.startswith(
        _KERAS_MODULES
    )


def _rewrite(model, serialized, fn_flag):
    """`serialized` (of `model`) with the BNs removed and, with `fn_flag`,
    the last Dense of every container a `FullNorm`, recursively."""
    config = dict(serialized["config"])
    by_name = {layer.name: layer for layer in model.layers}
    layers = [
        _rewrite(by_name[c["config"]["name"]], c, fn_flag)
        if isinstance(by_name.get(c["config"].get("name")), keras.Model)
        else c
        for c in config["layers"]
    ]
    if not isinstance(model, keras.Sequential):
        layers = _rewired(layers, set(removable_batch_normalizations(model)))
    if fn_flag:
        dense = [i for i, c in enumerate(layers) if _is_keras_dense(c)]
        if dense:
            layers[dense[-1]] = _full_norm_config(layers[dense[-1]])
    config["layers"] = layers
    return {**serialized, "config": config}


def _copy_weights(source, target):
    """Copies weights layer by layer by name (FullNorm: the kernel)."""
    sources = {layer.name: layer for layer in source.layers}
    for layer in target.layers:
        origin = sources[layer.name]
        if isinstance(layer, keras.Model):
            _copy_weights(origin, layer)
        elif isinstance(layer, FullNorm):
            layer.kernel.assign(origin.kernel)
        else:
            layer.set_weights(origin.get_weights())


@keras_thor_export
def LessBN(model, fn_flag=False):
    """Removes the batch normalizations inside residual bottlenecks.

    MindSpore's `less_batch_normalization` graph pass, on a Keras model:
    for every `Add` of a bottleneck block whose main branch is
    `conv-BN-ReLU-conv-BN-ReLU-conv-BN` and whose shortcut is a projection
    (`conv-BN`) or an identity coming from a ReLU, the first two BNs of
    the main branch go (their convolutions feed the ReLUs directly); the
    BN before the `Add`, the shortcut's BN and every BN outside matched
    blocks stay. Both `Add` input orders match (Keras's ResNets put the
    shortcut first, MindSpore's second); convolution biases stay. On
    `keras.applications.ResNet50` this removes 32 of the 53 BNs.

    With `fn_flag`, the last `Dense` of each (nested) model becomes a
    `keras_thor.layers.FullNorm` with its kernel (the bias is dropped).

    Args:
        model: A built Functional or Sequential `keras.Model`.
        fn_flag: Whether to put a `FullNorm` head in place of the last
            `Dense`.

    Returns:
        A `keras_thor.models.BoostFunctional` (or `BoostSequential`),
        not compiled, with `model`'s remaining weights.
    """
    check_rewritable(
        model, "LessBN", "remove its BatchNormalization layers by hand"
    )
    check_bool("fn_flag", fn_flag)
    return rebuild(
        model,
        registered_class(BoostFunctional),
        registered_class(BoostSequential),
        rewrite=lambda serialized: _rewrite(model, serialized, fn_flag),
        copy_weights=_copy_weights,
    )
