"""The train functions keras_thor's model classes run in place of Keras's."""

import keras

from keras_thor.src.distribute.distributed_trainer import (
    check_jit_under_strategy,
)
from keras_thor.src.distribute.distributed_trainer import has_own_train_step


def own_train_function(model, force, feature, make):
    """`model.train_function`, made by `make(model)` when missing (or
    `force`), else resynchronized with the optimizer's step count.

    `feature` names what needs keras_thor's training step in the errors:
    it needs the TensorFlow backend and never silently replaces an
    overridden `train_step`.
    """
    if model.train_function is not None and not force:
        if hasattr(model.train_function, "resync"):
            model.train_function.resync()
        return model.train_function
    if keras.backend.backend() != "tensorflow":
        raise ValueError(
            f"{feature} needs the TensorFlow backend. "
            f"Received: backend={keras.backend.backend()!r}"
        )
    if has_own_train_step(model):
        raise ValueError(
            f"{feature} runs keras_thor's own training step; it cannot run "
            f"an overridden `train_step` ({type(model).__name__}.train_step)."
            " Remove the override, or train with another optimizer."
        )
    check_jit_under_strategy(model)
    model.train_function = make(model)
    return model.train_function
