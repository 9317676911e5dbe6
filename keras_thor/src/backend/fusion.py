"""Compiling a pure per-variable update into one kernel where possible."""

import functools

import keras
from keras import ops

# Devices for which TensorFlow ships an XLA JIT compiler.
_XLA_DEVICE_TYPES = {"CPU", "GPU", "TPU"}
# Below this many elements a compiled launch costs more than it saves.
MIN_FUSED_SIZE = 1 << 16


def _tensorflow_can_compile():
    import tensorflow as tf

    devices = tf.config.list_logical_devices()
    return all(device.device_type in _XLA_DEVICE_TYPES for device in devices)


def _read_keras_variable(value):
    if isinstance(value, keras.Variable):
        return ops.convert_to_tensor(value)
    return value


def _size(tensors):
    size = 0
    for tensor in keras.tree.flatten(tensors):
        elements = 1
        for dimension in tensor.shape:
            elements *= dimension
        size += elements
    return size


def fused(fn):
    """Returns `fn` compiled as one XLA computation on TensorFlow.

    Keras runs TensorFlow train steps without XLA on CPU by default, and an
    optimizer update written with `keras.ops` is then a chain of separate
    elementwise kernels, each a full pass over the variable's memory. One
    compiled computation makes it a single pass; it is compiled once per
    variable shape and dtype, the first time the train step runs. Variables
    (the first argument, all of it when it is a list) smaller than
    `MIN_FUSED_SIZE` elements run
    uncompiled: there, launching a compiled computation costs more than
    the passes it saves. Inside a
    train step that is compiled already (`jit_compile=True`) it is inlined.

    `fn` must be pure: tensors (or variables, which are read) in, tensors
    out, no assignments; other arguments (Python numbers, bools) are
    constants of the compiled computation. JAX already compiles the whole
    train step, torch runs `fn` as it is, and so does TensorFlow on devices
    without an XLA compiler (pluggable devices).
    """
    compiled = None

    @functools.wraps(fn)
    def call(*args):
        nonlocal compiled
        if keras.backend.backend() != "tensorflow":
            return fn(*keras.tree.map_structure(_read_keras_variable, args))
        import tensorflow as tf

        if compiled is None:
            compiled = (
                tf.function(fn, jit_compile=True, autograph=False)
                if _tensorflow_can_compile()
                else fn
            )

        if _size(args[0]) < MIN_FUSED_SIZE:
            return fn(*keras.tree.map_structure(_read_keras_variable, args))

        # Variables are read here: passed as such, the traced computation
        # would capture the first ones it saw instead of taking arguments.
        def read(value):
            if isinstance(value, keras.Variable):
                value = value.value
            if isinstance(value, tf.Variable):
                return tf.convert_to_tensor(value)
            return value

        return compiled(*keras.tree.map_structure(read, args))

    return call
