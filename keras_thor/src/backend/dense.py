"""Dense gradients from whatever the backend hands the optimizer."""

import keras
from keras import ops


def dense(gradient):
    """`gradient` as a dense tensor.

    TensorFlow hands `tf.IndexedSlices` to the optimizer for `Embedding`
    tables (and `ops.convert_to_tensor` passes them through); the
    keras_thor update rules touch every entry, so they take the dense form.
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if isinstance(gradient, tf.IndexedSlices):
            return tf.convert_to_tensor(gradient)
    return ops.convert_to_tensor(gradient)
