"""Facts about the current tf.distribute strategy (TensorFlow)."""

from keras_thor.src import keras_internals


def in_multi_worker_mode(strategy):
    """Whether `strategy` is a MultiWorkerMirroredStrategy across workers."""
    import tensorflow as tf

    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and keras_internals.in_multi_worker_mode(strategy)


def local_value(strategy, value):
    """This worker's first local value of a distributed `value`."""
    import tensorflow as tf

    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


def spans_local_devices(strategy):
    """Whether `strategy` runs replicas on several devices of this worker
    (TPUs aside, which compile everything with XLA anyway)."""
    import tensorflow as tf

    if strategy.num_replicas_in_sync == 1 or isinstance(
        strategy, tf.distribute.TPUStrategy
    ):
        return False
    return len(strategy.extended.worker_devices) > 1
