"""Compiling a pure per-variable update into one kernel where possible."""

import functools

import keras


def fused(fn):
    """Returns `fn` compiled as one XLA computation on TensorFlow.

    Keras runs TensorFlow train steps without XLA on CPU by default, and an
    optimizer update written with `keras.ops` is then a chain of separate
    elementwise kernels, each a full pass over the variable's memory. One
    compiled computation makes it a single pass. `fn` must be pure: tensors
    (or variables, which are read) in, tensors out, no assignments. JAX
    already compiles the whole train step and torch runs `fn` as it is.
    """
    compiled = None

    @functools.wraps(fn)
    def call(*args):
        nonlocal compiled
        if keras.backend.backend() != "tensorflow":
            return fn(*args)
        import tensorflow as tf

        if compiled is None:
            compiled = tf.function(fn, jit_compile=True, autograph=False)
        # Variables are read here: passed as such, the traced computation
        # would capture the first ones it saw instead of taking arguments.
        args = [
            tf.convert_to_tensor(
                a.value if isinstance(a, keras.Variable) else a
            )
            if isinstance(a, (keras.Variable, tf.Variable))
            else a
            for a in args
        ]
        return compiled(*args)

    return call
