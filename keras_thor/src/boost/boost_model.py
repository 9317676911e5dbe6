"""The models that run keras_thor's boost training steps: converted in
place (`to_boost_model`) or of keras_thor's boost classes."""

import keras

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.boost.boost_optimizer import BoostOptimizer
from keras_thor.src.boost.train_function import BoostTrainFunction
from keras_thor.src.distribute.attached_training import AttachedTraining
from keras_thor.src.distribute.attached_training import attach
from keras_thor.src.distribute.attached_training import is_attached
from keras_thor.src.distribute.distributed_trainer import DistributedTrainer
from keras_thor.src.distribute.own_training import OwnTraining
from keras_thor.src.distribute.own_training import own_train_function

BOOST_TRAINING = OwnTraining(
    "A `BoostOptimizer`", "boost's training step is TensorFlow code"
)


def _boost_optimizer_of(optimizer):
    return optimizer if isinstance(optimizer, BoostOptimizer) else None


def _boost_inside(optimizer):
    """The `BoostOptimizer` `compile(optimizer=...)` trains with, bare or
    in a `LossScaleOptimizer` (a name or a config resolved)."""
    if isinstance(optimizer, (str, dict)):
        optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return _boost_optimizer_of(optimizer)


def _loss_scale_inside(optimizer):
    """The compiled optimizer with Keras's `mixed_float16` loss scaling
    moved inside a `BoostOptimizer` (which then unscales and skips as the
    `LossScaleOptimizer` would); with an algorithm that runs
    `without_global_loss_scale` (group loss scaling, DimReduce), none at
    all."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer
    boost = _boost_optimizer_of(optimizer.inner_optimizer)
    if boost is None:
        return optimizer
    inner = boost.inner_optimizer
    if boost.without_global_loss_scale or isinstance(
        inner, keras.optimizers.LossScaleOptimizer
    ):
        return boost
    return boost.replaced(
        inner_optimizer=keras.optimizers.LossScaleOptimizer(
            inner, name="loss_scale_optimizer"
        )
    )


def check_boost_compile(optimizer):
    """Raises where `compile(optimizer=optimizer)` cannot train a
    `BoostOptimizer` (any backend but TensorFlow)."""
    if optimizer is not None and optimizer != "auto":
        if _boost_inside(optimizer) is not None:
            BOOST_TRAINING.check_backend()


def boost_train_function_of(model, force):
    """The boost train function of `model` when it is compiled with a
    `BoostOptimizer`, else `None`."""
    if _boost_optimizer_of(model.optimizer) is None:
        return None
    return own_train_function(
        model, force, BOOST_TRAINING, _boost_train_function
    )


def boost_compile_config(model, config):
    """`config` with the `BoostOptimizer` a boost callback installed
    saved as the compiled optimizer."""
    if config and _boost_optimizer_of(model.optimizer) is not None:
        config = {
            **config,
            "optimizer": keras.saving.serialize_keras_object(model.optimizer),
        }
    return config


class _BoostAttached(AttachedTraining):
    """Boost's hooks on a model converted in place."""

    def check_compile(self, model, optimizer):
        check_boost_compile(optimizer)

    def after_compile(self, model):
        model.optimizer = _loss_scale_inside(model.optimizer)

    def train_function(self, model, force):
        return boost_train_function_of(model, force)

    def compile_config(self, model, config):
        return boost_compile_config(model, config)

    def build_config(self, model):
        return {"less_bn": getattr(model, LESS_BN_RECORD, None)}


BOOST_ATTACHED = _BoostAttached("boost")
# Where `LessBN` records its settings on a model it changed in place.
LESS_BN_RECORD = "_keras_thor_less_bn"


def is_boost_model(model):
    """Whether `model` runs boost's training steps: converted in place by
    `to_boost_model`, or of a keras_thor boost class."""
    return isinstance(model, BoostTrainer) or is_attached(model, BOOST_ATTACHED)


def use_boost_optimizer(model, optimizer):
    """Trains the boost `model` with `optimizer` (a `BoostOptimizer` a
    boost callback made around the compiled one) from the next train
    function on; it is saved as the compiled optimizer."""
    model.optimizer = optimizer
    model.train_function = None


class BoostTrainer(DistributedTrainer):
    """Mixin: `fit` runs a `BoostOptimizer`'s frozen and accumulating steps.

    With a `keras_thor.boost.BoostOptimizer` the training step takes
    gradients of the group that step trains only, and updates the weights
    on the steps that end an accumulation. With any other optimizer the
    Keras parent class's own train function runs.

    A `BoostOptimizer` trains on the TensorFlow backend only: `compile`
    with one raises on any other. A model saved compiled with one loads
    compiled with it on every backend (off TensorFlow with a warning:
    `predict` and `evaluate` run, `fit` raises).
    """

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        check_boost_compile(optimizer)
        self._compile_boost(optimizer, *args, **kwargs)

    def _compile_boost(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        self.optimizer = _loss_scale_inside(self.optimizer)

    def compile_from_config(self, config):
        # Keras's skips a model whose `compile` is overridden.
        config = keras.saving.deserialize_keras_object(config)
        self._compile_boost(**config)
        if _boost_inside(self.optimizer) is not None:
            BOOST_TRAINING.warn_loaded()
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def use_boost_optimizer(self, optimizer):
        """See `use_boost_optimizer`."""
        use_boost_optimizer(self, optimizer)

    def get_compile_config(self):
        return boost_compile_config(self, super().get_compile_config())

    def get_build_config(self):
        config = super().get_build_config()
        record = BOOST_ATTACHED.build_config(self)
        if config is None or record["less_bn"] is None:
            return config
        return {**config, "keras_thor": {BOOST_ATTACHED.name: record}}

    def make_train_function(self, force=False):
        function = boost_train_function_of(self, force)
        if function is None:
            return super().make_train_function(force=force)
        return function


def _boost_train_function(model):
    return BoostTrainFunction(model)


@keras_thor_export
class BoostFunctional(BoostTrainer, keras.Model):
    """A Functional `keras.Model` that runs boost training steps.

    What keras_thor 0.2's `keras_thor.boost` functions returned for a
    Functional model; its `.keras` files still load as one.
    """


@keras_thor_export
class BoostSequential(BoostTrainer, keras.Sequential):
    """A `keras.Sequential` that runs boost training steps (as
    `BoostFunctional`)."""


@keras_thor_export
def to_boost_model(model):
    """Gives `model` boost's training steps, in place, and returns it.

    Gradient freezing, gradient accumulation, DimReduce and group loss
    scaling need a training step of their own: this attaches it to the
    model instance (its class, layers, variables and saving stay the
    user's; see docs/boost.md). Any built `keras.Model` works:
    Sequential, Functional, subclassed, keras-hub Backbones and Tasks,
    `keras.applications`. With an optimizer that is not a
    `BoostOptimizer`, the model trains as before. Converting twice
    changes nothing; a model of a keras_thor boost class is returned as
    it is.

    Example:

    ```python
    model = keras_thor.boost.to_boost_model(model)
    model.compile(keras_thor.boost.BoostOptimizer(
        keras.optimizers.SGD(0.1), grad_accumulation_step=4), "mse")
    ```

    Args:
        model: A built `keras.Model`.

    Returns:
        `model`.

    Raises:
        TypeError: If `model` is not a `keras.Model`.
        ValueError: If `model` is not built.
    """
    check_built_model(model, "to_boost_model")
    if not isinstance(model, BoostTrainer):
        attach(model, BOOST_ATTACHED)
    return model


def check_built_model(model, function):
    """Raises unless `model` is a built `keras.Model`."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`{function}` takes a `keras.Model`. Argument `model` must be "
            f"one. Received: model={model!r} (of type {type(model).__name__})"
        )
    if not model.built:
        raise ValueError(
            "Argument `model` must be built (give it an input shape or call "
            f"it once). Received: model={model.name!r}, not built"
        )
