"""Keras's training and test steps, mended for tf.distribute.

Keras 3.15 goes wrong in three places that keras_thor's model classes put
right for every optimizer (see docs/distributed.md):

- under `MultiWorkerMirroredStrategy`, `fit` and `evaluate` reduce the
  first distributed batch eagerly (`_maybe_symbolic_build`), which fails;
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
        strategy = self.distribute_strategy
        if iterator is not None and in_multi_worker_mode(strategy):
            # Keras reduces the first batch across workers only to learn
            # its structure and shapes: one worker's batch does that.
            for _, _, batches in iterator:
                data_batch = keras.tree.map_structure(
                    lambda value: local_value(strategy, value), next(batches)
                )
                break
            iterator = None
        super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def train_step(self, *args):
        if keras.backend.backend() != "tensorflow":
            return super().train_step(*args)
        logs = keras_train_step(self, *args)
        if in_multi_worker_mode(self.distribute_strategy):
            return _with_replica_axis(logs)
        return logs

    def test_step(self, *args):
        logs = super().test_step(*args)
        if keras.backend.backend() != "tensorflow":
            return logs
        if in_multi_worker_mode(self.distribute_strategy):
            return _with_replica_axis(logs)
        return logs


def has_own_train_step(model):
    """Whether `model`'s class overrides keras_thor's `train_step`."""
    return type(model).train_step is not DistributedTrainer.train_step
