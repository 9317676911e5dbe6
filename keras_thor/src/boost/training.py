"""The training step of keras_thor's boost models.

A step either trains every variable or, under gradient freezing, one group
(a suffix of the network); it either updates the weights or, under
gradient accumulation, only accumulates. Each combination is its own
traced variant (`BoostOptimizer.variant_step`), chosen in Python before
the step from the optimizer's step counter: the frozen prefix is never
differentiated, and no collective sits inside a `tf.cond` (which breaks
under tf.distribute).
"""

import keras

from keras_thor.src.distribute.train_step import scaled_training_loss
from keras_thor.src.distribute.train_step import training_call


def taped_gradients(model, data, sources):
    """The forward pass in training mode and the gradients of the scaled
    loss with respect to `sources` only.

    Only `sources` are watched: a frozen front's forward pass is not
    recorded, so no backward pass reaches it. Returns
    `((x, y, sample_weight), y_pred, scaled_loss, grads)`.
    """
    import tensorflow as tf

    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch([v.value for v in sources])
        y_pred = training_call(model, x)
        scaled_loss = scaled_training_loss(model, x, y, y_pred, sample_weight)
    grads = tape.gradient(scaled_loss, sources)
    return (x, y, sample_weight), y_pred, scaled_loss, grads


def train_step(model, data, variables, update):
    """One step: gradients of `variables` only, handed to the
    `BoostOptimizer` (which updates them when `update`)."""
    optimizer = model.optimizer
    # Variables whose gradients an algorithm reads (the group loss scale
    # markers' overflow probes, one per group).
    probes = optimizer.overflow_probes()
    (x, y, sample_weight), y_pred, _, grads = taped_gradients(
        model, data, variables + probes
    )
    grads, overflows = grads[: len(variables)], grads[len(variables) :]
    optimizer.boost_apply(grads, variables, update, overflows)
    logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    return {**logs, **optimizer.training_logs()}
