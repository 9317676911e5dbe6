"""The THOR paper's trace rule: refresh a layer's inverses only when its
curvature has changed.

Pure functions; `THOR(trace_thresholds=(ω₁, ω₂))` keeps, per layer, the
trace at its last inversion and whether the layer has stopped. At each
refresh step, per layer (Chen et al., 2021, section "Trace-based"):

```
F = ⊕_j (c·A_j + π_j√λ·I) ⊗ (c·G_j + (√λ/π_j)·I)
tr F = Σ_j (c·tr A_j + a·π_j√λ) · (c·tr G_j + g·√λ/π_j)
Δ = |tr F − tr F_last| / tr F_last
Δ > ω₁:        invert F, F_last ← F
ω₂ ≤ Δ ≤ ω₁:   keep the inverses of F_last
Δ < ω₂:        keep them for good (the layer stops refreshing)
```

Notation:
    - `A_j`, `G_j`: the factors of group `j` (the averaged ones with
      `factor_decay`); `a`, `g`: their sizes; `c`: the factor scale
      (`√T` for a convolution), `λ`: the damping; `π_j`: the damping
      split's correction (`damping_split`; 1 for MindSpore's).
    - `F_last`: the damped factors the stored inverses were made from.
    - `ω₁`, `ω₂`: `trace_thresholds`.
"""

from keras import ops

from keras_thor.src.thor.damping_split import group_traces
from keras_thor.src.thor.damping_split import split_pi


def damped_kronecker_trace(
    a_blocks, g_blocks, groups, a_dim, g_dim, damping, damping_split="uniform"
):
    """`tr F = Σ_j (tr(c·A_j) + a·π_j√λ) · (tr(c·G_j) + g·√λ/π_j)`.

    `a_blocks`, `g_blocks` are the scaled factors `c·A_j`, `c·G_j` cut into
    diagonal blocks (`KroneckerBlock.factor_blocks`; a diagonal `A` is a
    vector); `π_j` follows `damping_split` (1 for "uniform").
    """
    root = ops.sqrt(ops.cast(damping, "float32"))
    a_traces = group_traces(a_blocks, groups, a_dim)
    g_traces = group_traces(g_blocks, groups, g_dim)
    pi = split_pi(damping_split, a_blocks, g_blocks, groups, a_dim, g_dim)
    return ops.sum(
        (a_traces + a_dim * root * pi) * (g_traces + g_dim * root / pi)
    )


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


def block_decision(
    block, a_blocks, g_blocks, damping, damping_split, last, seen, accepted
):
    """`(refresh, stop, last_trace)` of one block at a refresh step.

    `last` is `(tr F_last, stopped, thresholds)`; `seen` whether the
    factors hold any statistics yet, `accepted` whether this step's were
    taken (with `factor_decay`). The new `tr F_last` is the trace of an
    inversion that happens.
    """
    last_trace, stopped, thresholds = last
    trace = damped_kronecker_trace(
        a_blocks,
        g_blocks,
        block.groups,
        block.a_dim,
        block.g_dim,
        damping,
        damping_split,
    )
    refresh, stop = trace_decision(
        trace, last_trace, stopped, ops.logical_and(seen, accepted), thresholds
    )
    taken = ops.logical_and(ops.logical_and(refresh, seen), ops.isfinite(trace))
    return refresh, stop, ops.where(taken, trace, last_trace)
