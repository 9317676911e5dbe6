"""`keras_thor.load_model`: a saved model, converted again as it was."""

import json
import warnings
import zipfile

import keras

from keras_thor.src.boost.boost_model import is_boost_model
from keras_thor.src.boost.boost_model import to_boost_model
from keras_thor.src.boost.less_bn import LessBN
from keras_thor.src.thor.convert import convert


def _saved_configs(filepath):
    """The `compile_config` a `.keras` file holds (or `None`), and what
    keras_thor recorded in its build config (`{}` if nothing)."""
    with zipfile.ZipFile(filepath) as archive:
        config = json.loads(archive.read("config.json"))
    build_config = config.get("build_config") or {}
    return config.get("compile_config"), build_config.get("keras_thor", {})


def _convert_again(model, recorded):
    """Converts `model` as the saved model was: boost's changes (`LessBN`,
    boost's training steps) as recorded; THOR where recorded, and for
    every model saved without a record that is not of a boost class."""
    boost = recorded.get("boost")
    if boost is not None:
        less_bn = boost.get("less_bn")
        if less_bn is None:
            to_boost_model(model)
        else:
            LessBN(model, fn_flag=less_bn["fn_flag"])
    if "thor" in recorded or not is_boost_model(model):
        convert(model, report=False)


def load_model(filepath, custom_objects=None, safe_mode=True):
    """Opens a `.keras` file of a model THOR or boost trains, ready to train.

    `convert_to_thor_model` and boost (`to_boost_model`, `LessBN`,
    `AutoBoost`) change a model instance, and a `.keras` file holds the
    model's own class as Keras saves it, with a record of the changes in
    its build config. This opens the file
    (`keras.saving.load_model(..., compile=False)`), makes the same
    changes (THOR's conversion; boost's training steps, the bypassed
    BatchNormalizations and the `FullNorm` head), compiles the model as
    it was saved (through the model's own `compile`, so a keras-hub Task,
    whose `compile` Keras's loading skips, gets its saved optimizer too)
    and loads the weights and the optimizer's state (THOR's momenta,
    factors, inverses and step count; boost's step counts), so that
    `fit` continues where the saved model stopped. A file saved without
    a record (keras_thor 0.2, or a model never converted) is converted
    for THOR; files of `ThorModel`, `ThorSequential`, `ThorFunctional`,
    `BoostFunctional` and `BoostSequential` open as with
    `keras.models.load_model`.

    Without keras_thor, `keras.models.load_model(filepath, compile=False)`
    opens the same file as the user's plain model.

    Example:

    ```python
    model.save("model.keras")
    model = keras_thor.load_model("model.keras")
    model.fit(x, y)  # continues with THOR's state
    ```

    Args:
        filepath: Path of a `.keras` file.
        custom_objects: As for `keras.saving.load_model`.
        safe_mode: As for `keras.saving.load_model`.

    Returns:
        The model, converted, compiled as saved (if it was) and with its
        optimizer's state.

    Raises:
        ValueError: If `filepath` is not a `.keras` file, or THOR can
            precondition none of the layers of a model it converts.
    """
    if not str(filepath).endswith(".keras"):
        raise ValueError(
            "Argument `filepath` must name a `.keras` file. "
            f"Received: filepath={filepath!r}"
        )
    with warnings.catch_warnings():
        # A model that compiles itself (a keras-hub Task) holds an unbuilt
        # optimizer here; the saved one is loaded below.
        warnings.filterwarnings(
            "ignore", message="Skipping variable loading for optimizer"
        )
        model = keras.saving.load_model(
            filepath,
            custom_objects=custom_objects,
            compile=False,
            safe_mode=safe_mode,
        )
    compile_config, recorded = _saved_configs(filepath)
    _convert_again(model, recorded)
    if compile_config:
        config = keras.saving.deserialize_keras_object(
            compile_config, custom_objects=custom_objects, safe_mode=safe_mode
        )
        model.compile(**config)
        model.optimizer.build(model.trainable_variables)
    if compile_config or "boost" in recorded:
        # The optimizer's state, and weights the changes added (a
        # `FullNorm` head's multiplier).
        model.load_weights(filepath)
    return model
