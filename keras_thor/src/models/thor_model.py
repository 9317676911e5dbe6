"""Keras models whose training step captures THOR's curvature."""

import keras

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.models.distributed_trainer import DistributedTrainer
from keras_thor.src.models.own_training import own_train_function


class ThorTrainer(DistributedTrainer):
    """Mixin: `fit` runs THOR's refresh and plain steps apart.

    With a THOR optimizer (bare or inside a `LossScaleOptimizer`), steps
    `0, f, 2f, ...` run a separately traced step that records the
    THOR-aware layers' inputs and output gradients and refreshes the
    inverses; all other steps run the plain step. With any other optimizer
    the Keras parent class's own train function runs (an overridden
    `train_step` included).
    """

    def make_train_function(self, force=False):
        from keras_thor.src.backend.thor_training import thor_optimizer_of

        if thor_optimizer_of(self.optimizer) is None:
            return super().make_train_function(force=force)
        return own_train_function(
            self, force, "THOR's curvature capture", _thor_train_function
        )


def _thor_train_function(model):
    from keras_thor.src.backend.thor_training import ThorTrainFunction

    return ThorTrainFunction(model)


def _functional_arguments(args, kwargs):
    # The test `keras.Model` uses to tell a Functional construction.
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


@keras_thor_export
class ThorFunctional(ThorTrainer, keras.Model):
    """A Functional `keras.Model` whose training step feeds THOR.

    What `ThorModel(inputs, outputs)` and `convert_to_thor_model` return
    for Functional models. (Keras turns a class used functionally into a
    Functional subclass for good; keeping this class apart keeps
    `ThorModel` subclassable.)
    """


@keras_thor_export
class ThorModel(ThorTrainer, keras.Model):
    """A `keras.Model` whose training step feeds THOR its curvature.

    Use it as `keras.Model`: functionally (`ThorModel(inputs, outputs)`) or
    subclassed with THOR-aware layers from `keras_thor.layers`:

    ```python
    class Classifier(keras_thor.models.ThorModel):
        def __init__(self):
            super().__init__()
            self.hidden = keras_thor.layers.ThorDense(64, activation="relu")
            self.logits = keras_thor.layers.ThorDense(10)

        def call(self, x):
            return self.logits(self.hidden(x))
    ```

    `ThorModel(inputs, outputs)` returns a `ThorFunctional`, as does
    `keras_thor.convert_to_thor_model` for a Functional model; a subclass
    whose constructor calls `super().__init__(inputs, outputs)` should
    derive from `ThorFunctional`. Training with THOR needs the TensorFlow
    backend; `evaluate` and `predict` are Keras's own.
    """

    def __new__(cls, *args, **kwargs):
        if cls is ThorModel and _functional_arguments(args, kwargs):
            return ThorFunctional(*args, **kwargs)
        return super().__new__(cls, *args, **kwargs)


@keras_thor_export
class ThorSequential(ThorTrainer, keras.Sequential):
    """A `keras.Sequential` whose training step feeds THOR its curvature.

    `keras_thor.convert_to_thor_model` returns one for a Sequential model.
    """
