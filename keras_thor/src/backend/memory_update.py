"""Reading and writing one row of an optimizer variable, in place."""

import keras
from keras import ops


def read_row(variable, index):
    """Returns `variable[index]` for a scalar integer tensor `index`.

    On TensorFlow this gathers the one row from the resource, without
    reading the whole variable: an outstanding full read would make the
    following in-place `assign_row` copy the whole buffer first.
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if isinstance(variable, keras.Variable):
            variable = variable.value
        return tf.gather(variable, index)
    return ops.take(variable, index, axis=0)


def assign_row(optimizer, variable, index, value):
    """Sets `variable[index] = value` for a scalar integer tensor `index`.

    On TensorFlow this is an in-place scatter of the one row (the optimizer's
    `assign` turns `tf.IndexedSlices` into `scatter_update`), so a ring
    buffer of `n` rows costs one row per step instead of `n`. Other backends
    write the whole variable back.
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        row = tf.IndexedSlices(
            values=ops.expand_dims(value, 0),
            indices=ops.reshape(ops.cast(index, "int64"), (1,)),
        )
        optimizer.assign(variable, row)
        return
    # One integer dtype for every start index (JAX insists, also with x64).
    start = [ops.cast(index, "int32")] + [ops.zeros((), "int32")] * len(
        value.shape
    )
    rows = ops.convert_to_tensor(variable)
    optimizer.assign(
        variable, ops.slice_update(rows, start, ops.expand_dims(value, 0))
    )
