"""Linear algebra that reports failure as values instead of errors."""

import keras
from keras import ops


def cholesky(matrices):
    """Lower Cholesky factors; NaNs where a matrix is not positive definite.

    `keras.ops.cholesky` raises on a failed factorization on TensorFlow
    (it checks the result for NaNs) and on JAX when run eagerly; THOR needs
    the NaNs, to fall back to a more damped inverse inside a compiled step
    (or an eager one) instead of stopping training.
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.linalg.cholesky(matrices)
    if backend == "jax":
        import jax.numpy as jnp

        return jnp.linalg.cholesky(matrices)
    return ops.cholesky(matrices)
