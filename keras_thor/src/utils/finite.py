"""Guards that keep non-finite gradients out of weights and state."""

from keras import ops


def is_finite(tensor):
    """A scalar boolean: `True` when every entry of `tensor` is finite."""
    return ops.all(ops.isfinite(tensor))


def all_finite(tensors):
    """A scalar boolean: `True` when every entry of every tensor is finite
    (`True` for no tensors)."""
    flags = [is_finite(t) for t in tensors]
    if not flags:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack(flags))


def if_finite(finite, updated, unchanged):
    """`updated()` when `finite`, else `unchanged()`, without side effects.

    Both callables return tensors (no assignment), so this is a plain value
    `cond` on every backend and under `tf.distribute`; the caller assigns
    the result.
    """
    return ops.cond(finite, updated, unchanged)
