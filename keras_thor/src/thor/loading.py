"""`keras_thor.load_model`: a saved converted model, converted again."""

import json
import warnings
import zipfile

import keras

from keras_thor.src.thor.convert import convert


def _saved_compile_config(filepath):
    """The `compile_config` a `.keras` file holds, else `None`."""
    with zipfile.ZipFile(filepath) as archive:
        config = json.loads(archive.read("config.json"))
    return config.get("compile_config")


def load_model(filepath, custom_objects=None, safe_mode=True):
    """Opens a `.keras` file of a model THOR trains, ready to train on.

    `convert_to_thor_model` converts a model instance, and a `.keras`
    file holds the model's own class as Keras saves it. This opens the
    file (`keras.saving.load_model(..., compile=False)`), converts the
    model, compiles it as it was saved (through the model's own
    `compile`, so a keras-hub Task, whose `compile` Keras's loading
    skips, gets its saved optimizer too) and loads the optimizer's state
    (THOR's momenta, factors, inverses and step count), so that `fit`
    continues where the saved model stopped. Files of `ThorModel`,
    `ThorSequential` and `ThorFunctional` open too, as with
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
            precondition none of the model's layers.
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
    convert(model, report=False)
    compile_config = _saved_compile_config(filepath)
    if not compile_config:
        return model
    config = keras.saving.deserialize_keras_object(
        compile_config, custom_objects=custom_objects, safe_mode=safe_mode
    )
    model.compile(**config)
    model.optimizer.build(model.trainable_variables)
    model.load_weights(filepath)
    return model
