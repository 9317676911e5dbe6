"""Keras's training and test steps, mended for tf.distribute.

Keras 3.15 goes wrong in three places that keras_thor's model classes (and
converted models) put right for every optimizer (see docs/distributed.md):

- under a strategy, `fit` and `evaluate` average the first distributed
  batch eagerly (`_maybe_symbolic_build`), which fails under
  `MultiWorkerMirroredStrategy` and for boolean inputs;
- there they also reduce every scalar log along axis 0, which fails
  (`reduce_per_replica`): the steps give their logs a replica axis;
- a `LossScaleOptimizer` under MirroredStrategy decides from replica 0's
  gradients whether a step overflowed: an overflow on another replica
  alone reaches the weights. The training step makes every replica's
  gradients non-finite when one replica's are.
"""

import keras

from keras_thor.src.distribute.strategies import in_multi_worker_mode
from keras_thor.src.distribute.strategies import local_value
from keras_thor.src.distribute.strategies import spans_local_devices
from keras_thor.src.distribute.train_step import keras_train_step


def check_jit_under_strategy(model):
    """Raises for `jit_compile=True` across several local devices.

    Keras 3.15 puts `strategy.run` inside the XLA function, which fails
    when the replicas live on several devices of one worker ("Trying to
    access resource ... located in device CPU:1"); its `"auto"` turns XLA
    off under a strategy. Compiling each replica's forward and backward
    pass alone was slower on CPU (docs/distributed.md), so keras_thor does
    not offer it. Prediction is not refused (Keras's works).
    """
    if keras.backend.backend() != "tensorflow" or not model.jit_compile:
        return
    strategy = model.distribute_strategy
    if spans_local_devices(strategy):
        raise ValueError(
            "`jit_compile=True` does not work under a tf.distribute "
            f"strategy over {len(strategy.extended.worker_devices)} local "
            "devices in Keras 3.15 (one XLA computation cannot reach the "
            "other devices' variables). Compile with `jit_compile=False` "
            "or `'auto'` (which turns XLA off under a strategy). "
            "Received: jit_compile=True"
        )


def _with_replica_axis(logs):
    # Keras reduces each log along axis 0 across the workers.
    return keras.tree.map_structure(
        lambda value: keras.ops.expand_dims(value, 0), logs
    )


def mended_symbolic_build(model, keras_build, iterator=None, data_batch=None):
    """Keras's `_maybe_symbolic_build` (`keras_build`), from one replica's
    first batch under a strategy of several replicas.

    Keras averages the first distributed batch across the replicas only to
    learn its structure and shapes, which fails across workers and for
    boolean inputs (a keras-hub padding mask): one replica's batch does
    that.
    """
    strategy = model.distribute_strategy
    replicas = getattr(strategy, "num_replicas_in_sync", 1)
    if iterator is not None and (
        replicas > 1 or in_multi_worker_mode(strategy)
    ):
        for _, _, batches in iterator:
            data_batch = keras.tree.map_structure(
                lambda value: local_value(strategy, value), next(batches)
            )
            break
        iterator = None
    keras_build(iterator=iterator, data_batch=data_batch)


def mended_train_step(model, keras_step, *args):
    """Keras's training step, mended for tf.distribute on TensorFlow
    (`keras_step` elsewhere)."""
    if keras.backend.backend() != "tensorflow":
        return keras_step(*args)
    logs = keras_train_step(model, *args)
    if in_multi_worker_mode(model.distribute_strategy):
        return _with_replica_axis(logs)
    return logs


def mended_test_step(model, keras_step, *args):
    """`keras_step` (Keras's test step), its logs with a replica axis
    under MultiWorkerMirroredStrategy."""
    logs = keras_step(*args)
    if keras.backend.backend() != "tensorflow":
        return logs
    if in_multi_worker_mode(model.distribute_strategy):
        return _with_replica_axis(logs)
    return logs


class DistributedTrainer:
    """Mixin: Keras's TensorFlow steps, correct under tf.distribute.

    The training step is Keras's (`train_step` of the TensorFlow trainer),
    except that under a strategy with a `LossScaleOptimizer` an overflow on
    any replica is seen by all; under MultiWorkerMirroredStrategy `fit`,
    `evaluate` and `validation_data` work (Keras 3.15's fail there); and
    training or evaluating with `jit_compile=True` across several local
    devices is a clear error (Keras's fails obscurely).
    """

    def make_train_function(self, force=False):
        check_jit_under_strategy(self)
        return super().make_train_function(force=force)

    def make_test_function(self, force=False):
        check_jit_under_strategy(self)
        return super().make_test_function(force=force)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        mended_symbolic_build(
            self, super()._maybe_symbolic_build, iterator, data_batch
        )

    def train_step(self, *args):
        return mended_train_step(self, super().train_step, *args)

    def test_step(self, *args):
        return mended_test_step(self, super().test_step, *args)


def has_own_train_step(model):
    """Whether `model`'s class overrides the training step of Keras's
    backend trainer (or of keras_thor's model classes)."""
    step = type(model).train_step
    return step not in (DistributedTrainer.train_step, keras.Model.train_step)
