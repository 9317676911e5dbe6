"""The train functions keras_thor's model classes run in place of Keras's."""

import warnings

import keras

from keras_thor.src.distribute.distributed_trainer import (
    check_jit_under_strategy,
)
from keras_thor.src.distribute.distributed_trainer import has_own_train_step


class OwnTraining:
    """What needs keras_thor's own training step, as its errors name it.

    Args:
        feature: What needs the step, as the errors' sentences start with
            it (`"THOR"`, ``"A `BoostOptimizer`"``).
        reason: Why it needs TensorFlow (`"its curvature capture is
            TensorFlow code"`).
    """

    def __init__(self, feature, reason):
        self.feature = feature
        self.reason = reason

    def backend_message(self):
        return (
            f"{self.feature} trains on the TensorFlow backend only "
            f"({self.reason}). Set KERAS_BACKEND=tensorflow before importing "
            f"keras. Received: backend={keras.backend.backend()!r}"
        )

    def check_backend(self):
        """Raises the `ValueError` that names the backend and the fix
        anywhere but on TensorFlow (`compile`, `fit`)."""
        if keras.backend.backend() != "tensorflow":
            raise ValueError(self.backend_message())

    def warn_loaded(self):
        """Warns, anywhere but on TensorFlow, that a model loaded compiled
        with the feature predicts and evaluates but cannot `fit`."""
        if keras.backend.backend() != "tensorflow":
            warnings.warn(
                f"{self.feature} trains on the TensorFlow backend only "
                f"({self.reason}): this model, loaded compiled with it on "
                f"backend={keras.backend.backend()!r}, can `predict` and "
                "`evaluate` but not `fit`. To train it, set "
                "KERAS_BACKEND=tensorflow before importing keras.",
                stacklevel=3,
            )


def own_train_function(model, force, training, make):
    """`model.train_function`, made by `make(model)` when missing (or
    `force`), else resynchronized with the optimizer's step count.

    `training` (an `OwnTraining`) names what needs keras_thor's training
    step in the errors: it needs the TensorFlow backend and never silently
    replaces an overridden `train_step`.
    """
    if model.train_function is not None and not force:
        if hasattr(model.train_function, "resync"):
            model.train_function.resync()
        return model.train_function
    training.check_backend()
    if has_own_train_step(model):
        raise ValueError(
            f"{training.feature} runs keras_thor's own training step; it "
            "cannot run an overridden `train_step` "
            f"({type(model).__name__}.train_step). Remove the override, or "
            "train with another optimizer."
        )
    check_jit_under_strategy(model)
    model.train_function = make(model)
    return model.train_function
