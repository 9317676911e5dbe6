"""The THOR paper's trace rule: refresh a layer's inverses only when its
curvature has changed.

Pure functions; `THOR(trace_thresholds=(ω₁, ω₂))` keeps, per layer, the
trace at its last inversion and whether the layer has stopped. At each
refresh step, per layer (Chen et al., 2021, section "Trace-based"):

```
F = ⊕_j (c·A_j + √λ·I) ⊗ (c·G_j + √λ·I)
tr F = Σ_j (c·tr A_j + a·√λ) · (c·tr G_j + g·√λ)
Δ = |tr F − tr F_last| / tr F_last
Δ > ω₁:        invert F, F_last ← F
ω₂ ≤ Δ ≤ ω₁:   keep the inverses of F_last
Δ < ω₂:        keep them for good (the layer stops refreshing)
```

Notation:
    - `A_j`, `G_j`: the factors of group `j` (the averaged ones with
      `factor_decay`); `a`, `g`: their sizes; `c`: the factor scale
      (`√T` for a convolution), `λ`: the damping.
    - `F_last`: the damped factors the stored inverses were made from.
    - `ω₁`, `ω₂`: `trace_thresholds`.
"""

import math

from keras import ops


def _group_traces(blocks, groups, dim):
    """`tr` of each group's factor from its diagonal blocks.

    `blocks` is `(groups·n, s, s)` as `block_inverse.diagonal_blocks` cuts
    it (the last block of a group padded with identity, taken back out
    here), or a vector for a diagonal factor (one group).
    """
    if len(blocks.shape) == 1:
        return ops.sum(blocks, keepdims=True)
    diagonals = ops.diagonal(blocks, axis1=-2, axis2=-1)
    sums = ops.sum(ops.reshape(diagonals, (groups, -1)), axis=1)
    padding = math.prod(blocks.shape) // (groups * blocks.shape[-1]) - dim
    return sums - float(padding)


def damped_kronecker_trace(a_blocks, g_blocks, groups, a_dim, g_dim, damping):
    """`tr F = Σ_j (tr(c·A_j) + a·√λ) · (tr(c·G_j) + g·√λ)`.

    `a_blocks`, `g_blocks` are the scaled factors `c·A_j`, `c·G_j` cut into
    diagonal blocks (`KroneckerBlock.factor_blocks`; a diagonal `A` is a
    vector).
    """
    root = ops.sqrt(ops.cast(damping, "float32"))
    a_traces = _group_traces(ops.cast(a_blocks, "float32"), groups, a_dim)
    g_traces = _group_traces(ops.cast(g_blocks, "float32"), groups, g_dim)
    return ops.sum((a_traces + a_dim * root) * (g_traces + g_dim * root))


def trace_decision(trace, last_trace, stopped, usable, thresholds):
    """`(refresh, stop)` of one layer at a refresh step.

    `last_trace` is `tr F_last`, 0 before the first inversion (which always
    refreshes); `stopped` whether the layer has stopped; `usable` whether
    this step's factors can decide (finite; with `factor_decay`, taken into
    the averages at this step). Factors that cannot decide refresh, as
    without the rule (the inversion's own guard keeps the old inverses of
    non-finite factors and counts a trouble); they never stop a layer.
    """
    update_threshold, stop_threshold = thresholds
    first = last_trace <= 0.0
    usable = ops.logical_and(usable, ops.isfinite(trace))
    change = ops.abs(trace - last_trace) / ops.where(first, 1.0, last_trace)
    changed = ops.logical_or(first, change > update_threshold)
    refresh = ops.logical_and(
        ops.logical_not(stopped),
        ops.logical_or(ops.logical_not(usable), changed),
    )
    settled = ops.logical_and(
        ops.logical_and(usable, ops.logical_not(first)),
        change < stop_threshold,
    )
    return refresh, ops.logical_or(stopped, settled)
