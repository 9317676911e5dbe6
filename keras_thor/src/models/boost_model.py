"""Keras models that run keras_thor's boost training steps."""

import keras

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.models.convert import check_rewritable
from keras_thor.src.models.convert import with_model_class
from keras_thor.src.models.distributed_trainer import DistributedTrainer
from keras_thor.src.models.own_training import own_train_function


def _boost_optimizer_of(optimizer):
    from keras_thor.src.boost.boost_optimizer import BoostOptimizer

    return optimizer if isinstance(optimizer, BoostOptimizer) else None


class BoostTrainer(DistributedTrainer):
    """Mixin: `fit` runs a `BoostOptimizer`'s frozen and accumulating steps.

    With a `keras_thor.boost.BoostOptimizer` the training step takes
    gradients of the group that step trains only, and updates the weights
    on the steps that end an accumulation. With any other optimizer the
    Keras parent class's own train function runs.
    """

    def make_train_function(self, force=False):
        if _boost_optimizer_of(self.optimizer) is None:
            return super().make_train_function(force=force)
        return own_train_function(
            self, force, "A `BoostOptimizer`", _boost_train_function
        )


def _boost_train_function(model):
    from keras_thor.src.backend.boost_training import BoostTrainFunction

    return BoostTrainFunction(model)


@keras_thor_export
class BoostFunctional(BoostTrainer, keras.Model):
    """A Functional `keras.Model` that runs boost training steps.

    What `keras_thor.boost` returns for a Functional model.
    """


@keras_thor_export
class BoostSequential(BoostTrainer, keras.Sequential):
    """A `keras.Sequential` that runs boost training steps."""


def boost_class_config(model, serialized):
    """`serialized` (of `model`) as a boost model class's config."""
    return with_model_class(model, serialized, BoostFunctional, BoostSequential)


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
    serialized = keras.saving.serialize_keras_object(model)
    converted = keras.saving.deserialize_keras_object(
        boost_class_config(model, serialized)
    )
    converted.set_weights(model.get_weights())
    return converted
