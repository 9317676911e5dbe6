"""Rebuilding a Sequential or Functional model from its config.

`convert_to_thor_model`, `to_keras_model`, `to_boost_model` and `LessBN`
all serialize a model, change its config (the model class, some layer
configs) and build the result with the original weights.
"""

import keras

from keras_thor.src import keras_internals

# The config entries of Keras's own model classes.
KERAS_FUNCTIONAL = {
    "module": "keras.src.models.functional",
    "class_name": "Functional",
    "registered_name": "Functional",
}
KERAS_SEQUENTIAL = {
    "module": "keras",
    "class_name": "Sequential",
    "registered_name": None,
}


def registered_class(cls):
    """The config entries of a class registered with keras_thor."""
    return {
        "module": None,
        "class_name": cls.__name__,
        "registered_name": keras.saving.get_registered_name(cls),
    }


def check_rewritable(model, function, subclass_hint):
    """Raises unless `model` is a built Sequential or Functional model."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            "Argument `model` must be a `keras.Model`. "
            f"Received: model={model!r} (of type {type(model).__name__})"
        )
    if not keras_internals.is_functional(model):
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


def _copy_all_weights(source, target):
    target.set_weights(source.get_weights())


def rebuild(
    model,
    functional,
    sequential,
    rewrite=None,
    copy_weights=_copy_all_weights,
):
    """`model` rebuilt from its config as another model class.

    Args:
        model: A built Sequential or Functional model (checked by the
            caller with `check_rewritable`).
        functional, sequential: The config entries (`module`,
            `class_name`, `registered_name`) of the class the result takes
            for a Functional and for a Sequential `model`.
        rewrite: Optional `serialized -> serialized`, applied to the
            model's serialized config before the class is set.
        copy_weights: `(model, rebuilt) -> None`; by default every weight,
            in order.

    Returns:
        The rebuilt model, not compiled.
    """
    serialized = keras.saving.serialize_keras_object(model)
    if rewrite is not None:
        serialized = rewrite(serialized)
    serialized = dict(serialized)
    serialized.pop("compile_config", None)
    target = sequential if isinstance(model, keras.Sequential) else functional
    serialized.update(target)
    rebuilt = keras.saving.deserialize_keras_object(serialized)
    copy_weights(model, rebuilt)
    return rebuilt
