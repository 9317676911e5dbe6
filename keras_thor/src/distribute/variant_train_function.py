"""One `model.train_function` for training steps of a few kinds (variants),
each traced on its own and chosen in Python before each step."""

import abc
import collections
import contextlib
import functools

from keras_thor.src import keras_internals
from keras_thor.src.distribute.replicas import batch_value
from keras_thor.src.distribute.replicas import per_replica_rows
from keras_thor.src.distribute.train_step import reduce_logs

# One variant's functions: `traced` (one step on a batch, the `tf.function`
# tests read), `step` (the same, taking Keras's optional batches),
# `on_iterator` (one step that fetches its batch), `on_optional` (one step
# on a batch fetched as a `tf.experimental.Optional`) and `more_steps` (a
# fused run of steps).
_Variant = collections.namedtuple(
    "_Variant", ["traced", "step", "on_iterator", "on_optional", "more_steps"]
)


class VariantHooks(abc.ABC):
    """What a train function of step variants asks its subclass (the
    hooks), whatever the backend's plumbing.

    A subclass names the variant of each step (`variant_at(step)`, a
    hashable key), gives its per-replica step (`variant_step(key)`) and
    reads the step count (`read_step()`).
    """

    def __init__(self, model):
        self.model = model
        self._variants = {}
        self._step = None

    @abc.abstractmethod
    def read_step(self):
        """The optimizer's count of the steps run so far."""

    @abc.abstractmethod
    def variant_at(self, step):
        """The key of the variant step `step` (0-based) runs."""

    @abc.abstractmethod
    def variant_step(self, key):
        """The per-replica step `data -> logs` of variant `key`, untraced."""

    def fuses(self, key):
        """Whether consecutive steps of variant `key` run as one loop."""
        return True

    def recounts(self):
        """Whether to read the step count before every step (when the
        optimizer may skip steps)."""
        return False

    def wants_batch(self):
        """Whether the next step's batch should be fetched on the host and
        handed to `call_variant` (instead of an iterator), e.g. to read its
        size once."""
        return False

    def steps_covered_from(self, step):
        """How many steps from `step` on may run (per-step arrays)."""
        return float("inf")

    def check_covers(self, steps):
        """Raises a `ValueError` if the first `steps` steps cannot run
        (by default every step can)."""
        return None

    def call_variant(self, key, function, argument):
        """Runs one step of variant `key`, `function(argument)` (a batch, a
        `tf.experimental.Optional` batch or an iterator); a subclass watches
        steps here."""
        return function(argument)

    def resync(self):
        """Reads the step count from the optimizer before the next step."""
        self._step = None


class VariantTrainFunction(VariantHooks):
    """`model.train_function` whose every step runs one of a few variants.

    A subclass names the variant of each step (`variant_at(step)`, a
    hashable key), gives its per-replica step (`variant_step(key)`) and
    reads the step count (`read_step()`). Each variant is traced once, as
    its own `tf.function`s (`traced_variant(key)`), so TensorFlow counts
    neither their first traces nor their calls together.

    Each call runs `model.steps_per_execution` steps (fewer at the end of
    the data), as Keras's own train function does: consecutive steps of a
    variant that `fuses` run as one compiled loop, other steps alone. A
    list of batches (Keras's `train_on_batch`) runs one step per batch.
    With one step per execution and `fetches_in_step`, the traced call
    fetches its batch itself, as Keras's own does (unless the subclass
    `wants_batch`).

    The step count is read with `read_step()` at the start of each `fit`
    (`resync`), after a fused run or an end of data, and before every step
    while `recounts()`; otherwise it is counted in Python.
    """

    # Whether a one-step execution fetches its batch inside the traced call
    # (saves a host round trip a step). At the end of the data TensorFlow
    # still runs that call's updates that do not wait for the batch, the
    # step counters' among them (as in Keras 3.15's own train function).
    fetches_in_step = False

    def traced_variant(self, key):
        """The `tf.function` of one step of variant `key` on a batch (the
        untraced function under `run_eagerly`), for reading its graphs."""
        return self._variant(key).traced

    def state_values(self):
        """A context for host reads of the optimizer's variables (they hold
        their values on TensorFlow: nothing to do)."""
        return contextlib.nullcontext()

    def batch_rows(self, data):
        """The per-replica size of the batch `data` (`None` for an
        iterator)."""
        return per_replica_rows(
            self.model.distribute_strategy, batch_value(data)
        )

    def __call__(self, iterator):
        import tensorflow as tf

        if not isinstance(
            iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)
        ):
            return self._run_on_batches(iterator)
        if (
            self.fetches_in_step
            and self.model.steps_per_execution == 1
            and not self.wants_batch()
        ):
            return self._run_one(iterator)
        return self._run_steps(iterator)

    def _current_step(self):
        if self._step is None or self.recounts():
            self._step = self.read_step()
        return self._step

    def _run_one(self, iterator):
        """One step that fetches its own batch (end of data: OutOfRange)."""
        import tensorflow as tf

        step = self._current_step()
        if self.steps_covered_from(step) < 1:
            # Only an error if there is data left to train on.
            if not iterator.get_next_as_optional().has_value():
                raise tf.errors.OutOfRangeError(None, None, "End of data.")
            self.check_covers(step + 1)
        key = self.variant_at(step)
        try:
            logs = self.call_variant(
                key, self._variant(key).on_iterator, iterator
            )
        except tf.errors.OutOfRangeError:
            # The step count may have moved (see `fetches_in_step`).
            self.resync()
            raise
        self._step = step + 1
        return logs

    def _run_steps(self, iterator):
        import tensorflow as tf

        logs = None
        remaining = self.model.steps_per_execution
        while remaining > 0:
            batch = iterator.get_next_as_optional()
            if not batch.has_value():
                break
            step = self._current_step()
            self.check_covers(step + 1)
            key = self.variant_at(step)
            variant = self._variant(key)
            count = self._run_length(step, key, remaining)
            # The optional, not its value: its value's shapes are those the
            # iterator's own fetches give (a batch dimension of `None`), so
            # the step is traced once for both.
            logs = self.call_variant(key, variant.on_optional, batch)
            self._step = step + 1
            if count > 1:
                logs = variant.more_steps(
                    iterator, tf.constant(count - 1), logs
                )
                # It stops short at the end of the data: read the count.
                self.resync()
            remaining -= count
        if logs is None:
            raise tf.errors.OutOfRangeError(None, None, "End of data.")
        return logs

    def _run_length(self, step, key, remaining):
        """How many steps from `step` (of variant `key`) run as one: at
        most `remaining`, all of variant `key`, within the per-step arrays."""
        if self.model.run_eagerly or not self.fuses(key):
            return 1
        limit = min(remaining, self.steps_covered_from(step))
        count = 1
        while count < limit and self.variant_at(step + count) == key:
            count += 1
        return count

    def _run_on_batches(self, batches):
        import tensorflow as tf

        logs = None
        for _, data in zip(range(self.model.steps_per_execution), batches):
            step = self._current_step()
            # `data` exists, so the step needs its per-step values.
            self.check_covers(step + 1)
            key = self.variant_at(step)
            logs = self.call_variant(key, self._variant(key).step, data)
            self._step = step + 1
        if logs is None:
            raise tf.errors.OutOfRangeError(None, None, "End of data.")
        return logs

    def _variant(self, key):
        if key not in self._variants:
            self._variants[key] = self._trace(self.variant_step(key))
        return self._variants[key]

    def _trace(self, per_replica_step):
        model = self.model

        def one_step(data):
            strategy = model.distribute_strategy
            logs = strategy.run(per_replica_step, args=(data,))
            return reduce_logs(logs, strategy)

        traced = self._compile(one_step, "variant_step", model.jit_compile)
        step = keras_internals.autoconvert_optionals(model, traced)
        return _Variant(
            traced=traced,
            step=step,
            on_iterator=self._compile(
                lambda iterator: step(iterator.get_next()),
                "variant_step_on_iterator",
            ),
            on_optional=self._compile(
                lambda optional: step(optional.get_value()),
                "variant_step_on_optional",
            ),
            more_steps=self._compile(
                functools.partial(_more_steps, step), "variant_more_steps"
            ),
        )

    def _compile(self, function, name, jit=False):
        import tensorflow as tf

        if self.model.run_eagerly:
            return function
        # TensorFlow counts the traces of all functions with one code
        # object together and warns of "retracing" after five: every
        # variant's first trace would count. A `partial` has no code
        # object, so each variant's traces count on their own.
        own = functools.partial(function)
        own.__name__ = name
        return tf.function(
            own, reduce_retracing=True, jit_compile=jit, autograph=False
        )


def _more_steps(step, iterator, steps, logs):
    """`steps` more calls of `step` after one that returned `logs`, as one
    `tf.while_loop`.

    Stops early when the data runs out (as Keras's own loop does); returns
    the logs of the last step run.
    """
    import tensorflow as tf

    def more(count, logs, batch):
        return tf.logical_and(count < steps, batch.has_value())

    def body(count, logs, batch):
        logs = step(batch.get_value())
        batch = tf.cond(
            count + 1 < steps, iterator.get_next_as_optional, lambda: batch
        )
        return count + 1, logs, batch

    _, logs, _ = tf.while_loop(
        more, body, (tf.constant(0), logs, iterator.get_next_as_optional())
    )
    return logs
