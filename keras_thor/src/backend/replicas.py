"""Replica-aware helpers for optimizer state kept equal on every replica.

Outside `tf.distribute` (or on another backend) each helper is the plain
single-device operation.
"""

import keras


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
    """This replica's index in its sync group (0 outside a strategy)."""
    context = _replica_context()
    return 0 if context is None else context.replica_id_in_sync_group


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
    optimizer._all_reduce_sum_gradients = list
