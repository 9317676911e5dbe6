"""`convert_to_thor_model` and `to_keras_model`: into THOR and back."""

import logging
import warnings

import keras

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.distribute.attached_training import attach
from keras_thor.src.distribute.attached_training import detach
from keras_thor.src.thor.coverage import curvature_coverage
from keras_thor.src.thor.coverage import supported_layer_names
from keras_thor.src.thor.curvature import SUPPORTED
from keras_thor.src.thor.curvature import attach_curvature
from keras_thor.src.thor.curvature import detach_curvature
from keras_thor.src.thor.curvature import model_layers
from keras_thor.src.thor.fit_hooks import THOR_ATTACHED
from keras_thor.src.utils.rebuild import KERAS_FUNCTIONAL
from keras_thor.src.utils.rebuild import KERAS_SEQUENTIAL
from keras_thor.src.utils.rebuild import check_rewritable
from keras_thor.src.utils.rebuild import rebuild

logger = logging.getLogger("keras_thor")

# Layers of earlier keras_thor versions, saved in `.keras` files, and the
# Keras classes they are.
LEGACY_LAYERS = {
    "ThorDense": "Dense",
    "ThorConv2D": "Conv2D",
    "ThorEmbedding": "Embedding",
    "ThorLayerNormalization": "LayerNormalization",
}


# keras_thor's model classes, nested in a model, and Keras's.
THOR_MODELS = {
    "keras_thor>ThorFunctional": KERAS_FUNCTIONAL,
    "keras_thor>ThorSequential": KERAS_SEQUENTIAL,
}


def _to_keras_layers(config):
    """`config` with keras_thor's legacy layers and nested THOR models as
    their Keras classes."""
    if isinstance(config, list):
        return [_to_keras_layers(item) for item in config]
    if not isinstance(config, dict):
        return config
    result = {key: _to_keras_layers(value) for key, value in config.items()}
    name = config.get("registered_name")
    if name in THOR_MODELS:
        result.update(THOR_MODELS[name])
    elif name in {f"keras_thor>{legacy}" for legacy in LEGACY_LAYERS}:
        result.update(
            module="keras.layers",
            class_name=LEGACY_LAYERS[config["class_name"]],
            registered_name=None,
        )
    return result


def _report(coverage):
    """Logs the coverage summary and warns about first-order layers, named
    and counted by class and reason."""
    logger.info(coverage.summary())
    groups = {}
    for row in coverage.first_order:
        key = (row.class_name, row.rule.removeprefix("first-order: "))
        groups.setdefault(key, []).append(row)
    if not groups:
        return
    parts = [
        f"{len(rows)} {class_name} ({sum(r.parameters for r in rows):,} "
        f"parameters; {reason}): {', '.join(r.name for r in rows)}"
        for (class_name, reason), rows in groups.items()
    ]
    warnings.warn(
        "THOR leaves these layers first-order (THOR's first-order rule: "
        "momentum SGD, or Adam's step with `first_order='adam'`): "
        f"{'; '.join(parts)}. {coverage.summary()} "
        "`keras_thor.curvature_coverage(model)` gives the table.",
        stacklevel=4,
    )


def _check_model(model):
    if not isinstance(model, keras.Model):
        raise TypeError(
            "Argument `model` must be a `keras.Model`. "
            f"Received: model={model!r} (of type {type(model).__name__})"
        )
    if not model.built:
        raise ValueError(
            "Argument `model` must be built (give it an input shape, or "
            "call it once on a batch) so that THOR can find its layers' "
            f"weights. Received: model={model.name} (not built)"
        )


def _frozen_with_rules(model):
    """The layers with a curvature rule whose weights are all frozen."""
    return [
        layer.name
        for layer in model_layers(model)
        if isinstance(layer, SUPPORTED)
        and layer.weights
        and not layer.trainable_weights
    ]


def _no_curvature_error(model):
    frozen = _frozen_with_rules(model)
    if frozen:
        return ValueError(
            "THOR can precondition none of the layers this model trains: "
            f"the {len(frozen)} layers with curvature rules are frozen "
            f"(`trainable=False`): {frozen}. Unfreeze some of them, or "
            f"train with another optimizer. Received: model={model.name}"
        )
    found = sorted(
        {
            type(layer).__name__
            for layer in model_layers(model)
            if layer.trainable_weights
        }
    )
    return ValueError(
        "THOR can precondition none of the layers of this model. "
        f"Layer types with trainable weights: {found}. THOR has curvature "
        f"rules for: {supported_layer_names()} (and subclasses of them "
        f"that keep their class's `call`). Received: model={model.name}"
    )


@keras_thor_export
def convert_to_thor_model(model):
    """Makes `model` a model THOR trains, and returns it (the same object).

    The model keeps its class, layers and variables: a Sequential, a
    Functional or a subclassed model, a keras-hub Backbone or Task
    (`generate`, its `preprocessor`, `summary` and `get_config` are its
    own), a `keras.applications` model. Its layers get their curvature
    rules, and this instance gets its own `compile`, `make_train_function`
    and `fit`, so that `fit` runs THOR's training step when the model is
    compiled with THOR (and Keras's own step with any other optimizer).
    Nothing is rebuilt or copied. The MindSpore equivalent is
    `ConvertModelUtils.convert_to_thor_model` plus `nn.thor(net, ...)`.

    THOR preconditions the kernels of `Dense`, `EinsumDense`
    (MultiHeadAttention's projections), 1-3-D, grouped, depthwise and
    separable convolutions, `Embedding`, `ReversibleEmbedding`, and the
    scale and offset of `LayerNormalization` (MindSpore's diagonal rule);
    `BatchNormalization` and `GroupNormalization` take the plain gradient,
    as in MindSpore's THOR. Biases take the plain gradient unless
    `THOR(precondition_biases=...)` selects them; every other variable
    takes the plain gradient. The conversion logs a summary and warns,
    naming every layer left first-order; `keras_thor.curvature_coverage`
    gives the table.

    The conversion belongs to the instance: a `.keras` file holds the
    model's own class, and `keras_thor.load_model` opens it converted,
    with THOR's state; `keras.models.clone_model` returns an unconverted
    copy. A class that overrides `train_step` trains with THOR only
    without the override (`fit` raises). `keras_thor.to_keras_model`
    undoes the conversion.

    Example:

    ```python
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model = keras_thor.convert_to_thor_model(model)
    model.compile(
        optimizer=keras_thor.optimizers.THOR.recommended(), loss="mse"
    )
    ```

    Args:
        model: A built `keras.Model`.

    Returns:
        `model`, converted.

    Raises:
        TypeError: If `model` is not a `keras.Model`.
        ValueError: If `model` is not built, or THOR can precondition none
            of the layers it trains (frozen layers are named).
    """
    return convert(model)


def convert(model, report=True):
    """`convert_to_thor_model`; with `report=False` it logs the coverage
    summary without warning (a model opened again by `load_model`)."""
    from keras_thor.src.thor.model import ThorTrainer

    _check_model(model)
    coverage = curvature_coverage(model)
    if coverage.curvature_parameters == 0:
        raise _no_curvature_error(model)
    attach_curvature(model)
    if not isinstance(model, ThorTrainer):
        attach(model, THOR_ATTACHED)
    if report:
        _report(coverage)
    else:
        logger.info(coverage.summary())
    return model


@keras_thor_export
def to_keras_model(model):
    """Returns `model` as a plain Keras model, for serving without THOR.

    The inverse of `convert_to_thor_model`. A model converted in place
    gets its class's own methods back, and its layers their class's
    `call`: the same object is returned, of the user's class, and trains
    with THOR again only once converted again. A `ThorFunctional` or
    `ThorSequential` (`ThorModel(inputs, outputs)`, and the `.keras` files
    of earlier keras_thor versions) is rebuilt as a `keras.Sequential` or a
    Functional `keras.Model` with the same layers and weights; layers of
    earlier versions (`ThorDense`, ...) become their Keras classes. Either
    way its `.keras` file loads where keras_thor is not installed
    (`keras.models.load_model(path, compile=False)`).

    A subclassed `keras_thor.models.ThorModel` is the user's own class and
    cannot be rebuilt from outside: serve it with `model.export(path)`, or
    load its weights into the same architecture built on `keras.Model`.

    Example:

    ```python
    plain = keras_thor.to_keras_model(model)
    plain.save("served.keras")
    ```

    Args:
        model: A built `keras.Model`, typically one
            `convert_to_thor_model` returned.

    Returns:
        The plain Keras model, not compiled when rebuilt.

    Raises:
        TypeError: If `model` is not a `keras.Model`.
        ValueError: If `model` is a subclassed `ThorModel`.
    """
    from keras_thor.src.thor.model import ThorTrainer

    _check_model(model)
    if not isinstance(model, ThorTrainer):
        detach(model, THOR_ATTACHED)
        detach_curvature(model)
        return model
    check_rewritable(
        model,
        "to_keras_model",
        "serve it with `model.export(path)`, or load its weights into the "
        "same architecture built on `keras.Model`",
    )
    return rebuild(
        model, KERAS_FUNCTIONAL, KERAS_SEQUENTIAL, rewrite=_to_keras_layers
    )
