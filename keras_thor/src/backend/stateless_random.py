"""Stateless random draws from a `(2,)` integer seed.

THOR's sampled Fisher draws from `(step, replica)`, so that a run repeats
exactly and a resumed run draws what an uninterrupted one would. Each
backend draws with its own generator (TensorFlow's stateless ops, JAX's
threefry key made from the two integers), so the draws differ between
backends, not within one.
"""

import keras


def _jax_key(seed):
    import jax
    import jax.numpy as jnp

    return jax.random.wrap_key_data(jnp.asarray(seed).astype("uint32"))


def categorical(logits, seed):
    """One class index (int32) per row of `logits` `(rows, classes)`."""
    if keras.backend.backend() == "jax":
        import jax

        drawn = jax.random.categorical(_jax_key(seed), logits, axis=-1)
        return drawn.astype("int32")
    import tensorflow as tf

    return tf.random.stateless_categorical(logits, 1, seed, dtype="int32")[:, 0]


def uniform(shape, seed):
    """Floats uniform in [0, 1)."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.random.uniform(_jax_key(seed), tuple(shape))
    import tensorflow as tf

    return tf.random.stateless_uniform(shape, seed)


def normal(shape, seed):
    """Standard normal floats."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.random.normal(_jax_key(seed), tuple(shape))
    import tensorflow as tf

    return tf.random.stateless_normal(shape, seed)
