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
        reason: Why it needs the backends it trains on (`"its curvature
            capture is TensorFlow and JAX code"`).
        backends: The backends it trains on.
    """

    def __init__(self, feature, reason, backends=("tensorflow",)):
        self.feature = feature
        self.reason = reason
        self.backends = tuple(backends)

    def _trains_on(self):
        names = {"tensorflow": "TensorFlow", "jax": "JAX"}
        backends = " or ".join(names[b] for b in self.backends)
        noun = "backend" if len(self.backends) == 1 else "backends"
        return f"{self.feature} trains on the {backends} {noun} only"

    def _setting(self):
        return " or ".join(f"KERAS_BACKEND={b}" for b in self.backends)

    def backend_message(self):
        return (
            f"{self._trains_on()} ({self.reason}). Set {self._setting()} "
            "before importing keras. "
            f"Received: backend={keras.backend.backend()!r}"
        )

    def check_backend(self):
        """Raises the `ValueError` that names the backend and the fix
        on a backend it does not train on (`compile`, `fit`)."""
        if keras.backend.backend() not in self.backends:
            raise ValueError(self.backend_message())

    def warn_loaded(self):
        """Warns, on a backend it does not train on, that a model loaded
        compiled with the feature predicts and evaluates but cannot
        `fit`."""
        if keras.backend.backend() not in self.backends:
            warnings.warn(
                f"{self._trains_on()} ({self.reason}): this model, loaded "
                "compiled with it on "
                f"backend={keras.backend.backend()!r}, can `predict` and "
                "`evaluate` but not `fit`. To train it, set "
                f"{self._setting()} before importing keras.",
                stacklevel=3,
            )


def own_train_function(model, force, training, make):
    """`model.train_function`, made by `make(model)` when missing (or
    `force`), else resynchronized with the optimizer's step count.

    `training` (an `OwnTraining`) names what needs keras_thor's training
    step in the errors: it needs one of its backends and never silently
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
