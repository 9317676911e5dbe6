"""Stateless random draws from a `(2,)` integer seed (TensorFlow).

THOR's training step runs on TensorFlow only; its sampled Fisher draws
from `(step, replica)` so that a run repeats exactly and a resumed run
draws what an uninterrupted one would.
"""


def categorical(logits, seed):
    """One class index (int32) per row of `logits` `(rows, classes)`."""
    import tensorflow as tf

    return tf.random.stateless_categorical(logits, 1, seed, dtype="int32")[:, 0]


def uniform(shape, seed):
    """Floats uniform in [0, 1)."""
    import tensorflow as tf

    return tf.random.stateless_uniform(shape, seed)


def normal(shape, seed):
    """Standard normal floats."""
    import tensorflow as tf

    return tf.random.stateless_normal(shape, seed)
