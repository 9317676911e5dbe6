"""Replica-aware helpers for optimizer state kept equal on every replica.

Outside `tf.distribute` (or on another backend) each helper is the plain
single-device operation.
"""

import keras

from keras_thor.src import keras_internals
from keras_thor.src.utils.finite import all_finite


def _replica_context():
    """The TF replica context when several replicas run, else `None`."""
    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context


def replica_count():
    """How many replicas run this step in sync (1 outside a strategy)."""
    if keras.backend.backend() != "tensorflow":
        return 1
    import tensorflow as tf

    return tf.distribute.get_strategy().num_replicas_in_sync


def under_strategy():
    """Whether a tf.distribute strategy (even of one replica) runs this
    step: its merge calls then break inside a `cond`."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return tf.distribute.has_strategy()


def all_reduce_sum(tensors):
    """The sums of `tensors` (a list) over the replicas."""
    context = _replica_context()
    if context is None or not tensors:
        return list(tensors)
    return list(context.all_reduce("SUM", list(tensors)))


def assign_replicated(assignments):
    """Assigns each `(variable, value)`, `value` equal on every replica.

    Under a strategy the assignments run in one cross-replica update, so
    any variable (whatever its `aggregation`) can be set from replica
    context, and its copies stay identical.
    """
    assignments = list(assignments)
    context = _replica_context()
    if context is None:
        for variable, value in assignments:
            variable.assign(value)
        return

    def update(strategy, values):
        for (variable, _), value in zip(assignments, values):
            strategy.extended.update(
                _tf_variable(variable),
                lambda v, x: v.assign(x),
                args=(value,),
                group=False,
            )

    context.merge_call(update, args=([value for _, value in assignments],))


def _tf_variable(variable):
    if isinstance(variable, keras.Variable):
        return variable.value
    return variable


def replica_id():
    """This replica's index in its sync group (0 outside a strategy): a
    Python int where the strategy fixes it when tracing (Mirrored,
    MultiWorkerMirrored), else a scalar tensor (TPU)."""
    context = _replica_context()
    if context is None:
        return 0
    import tensorflow as tf

    index = context.replica_id_in_sync_group
    static = tf.get_static_value(index)
    return index if static is None else int(static)


def all_gather(tensors):
    """Each tensor of every replica, stacked on a new leading axis."""
    context = _replica_context()
    if context is None:
        return [keras.ops.expand_dims(t, 0) for t in tensors]
    stacked = [keras.ops.expand_dims(t, 0) for t in tensors]
    return list(context.all_gather(stacked, axis=0))


def use_local_gradients(optimizer):
    """Makes `optimizer.apply` update each replica's copies with that
    replica's own gradients: the all-reduce of Keras's TensorFlow optimizer
    is skipped (a per-instance override of its private hook; the replicas
    run their steps in threads at once, so it is set once for good)."""
    keras_internals.skip_gradient_all_reduce(optimizer)


def finite_on_all_replicas(grads):
    """Whether every replica's `grads` (`None` entries skipped) are finite:
    a scalar boolean, equal on every replica (one scalar all-reduce)."""
    present = [_dense_values(g) for g in grads if g is not None]
    troubles = keras.ops.cast(
        keras.ops.logical_not(all_finite(present)), "float32"
    )
    return all_reduce_sum([troubles])[0] == 0


def overflow_on_every_replica(grads):
    """`grads`, made non-finite on every replica when one replica's are.

    A `keras.optimizers.LossScaleOptimizer` under a strategy decides from
    replica 0's gradients whether a step overflowed; with this, an
    overflow on any replica is seen there (and the step skipped). It
    looks at all gradients together, so a NaN in the first is enough.
    """
    if _replica_context() is None:
        return list(grads)
    poison = keras.ops.where(finite_on_all_replicas(grads), 0.0, float("nan"))
    grads = list(grads)
    first = next((i for i, g in enumerate(grads) if g is not None), None)
    if first is not None:
        grads[first] = _plus(grads[first], poison)
    return grads


def _dense_values(gradient):
    # The values of an IndexedSlices (an Embedding's TF gradient).
    return getattr(gradient, "values", gradient)


def _plus(gradient, scalar):
    import tensorflow as tf

    scalar = keras.ops.cast(scalar, gradient.dtype)
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            gradient.values + scalar, gradient.indices, gradient.dense_shape
        )
    return gradient + scalar


def batch_value(data):
    """`data`, or its value when it is a `tf.experimental.Optional`."""
    import tensorflow as tf

    if isinstance(data, tf.experimental.Optional):
        return data.get_value()
    return data


def has_distributed_values(data):
    """Whether any tensor of the batch `data` is a `tf.distribute` value
    (one part per replica)."""
    import tensorflow as tf

    return any(
        isinstance(value, tf.distribute.DistributedValues)
        for value in keras.tree.flatten(data)
    )


def per_replica_rows(strategy, data):
    """The leading dimension of the first input in the batch `data` (one
    replica's part under `strategy`), or `None` for an iterator."""
    import tensorflow as tf

    if isinstance(data, (tf.data.Iterator, tf.distribute.DistributedIterator)):
        return None
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    for value in keras.tree.flatten(x):
        if isinstance(value, tf.distribute.DistributedValues):
            value = strategy.experimental_local_results(value)[0]
        if value is None or not getattr(value, "shape", None):
            continue
        rows = value.shape[0]
        return int(rows if rows is not None else tf.shape(value)[0])
    return None
