"""Base of the optimizers that follow torch's or Paddle's conventions."""

import keras

from keras_thor.src import keras_internals
from keras_thor.src.backend.dense import dense
from keras_thor.src.optimizers.strategy_checks import (
    check_base_options_under_strategy,
)


class ReferenceOptimizer(keras.optimizers.Optimizer):
    """An optimizer that keeps a reference framework's semantics.

    Where Keras's base optimizer and torch/Paddle disagree, the reference
    wins:

    - `weight_decay` adds `weight_decay * w` to the gradient (an L2
      penalty), instead of Keras's decoupled `w -= lr * weight_decay * w`.
      Subclasses add `decay_for(variable) * w` in `update_step`;
      `exclude_from_weight_decay()` applies as for Keras's own decay.
    - Clipping sees dense gradients: TensorFlow hands `Embedding` gradients
      over as `tf.IndexedSlices` with one row per lookup, and clipping those
      rows before they are summed is not what torch or Paddle compute.
    - Base options that Keras gets wrong under several replicas are refused
      when the optimizer is built (`check_base_options_under_strategy`).
    """

    def __init__(self, weight_decay, **kwargs):
        super().__init__(weight_decay=None, **kwargs)
        self.weight_decay = weight_decay

    def build(self, var_list):
        if self.built:
            return
        check_base_options_under_strategy(self)
        super().build(var_list)

    def _apply_weight_decay(self, variables):
        # Added to the gradient in `update_step` instead.
        return

    def _clip_gradients(self, grads):
        if self.clipnorm or self.clipvalue or self.global_clipnorm:
            grads = [None if g is None else dense(g) for g in grads]
        return super()._clip_gradients(grads)

    def decay_for(self, variable):
        """The L2 coefficient for `variable`: 0.0 if none or excluded."""
        if not self.weight_decay or not keras_internals.uses_weight_decay(
            self, variable
        ):
            return 0.0
        return self.weight_decay
