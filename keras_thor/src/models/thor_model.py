"""Keras models whose training step captures THOR's curvature."""

import keras

from keras_thor.src.api_export import keras_thor_export


class ThorTrainer:
    """Mixin: `fit` runs THOR's refresh and plain steps apart.

    With a THOR optimizer (bare or inside a `LossScaleOptimizer`), steps
    `0, f, 2f, ...` run a separately traced step that records the
    THOR-aware layers' inputs and output gradients and refreshes the
    inverses; all other steps run the plain step. With any other optimizer
    this trains as the Keras parent class does.
    """

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        if keras.backend.backend() != "tensorflow":
            raise NotImplementedError(
                "THOR's curvature capture needs the TensorFlow backend. "
                f"Received: backend={keras.backend.backend()!r}"
            )
        from keras_thor.src.backend.thor_training import ThorTrainFunction

        self.train_function = ThorTrainFunction(self)
        return self.train_function


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

    `keras_thor.convert_to_thor_model` returns one for a Functional model.
    Training with THOR needs the TensorFlow backend; `evaluate` and
    `predict` are Keras's own.
    """


@keras_thor_export
class ThorSequential(ThorTrainer, keras.Sequential):
    """A `keras.Sequential` whose training step feeds THOR its curvature.

    `keras_thor.convert_to_thor_model` returns one for a Sequential model.
    """
