"""`convert_to_thor_model`: swap Keras layers for THOR-aware ones."""

import keras

from keras_thor.src.api_export import keras_thor_export

# Keras class name -> THOR-aware class name (all registered as keras_thor>).
_THOR_CLASSES = {
    "Dense": "ThorDense",
    "Conv2D": "ThorConv2D",
    "Embedding": "ThorEmbedding",
    "LayerNormalization": "ThorLayerNormalization",
}
_KERAS_MODULES = ("keras.layers", "keras.src.layers")


def _is_convertible(layer_config):
    name = layer_config.get("class_name")
    module = layer_config.get("module") or ""
    if name not in _THOR_CLASSES or not module.startswith(_KERAS_MODULES):
        return False
    return layer_config.get("config", {}).get("groups", 1) == 1


def _swap(config):
    """`config` with every convertible layer config swapped, recursively."""
    if isinstance(config, list):
        return [_swap(item) for item in config]
    if not isinstance(config, dict):
        return config
    swapped = {key: _swap(value) for key, value in config.items()}
    if _is_convertible(config):
        name = _THOR_CLASSES[config["class_name"]]
        swapped.update(
            module=None, class_name=name, registered_name=f"keras_thor>{name}"
        )
    return swapped


def with_model_class(model, serialized, functional, sequential):
    """`serialized` (of `model`) as the `functional` or `sequential` class
    (registered keras_thor classes), without its compile config."""
    target = sequential if isinstance(model, keras.Sequential) else functional
    serialized = dict(serialized)
    serialized.pop("compile_config", None)
    serialized.update(
        module=None,
        class_name=target.__name__,
        registered_name=f"keras_thor>{target.__name__}",
    )
    return serialized


def check_rewritable(model, function, subclass_hint):
    """Raises unless `model` is a built Sequential or Functional model."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            "Argument `model` must be a `keras.Model`. "
            f"Received: model={model!r} (of type {type(model).__name__})"
        )
    functional = isinstance(model, keras.Sequential) or hasattr(
        model, "_nodes_by_depth"
    )
    if not functional:
        raise ValueError(
            f"`{function}` converts Sequential and Functional models. "
            f"For a subclassed model, {subclass_hint}. "
            f"Received: model of type {type(model).__name__}"
        )
    if not model.built:
        raise ValueError(
            "Argument `model` must be built (give it an input shape or call "
            f"it once) so that its weights can be kept. Received: {model.name}"
        )


@keras_thor_export
def convert_to_thor_model(model):
    """Returns `model` with THOR-aware layers, its weights and names kept.

    `Dense`, `Conv2D` (with `groups=1`), `Embedding` and
    `LayerNormalization` layers, at any depth of nested Sequential and
    Functional models, become `keras_thor.layers.ThorDense`, `ThorConv2D`,
    `ThorEmbedding` and `ThorLayerNormalization`; every other layer is
    rebuilt from its config. The result is a
    `keras_thor.models.ThorSequential` (for a Sequential) or a
    `keras_thor.models.ThorFunctional` (for a Functional model), not compiled,
    holding copies of `model`'s weights. The MindSpore equivalent is
    `ConvertModelUtils.convert_to_thor_model` plus `nn.thor(net, ...)`.

    A subclassed model cannot be rewritten from outside: build it from
    `keras_thor.layers` and subclass `keras_thor.models.ThorModel`.

    Args:
        model: A Sequential or Functional `keras.Model`, built.

    Returns:
        The THOR-aware model.
    """
    from keras_thor.src.models.thor_model import ThorModel
    from keras_thor.src.models.thor_model import ThorSequential

    check_rewritable(
        model,
        "convert_to_thor_model",
        "use `keras_thor.layers` inside it and subclass "
        "`keras_thor.models.ThorModel`",
    )
    serialized = _swap(keras.saving.serialize_keras_object(model))
    converted = keras.saving.deserialize_keras_object(
        with_model_class(model, serialized, ThorModel, ThorSequential)
    )
    converted.set_weights(model.get_weights())
    return converted
