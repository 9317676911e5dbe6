"""THOR's curvature estimator: every block's state, keyed by block.

kfac-jax's `BlockDiagonalCurvature` for THOR. The estimator gathers the
statistics of a step, refreshes the inverses from them and
preconditions with the stored inverses:

```
gather:      A = Σ XᵀX / rows,  G = Σ DᵀD / rows   (global batch)
refresh:     W ← α·W + 1,  A ← A + (A_new − A) / W   (with factor_decay)
             refresh_i = trace_decision(tr_i, ...)   (with trace_thresholds)
             A⁻¹ = blocks of (c·A + π√λ·I)⁻¹,  G⁻¹ = blocks of (c·G + √λ/π·I)⁻¹
precondition: d = A⁻¹ · g · G⁻¹    (factored order: (A⁻¹Xᵀ) · (D·G⁻¹))
```

Notation:
    - `X`, `D`: a layer's inputs and per-sample output gradients as rows;
      `c`: the block's factor scale (`√T` for a convolution, else 1).
    - `α`: `factor_decay`; `W`: the averages' weight; `λ`: the damping;
      `π`: 1, or the π correction with `damping_split="pi"`.
    - `tr_i`: block `i`'s damped Kronecker trace (`trace_rule`).

Its variables are THOR's: created through THOR's `add_variable`, in the
order `THOR.build` documents, and written through THOR's `assign`.
"""

import dataclasses

import keras
from keras import ops

from keras_thor.src.backend.values import numpy_value
from keras_thor.src.distribute import replicas
from keras_thor.src.thor.block_state import BlockState
from keras_thor.src.thor.block_state import added_averages
from keras_thor.src.thor.block_state import added_inverses
from keras_thor.src.thor.factor_averaging import average_weight
from keras_thor.src.thor.factor_averaging import averaged_factor
from keras_thor.src.thor.inverse_placement import spread_over_replicas
from keras_thor.src.thor.trace_rule import block_decision
from keras_thor.src.utils.finite import all_finite


def _first_examples(tensors, count):
    """The first `count` examples of every tensor in `tensors`."""
    return keras.tree.map_structure(lambda tensor: tensor[:count], tensors)


class CurvatureEstimator:
    """The curvature state of THOR's blocks and what is done with it.

    Creates its variables when constructed (THOR does so in `build`):
    per block `a_inverse`, `g_inverse` (identities); `curvature_troubles`;
    with `factor_decay` per block `a_factor`, `g_factor`, `factor_weight`;
    with `kl_clip` `guard_scale`; with `trace_thresholds` `last_traces`,
    `stopped_blocks` (one entry per block) and `skipped_inversions`; with
    `burn_in_steps` `burn_in_steps_done`.

    Args:
        options: The `CurvatureOptions`.
        variables: THOR's trained variables.
        blocks: `{variable index: block}` of those with curvature.
        variable_index: `variable -> index` in `variables`, or `None`.
        add_variable: THOR's `add_variable`.
        assign: THOR's `assign`.
        assign_add: THOR's `assign_add`.
    """

    def __init__(
        self,
        options,
        variables,
        blocks,
        variable_index,
        add_variable,
        assign,
        assign_add,
    ):
        self.options = options
        self._variable_index = variable_index
        self._assign, self._assign_add = assign, assign_add
        self._blocks = dict(sorted(blocks.items()))
        names = {i: variables[i].path.replace("/", "_") for i in self._blocks}
        inverses = {
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
        self._states = {}
        for index, (a_inverse, g_inverse) in inverses.items():
            averages = {}
            if options.factor_decay is not None:
                averages = added_averages(
                    add_variable, names[index], a_inverse, g_inverse
                )
            self._states[index] = BlockState(a_inverse, g_inverse, **averages)
        if options.kl_clip is not None:
            self._guard_scale = add_variable(
                (), "ones", "float32", name="guard_scale"
            )
        if options.trace_thresholds is not None:
            count = (len(self._blocks),)
            self._last_traces = add_variable(
                count, "zeros", "float32", name="last_traces"
            )
            self._stopped = add_variable(
                count, "zeros", "int32", name="stopped_blocks"
            )
            self._skipped = add_variable(
                (), "zeros", "int32", name="skipped_inversions"
            )
        if options.burn_in_steps:
            self._burned_in = add_variable(
                (), "zeros", "int32", name="burn_in_steps_done"
            )

    @property
    def blocks(self):
        """`{variable index: block}` of the variables with curvature."""
        return dict(self._blocks)

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
        if index not in self._states:
            raise ValueError(
                "Only variables with a curvature block have curvature state "
                f"(`THOR.curvature_blocks`). Received: variable={variable.path}"
            )
        values = {
            field.name: numpy_value(value)
            for field in dataclasses.fields(BlockState)
            if (value := getattr(self._states[index], field.name)) is not None
        }
        if self.options.trace_thresholds is not None:
            position = list(self._blocks).index(index)
            values["last_trace"] = numpy_value(self._last_traces)[position]
            values["stopped"] = bool(numpy_value(self._stopped)[position])
        return BlockState(**values)

    def inverses_of(self, index):
        """`(A⁻¹, G⁻¹)` variables of variable `index`, `(None, None)`
        without a block."""
        state = self._states.get(index)
        if state is None:
            return None, None
        return state.a_inverse, state.g_inverse

    @property
    def curvature_troubles(self):
        """How many layer refreshes fell back or kept their old inverses."""
        return int(numpy_value(self._troubles))

    @property
    def skipped_inversions(self):
        """How many inversions the trace rule skipped (0 without it)."""
        if self.options.trace_thresholds is None:
            return 0
        return int(numpy_value(self._skipped))

    def steps_burned_in(self):
        """The burn-in steps run so far, an int32 tensor (0 without
        `burn_in_steps`)."""
        if not self.options.burn_in_steps:
            return ops.convert_to_tensor(0, "int32")
        return ops.convert_to_tensor(self._burned_in)

    def record_burn_in(self):
        """Counts one burn-in step."""
        self._assign_add(self._burned_in, 1)

    def training_logs(self):
        """The troubles so far; the last guard scale (`kl_clip`); the
        skipped inversions and stopped blocks (`trace_thresholds`)."""
        logs = {"thor_curvature_troubles": ops.cast(self._troubles, "float32")}
        if self.options.kl_clip is not None:
            logs["thor_guard_scale"] = ops.convert_to_tensor(self._guard_scale)
        if self.options.trace_thresholds is not None:
            logs["thor_skipped_inversions"] = ops.cast(self._skipped, "float32")
            logs["thor_stopped_blocks"] = ops.cast(
                ops.sum(self._stopped), "float32"
            )
        return logs

    @property
    def guard_scale(self):
        """The last step's guard scale `ν` (`kl_clip`; `None` without)."""
        if self.options.kl_clip is None:
            return None
        return float(numpy_value(self._guard_scale))

    def record_guard_scale(self, scale):
        """Keeps the step's guard scale `ν` (`kl_guard`)."""
        self._assign(self._guard_scale, scale)

    def gather(self, calls, output_grads, sample_scale):
        """The factors `{variable index: (A, G, c)}` over the global batch.

        `calls` are the recorded block calls, `output_grads` the gradients
        at their outputs (`None`: skipped) and `sample_scale` turns those
        into per-sample gradients. Sums are all-reduced across replicas,
        one collective per bucket, then divided by the global row count.
        Several calls of one layer pool their rows. With
        `statistics_rows` (`conv_statistics_rows` for a convolution), each
        call keeps its first examples only.
        """
        sums = {}
        for call, output_grad in zip(calls, output_grads):
            index = self._variable_index(call.block.kernel)
            if output_grad is None or index is None:
                continue
            inputs = call.inputs
            sample_grads = ops.cast(output_grad, "float32") * sample_scale
            examples = self.options.statistics_rows
            if call.block.convolutional:
                examples = self.options.conv_statistics_rows or examples
            if examples is not None:
                inputs, sample_grads = _first_examples(
                    (inputs, sample_grads), examples
                )
            a_sum, g_sum, rows, factor_scale = self._blocks[index].statistics(
                inputs, sample_grads
            )
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
                statistics[index] = (a_sum / rows, g_sum / rows, sums[index][3])
        return statistics

    def refresh(self, statistics, damping, invert=True):
        """Takes a statistics step's factors (`gather`); replaces the
        inverses if `invert`.

        With `factor_decay` the factors first update the averages (a
        layer whose new factors are not finite keeps its averages), and
        the inverses are those of the averages. With `trace_thresholds`,
        only the layers the trace rule selects are inverted.
        """
        if not statistics:
            return
        indices = sorted(statistics)
        accepted = {}
        if self.options.factor_decay is not None:
            accepted = self._average_factors(indices, statistics)
        if not invert:
            return
        refresh = {}
        if self.options.trace_thresholds is not None:
            refresh = self._apply_trace_rule(statistics, accepted, damping)
        # Not compiled: XLA's CPU Cholesky and triangular solve were 10x
        # slower than TensorFlow's (docs/benchmarks.md).
        if self.options.spread_inverses and replicas.replica_count() > 1:
            shared = spread_over_replicas(
                [
                    lambda i=i: self.inverses(i, statistics[i], damping)
                    for i in indices
                ],
                [[v.shape for v in self.inverses_of(i)] for i in indices],
                [refresh.get(i) for i in indices],
            )
            results = [
                self._unless_kept(i, refresh.get(i), lambda r=r: r)
                for i, r in zip(indices, shared)
            ]
        else:
            results = [
                self._unless_kept(
                    i,
                    refresh.get(i),
                    lambda i=i: self.inverses(i, statistics[i], damping),
                )
                for i in indices
            ]
        troubles = []
        for index, (a_inverse, g_inverse, trouble) in zip(indices, results):
            state = self._states[index]
            self._assign(state.a_inverse, a_inverse)
            self._assign(state.g_inverse, g_inverse)
            troubles.append(ops.cast(trouble, "int32"))
        self._assign_add(self._troubles, ops.sum(ops.stack(troubles)))

    def _average_factors(self, indices, statistics):
        """Each layer's averages and weight take its new factors if they
        are finite; otherwise both stay (a trouble is counted). Returns
        `{index: whether its new factors were taken}`."""
        accepted = {}
        troubles = []
        for index in indices:
            state = self._states[index]
            a_new, g_new = self._blocks[index].factor_blocks(
                statistics[index], self.options.split_dim
            )
            finite = all_finite([a_new, g_new])
            previous = state.factor_weight
            weight = average_weight(previous, self.options.factor_decay)
            for average, new in (
                (state.a_factor, a_new),
                (state.g_factor, g_new),
            ):
                updated = averaged_factor(average, new, weight)
                self._assign(average, ops.where(finite, updated, average))
            self._assign(previous, ops.where(finite, weight, previous))
            troubles.append(ops.cast(ops.logical_not(finite), "int32"))
            accepted[index] = finite
        self._assign_add(self._troubles, ops.sum(ops.stack(troubles)))
        return accepted

    def _current_factors(self, index, statistics):
        """`(c·A, c·G, seen)` an inversion of block `index` would use, as
        diagonal blocks: the averages (seen once a statistics step was
        accepted) with `factor_decay`, else this step's factors."""
        state = self._states[index]
        if self.options.factor_decay is not None:
            return state.a_factor, state.g_factor, state.factor_weight > 0
        a, g = self._blocks[index].factor_blocks(
            statistics[index], self.options.split_dim
        )
        return a, g, True

    def _apply_trace_rule(self, statistics, accepted, damping):
        """`{index: refresh}` of the blocks in `statistics` by the trace
        rule (`trace_rule.block_decision`); updates the last traces, the
        stopped blocks and the count of skipped inversions.

        `accepted` tells, with `factor_decay`, whether a block's averages
        took this step's factors: if not, the rule does not decide (an
        unchanged average would look settled and stop the layer).
        """
        last_traces = ops.unstack(ops.convert_to_tensor(self._last_traces))
        stopped = ops.unstack(ops.convert_to_tensor(self._stopped) > 0)
        refresh = {}
        for position, (index, block) in enumerate(self._blocks.items()):
            if index not in statistics:
                continue
            a, g, seen = self._current_factors(index, statistics)
            last = (
                last_traces[position],
                stopped[position],
                self.options.trace_thresholds,
            )
            refresh[index], stopped[position], last_traces[position] = (
                block_decision(
                    block,
                    a,
                    g,
                    damping,
                    self.options.damping_split,
                    last,
                    seen,
                    accepted.get(index, True),
                )
            )
        self._assign(self._last_traces, ops.stack(last_traces))
        self._assign(self._stopped, ops.cast(ops.stack(stopped), "int32"))
        skipped = [
            ops.cast(ops.logical_not(r), "int32") for r in refresh.values()
        ]
        self._assign_add(self._skipped, ops.sum(ops.stack(skipped)))
        return refresh

    def _unless_kept(self, index, refresh, inverses):
        """`inverses()`, or block `index`'s stored inverses (and no
        trouble) where `refresh` (a boolean tensor; `None`: always) is
        false."""
        if refresh is None:
            return inverses()
        state = self._states[index]
        return ops.cond(
            refresh,
            inverses,
            lambda: (
                ops.convert_to_tensor(state.a_inverse),
                ops.convert_to_tensor(state.g_inverse),
                ops.convert_to_tensor(False),
            ),
        )

    def inverses(self, index, statistics, damping):
        """`(A⁻¹, G⁻¹, trouble)` of block `index` from its `(A, G, c)`
        (with `factor_decay`, from its averaged factors), at damping `λ`;
        stores nothing."""
        state = self._states[index]
        block = self._blocks[index]
        if self.options.factor_decay is None:
            return block.inverses(
                statistics,
                damping,
                self.options.split_dim,
                state.a_inverse,
                state.g_inverse,
                self.options.damping_split,
            )
        a_inverse, g_inverse, trouble = block.inverses_of_blocks(
            state.a_factor,
            state.g_factor,
            damping,
            state.a_inverse,
            state.g_inverse,
            self.options.damping_split,
        )
        # No accepted statistics yet: keep the starting inverses.
        seen = state.factor_weight > 0
        return (
            ops.where(seen, a_inverse, state.a_inverse),
            ops.where(seen, g_inverse, state.g_inverse),
            trouble,
        )

    def precondition(self, index, gradient, damping, batch_size):
        """`A⁻¹ · g · G⁻¹` of block `index` from the stored inverses."""
        block = self._blocks[index]
        state = self._states[index]
        return block.precondition(
            ops.reshape(ops.cast(gradient, "float32"), block.kernel.shape),
            state.a_inverse,
            state.g_inverse,
            damping,
            batch_size,
        )

    def curvature_norm(self, index, kernel_vector, bias_vector=None):
        """`⟨u, F̂u⟩` of block `index`, `F̂ = c·A ⊗ c·G` its averaged
        factors, undamped (`factor_decay`): `u` is `kernel_vector`, with
        `bias_vector` the bias's part for a joint block."""
        state = self._states[index]
        block = self._blocks[index]
        kernel_vector = ops.reshape(
            ops.cast(kernel_vector, "float32"), block.kernel.shape
        )
        # The preconditioner's products, the factors in the inverses' place.
        if bias_vector is None:
            product = block.precondition(
                kernel_vector, state.a_factor, state.g_factor, None, None
            )
            return ops.sum(product * kernel_vector)
        bias_vector = ops.reshape(
            ops.cast(bias_vector, "float32"), block.bias.shape
        )
        kernel_product, bias_product = block.precondition_pair(
            kernel_vector, bias_vector, state.a_factor, state.g_factor
        )
        return ops.sum(kernel_product * kernel_vector) + ops.sum(
            bias_product * bias_vector
        )

    def factored_gradient(self, index, inputs, output_grads):
        """`A⁻¹ · g · G⁻¹` of one call of block `index`'s layer, in the
        factored order, from the stored inverses."""
        state = self._states[index]
        return self._blocks[index].factored_gradient(
            inputs, output_grads, state.a_inverse, state.g_inverse
        )
