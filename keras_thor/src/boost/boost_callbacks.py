"""How keras_thor's boost callbacks switch their algorithm on in `fit`.

A callback's `set_model` runs after Keras builds the compiled optimizer and
before it makes the train function: there the callback wraps the model's
optimizer in a `BoostOptimizer` carrying itself, so the boost model's
training step runs the algorithm and the optimizer keeps its state (saved
with the model).
"""

import keras

from keras_thor.src.boost.boost_model import is_boost_model
from keras_thor.src.boost.boost_model import use_boost_optimizer
from keras_thor.src.boost.boost_optimizer import BoostOptimizer


class BoostCallback(keras.callbacks.Callback):
    """The base of the callbacks that `install` a boost algorithm in
    `set_model`: a restored algorithm is kept when `same_settings`."""

    def same_settings(self, other):
        """Whether `other` runs with the same settings (an equal config)."""
        return self.get_config() == other.get_config()


def install(callback, model, argument, unwrap_loss_scale=False):
    """Makes `model.optimizer` a `BoostOptimizer` with `argument=callback`.

    An optimizer that already runs an equal configuration (the same
    callback, or one restored from a saved model) is kept with its state.
    A model that is not compiled is left alone (`predict`). With
    `unwrap_loss_scale`, a `keras.optimizers.LossScaleOptimizer` around
    the optimizer is taken off (the callback scales instead).
    """
    feature = type(callback).__name__
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return
    if not is_boost_model(model):
        raise ValueError(
            f"The `{feature}` callback trains a keras_thor boost model: pass "
            "your model through `keras_thor.boost.to_boost_model` before "
            f"`compile`. Received: a {type(model).__name__} model"
        )
    if isinstance(optimizer, BoostOptimizer):
        current = getattr(optimizer, argument)
        if current is callback:
            return
        if current is not None:
            if callback.same_settings(current):
                return
            raise ValueError(
                f"The model's optimizer already runs {feature} with other "
                f"settings. Received: {callback!r}, running: {current!r}"
            )
    if unwrap_loss_scale:
        optimizer = _without_loss_scale(optimizer)
    with model.distribute_strategy.scope():
        if isinstance(optimizer, BoostOptimizer):
            optimizer = optimizer.replaced(**{argument: callback})
        else:
            optimizer = BoostOptimizer(optimizer, **{argument: callback})
    use_boost_optimizer(model, optimizer)


def _without_loss_scale(optimizer):
    if isinstance(optimizer, BoostOptimizer):
        inner = _without_loss_scale(optimizer.inner_optimizer)
        if inner is optimizer.inner_optimizer:
            return optimizer
        return optimizer.replaced(inner_optimizer=inner)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer
