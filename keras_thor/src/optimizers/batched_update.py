"""Optimizers whose update of all variables is one computation."""

from keras_thor.src.backend.single_device import tensorflow_without_strategy


class BatchedUpdate:
    """Mixin: every update goes through `_update_variables(grads, vars, lr)`.

    Without tf.distribute, Keras's per-variable update is a plain loop, and
    one (compiled) computation for all variables saves a launch per
    variable. Under a strategy, and on other backends, Keras's own
    per-device loop calls `update_step`, which updates one variable the same
    way.
    """

    def update_step(self, gradient, variable, learning_rate):
        self._update_variables([gradient], [variable], learning_rate)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if not tensorflow_without_strategy():
            return super()._backend_update_step(
                grads, trainable_variables, learning_rate
            )
        self._update_variables(grads, trainable_variables, learning_rate)
