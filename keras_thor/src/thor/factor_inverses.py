"""Refreshing one block's stored inverses from its factor blocks: THOR's
one inversion path.

```
a_inverse = blocks of (c·A_j + π_j√λ·I)⁻¹  (1 / (a + π√λ) for a diagonal a)
g_inverse = blocks of (c·G_j + (√λ/π_j)·I)⁻¹
```

Notation:
    - `c·A_j`, `c·G_j`: the factors of group `j`, scaled (`√T` for a
      convolution, else 1) and cut into diagonal blocks
      (`KroneckerBlock.factor_blocks`): this step's, or their averages
      with `factor_decay`.
    - `λ`: the damping; `π_j`: one per group, or a scalar (1: MindSpore's
      split, see `damping_split`).
"""

from keras import ops

from keras_thor.src.thor.block_inverse import damped_inverse_of_blocks
from keras_thor.src.thor.damping_split import per_matrix
from keras_thor.src.utils.finite import all_finite


def block_factor_inverses(
    a_blocks,
    g_blocks,
    a_is_diagonal,
    damping,
    previous_a_inverse,
    previous_g_inverse,
    pi=1.0,
    layouts=(None, None),
):
    """The damped inverses of one block's factor blocks, robustly.

    Returns `(a_inverse, g_inverse, trouble)`. `layouts` are the
    `(groups, dim)` of `A` and `G` when only the factors' own diagonal is
    to be damped (`block_inverse.damped_inverse_of_blocks`), else `None`.
    A block that fails its Cholesky factorization is inverted with more
    damping; if the factors are not finite (or even the fallback fails)
    both previous inverses are kept. `trouble` is `True` in either case.
    """
    root = ops.sqrt(damping)
    a_layout, g_layout = layouts
    if a_is_diagonal:
        a_inverse = 1.0 / (a_blocks + root * pi)
        a_fell_back = ops.convert_to_tensor(False)
    else:
        a_inverse, a_fell_back = damped_inverse_of_blocks(
            a_blocks, per_matrix(root * pi, a_blocks.shape[0]), a_layout
        )
    g_inverse, g_fell_back = damped_inverse_of_blocks(
        g_blocks, per_matrix(root / pi, g_blocks.shape[0]), g_layout
    )
    usable = all_finite([a_blocks, g_blocks, a_inverse, g_inverse])
    trouble = ops.logical_or(
        ops.logical_not(usable), ops.logical_or(a_fell_back, g_fell_back)
    )
    return (
        ops.where(usable, a_inverse, previous_a_inverse),
        ops.where(usable, g_inverse, previous_g_inverse),
        trouble,
    )
