"""The training step of keras_thor's boost models and its traced variants.

A step either trains every variable or, under gradient freezing, one group
(a suffix of the network); it either updates the weights or, under
gradient accumulation, only accumulates. Each combination is its own
`tf.function`, chosen in Python before the step from the optimizer's step
counter: the frozen prefix is never differentiated, and no collective sits
inside a `tf.cond` (which breaks under tf.distribute).
"""

import keras
from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.boost.snapshots import snapshot
from keras_thor.src.distribute import replicas
from keras_thor.src.distribute.train_step import scaled_training_loss
from keras_thor.src.distribute.train_step import training_call


def train_step(model, data, variables, update):
    """One step: gradients of `variables` only, handed to the
    `BoostOptimizer` (which updates them when `update`)."""
    import tensorflow as tf

    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    optimizer = model.optimizer
    # The group loss scale markers' overflow probes, one per group.
    probes = optimizer.overflow_probes()
    # Only the trained variables are watched: the frozen front's forward
    # pass is not recorded, so no backward pass reaches it.
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch([v.value for v in variables + probes])
        y_pred = training_call(model, x)
        scaled_loss = scaled_training_loss(model, x, y, y_pred, sample_weight)
    grads = tape.gradient(scaled_loss, variables + probes)
    grads, overflows = grads[: len(variables)], grads[len(variables) :]
    optimizer.boost_apply(grads, variables, update, overflows)
    logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    return {**logs, **optimizer.training_logs()}


def _restore(variables, values):
    """Puts `values` back: metrics (each replica's own) by plain
    assignment, the model's variables in one cross-replica update."""
    local = [(v, x) for v, x in zip(variables, values) if _on_read(v)]
    for variable, value in local:
        variable.assign(value)
    replicas.assign_replicated(
        (v, x) for v, x in zip(variables, values) if not _on_read(v)
    )


def _on_read(variable):
    return getattr(variable, "synchronization", None) == "on_read"


def dim_reduce_train_step(model, data, variables, components):
    """One DimReduce step: the gradient, one or two trial forward passes
    on the same batch, then the optimizer's update (`BoostOptimizer.
    dim_reduce_apply`).

    The trials run in training mode from the step's own random state
    (dropout masks) and leave the model's other variables (moving
    statistics, random state) and the metrics as the step left them.
    """
    import tensorflow as tf

    optimizer = model.optimizer
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    states = list(model.non_trainable_variables)
    states_before = snapshot(states)
    with tf.GradientTape() as tape:
        y_pred = training_call(model, x)
        loss = scaled_training_loss(model, x, y, y_pred, sample_weight)
    grads = tape.gradient(loss, variables)
    states_after = snapshot(states)
    metrics = list(model.metrics_variables)
    metrics_after = snapshot(metrics)
    grads = replicas.all_reduce_sum(
        [
            ops.zeros(v.shape, "float32")
            if g is None
            else ops.cast(ops.convert_to_tensor(g), "float32")
            for g, v in zip(grads, variables)
        ]
    )
    (loss,) = replicas.all_reduce_sum([ops.cast(loss, "float32")])
    found = optimizer.dim_reduce_direction(grads, components)
    weights = snapshot(variables)

    def trial_loss(t):
        """The batch loss at `w + t·d_n` (replica mean)."""
        tried = [
            ops.cast(w + t * d, v.dtype)
            for w, d, v in zip(weights, found["full_direction"], variables)
        ]
        _restore(variables + states, tried + states_before)
        trial_pred = training_call(model, x)
        trial = keras_internals.compute_loss(
            model, x, y, trial_pred, sample_weight
        )
        return replicas.all_reduce_sum([ops.cast(trial, "float32")])[0]

    dim_reduce = optimizer.dim_reduce
    first, second = dim_reduce.trial_steps
    first_loss = trial_loss(first)
    if not replicas.under_strategy():
        # The second trial only when the first fails (MindSpore's
        # order). Under a strategy both run: a collective or merge call
        # in a `cond` breaks under tf.distribute.
        accepted = ops.logical_and(
            loss + dim_reduce.sigma * first * found["slope"] > first_loss,
            ops.isfinite(first_loss),
        )
        second_loss = ops.cond(
            accepted, lambda: first_loss, lambda: trial_loss(second)
        )
    else:
        second_loss = trial_loss(second)
    trial_losses = [first_loss, second_loss]
    _restore(
        variables + states + metrics, weights + states_after + metrics_after
    )
    optimizer.dim_reduce_apply(
        found, components, loss, trial_losses, grads, variables
    )
    logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    return {**logs, **optimizer.training_logs()}
