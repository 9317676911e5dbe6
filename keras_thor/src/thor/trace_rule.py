"""The THOR paper's trace rule: refresh a layer's inverses only when its
curvature has changed.

Pure functions, and the rule's state (`TraceRuleState`):
`THOR(trace_thresholds=(ω₁, ω₂))` keeps, per layer, the trace at its last
inversion and whether the layer has stopped. At each refresh step, per
layer (Chen et al., 2021, section "Trace-based"):

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
      split's correction (`damping_split.split_pi`; 1 for MindSpore's).
    - `F_last`: the damped factors the stored inverses were made from.
    - `ω₁`, `ω₂`: `trace_thresholds`.
"""

from keras import ops

from keras_thor.src.backend.values import numpy_value
from keras_thor.src.thor.damping_split import group_traces
from keras_thor.src.thor.option_state import OptionState


def damped_kronecker_trace(
    a_blocks, g_blocks, groups, a_dim, g_dim, damping, pi=1.0
):
    """`tr F = Σ_j (tr(c·A_j) + a·π_j√λ) · (tr(c·G_j) + g·√λ/π_j)`.

    `a_blocks`, `g_blocks` are the scaled factors `c·A_j`, `c·G_j` cut into
    diagonal blocks (`KroneckerBlock.factor_blocks`; a diagonal `A` is a
    vector); `pi` is `π_j`, a scalar or one per group.
    """
    root = ops.sqrt(ops.cast(damping, "float32"))
    a_traces = group_traces(a_blocks, groups, a_dim)
    g_traces = group_traces(g_blocks, groups, g_dim)
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
    block, a_blocks, g_blocks, damping, pi, last, seen, accepted
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
        pi,
    )
    refresh, stop = trace_decision(
        trace, last_trace, stopped, ops.logical_and(seen, accepted), thresholds
    )
    taken = ops.logical_and(ops.logical_and(refresh, seen), ops.isfinite(trace))
    return refresh, stop, ops.where(taken, trace, last_trace)


class TraceRuleState(OptionState):
    """The trace rule's state (`trace_thresholds`): `last_traces` and
    `stopped_blocks` (one entry per block), then `skipped_inversions`."""

    option = "trace_thresholds"

    def __init__(self, options, table, add_variable):
        super().__init__(options, table, add_variable)
        self.positions = {index: p for p, index in enumerate(table)}
        count = (len(table),)
        self.last_traces = add_variable(
            count, "zeros", "float32", name="last_traces"
        )
        self.stopped = add_variable(
            count, "zeros", "int32", name="stopped_blocks"
        )
        self.skipped = add_variable(
            (), "zeros", "int32", name="skipped_inversions"
        )

    def block_state(self, index, position):
        return {
            "last_trace": numpy_value(self.last_traces)[position],
            "stopped": bool(numpy_value(self.stopped)[position]),
        }

    @property
    def skipped_inversions(self):
        """How many inversions the rule skipped."""
        return int(numpy_value(self.skipped))

    def training_logs(self):
        return {
            "thor_skipped_inversions": ops.cast(self.skipped, "float32"),
            "thor_stopped_blocks": ops.cast(ops.sum(self.stopped), "float32"),
        }

    def decide(self, blocks, factors, damping, writes):
        """`{index: refresh}` of the blocks in `factors` (`block_decision`);
        the new last traces, stopped blocks and skipped count go to
        `writes`.

        `factors[index]` is `(c·A blocks, c·G blocks, π, seen, accepted)`:
        with `factor_decay`, whether the averages hold statistics yet and
        took this step's (if not, the rule does not decide: an unchanged
        average would look settled and stop the layer).
        """
        last_traces = ops.unstack(ops.convert_to_tensor(self.last_traces))
        stopped = ops.unstack(ops.convert_to_tensor(self.stopped) > 0)
        refresh = {}
        for index, (a, g, pi, seen, accepted) in factors.items():
            position = self.positions[index]
            last = (
                last_traces[position],
                stopped[position],
                self.options.trace_thresholds,
            )
            refresh[index], stopped[position], last_traces[position] = (
                block_decision(
                    blocks[index], a, g, damping, pi, last, seen, accepted
                )
            )
        writes.set(self.last_traces, ops.stack(last_traces))
        writes.set(self.stopped, ops.cast(ops.stack(stopped), "int32"))
        skipped = [
            ops.cast(ops.logical_not(r), "int32") for r in refresh.values()
        ]
        writes.add(self.skipped, ops.sum(ops.stack(skipped)))
        return refresh
