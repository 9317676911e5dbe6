"""THOR's `model.train_function`: refresh, statistics-only and plain steps
as separate traced functions, chosen in Python before each step."""

import warnings

import keras

from keras_thor.src import keras_internals
from keras_thor.src.backend.values import numpy_value
from keras_thor.src.distribute.train_step import reduce_logs
from keras_thor.src.thor.training import thor_optimizer_of
from keras_thor.src.thor.training import train_step


class ThorTrainFunction:
    """`model.train_function` for THOR: refresh, statistics-only and plain
    steps, apart.

    Each call runs `model.steps_per_execution` steps (fewer at the end of
    the data), as Keras's own train function does; a refresh (or
    statistics) step runs alone, the plain steps between them run as one
    compiled loop.
    With one step per execution each call is one traced function that
    fetches its batch itself, as Keras's own, and the step count is kept
    in Python between calls (read back from the optimizer at the start of
    each `fit` and whenever a `LossScaleOptimizer` may skip steps).
    """

    def __init__(self, model):
        self.model = model
        self._refresh_step = self._one_step(statistics=True, invert=True)
        self._statistics_step = self._one_step(statistics=True, invert=False)
        self._plain_step = self._one_step(statistics=False, invert=False)
        self._plain_steps = self._compile(self._plain_loop, jit=False)
        self._refresh_on_iterator = self._compile(
            lambda iterator: self._refresh_step(iterator.get_next()), jit=False
        )
        self._statistics_on_iterator = self._compile(
            lambda iterator: self._statistics_step(iterator.get_next()),
            jit=False,
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
        schedule = thor.refresh_schedule
        if schedule.steps_covered_from(step) < 1:
            # Only an error if there is data left to train on.
            batch = iterator.get_next_as_optional()
            if not batch.has_value():
                raise tf.errors.OutOfRangeError(None, None, "End of data.")
            schedule.check_covers(step + 1)
        try:
            if schedule.refreshes_at(step):
                logs = self._refresh(thor, self._refresh_on_iterator, iterator)
            elif schedule.gathers_statistics_at(step):
                logs = self._refresh(
                    thor, self._statistics_on_iterator, iterator
                )
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

    def _one_step(self, statistics, invert):
        model = self.model

        def one_step(data):
            strategy = model.distribute_strategy
            logs = strategy.run(
                lambda batch: train_step(model, batch, statistics, invert),
                args=(data,),
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
                logs = self._refresh(
                    thor, self._statistics_kind(thor), batch.get_value()
                )
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
        """0 if the next step gathers statistics, else how many plain steps
        to run.

        At most `remaining`, up to the next statistics step, and no further
        than the per-step arrays reach; raises if they do not reach the
        next step.
        """
        step = int(numpy_value(thor.iterations))
        schedule = thor.refresh_schedule
        schedule.check_covers(step + 1)
        if schedule.gathers_statistics_at(step):
            return 0
        period = schedule.statistics_period
        return min(
            remaining,
            period - step % period,
            schedule.steps_covered_from(step),
        )

    def _statistics_kind(self, thor):
        """The traced step for the next statistics step: refresh or not."""
        step = int(numpy_value(thor.iterations))
        if thor.refresh_schedule.refreshes_at(step):
            return self._refresh_step
        return self._statistics_step

    def _run_on_batches(self, thor, batches):
        self.resync()
        logs = None
        for _, data in zip(range(self.model.steps_per_execution), batches):
            # `data` exists, so the step needs its per-step values.
            if thor is not None and self._next_run(thor, 1) == 0:
                logs = self._refresh(thor, self._statistics_kind(thor), data)
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
