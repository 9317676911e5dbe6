"""MultiWorkerMirroredStrategy facts the model classes need (TensorFlow)."""


def in_multi_worker_mode(strategy):
    """Whether `strategy` is a MultiWorkerMirroredStrategy across workers."""
    import tensorflow as tf

    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.extended._in_multi_worker_mode()
    )


def local_value(strategy, value):
    """This worker's first local value of a distributed `value`."""
    import tensorflow as tf

    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value
