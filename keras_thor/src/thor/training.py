"""THOR's training step and its traced train functions (TensorFlow).

MindSpore compiles two graphs for THOR: one that captures the curvature
statistics and refreshes the inverses, one that only preconditions with the
stored inverses. Here they are `tf.function`s, chosen in Python before
each step from the optimizer's step counter, so a step that does not refresh
never computes a statistic, and no collective sits inside a `tf.cond` (which
breaks under tf.distribute). With `THOR(statistics_frequency=...)` a third
one gathers statistics without inverting.
"""

import keras
from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.backend.dense import dense
from keras_thor.src.distribute import replicas
from keras_thor.src.distribute.train_step import apply_gradients
from keras_thor.src.distribute.train_step import examples as batch_examples
from keras_thor.src.distribute.train_step import keras_train_step
from keras_thor.src.distribute.train_step import scaled_training_loss
from keras_thor.src.distribute.train_step import training_call
from keras_thor.src.thor import capture
from keras_thor.src.thor.optimizer import THOR
from keras_thor.src.thor.sampled_fisher import fisher_loss_kind
from keras_thor.src.thor.sampled_fisher import sampled_loss
from keras_thor.src.thor.sampled_fisher import sampled_targets


def thor_optimizer_of(optimizer):
    """The `THOR` inside `optimizer` (unwrapping a `LossScaleOptimizer`)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer if isinstance(optimizer, THOR) else None


def _first_examples(tensors, count):
    """The first `count` examples of every tensor in `tensors`."""
    return keras.tree.map_structure(lambda tensor: tensor[:count], tensors)


def curvature_statistics(thor, calls, output_grads, sample_scale):
    """THOR's factors `{kernel index: (A, G, c)}` over the global batch.

    `sample_scale` turns a gradient of the (scaled, replica-shared) mean
    loss into a per-sample gradient. Sums are all-reduced across replicas,
    one collective per bucket of `thor.block_buckets()`, then divided
    by the global row count. Several calls of one layer pool their rows.
    With `statistics_rows`, each call keeps its first examples only.
    """
    sums = {}
    for call, output_grad in zip(calls, output_grads):
        if output_grad is None:
            continue
        index = thor.variable_index(call.block.kernel)
        if index is None:
            continue
        inputs = call.inputs
        sample_grads = ops.cast(output_grad, "float32") * sample_scale
        if thor.statistics_rows is not None:
            inputs, sample_grads = _first_examples(
                (inputs, sample_grads), thor.statistics_rows
            )
        a_sum, g_sum, rows, factor_scale = call.block.statistics(
            inputs, sample_grads
        )
        if index in sums:
            previous = sums[index]
            a_sum, g_sum = a_sum + previous[0], g_sum + previous[1]
            rows = rows + previous[2]
        sums[index] = (a_sum, g_sum, rows, factor_scale)

    statistics = {}
    for bucket in thor.block_buckets():
        present = [index for index in bucket if index in sums]
        if not present:
            continue
        flat = replicas.all_reduce_sum(
            [tensor for index in present for tensor in sums[index][:3]]
        )
        for position, index in enumerate(present):
            a_sum, g_sum, rows = flat[3 * position : 3 * position + 3]
            statistics[index] = (a_sum / rows, g_sum / rows, sums[index][3])
    return statistics


def _factored_calls(thor, calls):
    """`{kernel index: [call positions]}` of the factored-order kernels."""
    factored = {}
    for position, call in enumerate(calls):
        index = thor.variable_index(call.block.kernel)
        if index in thor.factored_kernels:
            factored.setdefault(index, []).append(position)
    return factored


def _gradients(thor, variables, calls, factored, scaled_loss, tape, refresh):
    """One backward pass: `(grads, output_grads)`.

    `grads[i]` is `variables[i]`'s gradient, `None` for factored-order
    kernels (the tape never computes it); `output_grads[p]` the gradient at
    `calls[p]`'s outputs where needed (every call if `refresh`, the
    factored-order calls otherwise), else `None`.
    """
    blocks = thor.curvature_blocks
    skipped = {id(blocks[index].kernel) for index in factored}
    factored_positions = {
        p for positions in factored.values() for p in positions
    }
    needed = [
        p for p in range(len(calls)) if refresh or p in factored_positions
    ]
    plain = [v for v in variables if id(v) not in skipped]
    gradients = tape.gradient(
        scaled_loss, plain + [calls[p].outputs for p in needed]
    )
    output_grads = [None] * len(calls)
    for position, grad in zip(needed, gradients[len(plain) :]):
        output_grads[position] = grad
    plain_grads = iter(gradients[: len(plain)])
    grads = [None if id(v) in skipped else next(plain_grads) for v in variables]
    return grads, output_grads


def _add_factored_gradients(
    thor, variables, grads, calls, factored, output_grads
):
    """Fills in `A⁻¹ · g · G⁻¹` of the factored-order kernels (summed over
    their calls), from the stored inverses."""
    for position, variable in enumerate(variables):
        index = thor.variable_index(variable)
        if index not in factored:
            continue
        parts = [
            thor.factored_gradient(index, calls[p].inputs, output_grads[p])
            for p in factored[index]
            if output_grads[p] is not None
        ]
        if parts:
            total = sum(parts[1:], parts[0])
            grads[position] = ops.cast(total, variable.dtype)
    return grads


def _sampled_fisher_loss(model, thor, y_pred):
    """The loss at targets drawn from the model's predictive distribution,
    scaled as the training loss is (`sampled_fisher`)."""
    import tensorflow as tf

    kind, from_logits = fisher_loss_kind(model.loss)
    seed = tf.stack(
        [
            ops.cast(thor.iterations, "int64"),
            ops.cast(replicas.replica_id(), "int64"),
        ]
    )
    targets = sampled_targets(kind, from_logits, y_pred, seed)
    loss = sampled_loss(kind, from_logits, targets, y_pred)
    return model.optimizer.scale_loss(loss / replicas.replica_count())


def _guarded_gradients(model, thor, variables, grads):
    """The kernels' gradients replaced by their guarded directions `ν·d`.

    `d` comes from the global gradient (summed across replicas here, one
    collective), so `ν` is the same on every replica; each replica then
    passes `ν·d / replicas`, in the loss's scale, which the optimizer sums
    and unscales as it does gradients.
    """
    guarded = thor.preconditioned_in_step
    positions = []
    for position, variable in enumerate(variables):
        index = thor.variable_index(variable)
        if index in guarded and grads[position] is not None:
            positions.append((position, index))
    if not positions:
        return grads
    raw = [ops.cast(dense(grads[p]), "float32") for p, _ in positions]
    count = replicas.replica_count()
    if count > 1:
        raw = replicas.all_reduce_sum(raw)
    loss_scale = ops.cast(model.optimizer.scale_loss(1.0), "float32")
    unscaled = [g / loss_scale for g in raw]
    directions = thor.guard(
        [
            thor.precondition_kernel(index, g)
            for g, (_, index) in zip(unscaled, positions)
        ],
        unscaled,
    )
    grads = list(grads)
    for (position, _), direction in zip(positions, directions):
        grads[position] = ops.cast(
            direction * (loss_scale / count), variables[position].dtype
        )
    return grads


def train_step(model, data, statistics, invert):
    """One training step; it gathers curvature statistics if `statistics`
    and then refreshes the inverses if `invert`.

    As Keras's TensorFlow `train_step`, plus: layers with curvature blocks
    record their calls, the loss is differentiated with respect to their
    outputs too (statistics steps, and Dense layers preconditioned in the
    factored order; with `fisher="sampled"`, a second loss at sampled
    targets gives the statistics), the factors go to the optimizer before
    `apply_gradients`, and with `kl_clip` the kernels' directions are
    guarded here. The logs carry `THOR.training_logs()`. Under a strategy, a
    `LossScaleOptimizer` sees an overflow on any replica (Keras's looks at
    replica 0's gradients).
    """
    import tensorflow as tf

    thor = thor_optimizer_of(model.optimizer)
    if thor is None:
        return keras_train_step(model, data)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    variables = model.trainable_weights
    if not thor.built:
        # The layers' curvature rules need the layers built: this builds
        # the model, then the optimizer (a `LossScaleOptimizer` too).
        keras_internals.symbolic_build(model, data)
        variables = model.trainable_weights
    blocks = thor.curvature_blocks
    recorded = (
        blocks if statistics else {i: blocks[i] for i in thor.factored_kernels}
    )
    sampled = statistics and thor.fisher == "sampled"
    with capture.thor_training_step():
        with tf.GradientTape(persistent=sampled) as tape:
            with capture.capture_calls(recorded.values()) as calls:
                y_pred = training_call(model, x)
            scaled_loss = scaled_training_loss(
                model, x, y, y_pred, sample_weight
            )
            if sampled:
                fisher_loss = _sampled_fisher_loss(model, thor, y_pred)
        factored = _factored_calls(thor, calls)
        grads, output_grads = _gradients(
            thor,
            variables,
            calls,
            factored,
            scaled_loss,
            tape,
            statistics and not sampled,
        )
        statistics_grads = output_grads
        if sampled:
            statistics_grads = tape.gradient(
                fisher_loss, [call.outputs for call in calls]
            )
            del tape
        if statistics:
            loss_scale = ops.cast(model.optimizer.scale_loss(1.0), "float32")
            examples = batch_examples(x) * replicas.replica_count()
            sample_scale = ops.cast(examples, "float32") / loss_scale
            thor.refresh_curvature(
                curvature_statistics(
                    thor, calls, statistics_grads, sample_scale
                ),
                invert=invert,
            )
        # After the refresh: the factored products read the new inverses.
        grads = _add_factored_gradients(
            thor, variables, grads, calls, factored, output_grads
        )
        if thor.kl_clip is not None:
            grads = _guarded_gradients(model, thor, variables, grads)
        apply_gradients(model.optimizer, grads, variables)
    logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    return {**logs, **thor.training_logs()}
