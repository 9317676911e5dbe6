"""One curvature block's state, as `CurvatureEstimator` keeps it."""

import dataclasses

from keras import ops


@dataclasses.dataclass(frozen=True)
class BlockState:
    """One block's curvature state: what the estimator keeps for it.

    `CurvatureEstimator.state_for` gathers it from the estimator's
    inverses and its option states, as NumPy arrays. A field is `None`
    where its option is off.

    Args:
        a_inverse: The stored `A⁻¹` blocks (a vector for a diagonal `A`).
        g_inverse: The stored `G⁻¹` blocks.
        a_factor: The averaged `c·A` blocks (`factor_decay`).
        g_factor: The averaged `c·G` blocks (`factor_decay`).
        factor_weight: The averages' weight `W` (`factor_decay`).
        last_trace: The damped trace at the block's last inversion
            (`trace_thresholds`; an entry of THOR's `last_traces`).
        stopped: Whether the trace rule has stopped the block
            (`trace_thresholds`; an entry of THOR's `stopped_blocks`).
    """

    a_inverse: object
    g_inverse: object
    a_factor: object = None
    g_factor: object = None
    factor_weight: object = None
    last_trace: object = None
    stopped: object = None


def _identity_blocks(shape, dtype=None):
    # A copy: on torch a broadcast is a view that loading cannot write into.
    return ops.copy(ops.broadcast_to(ops.eye(shape[-1], dtype=dtype), shape))


def added_inverses(add_variable, name, block, split_dim):
    """`(A⁻¹, G⁻¹)` variables of `block`, created by `add_variable` as
    identity blocks (`A⁻¹` a vector of ones when `A` is diagonal) and
    named `{name}_a_inverse`, `{name}_g_inverse`."""
    a_shape, g_shape = block.inverse_shapes(split_dim)
    a_initializer = "ones" if block.a_is_diagonal else _identity_blocks
    return (
        add_variable(
            a_shape, a_initializer, "float32", name=f"{name}_a_inverse"
        ),
        add_variable(
            g_shape, _identity_blocks, "float32", name=f"{name}_g_inverse"
        ),
    )
