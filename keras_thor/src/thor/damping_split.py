"""How THOR splits the damping `λ` between a block's two factors.

```
"uniform" (MindSpore):  (c·A_j + √λ·I)⁻¹,    (c·G_j + √λ·I)⁻¹
"pi" (K-FAC §6.3):      (c·A_j + π_j√λ·I)⁻¹, (c·G_j + (√λ/π_j)·I)⁻¹
                        π_j = sqrt((tr(c·A_j) / a) / (tr(c·G_j) / g))
```

Notation:
    - `A_j`, `G_j`: the factors of group `j` that are inverted (the
      averaged ones with `factor_decay`); `a`, `g`: their sizes; `c`: the
      block's factor scale (it cancels in `π_j`).
    - `π_j = 1` where either trace is 0 or not finite.

Both splits add `λ` to the Kronecker product's eigenvalues at first
order; "pi" balances the two factors' damping to their mean eigenvalues
(Martens & Grosse, 2015, §6.3; kfac-jax's, kfac-pytorch's and
tensorflow/kfac's default), where "uniform" can leave a small `G` under
its damping.
"""

from keras import ops

DAMPING_SPLITS = ("uniform", "pi")


def group_traces(blocks, groups, dim):
    """`tr` of each group's factor `(groups,)` from its diagonal blocks.

    `blocks` is `(groups·n, s, s)` as `block_inverse.diagonal_blocks` cuts
    it (the last block of a group padded with identity, left out of the
    sum), a whole factor `(groups, dim, dim)`, or a vector for a diagonal
    factor (one group).
    """
    blocks = ops.cast(blocks, "float32")
    if len(blocks.shape) == 1:
        return ops.sum(blocks, keepdims=True)
    diagonals = ops.diagonal(blocks, axis1=-2, axis2=-1)
    return ops.sum(ops.reshape(diagonals, (groups, -1))[:, :dim], axis=1)


def pi_correction(a_traces, g_traces, a_dim, g_dim):
    """`π_j = sqrt((tr A_j / a) / (tr G_j / g))` per group, 1 where a trace
    is 0 or not finite."""
    ratio = (a_traces / float(a_dim)) / (g_traces / float(g_dim))
    usable = ops.logical_and(
        ops.logical_and(a_traces > 0.0, g_traces > 0.0), ops.isfinite(ratio)
    )
    return ops.where(usable, ops.sqrt(ops.where(usable, ratio, 1.0)), 1.0)


def split_pi(split, a_blocks, g_blocks, groups, a_dim, g_dim):
    """`π` of one block's factors: `1.0` for the "uniform" split, else
    `pi_correction` of `a_blocks`, `g_blocks` (as `group_traces` takes
    them), one per group."""
    if split == "uniform":
        return 1.0
    return pi_correction(
        group_traces(a_blocks, groups, a_dim),
        group_traces(g_blocks, groups, g_dim),
        a_dim,
        g_dim,
    )


def per_matrix(values, count):
    """Per-group `values` (a scalar or `(groups,)`) repeated for `count`
    stacked matrices, shaped `(count, 1, 1)` to add to them."""
    values = ops.reshape(ops.convert_to_tensor(values, "float32"), (-1,))
    if values.shape[0] not in (1, count):
        values = ops.repeat(values, count // values.shape[0])
    return ops.reshape(values, (-1, 1, 1))
