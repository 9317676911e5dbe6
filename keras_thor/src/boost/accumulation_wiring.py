"""Gradient accumulation's part of a `BoostOptimizer` step."""

import keras
from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.backend.dense import dense
from keras_thor.src.boost.algorithm import BoostAlgorithm
from keras_thor.src.distribute import replicas
from keras_thor.src.utils.finite import all_finite
from keras_thor.src.utils.validation import check_int


class Accumulation(BoostAlgorithm):
    """Applies the mean gradient of every `N` micro-steps:

    ```
    acc ← acc + g / (S·N)            (skipped when g is not finite)
    every N-th step: inner.apply(acc); acc ← 0
    ```

    Notation:
        - `N`: `setting` (`grad_accumulation_step`); `g`: the gradients
          summed over the replicas; `acc`: `accumulators`.
        - `S`: a `LossScaleOptimizer` inner optimizer's scale (else 1),
          halved on a non-finite `g`.
    """

    argument = "grad_accumulation_step"
    needs_boost_model = True
    applies_updates = True

    @classmethod
    def validated(cls, setting):
        return check_int("grad_accumulation_step", setting, minimum=1)

    @classmethod
    def enabled(cls, setting):
        return setting > 1

    @classmethod
    def serialized(cls, setting):
        return setting

    @classmethod
    def deserialized(cls, config, custom_objects=None):
        return config

    def build(self, add_state, var_list):
        self.accumulators = [
            add_state(v.shape, f"{v.path.replace('/', '_')}_accumulator")
            for v in var_list
        ]

    def updates_at(self, step):
        return (step + 1) % self.setting == 0

    def apply(self, optimizer, grads, variables, update, probe_gradients):
        inner = optimizer.inner_optimizer
        loss_scaled = isinstance(inner, keras.optimizers.LossScaleOptimizer)
        present = [(g, v) for g, v in zip(grads, variables) if g is not None]
        # The accumulators are dense: so are an embedding's sums.
        reduced = replicas.all_reduce_sum(
            [ops.cast(dense(g), "float32") for g, _ in present]
        )
        finite = all_finite(reduced)
        scale = ops.cast(inner.dynamic_scale, "float32") if loss_scaled else 1.0
        accumulators = [
            self.accumulators[
                keras_internals.trained_variable_index(optimizer, v)
            ]
            for _, v in present
        ]
        totals = [
            acc + ops.where(finite, g / (scale * self.setting), 0)
            for acc, g in zip(accumulators, reduced)
        ]
        if loss_scaled:
            _lower_scale_unless(inner, finite)
        if not update:
            replicas.assign_replicated(zip(accumulators, totals))
            return
        count = replicas.replica_count()
        if loss_scaled:
            # The loss scale optimizer unscales by its (possibly lowered)
            # scale, and every replica's share is summed once more.
            new_scale = ops.cast(inner.dynamic_scale, "float32")
            shares = [total * (new_scale / count) for total in totals]
        else:
            shares = [total / count for total in totals]
        inner.apply(
            [ops.cast(s, v.dtype) for s, (_, v) in zip(shares, present)],
            [v for _, v in present],
        )
        replicas.assign_replicated(
            (acc, ops.zeros_like(acc)) for acc in accumulators
        )


def _lower_scale_unless(loss_scale_optimizer, finite):
    """Halves the loss scale (and restarts its growth count) unless
    `finite`."""
    lso = loss_scale_optimizer
    replicas.assign_replicated(
        [
            (
                lso.dynamic_scale,
                ops.where(finite, lso.dynamic_scale, lso.dynamic_scale / 2),
            ),
            (lso.step_counter, ops.where(finite, lso.step_counter, 0)),
        ]
    )
