"""Guards that keep non-finite gradients out of weights and state."""

from keras import ops

_LOW_PRECISION = ("float16", "bfloat16")


def is_finite(tensor):
    """A scalar boolean: `True` when every entry of `tensor` is finite.

    One reduction pass: the sum of a tensor is finite exactly when no entry
    is NaN or infinite and the sum does not overflow. Low-precision tensors
    are summed in float32, so an overflow means entries near float32's
    maximum, which no update survives anyway.
    """
    if tensor.dtype in _LOW_PRECISION:
        tensor = ops.cast(tensor, "float32")
    return ops.isfinite(ops.sum(tensor))


def if_finite(finite, updated, unchanged):
    """`updated()` when `finite`, else `unchanged()`, without side effects.

    Both callables return tensors (no assignment), so this is a plain value
    `cond` on every backend and under `tf.distribute`; the caller assigns
    the result.
    """
    return ops.cond(finite, updated, unchanged)
