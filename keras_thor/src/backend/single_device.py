"""Whether an optimizer step runs on TensorFlow without tf.distribute."""

import keras


def tensorflow_without_strategy():
    """True on TensorFlow outside any `tf.distribute` strategy.

    There, Keras's per-variable `distribution.extended.update` is a plain
    call, and an optimizer may update all its variables at once.
    """
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return not tf.distribute.has_strategy()
