"""Snapshots of variables' values inside a training step."""

from keras import ops


def snapshot(variables):
    """The variables' values now (copies: later assignments leave them)."""
    return [ops.copy(ops.convert_to_tensor(v)) for v in variables]
