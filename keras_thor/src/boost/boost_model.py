"""Keras models that run keras_thor's boost training steps."""

import keras

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.boost.boost_optimizer import BoostOptimizer
from keras_thor.src.boost.train_function import BoostTrainFunction
from keras_thor.src.distribute.distributed_trainer import DistributedTrainer
from keras_thor.src.distribute.own_training import OwnTraining
from keras_thor.src.distribute.own_training import own_train_function
from keras_thor.src.utils.rebuild import check_rewritable
from keras_thor.src.utils.rebuild import rebuild
from keras_thor.src.utils.rebuild import registered_class

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
        if _boost_inside(optimizer) is not None:
            BOOST_TRAINING.check_backend()
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
        """Trains with `optimizer` (a `BoostOptimizer` a boost callback
        made around the compiled one) from the next train function on; it
        is saved as the compiled optimizer."""
        self.optimizer = optimizer
        self.train_function = None

    def get_compile_config(self):
        config = super().get_compile_config()
        if config and _boost_optimizer_of(self.optimizer) is not None:
            config["optimizer"] = keras.saving.serialize_keras_object(
                self.optimizer
            )
        return config

    def make_train_function(self, force=False):
        if _boost_optimizer_of(self.optimizer) is None:
            return super().make_train_function(force=force)
        return own_train_function(
            self, force, BOOST_TRAINING, _boost_train_function
        )


def _boost_train_function(model):
    return BoostTrainFunction(model)


@keras_thor_export
class BoostFunctional(BoostTrainer, keras.Model):
    """A Functional `keras.Model` that runs boost training steps.

    What `keras_thor.boost` returns for a Functional model.
    """


@keras_thor_export
class BoostSequential(BoostTrainer, keras.Sequential):
    """A `keras.Sequential` that runs boost training steps."""


@keras_thor_export
def to_boost_model(model):
    """Returns `model` as a `BoostFunctional`/`BoostSequential`.

    Layers, weights and names are kept (the model is rebuilt from its
    config); the result is not compiled. A model that already is one is
    returned as it is.

    Args:
        model: A built Sequential or Functional `keras.Model`.
    """
    if isinstance(model, (BoostFunctional, BoostSequential)):
        return model
    check_rewritable(
        model,
        "to_boost_model",
        "derive it from `keras_thor.models.BoostFunctional`",
    )
    return rebuild(
        model,
        registered_class(BoostFunctional),
        registered_class(BoostSequential),
    )
