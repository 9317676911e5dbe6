"""Block-diagonal damped inverses of curvature factors (THOR's split)."""

import math

from keras import ops

from keras_thor.src.backend.linalg import cholesky
from keras_thor.src.optimizers.finite import is_finite


def block_layout(dim, split_dim):
    """`(blocks, block_size)` of a `dim`-sized factor cut every `split_dim`.

    A factor no larger than `split_dim` is one block of its own size;
    a larger one is `ceil(dim / split_dim)` blocks of `split_dim`, the last
    one padded with identity.
    """
    if dim <= split_dim:
        return 1, dim
    return math.ceil(dim / split_dim), split_dim


def diagonal_blocks(matrix, split_dim):
    """The diagonal blocks of a square `matrix`, shape `(n, s, s)`.

    Off-diagonal blocks are dropped; the last block is padded with identity
    up to `s` rows.
    """
    dim = matrix.shape[-1]
    blocks, size = block_layout(dim, split_dim)
    padding = blocks * size - dim
    if padding:
        matrix = ops.pad(matrix, [[0, padding], [0, padding]])
        pad_diagonal = ops.concatenate(
            [
                ops.zeros((dim,), matrix.dtype),
                ops.ones((padding,), matrix.dtype),
            ]
        )
        matrix = matrix + ops.diag(pad_diagonal)
    grid = ops.transpose(
        ops.reshape(matrix, (blocks, size, blocks, size)), (0, 2, 1, 3)
    )
    return ops.transpose(ops.diagonal(grid, axis1=0, axis2=1), (2, 0, 1))


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
    """Blocks of `(factor + damping * I)⁻¹` and whether it needed a fallback.

    Returns `(inverse_blocks, fell_back)`. The damping is added before the
    last block is padded, so the padding stays an identity. When a block of
    the damped factor is not numerically positive definite (round-off on a
    nearly singular factor), the factor is damped again with its mean
    diagonal added; the caller keeps its previous inverse if even that is
    not finite.
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
        return inverse_with(damping + ops.abs(ops.mean(ops.diagonal(factor))))

    return ops.cond(fell_back, more_damped, lambda: inverse), fell_back


def multiply_left(blocks, matrix):
    """`blockdiag(blocks) @ matrix` for `matrix` of shape `(d, m)`."""
    blocks, matrix = (
        ops.convert_to_tensor(blocks),
        ops.convert_to_tensor(matrix),
    )
    count, size = blocks.shape[0], blocks.shape[-1]
    dim = matrix.shape[0]
    if count == 1 and size == dim:
        return ops.matmul(blocks[0], matrix)
    padding = count * size - dim
    padded = ops.pad(matrix, [[0, padding], [0, 0]]) if padding else matrix
    stacked = ops.reshape(padded, (count, size, matrix.shape[1]))
    product = ops.reshape(ops.matmul(blocks, stacked), (count * size, -1))
    return product[:dim]


def multiply_right(matrix, blocks):
    """`matrix @ blockdiag(blocks)` for symmetric blocks."""
    return ops.transpose(multiply_left(blocks, ops.transpose(matrix)))
