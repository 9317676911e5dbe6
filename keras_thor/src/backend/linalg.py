"""Linear algebra that reports failure as values instead of errors."""

import keras
from keras import ops


def cholesky(matrices):
    """Lower Cholesky factors; NaNs where a matrix is not positive definite.

    `keras.ops.cholesky` on TensorFlow raises on a failed factorization (it
    checks the result for NaNs); THOR needs the NaNs, to fall back to a more
    damped inverse inside a compiled step instead of stopping training.
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.linalg.cholesky(matrices)
    return ops.cholesky(matrices)
