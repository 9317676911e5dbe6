"""THOR's training step and its two traced train functions (TensorFlow).

MindSpore compiles two graphs for THOR: one that captures the curvature
statistics and refreshes the inverses, one that only preconditions with the
stored inverses. Here they are two `tf.function`s, chosen in Python before
each step from the optimizer's step counter, so a step that does not refresh
never computes a statistic, and no collective sits inside a `tf.cond` (which
breaks under tf.distribute).
"""

import warnings

import keras
from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.backend.values import numpy_value
from keras_thor.src.distribute import replicas
from keras_thor.src.distribute.train_step import apply_gradients
from keras_thor.src.distribute.train_step import examples as batch_examples
from keras_thor.src.distribute.train_step import keras_train_step
from keras_thor.src.distribute.train_step import reduce_logs
from keras_thor.src.distribute.train_step import scaled_training_loss
from keras_thor.src.distribute.train_step import training_call
from keras_thor.src.thor import capture
from keras_thor.src.thor.optimizer import THOR


def thor_optimizer_of(optimizer):
    """The `THOR` inside `optimizer` (unwrapping a `LossScaleOptimizer`)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer if isinstance(optimizer, THOR) else None


def curvature_statistics(thor, calls, output_grads, sample_scale):
    """THOR's factors `{kernel index: (A, G, c)}` over the global batch.

    `sample_scale` turns a gradient of the (scaled, replica-shared) mean
    loss into a per-sample gradient. Sums are all-reduced across replicas,
    one collective per bucket of `thor.block_buckets()`, then divided
    by the global row count. Several calls of one layer pool their rows.
    """
    sums = {}
    for call, output_grad in zip(calls, output_grads):
        if output_grad is None:
            continue
        index = thor.variable_index(call.block.kernel)
        if index is None:
            continue
        sample_grads = ops.cast(output_grad, "float32") * sample_scale
        a_sum, g_sum, rows, factor_scale = call.block.statistics(
            call.inputs, sample_grads
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
    `calls[p]`'s outputs where needed (every call on a refresh step, the
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


def train_step(model, data, refresh):
    """One training step; on `refresh` steps it also refreshes THOR.

    As Keras's TensorFlow `train_step`, plus: layers with curvature blocks
    record their calls, the loss is differentiated with respect to their
    outputs too (refresh steps, and Dense layers preconditioned in the
    factored order), and on refresh steps the factors go to the optimizer
    before
    `apply_gradients`. Under a strategy, a `LossScaleOptimizer` sees an
    overflow on any replica (Keras's looks at replica 0's gradients).
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
        blocks if refresh else {i: blocks[i] for i in thor.factored_kernels}
    )
    with capture.thor_training_step():
        with tf.GradientTape() as tape:
            with capture.capture_calls(recorded.values()) as calls:
                y_pred = training_call(model, x)
            scaled_loss = scaled_training_loss(
                model, x, y, y_pred, sample_weight
            )
        factored = _factored_calls(thor, calls)
        grads, output_grads = _gradients(
            thor, variables, calls, factored, scaled_loss, tape, refresh
        )
        if refresh:
            loss_scale = ops.cast(model.optimizer.scale_loss(1.0), "float32")
            examples = batch_examples(x) * replicas.replica_count()
            sample_scale = ops.cast(examples, "float32") / loss_scale
            thor.refresh_curvature(
                curvature_statistics(thor, calls, output_grads, sample_scale)
            )
        # After the refresh: the factored products read the new inverses.
        grads = _add_factored_gradients(
            thor, variables, grads, calls, factored, output_grads
        )
        apply_gradients(model.optimizer, grads, variables)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


class ThorTrainFunction:
    """`model.train_function` for THOR: refresh and plain steps, apart.

    Each call runs `model.steps_per_execution` steps (fewer at the end of
    the data), as Keras's own train function does; a refresh step runs
    alone, the plain steps between refreshes run as one compiled loop.
    With one step per execution each call is one traced function that
    fetches its batch itself, as Keras's own, and the step count is kept
    in Python between calls (read back from the optimizer at the start of
    each `fit` and whenever a `LossScaleOptimizer` may skip steps).
    """

    def __init__(self, model):
        self.model = model
        self._refresh_step = self._one_step(refresh=True)
        self._plain_step = self._one_step(refresh=False)
        self._plain_steps = self._compile(self._plain_loop, jit=False)
        self._refresh_on_iterator = self._compile(
            lambda iterator: self._refresh_step(iterator.get_next()), jit=False
        )
        self._plain_on_iterator = self._compile(
            lambda iterator: self._plain_step(iterator.get_next()), jit=False
        )
        self._warned = False
        self._step = None

    def resync(self):
        """Reads the step count from the optimizer before the next step."""
        self._step = None

    def _current_step(self, thor):
        if self._step is None or isinstance(
            self.model.optimizer, keras.optimizers.LossScaleOptimizer
        ):
            self._step = int(numpy_value(thor.iterations))
        return self._step

    def _single_step(self, thor, iterator):
        """One step that fetches its own batch (end of data: OutOfRange)."""
        import tensorflow as tf

        if thor is None:
            return self._plain_on_iterator(iterator)
        step = self._current_step(thor)
        if thor.steps_covered_from(step) < 1:
            # Only an error if there is data left to train on.
            batch = iterator.get_next_as_optional()
            if not batch.has_value():
                raise tf.errors.OutOfRangeError(None, None, "End of data.")
            thor.check_schedules_cover(step + 1)
        try:
            if thor.refreshes_at(step):
                logs = self._refresh(thor, self._refresh_on_iterator, iterator)
            else:
                logs = self._plain_on_iterator(iterator)
        except tf.errors.OutOfRangeError:
            # Keras 3.15's end-of-data call still counts an iteration (for
            # every optimizer): read the count back.
            self.resync()
            raise
        self._step = step + 1
        return logs

    def _compile(self, fn, jit):
        import tensorflow as tf

        if self.model.run_eagerly:
            return fn
        return tf.function(
            fn, reduce_retracing=True, jit_compile=jit, autograph=False
        )

    def _one_step(self, refresh):
        model = self.model

        def one_step(data):
            strategy = model.distribute_strategy
            logs = strategy.run(
                lambda batch: train_step(model, batch, refresh), args=(data,)
            )
            return reduce_logs(logs, strategy)

        compiled = self._compile(one_step, jit=model.jit_compile)
        return keras_internals.autoconvert_optionals(model, compiled)

    def _plain_loop(self, iterator, steps, logs):
        """`steps` more plain steps after one that returned `logs`.

        Stops early when the data runs out (as Keras's own loop does);
        returns the logs of the last step run.
        """
        import tensorflow as tf

        if self.model.run_eagerly:
            for _ in range(int(steps)):
                batch = iterator.get_next_as_optional()
                if not batch.has_value():
                    break
                logs = self._plain_step(batch.get_value())
            return logs

        def more(step, batch):
            return tf.logical_and(step < steps, batch.has_value())

        def body(step, logs, batch):
            logs = self._plain_step(batch.get_value())
            batch = tf.cond(
                step + 1 < steps,
                iterator.get_next_as_optional,
                lambda: batch,
            )
            return step + 1, logs, batch

        _, logs, _ = tf.while_loop(
            lambda step, logs, batch: more(step, batch),
            body,
            (tf.constant(0), logs, iterator.get_next_as_optional()),
        )
        return logs

    def __call__(self, iterator):
        import tensorflow as tf

        thor = thor_optimizer_of(self.model.optimizer)
        if not isinstance(
            iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)
        ):
            return self._run_on_batches(thor, iterator)
        if self.model.steps_per_execution == 1:
            return self._single_step(thor, iterator)
        self.resync()
        logs = None
        remaining = self.model.steps_per_execution
        while remaining > 0:
            batch = iterator.get_next_as_optional()
            if not batch.has_value():
                break
            count = (
                remaining if thor is None else self._next_run(thor, remaining)
            )
            if count == 0:
                data = batch.get_value()
                logs = self._refresh(thor, self._refresh_step, data)
                count = 1
            else:
                logs = self._plain_step(batch.get_value())
                if count > 1:
                    logs = self._plain_steps(
                        iterator, tf.constant(count - 1), logs
                    )
            remaining -= count
        if logs is None:
            raise tf.errors.OutOfRangeError(None, None, "End of data.")
        return logs

    def _next_run(self, thor, remaining):
        """0 if the next step refreshes, else how many plain steps to run.

        At most `remaining`, up to the next refresh, and no further than the
        per-step arrays reach; raises if they do not reach the next step.
        """
        step = int(numpy_value(thor.iterations))
        thor.check_schedules_cover(step + 1)
        if thor.refreshes_at(step):
            return 0
        return min(
            remaining,
            thor.frequency - step % thor.frequency,
            thor.steps_covered_from(step),
        )

    def _run_on_batches(self, thor, batches):
        self.resync()
        logs = None
        for _, data in zip(range(self.model.steps_per_execution), batches):
            # `data` exists, so the step needs its per-step values.
            if thor is not None and self._next_run(thor, 1) == 0:
                logs = self._refresh(thor, self._refresh_step, data)
            else:
                logs = self._plain_step(data)
        return logs

    def _refresh(self, thor, refresh_step, argument):
        before = thor.curvature_troubles
        logs = refresh_step(argument)
        troubles = thor.curvature_troubles - before
        if troubles and not self._warned:
            warnings.warn(
                f"THOR could not use the fresh curvature of {troubles} "
                "layer(s): a factor was not positive definite (inverted with "
                "more damping) or not finite (the previous inverses were "
                "kept; under mixed precision an overflowed step, which the "
                "loss scale then skips, does this). Training goes on; if it "
                "repeats without overflow, raise `damping`. This warning is "
                "shown once.",
                stacklevel=3,
            )
            self._warned = True
        return logs
