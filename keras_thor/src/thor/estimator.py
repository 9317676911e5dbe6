"""THOR's curvature estimator: every block's state, keyed by block.

kfac-jax's `BlockDiagonalCurvature` for THOR. The estimator gathers the
statistics of a step and refreshes the inverses from them, as values
into the step's `StateWrites`:

```
gather:   A = Σ XᵀX / rows,  G = Σ DᵀD / rows       (global batch)
cut:      c·A, c·G into the inverses' diagonal blocks
average:  W ← α·W + 1,  A ← A + (A_new − A) / W      (factor_decay)
π:        per block, once (damping_split)
decide:   refresh_i = trace_decision(tr_i, ...)      (trace_thresholds)
invert:   A⁻¹ = blocks of (c·A + π√λ·I)⁻¹,  G⁻¹ = blocks of (c·G + √λ/π·I)⁻¹
```

Notation:
    - `X`, `D`: a layer's inputs and per-sample output gradients as rows;
      `c`: the block's factor scale (`√T` for a convolution, else 1).
    - `α`: `factor_decay`; `W`: the averages' weight; `λ`: the damping;
      `π`: 1, or the π correction with `damping_split="pi"`.
    - `tr_i`: block `i`'s damped Kronecker trace (`trace_rule`).

It holds what every setting needs (the blocks, their inverses, the count
of curvature troubles) and one `OptionState` per option that is on, from
`OPTION_STATES`. Its variables are THOR's: created through THOR's
`add_variable`, in the order `THOR.build` documents.
"""

import keras
from keras import ops

from keras_thor.src.backend.values import numpy_value
from keras_thor.src.distribute import replicas
from keras_thor.src.thor.block_state import BlockState
from keras_thor.src.thor.block_state import added_inverses
from keras_thor.src.thor.burn_in import BurnInState
from keras_thor.src.thor.damping_split import split_pi
from keras_thor.src.thor.factor_averaging import FactorAverages
from keras_thor.src.thor.factor_inverses import block_factor_inverses
from keras_thor.src.thor.inverse_placement import spread_over_replicas
from keras_thor.src.thor.kl_guard import KlGuardState
from keras_thor.src.thor.options import STATISTICS_ROWS_WIDTH
from keras_thor.src.thor.trace_rule import TraceRuleState

# The options with state, in the order their variables are created (after
# the inverses and `curvature_troubles`): saved files load by position.
OPTION_STATES = (FactorAverages, KlGuardState, TraceRuleState, BurnInState)


def _first_examples(tensors, count):
    """The first `count` examples of every tensor in `tensors`."""
    return keras.tree.map_structure(lambda tensor: tensor[:count], tensors)


class CurvatureValues:
    """The blocks' inverses and averaged factors as a step leaves them:
    the estimator's variables after `writes`."""

    def __init__(self, estimator, writes):
        self._estimator = estimator
        self._writes = writes

    def inverses(self, index):
        """`(A⁻¹, G⁻¹)` of block `index`."""
        return tuple(
            self._writes.value(v) for v in self._estimator.inverses_of(index)
        )

    def averaged_factors(self, index):
        """The averaged `(c·A, c·G)` blocks of block `index`
        (`factor_decay`)."""
        return self._estimator.option(FactorAverages).factors_of(
            index, self._writes
        )


class CurvatureEstimator:
    """The curvature state of THOR's blocks and what is done with it.

    Creates its variables when constructed (THOR does so in `build`): per
    block `a_inverse`, `g_inverse` (identities); `curvature_troubles`;
    then each enabled option's, in `OPTION_STATES` order: with
    `factor_decay` per block `a_factor`, `g_factor`, `factor_weight`; with
    `kl_clip` `guard_scale`; with `trace_thresholds` `last_traces`,
    `stopped_blocks` and `skipped_inversions`; with `burn_in_steps`
    `burn_in_steps_done`.

    Args:
        options: The `CurvatureOptions`.
        variables: THOR's trained variables.
        preconditioners: Each variable's block or diagonal rule (`None`:
            none), by variable index.
        blocks: `{variable index: block}` of the Kronecker blocks among
            them.
        variable_index: `variable -> index` in `variables`, or `None`.
        add_variable: THOR's `add_variable`.
    """

    def __init__(
        self,
        options,
        variables,
        preconditioners,
        blocks,
        variable_index,
        add_variable,
    ):
        self.options = options
        self._variable_index = variable_index
        self._preconditioners = list(preconditioners)
        self._blocks = dict(sorted(blocks.items()))
        names = {i: variables[i].path.replace("/", "_") for i in self._blocks}
        self._inverses = {
            index: added_inverses(
                add_variable, names[index], block, options.split_dim
            )
            for index, block in self._blocks.items()
        }
        split_indices = options.split_indices
        if split_indices and split_indices[-1] >= len(self._blocks):
            raise ValueError(
                "Every entry of `split_indices` must index one of the "
                f"{len(self._blocks)} layers with curvature. "
                f"Received: split_indices={split_indices}"
            )
        self._troubles = add_variable(
            (), "zeros", "int32", name="curvature_troubles"
        )
        table = {i: (names[i], *self._inverses[i]) for i in self._blocks}
        self._option_states = {
            kind: kind(options, table, add_variable)
            for kind in OPTION_STATES
            if kind.enabled(options)
        }

    def option(self, kind):
        """The state of option `kind` (an `OPTION_STATES` class), `None`
        while the option is off."""
        return self._option_states.get(kind)

    @property
    def blocks(self):
        """`{variable index: block}` of the variables with curvature."""
        return dict(self._blocks)

    def preconditioner(self, index):
        """Variable `index`'s block or diagonal rule (`None`: none)."""
        return self._preconditioners[index]

    def recorded_blocks(self):
        """`{variable index: the block whose calls the step records}`."""
        return {i: b.recorded_block for i, b in self._blocks.items()}

    @property
    def buckets(self):
        """The block indices per reduction bucket of the statistics.

        One bucket by default; `split_indices=[i, j]` cuts after the
        blocks `i` and `j` (MindSpore's all-reduce fusion points).
        """
        indices = list(self._blocks)
        cuts = [0] + [i + 1 for i in (self.options.split_indices or [])]
        cuts = sorted(set(cuts + [len(indices)]))
        return [indices[a:b] for a, b in zip(cuts[:-1], cuts[1:])]

    def state_for(self, variable):
        """`variable`'s `BlockState`, its values as NumPy arrays.

        Raises a `ValueError` if `variable` has no curvature block.
        """
        index = self._variable_index(variable)
        if index not in self._blocks:
            raise ValueError(
                "Only variables with a curvature block have curvature state "
                f"(`THOR.curvature_blocks`). Received: variable={variable.path}"
            )
        a_inverse, g_inverse = self._inverses[index]
        values = {
            "a_inverse": numpy_value(a_inverse),
            "g_inverse": numpy_value(g_inverse),
        }
        position = list(self._blocks).index(index)
        for state in self._option_states.values():
            values.update(state.block_state(index, position))
        return BlockState(**values)

    def inverses_of(self, index):
        """`(A⁻¹, G⁻¹)` variables of variable `index`, `(None, None)`
        without a block."""
        return self._inverses.get(index, (None, None))

    def values_after(self, writes):
        """The `CurvatureValues` the step's `writes` leave."""
        return CurvatureValues(self, writes)

    @property
    def curvature_troubles(self):
        """How many layer refreshes fell back or kept their old inverses."""
        return int(numpy_value(self._troubles))

    @property
    def skipped_inversions(self):
        """How many inversions the trace rule skipped (0 without it)."""
        trace_rule = self.option(TraceRuleState)
        return 0 if trace_rule is None else trace_rule.skipped_inversions

    def steps_burned_in(self):
        """The burn-in steps run so far, an int32 tensor (0 without
        `burn_in_steps`)."""
        burn_in = self.option(BurnInState)
        if burn_in is None:
            return ops.convert_to_tensor(0, "int32")
        return burn_in.steps_done()

    def record_burn_in(self, writes):
        """Counts one burn-in step (into `writes`)."""
        self.option(BurnInState).record(writes)

    @property
    def guard_scale(self):
        """The last step's guard scale `ν` (`kl_clip`; `None` without)."""
        guard = self.option(KlGuardState)
        return None if guard is None else guard.last_scale

    def held_guard_scale(self):
        """The stored guard scale `ν` as a float32 tensor: what the steps
        between refreshes apply with `kl_clip_steps="refresh"`."""
        return ops.convert_to_tensor(self.option(KlGuardState).scale)

    def record_guard_scale(self, scale, writes):
        """Keeps the step's guard scale `ν` (into `writes`)."""
        writes.set(self.option(KlGuardState).scale, scale)

    def training_logs(self):
        """The troubles so far, and each option's logs (the last guard
        scale; the skipped inversions and stopped blocks)."""
        logs = {"thor_curvature_troubles": ops.cast(self._troubles, "float32")}
        for state in self._option_states.values():
            logs.update(state.training_logs())
        return logs

    def gather(self, calls, output_grads, sample_scale, terms_per_example=1):
        """The factors `{variable index: (A, G, c)}` over the global batch.

        `calls` are the recorded block calls, `output_grads` the gradients
        at their outputs (`None`: skipped) and `sample_scale` turns those
        into per-sample gradients, one per loss term; `terms_per_example`
        (`loss_terms`) is what a block with one row per example divides
        by besides its examples. Sums are all-reduced across replicas,
        one collective per bucket, then divided by the global row count.
        Several calls of one layer pool their rows. With
        `statistics_rows` (`conv_statistics_rows` for a convolution), each
        call keeps its first examples only (with `"width"`, as many as the
        block's `examples_for_width`).
        """
        sums = {}
        for call, output_grad in zip(calls, output_grads):
            index = self._variable_index(call.block.kernel)
            if output_grad is None or index is None:
                continue
            inputs = call.inputs
            sample_grads = ops.cast(output_grad, "float32") * sample_scale
            block = self._blocks[index]
            examples = self.options.statistics_rows
            if block.convolutional:
                examples = self.options.conv_statistics_rows or examples
            if examples == STATISTICS_ROWS_WIDTH:
                examples = block.examples_for_width(sample_grads)
            if examples is not None:
                inputs, sample_grads = _first_examples(
                    (inputs, sample_grads), examples
                )
            if block.rows_are_examples:
                statistics = block.statistics(
                    inputs, sample_grads, terms_per_example
                )
            else:
                statistics = block.statistics(inputs, sample_grads)
            a_sum, g_sum, rows, factor_scale = statistics
            if index in sums:
                previous = sums[index]
                a_sum, g_sum = a_sum + previous[0], g_sum + previous[1]
                rows = rows + previous[2]
            sums[index] = (a_sum, g_sum, rows, factor_scale)
        statistics = {}
        for bucket in self.buckets:
            present = [index for index in bucket if index in sums]
            if not present:
                continue
            flat = replicas.all_reduce_sum(
                [tensor for index in present for tensor in sums[index][:3]]
            )
            for position, index in enumerate(present):
                a_sum, g_sum, rows = flat[3 * position : 3 * position + 3]
                statistics[index] = (
                    *self._blocks[index].factor_means(a_sum, g_sum, rows),
                    sums[index][3],
                )
        return statistics

    def refresh(self, statistics, damping, invert, writes):
        """Takes a statistics step's factors (`gather`) and, if `invert`,
        makes new inverses, into `writes`.

        Each block's factors are cut into its inverses' blocks once; with
        `factor_decay` they first update the averages (a layer whose new
        factors are not finite keeps its averages), and the inverses are
        those of the averages. `π` is computed once per block, on
        inverting steps only. With
        `trace_thresholds`, only the layers the trace rule selects are
        inverted.
        """
        if not statistics:
            return
        averaged = self.option(FactorAverages) is not None
        factors, troubles = {}, []
        for index in sorted(statistics):
            factors[index] = self.factors(index, statistics[index], writes)
            if averaged:
                accepted = factors[index][-1]
                troubles.append(ops.cast(ops.logical_not(accepted), "int32"))
        if troubles:
            writes.add(self._troubles, ops.sum(ops.stack(troubles)))
        if not invert:
            return
        factors = {
            index: (a, g, self.pi(index, a, g), seen, accepted)
            for index, (a, g, seen, accepted) in factors.items()
        }
        refresh = {}
        trace_rule = self.option(TraceRuleState)
        if trace_rule is not None:
            refresh = trace_rule.decide(self._blocks, factors, damping, writes)
        inverses = self._inverses_for(factors, refresh, damping)
        troubles = []
        for index, (a_inverse, g_inverse, trouble) in inverses.items():
            a_variable, g_variable = self._inverses[index]
            writes.set(a_variable, a_inverse)
            writes.set(g_variable, g_inverse)
            troubles.append(ops.cast(trouble, "int32"))
        writes.add(self._troubles, ops.sum(ops.stack(troubles)))

    def factors(self, index, statistics, writes):
        """`(c·A blocks, c·G blocks, seen, accepted)` of block `index` from
        a statistics step's `(A, G, c)`, cut into its inverses' blocks.

        With `factor_decay` the cut factors go into the averages (into
        `writes`) and the averages come back: `seen` says whether they
        hold any statistics, `accepted` whether they took these.
        """
        a, g = self._blocks[index].factor_blocks(
            statistics, self.options.split_dim
        )
        averages = self.option(FactorAverages)
        if averages is None:
            return a, g, True, True
        return averages.take(index, a, g, writes)

    def pi(self, index, a_blocks, g_blocks):
        """`π` of block `index`'s factor blocks (`damping_split`), once
        per block and refresh."""
        block = self._blocks[index]
        return split_pi(
            self.options.damping_split,
            a_blocks,
            g_blocks,
            block.groups,
            block.a_dim,
            block.g_dim,
        )

    def _inverses_for(self, factors, refresh, damping):
        """`{index: (A⁻¹, G⁻¹, trouble)}` of the blocks in `factors`; the
        stored ones (no trouble) where `refresh[index]` is false. Under a
        strategy with `spread_inverses`, each replica inverts its share.

        Not compiled: XLA's CPU Cholesky and triangular solve were 10x
        slower than TensorFlow's (docs/benchmarks.md).
        """
        indices = list(factors)

        def inverted(index):
            return lambda: self.inverses(index, factors[index], damping)

        if self.options.spread_inverses and replicas.replica_count() > 1:
            shared = spread_over_replicas(
                [inverted(i) for i in indices],
                [[v.shape for v in self._inverses[i]] for i in indices],
                [refresh.get(i) for i in indices],
            )
            results = [
                self._unless_kept(i, refresh.get(i), lambda r=r: r)
                for i, r in zip(indices, shared)
            ]
        else:
            results = [
                self._unless_kept(i, refresh.get(i), inverted(i))
                for i in indices
            ]
        return dict(zip(indices, results))

    def inverses(self, index, factors, damping):
        """`(A⁻¹, G⁻¹, trouble)` of block `index` at damping `λ`, from its
        `factors` `(c·A blocks, c·G blocks, π, seen, accepted)` (as
        `refresh` makes them); stores nothing.
        `factor_inverses.block_factor_inverses` damps this step's factors
        on their own diagonal, the averages on every diagonal entry; the
        averages keep the starting inverses until they hold statistics."""
        a_blocks, g_blocks, pi, seen, _ = factors
        block = self._blocks[index]
        a_variable, g_variable = map(
            ops.convert_to_tensor, self._inverses[index]
        )
        averaged = self.option(FactorAverages) is not None
        a_inverse, g_inverse, trouble = block_factor_inverses(
            a_blocks,
            g_blocks,
            block.a_is_diagonal,
            damping,
            a_variable,
            g_variable,
            pi=pi,
            layouts=(None, None) if averaged else block.factor_layouts,
        )
        if not averaged:
            return a_inverse, g_inverse, trouble
        return (
            ops.where(seen, a_inverse, a_variable),
            ops.where(seen, g_inverse, g_variable),
            trouble,
        )

    def _unless_kept(self, index, refresh, inverses):
        """`inverses()`, or block `index`'s stored inverses (and no
        trouble) where `refresh` (a boolean tensor; `None`: always) is
        false."""
        if refresh is None:
            return inverses()
        a_variable, g_variable = self._inverses[index]
        return ops.cond(
            refresh,
            inverses,
            lambda: (
                ops.convert_to_tensor(a_variable),
                ops.convert_to_tensor(g_variable),
                ops.convert_to_tensor(False),
            ),
        )
