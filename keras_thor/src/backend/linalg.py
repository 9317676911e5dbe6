"""Linear algebra that reports failure as values instead of errors, and
runs on JAX's CPU without jaxlib 0.10.2's LAPACK deadlock."""

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


def map_matrices(function, matrices):
    """`function` applied to a stack of matrices `(n, s, s)`, as one batched
    call; on JAX's CPU one matrix at a time (`jax.lax.map`, `function`
    receiving each as a stack of one).

    jaxlib 0.10.2's CPU LAPACK kernels (`potrf`, `trsm`) split a batched
    call over XLA's intra-op thread pool and block a pool thread until the
    pieces are done: two batched calls running at once (two layers'
    inversions in one step, or every device's copy of them under
    `keras.distribution.DataParallel` on host devices) can each wait
    forever for the thread the other holds on a 2-core machine. A call on
    one matrix runs inline and cannot (about 10-20% slower than a batched
    call on this CPU, docs/benchmarks.md).
    """
    if keras.backend.backend() != "jax" or matrices.shape[0] == 1:
        return function(matrices)
    import jax

    if jax.default_backend() != "cpu":
        return function(matrices)

    return jax.lax.map(lambda matrix: function(matrix[None])[0], matrices)
