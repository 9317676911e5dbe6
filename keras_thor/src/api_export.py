"""Registration of public keras_thor objects for Keras serialization."""

import keras


def keras_thor_export(cls):
    """Registers `cls` as `keras_thor>ClassName` for `.keras` files."""
    return keras.saving.register_keras_serializable(package="keras_thor")(cls)
