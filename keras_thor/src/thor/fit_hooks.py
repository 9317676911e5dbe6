"""What Keras's `compile` and `fit` call on a model THOR trains.

Shared by the model classes (`ThorTrainer`) and by models converted in
place (`THOR_ATTACHED`, an `AttachedTraining`): the checks `compile`
makes, the train function `fit` runs, and the read of THOR's skipped
updates when `fit` returns.
"""

import keras

from keras_thor.src.distribute.attached_training import AttachedTraining
from keras_thor.src.distribute.own_training import OwnTraining
from keras_thor.src.distribute.own_training import own_train_function
from keras_thor.src.thor.curvature import require_curvature
from keras_thor.src.thor.train_function import ThorVariants
from keras_thor.src.thor.train_function import thor_train_function
from keras_thor.src.thor.training import thor_optimizer_of

THOR_TRAINING = OwnTraining(
    "THOR",
    "its training step is written for TensorFlow's tape and JAX's vjp",
    backends=("tensorflow", "jax"),
)


def check_distribution():
    """Raises for a `keras.distribution` THOR does not train under (any
    but `DataParallel`: `ModelParallel` lays THOR's state out on one
    device of the mesh, which JAX refuses)."""
    distribution = keras.distribution.distribution()
    if distribution is None or isinstance(
        distribution, keras.distribution.DataParallel
    ):
        return
    raise ValueError(
        "THOR trains under `keras.distribution.DataParallel` only; "
        f"{type(distribution).__name__} is not supported yet (THOR's "
        "curvature state has no layout on the device mesh). Use "
        "`keras.distribution.DataParallel`, or another optimizer. "
        f"Received: distribution={distribution!r}"
    )


def check_compile(optimizer):
    """Raises where `compile(optimizer=optimizer)` cannot train with THOR
    (the backend, the distribution); any other optimizer passes, and so
    do `None` and `"auto"` (a class's own default, e.g. keras-hub's)."""
    if optimizer is None or optimizer == "auto":
        return
    if isinstance(optimizer, (str, dict)):
        optimizer = keras.optimizers.get(optimizer)
    if thor_optimizer_of(optimizer) is not None:
        THOR_TRAINING.check_backend()
        check_distribution()


def make_train_function(model, force, keras_make):
    """THOR's train function for `model` when it is compiled with THOR,
    else `keras_make(force=force)` (Keras's own)."""
    function = thor_train_function_of(model, force)
    return keras_make(force=force) if function is None else function


def thor_train_function_of(model, force):
    """THOR's train function for `model` when it is compiled with THOR,
    else `None`."""
    if thor_optimizer_of(model.optimizer) is None:
        return None
    check_distribution()
    if model.built:
        require_curvature(model)
        thor = thor_optimizer_of(model.optimizer)
        if not thor.built and model.optimizer.built:
            # A `LossScaleOptimizer` built before the model was converted
            # (THOR then had no curvature to build with).
            thor.build(model.trainable_variables)
    return own_train_function(model, force, THOR_TRAINING, thor_train_function)


def after_fit(model):
    """Reads THOR's count of skipped updates once more: arrays and
    `steps_per_epoch` never reach an end of data (one host read)."""
    if isinstance(model.train_function, ThorVariants):
        model.train_function.check_skipped_updates()


class _ThorAttached(AttachedTraining):
    """THOR's hooks on a model converted in place."""

    def check_compile(self, model, optimizer):
        check_compile(optimizer)

    def train_function(self, model, force):
        return thor_train_function_of(model, force)

    def build_config(self, model):
        return True

    def after_fit(self, model):
        after_fit(model)


THOR_ATTACHED = _ThorAttached("thor")
