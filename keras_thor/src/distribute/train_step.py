"""Keras's TensorFlow training step, in pieces keras_thor's steps share.

THOR's and boost's training steps are Keras's (`train_step` of the
TensorFlow trainer) with more in between; these are the pieces they keep,
with one mend for tf.distribute: a `LossScaleOptimizer` sees an overflow
on any replica (Keras's looks at replica 0's gradients only).
"""

import warnings

import keras

from keras_thor.src import keras_internals
from keras_thor.src.distribute import replicas


def examples(x):
    """The number of examples in the batch `x` (a scalar tensor where the
    traced shape does not fix it)."""
    first = next(t for t in keras.tree.flatten(x) if t is not None)
    if keras.backend.backend() != "tensorflow":
        return keras.ops.shape(first)[0]
    import tensorflow as tf

    return tf.shape(first)[0]


def training_call(model, x):
    """`model(x)` in training mode, as Keras's `train_step` calls it."""
    if keras_internals.call_has_training_arg(model):
        return model(x, training=True)
    return model(x)


def scaled_training_loss(model, x, y, y_pred, sample_weight):
    """The step's loss, tracked for the logs, scaled for the optimizer
    (as Keras's TensorFlow `train_step` computes it)."""
    loss = keras_internals.compute_loss(model, x, y, y_pred, sample_weight)
    keras_internals.loss_tracker(model).update_state(
        loss * replicas.replica_count(), sample_weight=examples(x)
    )
    if model.optimizer is None:
        return loss
    return model.optimizer.scale_loss(loss)


def apply_gradients(optimizer, grads, variables):
    """`optimizer.apply_gradients`, an overflow on any replica seen by all."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # It would look at replica 0's gradients only.
        grads = replicas.overflow_on_every_replica(grads)
    optimizer.apply_gradients(zip(grads, variables))


def keras_train_step(model, data):
    """Keras's TensorFlow `train_step`, with the overflow mend."""
    import tensorflow as tf

    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    variables = model.trainable_weights
    with tf.GradientTape() as tape:
        y_pred = training_call(model, x)
        loss = scaled_training_loss(model, x, y, y_pred, sample_weight)
    if variables:
        apply_gradients(
            model.optimizer, tape.gradient(loss, variables), variables
        )
    else:
        warnings.warn(
            "The model does not have any trainable weights.", stacklevel=2
        )
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def reduce_logs(logs, strategy):
    """The logs of one replica-run step as plain tensors (replica mean)."""
    import tensorflow as tf

    if strategy.num_replicas_in_sync == 1:
        return logs
    tpu = isinstance(strategy, tf.distribute.TPUStrategy)

    def reduce(value):
        if not isinstance(value, tf.distribute.DistributedValues):
            if isinstance(
                strategy, tf.distribute.MultiWorkerMirroredStrategy
            ) and isinstance(value, tf.Tensor):
                return strategy.reduce("MEAN", value, axis=None)
            return value
        if tpu:
            return strategy.experimental_local_results(value)[0]
        if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return strategy.reduce("MEAN", value, axis=None)
        return tf.reduce_mean(strategy.experimental_local_results(value), 0)

    return keras.tree.map_structure(reduce, logs)
