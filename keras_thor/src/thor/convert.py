"""`convert_to_thor_model` and `to_keras_model`: into THOR and back."""

import logging
import warnings

import keras

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.thor.coverage import curvature_coverage
from keras_thor.src.thor.coverage import supported_layer_names
from keras_thor.src.thor.curvature import model_layers
from keras_thor.src.utils.rebuild import KERAS_FUNCTIONAL
from keras_thor.src.utils.rebuild import KERAS_SEQUENTIAL
from keras_thor.src.utils.rebuild import check_rewritable
from keras_thor.src.utils.rebuild import rebuild
from keras_thor.src.utils.rebuild import registered_class

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
        "THOR leaves these layers first-order (plain momentum SGD): "
        f"{'; '.join(parts)}. {coverage.summary()} "
        "`keras_thor.curvature_coverage(model)` gives the table.",
        stacklevel=3,
    )


@keras_thor_export
def convert_to_thor_model(model):
    """Returns `model` as a model THOR trains, its layers and weights kept.

    The layers stay the Keras layers they are (nested models and layers
    inside layers included); only the model class changes, to a
    `keras_thor.models.ThorSequential` (for a Sequential) or a
    `keras_thor.models.ThorFunctional` (for a Functional model), whose
    training step records what THOR's curvature needs. The result is not
    compiled and holds copies of `model`'s weights. The MindSpore
    equivalent is `ConvertModelUtils.convert_to_thor_model` plus
    `nn.thor(net, ...)`.

    THOR preconditions the kernels of `Dense`, `EinsumDense`
    (MultiHeadAttention's projections), 1-3-D, grouped, depthwise and
    separable convolutions, `Embedding`, and the scale and offset of
    `LayerNormalization` (MindSpore's diagonal rule); `BatchNormalization`
    and `GroupNormalization` take the plain gradient, as in MindSpore's
    THOR. Biases take the plain gradient unless
    `THOR(precondition_biases=...)` selects them ("shared", "all" or
    "joint"); every other variable takes the plain gradient. The
    conversion logs a summary and warns, naming every layer left
    first-order; `keras_thor.curvature_coverage(model)` gives the table.
    `keras_thor.to_keras_model` turns the result back into plain Keras.

    Users' own layers need no registering: unregistered classes and
    `Lambda` layers (Python lambdas included) are rebuilt from the model's
    own objects and stay what they are. A layer whose `get_config` does
    not give back its constructor arguments is a `ValueError` naming it.
    Loading the saved result needs `custom_objects` for those classes (and
    `safe_mode=False` for Python lambdas), as for any Keras model.

    A subclassed model cannot be rebuilt from outside: derive it from
    `keras_thor.models.ThorModel` instead of `keras.Model`.

    Args:
        model: A Sequential or Functional `keras.Model`, built.

    Returns:
        The model for THOR.

    Raises:
        ValueError: If THOR can precondition none of the model's layers,
            or a layer cannot be rebuilt from its config.
    """
    from keras_thor.src.thor.model import ThorFunctional
    from keras_thor.src.thor.model import ThorSequential

    check_rewritable(
        model,
        "convert_to_thor_model",
        "subclass `keras_thor.models.ThorModel` instead of `keras.Model`",
    )
    coverage = curvature_coverage(model)
    if coverage.curvature_parameters == 0:
        found = sorted(
            {
                type(layer).__name__
                for layer in model_layers(model)
                if not isinstance(layer, keras.layers.InputLayer)
            }
        )
        raise ValueError(
            "THOR can precondition none of the layers of this model. "
            f"Layer types found: {found}. THOR has curvature rules for: "
            f"{supported_layer_names()} (and subclasses of them that keep "
            f"their class's `call`). Received: model={model.name}"
        )
    converted = rebuild(
        model,
        registered_class(ThorFunctional),
        registered_class(ThorSequential),
        rewrite=_to_keras_layers,
    )
    _report(coverage)
    return converted


@keras_thor_export
def to_keras_model(model):
    """Returns `model` as a plain Keras model, for serving without THOR.

    The inverse of `convert_to_thor_model`: the same architecture, layers
    and weights (so the same predictions), as a `keras.Sequential` or a
    Functional `keras.Model`. Layers of earlier keras_thor versions
    (`ThorDense`, ...) become their Keras classes; users' own layers
    (registered or not) stay theirs. Its `.keras` file loads where
    keras_thor is not installed (`keras.models.load_model(path,
    compile=False)`).

    A subclassed `keras_thor.models.ThorModel` is the user's own class and
    cannot be rebuilt from outside: serve it with `model.export(path)`
    (a TensorFlow SavedModel that needs only TensorFlow), or load its
    weights into the same architecture built on `keras.Model`.

    Args:
        model: A built Sequential or Functional `keras.Model`, typically
            one `convert_to_thor_model` returned.

    Returns:
        The plain Keras model, not compiled.
    """
    check_rewritable(
        model,
        "to_keras_model",
        "serve it with `model.export(path)`, or load its weights into the "
        "same architecture built on `keras.Model`",
    )
    return rebuild(
        model, KERAS_FUNCTIONAL, KERAS_SEQUENTIAL, rewrite=_to_keras_layers
    )
