"""Refreshing one layer's stored inverses from fresh factors."""

from keras import ops

from keras_thor.src.thor.block_inverse import damped_block_inverse
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
    usable = all_finite([a, g, a_inverse, g_inverse])
    trouble = ops.logical_or(
        ops.logical_not(usable), ops.logical_or(a_fell_back, g_fell_back)
    )
    return (
        ops.where(usable, a_inverse, previous_a_inverse),
        ops.where(usable, g_inverse, previous_g_inverse),
        trouble,
    )
