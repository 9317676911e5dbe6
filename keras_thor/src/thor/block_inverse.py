"""Block-diagonal damped inverses of curvature factors (THOR's split).

A factor is a stack of `groups` square matrices `(groups, d, d)` (one for
most layers; one per group of a grouped or depthwise convolution). Each is
cut into diagonal blocks of `split_dim`, and the inverses of all groups'
blocks are stored together, `(groups·n, s, s)`.
"""

import math

from keras import ops

from keras_thor.src.backend.linalg import cholesky
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
    """
    lower = cholesky(blocks)
    identity = ops.broadcast_to(
        ops.eye(blocks.shape[-1], dtype=blocks.dtype), blocks.shape
    )
    inverse_factor = ops.solve_triangular(lower, identity, lower=True)
    return ops.matmul(ops.transpose(inverse_factor, (0, 2, 1)), inverse_factor)


def damped_block_inverse(factor, damping, split_dim):
    """Blocks of `(factor + damping · I)⁻¹` and whether it needed a fallback.

    `factor` is `(groups, d, d)`. Returns `(inverse_blocks, fell_back)`. The
    damping is added before the last block is padded, so the padding stays
    an identity. When a block of the damped factor is not numerically
    positive definite (round-off on a nearly singular factor), the factor
    is damped again with its mean diagonal added; the caller keeps its
    previous inverse if even that is not finite.
    """
    factor = ops.convert_to_tensor(factor)
    identity = ops.eye(factor.shape[-1], dtype=factor.dtype)

    def inverse_with(shift):
        return inverse_via_cholesky(
            diagonal_blocks(factor + shift * identity, split_dim)
        )

    inverse = inverse_with(damping)
    fell_back = ops.logical_not(is_finite(inverse))

    def more_damped():
        diagonal = ops.diagonal(factor, axis1=-2, axis2=-1)
        return inverse_with(damping + ops.abs(ops.mean(diagonal)))

    return ops.cond(fell_back, more_damped, lambda: inverse), fell_back


def damped_inverse_of_blocks(blocks, damping):
    """`(blocks + damping · I)⁻¹` of stored diagonal blocks `(n, s, s)`, and
    whether it needed a fallback.

    As `damped_block_inverse`, for factors kept as their diagonal blocks
    (`THOR(factor_decay=...)`): a block that is not numerically positive
    definite is damped again with the mean diagonal of all blocks added.
    """
    blocks = ops.convert_to_tensor(blocks)
    identity = ops.eye(blocks.shape[-1], dtype=blocks.dtype)
    inverse = inverse_via_cholesky(blocks + damping * identity)
    fell_back = ops.logical_not(is_finite(inverse))

    def more_damped():
        diagonal = ops.diagonal(blocks, axis1=-2, axis2=-1)
        shift = damping + ops.abs(ops.mean(diagonal))
        return inverse_via_cholesky(blocks + shift * identity)

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
