"""Block-diagonal damped inverses of curvature factors (THOR's split).

A factor is a stack of `groups` square matrices `(groups, d, d)` (one for
most layers; one per group of a grouped or depthwise convolution). Each is
cut into diagonal blocks of `split_dim`, and the inverses of all groups'
blocks are stored together, `(groups·n, s, s)`.
"""

import math

import numpy as np
from keras import ops

from keras_thor.src.backend.linalg import cholesky
from keras_thor.src.backend.linalg import map_matrices
from keras_thor.src.utils.finite import is_finite


def block_layout(dim, split_dim):
    """`(blocks, block_size)` of a `dim`-sized factor cut every `split_dim`.

    A factor no larger than `split_dim` is one block of its own size;
    a larger one is `ceil(dim / split_dim)` blocks of `split_dim`, the last
    one padded with identity.
    """
    if dim <= split_dim:
        return 1, dim
    return math.ceil(dim / split_dim), split_dim


def diagonal_blocks(matrices, split_dim):
    """The diagonal blocks of square `matrices` `(groups, d, d)`.

    Returns `(groups·n, s, s)`, group by group. Off-diagonal blocks are
    dropped; the last block of each group is padded with identity up to
    `s` rows.
    """
    groups, dim = matrices.shape[0], matrices.shape[-1]
    blocks, size = block_layout(dim, split_dim)
    padding = blocks * size - dim
    if padding:
        matrices = ops.pad(matrices, [[0, 0], [0, padding], [0, padding]])
        pad_diagonal = ops.concatenate(
            [
                ops.zeros((dim,), matrices.dtype),
                ops.ones((padding,), matrices.dtype),
            ]
        )
        matrices = matrices + ops.diag(pad_diagonal)
    grid = ops.transpose(
        ops.reshape(matrices, (groups, blocks, size, blocks, size)),
        (0, 1, 3, 2, 4),
    )
    diagonal = ops.transpose(ops.diagonal(grid, axis1=1, axis2=2), (0, 3, 1, 2))
    return ops.reshape(diagonal, (groups * blocks, size, size))


def inverse_via_cholesky(blocks):
    """Inverses of symmetric positive definite `blocks` `(n, s, s)`.

    `M = L Lᵀ`, `X = L⁻¹`, `M⁻¹ = Xᵀ X` (symmetric by construction). A block
    that is not positive definite comes back with non-finite entries.
    (On JAX block by block: `map_matrices`.)
    """
    return map_matrices(_inverse_via_cholesky, ops.convert_to_tensor(blocks))


def _inverse_via_cholesky(blocks):
    lower = cholesky(blocks)
    identity = ops.broadcast_to(
        ops.eye(blocks.shape[-1], dtype=blocks.dtype), blocks.shape
    )
    inverse_factor = ops.solve_triangular(lower, identity, lower=True)
    return ops.matmul(ops.transpose(inverse_factor, (0, 2, 1)), inverse_factor)


def _factor_diagonal(shape, layout):
    """`(n, s)`: 1 on the diagonal entries of the blocks `shape` that belong
    to the factor, 0 on the identity padding; `None` where all do (no
    `layout`, or no padding)."""
    count, size = shape[0], shape[-1]
    if layout is None:
        return None
    groups, dim = layout
    positions = np.arange(count // groups * size) < dim
    if positions.all():
        return None
    return np.tile(positions.reshape(-1, size), (groups, 1)).astype("float32")


def damped_inverse_of_blocks(blocks, damping, layout=None):
    """`(blocks + damping · I)⁻¹` of diagonal blocks, and whether it needed
    a fallback.

    `blocks` are `(groups·n, s, s)` as `diagonal_blocks` cuts a factor;
    `damping` is a scalar or one value per block `(groups·n, 1, 1)`. With
    `layout = (groups, dim)`, the size of the factor the blocks were cut
    from, only the factor's own diagonal is damped, so a padded last block
    keeps its identity padding (as if the whole factor was damped, then
    cut); without it every diagonal entry is (THOR's averaged blocks, whose
    saved inverses hold damped padding). When a block is not numerically
    positive definite (round-off on a nearly singular factor), every block
    is inverted again with the mean of those diagonal entries added to
    the damping; the caller keeps its previous inverse if even that is
    not finite.
    """
    blocks = ops.convert_to_tensor(blocks)
    damped = ops.eye(blocks.shape[-1], dtype=blocks.dtype)
    diagonal = _factor_diagonal(blocks.shape, layout)
    if diagonal is not None:
        damped = damped * diagonal[:, None]
    inverse = inverse_via_cholesky(blocks + damping * damped)
    fell_back = ops.logical_not(is_finite(inverse))

    def more_damped():
        entries = ops.diagonal(blocks, axis1=-2, axis2=-1)
        if diagonal is None:
            mean = ops.mean(entries)
        else:
            mean = ops.sum(entries * diagonal) / float(diagonal.sum())
        return inverse_via_cholesky(blocks + (damping + ops.abs(mean)) * damped)

    return ops.cond(fell_back, more_damped, lambda: inverse), fell_back


def multiply_left(blocks, matrices):
    """`blockdiag(blocks) @ matrix` for each group's matrix.

    `matrices` is `(groups, d, m)`, `m` possibly unknown until run time;
    `blocks` the `(groups·n, s, s)` inverse blocks of `d`-sized factors.
    """
    blocks = ops.convert_to_tensor(blocks)
    matrices = ops.convert_to_tensor(matrices)
    groups, dim = matrices.shape[0], matrices.shape[1]
    count, size = blocks.shape[0] // groups, blocks.shape[-1]
    if count == 1 and size == dim:
        return ops.matmul(blocks, matrices)
    padding = count * size - dim
    if padding:
        matrices = ops.pad(matrices, [[0, 0], [0, padding], [0, 0]])
    stacked = ops.reshape(matrices, (groups * count, size, -1))
    product = ops.reshape(
        ops.matmul(blocks, stacked), (groups, count * size, -1)
    )
    return product[:, :dim]


def multiply_right(matrices, blocks):
    """`matrix @ blockdiag(blocks)` for each group's matrix `(groups, m, d)`,
    for symmetric blocks."""
    transposed = ops.transpose(matrices, (0, 2, 1))
    return ops.transpose(multiply_left(blocks, transposed), (0, 2, 1))
