"""Refreshing one layer's stored inverses from fresh factors."""

from keras import ops

from keras_thor.src.thor.block_inverse import damped_block_inverse
from keras_thor.src.thor.block_inverse import damped_inverse_of_blocks
from keras_thor.src.thor.damping_split import per_matrix
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
    pi=1.0,
    a_split_dim=None,
):
    """The damped inverses of one layer's factors, robustly.

    Returns `(a_inverse, g_inverse, trouble)`:

    ```
    a_inverse = blocks of (c·A_j + π_j√λ·I)⁻¹  (1 / (a + π√λ) for diagonal a)
    g_inverse = blocks of (c·G_j + (√λ/π_j)·I)⁻¹
    ```

    Notation:
        - `A_j`, `G_j`: the factors of group `j`, stacked `(groups, d, d)`
          (one group except for grouped and depthwise convolutions).
        - `c`: `factor_scale` (`√T` for convolutions, else 1); `λ`: the
          damping; `π_j`: `pi`, a scalar or one per group (1: MindSpore's
          split, see `damping_split`).

    `G` is cut into blocks of `split_dim`, `A` of `a_split_dim` (default
    `split_dim`). A block that fails its Cholesky factorization is
    inverted with more damping; if the factors are not finite (or even
    the fallback fails) both previous inverses are kept. `trouble` is
    `True` in either case.
    """
    root = ops.sqrt(damping)
    if a_is_diagonal:
        a_inverse = 1.0 / (a + root * pi)
        a_fell_back = ops.convert_to_tensor(False)
    else:
        a_inverse, a_fell_back = damped_block_inverse(
            factor_scale * a,
            per_matrix(root * pi, a.shape[0]),
            split_dim if a_split_dim is None else a_split_dim,
        )
    g_inverse, g_fell_back = damped_block_inverse(
        factor_scale * g, per_matrix(root / pi, g.shape[0]), split_dim
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
    pi=1.0,
):
    """`factor_inverses` of factors kept as their (scaled) diagonal blocks.

    `a_blocks`, `g_blocks` are `c·A_j`, `c·G_j` cut as the inverses are
    (`(groups·n, s, s)`; a vector for a diagonal `A`), e.g. moving averages
    of them (`THOR(factor_decay=...)`); `pi` as for `factor_inverses`.
    Returns `(a_inverse, g_inverse, trouble)` with the same fallbacks.
    """
    root = ops.sqrt(damping)
    if a_is_diagonal:
        a_inverse = 1.0 / (a_blocks + root * pi)
        a_fell_back = ops.convert_to_tensor(False)
    else:
        a_inverse, a_fell_back = damped_inverse_of_blocks(
            a_blocks, per_matrix(root * pi, a_blocks.shape[0])
        )
    g_inverse, g_fell_back = damped_inverse_of_blocks(
        g_blocks, per_matrix(root / pi, g_blocks.shape[0])
    )
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
