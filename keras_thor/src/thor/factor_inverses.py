"""Refreshing one layer's stored inverses from fresh factors."""

from keras import ops

from keras_thor.src.thor.block_inverse import damped_block_inverse
from keras_thor.src.thor.block_inverse import damped_inverse_of_blocks
from keras_thor.src.utils.finite import all_finite


def factor_inverses(
    a,
    g,
    factor_scale,
    a_is_diagonal,
    damping,
    split_dim,
    previous_a_inverse,
    previous_g_inverse,
):
    """The damped inverses of one layer's factors, robustly.

    Returns `(a_inverse, g_inverse, trouble)`:

    ```
    a_inverse = blocks of (c·A_j + √λ·I)⁻¹    (or 1 / (a + √λ) for diagonal a)
    g_inverse = blocks of (c·G_j + √λ·I)⁻¹
    ```

    Notation:
        - `A_j`, `G_j`: the factors of group `j`, stacked `(groups, d, d)`
          (one group except for grouped and depthwise convolutions).
        - `c`: `factor_scale` (`√T` for convolutions, else 1); `λ`: the
          damping.

    A block that fails its Cholesky factorization is inverted with more
    damping; if the factors are not finite (or even the fallback fails)
    both previous inverses are kept. `trouble` is `True` in either case.
    """
    root = ops.sqrt(damping)
    if a_is_diagonal:
        a_inverse, a_fell_back = 1.0 / (a + root), ops.convert_to_tensor(False)
    else:
        a_inverse, a_fell_back = damped_block_inverse(
            factor_scale * a, root, split_dim
        )
    g_inverse, g_fell_back = damped_block_inverse(
        factor_scale * g, root, split_dim
    )
    return _kept_if_unusable(
        [a, g],
        (a_inverse, g_inverse),
        (a_fell_back, g_fell_back),
        (previous_a_inverse, previous_g_inverse),
    )


def block_factor_inverses(
    a_blocks,
    g_blocks,
    a_is_diagonal,
    damping,
    previous_a_inverse,
    previous_g_inverse,
):
    """`factor_inverses` of factors kept as their (scaled) diagonal blocks.

    `a_blocks`, `g_blocks` are `c·A_j`, `c·G_j` cut as the inverses are
    (`(groups·n, s, s)`; a vector for a diagonal `A`), e.g. moving averages
    of them (`THOR(factor_decay=...)`). Returns
    `(a_inverse, g_inverse, trouble)` with the same fallbacks.
    """
    root = ops.sqrt(damping)
    if a_is_diagonal:
        a_inverse = 1.0 / (a_blocks + root)
        a_fell_back = ops.convert_to_tensor(False)
    else:
        a_inverse, a_fell_back = damped_inverse_of_blocks(a_blocks, root)
    g_inverse, g_fell_back = damped_inverse_of_blocks(g_blocks, root)
    return _kept_if_unusable(
        [a_blocks, g_blocks],
        (a_inverse, g_inverse),
        (a_fell_back, g_fell_back),
        (previous_a_inverse, previous_g_inverse),
    )


def _kept_if_unusable(factors, inverses, fell_back, previous):
    """`(a_inverse, g_inverse, trouble)`: the new inverses, or both
    previous ones where a factor or an inverse is not finite; `trouble` if
    so or if an inversion fell back."""
    usable = all_finite([*factors, *inverses])
    trouble = ops.logical_or(
        ops.logical_not(usable), ops.logical_or(*fell_back)
    )
    return (
        ops.where(usable, inverses[0], previous[0]),
        ops.where(usable, inverses[1], previous[1]),
        trouble,
    )
