"""Keras models whose training step captures THOR's curvature."""

import keras

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.distribute.distributed_trainer import DistributedTrainer
from keras_thor.src.thor import fit_hooks
from keras_thor.src.thor.curvature import attach_curvature
from keras_thor.src.thor.training import thor_optimizer_of


class ThorTrainer(DistributedTrainer):
    """Mixin: `fit` runs THOR's refresh and plain steps apart.

    Once the model is built, its layers get their curvature rules
    (`attach_curvature`: what THOR's `build` reads) the first time its
    trainable variables are asked for. With a THOR optimizer
    (bare or inside a `LossScaleOptimizer`), steps `0, f, 2f, ...` run a
    separately traced step that records the layers' inputs and output
    gradients and refreshes the inverses; all other steps run the plain
    step. With any other optimizer the Keras parent class's own train
    function runs (an overridden `train_step` included).

    THOR trains on the TensorFlow and JAX backends: `compile` with THOR
    raises on any other (torch). A model saved compiled with THOR loads
    compiled with it (and its state) on every backend, so `predict` and
    `evaluate` run there; on torch loading warns and `fit` raises.
    """

    def compile(self, optimizer="rmsprop", *args, **kwargs):
        fit_hooks.check_compile(optimizer)
        super().compile(optimizer, *args, **kwargs)

    def compile_from_config(self, config):
        # Keras's own skips a model whose `compile` is overridden; this one
        # restores the saved compilation on every backend.
        config = keras.saving.deserialize_keras_object(config)
        super().compile(**config)
        if thor_optimizer_of(self.optimizer) is not None:
            fit_hooks.THOR_TRAINING.warn_loaded()
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    @property
    def trainable_variables(self):
        # Whatever builds THOR (fit, loading, a user) asks for these first.
        self._attach_curvature()
        return super().trainable_variables

    @property
    def trainable_weights(self):
        self._attach_curvature()
        return super().trainable_weights

    def _attach_curvature(self):
        """Gives the layers their curvature rules once the model is built."""
        if self.built and not getattr(self, "_keras_thor_attached", False):
            object.__setattr__(self, "_keras_thor_attached", True)
            attach_curvature(self)

    def fit(self, *args, **kwargs):
        history = super().fit(*args, **kwargs)
        fit_hooks.after_fit(self)
        return history

    def make_train_function(self, force=False):
        return fit_hooks.make_train_function(
            self, force, super().make_train_function
        )


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

    What `ThorModel(inputs, outputs)` returns (and what keras_thor 0.1's
    `convert_to_thor_model` returned for Functional models). (Keras turns
    a class used functionally into a Functional subclass for good; keeping
    this class apart keeps `ThorModel` subclassable.)
    """


@keras_thor_export
class ThorModel(ThorTrainer, keras.Model):
    """A `keras.Model` whose training step feeds THOR its curvature.

    Use it as `keras.Model`: functionally (`ThorModel(inputs, outputs)`) or
    subclassed, with Keras's own layers:

    ```python
    class Classifier(keras_thor.models.ThorModel):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(64, activation="relu")
            self.logits = keras.layers.Dense(10)

        def call(self, x):
            return self.logits(self.hidden(x))
    ```

    `ThorModel(inputs, outputs)` returns a `ThorFunctional`; a subclass
    whose constructor calls `super().__init__(inputs, outputs)` should
    derive from `ThorFunctional`. Training with THOR needs the TensorFlow
    or JAX backend (`compile` with THOR raises on torch); `evaluate` and
    `predict` are Keras's own.
    """

    def __new__(cls, *args, **kwargs):
        if cls is ThorModel and _functional_arguments(args, kwargs):
            return ThorFunctional(*args, **kwargs)
        return super().__new__(cls, *args, **kwargs)


@keras_thor_export
class ThorSequential(ThorTrainer, keras.Sequential):
    """A `keras.Sequential` whose training step feeds THOR its curvature.

    keras_thor 0.1's `convert_to_thor_model` returned one for a Sequential
    model; its `.keras` files still load as one.
    """
