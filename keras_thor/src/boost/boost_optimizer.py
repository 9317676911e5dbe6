"""`BoostOptimizer`: the optimizer side of keras_thor's boost algorithms."""

import keras
from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.boost.adasum import AdaSum
from keras_thor.src.boost.adasum import adasum_tree
from keras_thor.src.boost.centralization import centralize_gradient
from keras_thor.src.distribute import replicas
from keras_thor.src.utils.finite import all_finite
from keras_thor.src.utils.validation import check_int


def _check_adasum(adasum, inner_optimizer, grad_accumulation_step):
    if adasum is None:
        return None
    if not isinstance(adasum, AdaSum):
        raise TypeError(
            "Argument `adasum` must be a `keras_thor.boost.AdaSum` or None. "
            f"Received: adasum={adasum!r}"
        )
    if grad_accumulation_step > 1 or isinstance(
        inner_optimizer, keras.optimizers.LossScaleOptimizer
    ):
        raise ValueError(
            "AdaSum combines with neither gradient accumulation nor a "
            "`LossScaleOptimizer` in this version. Received: adasum="
            f"{adasum!r}, grad_accumulation_step={grad_accumulation_step}, "
            f"inner_optimizer={type(inner_optimizer).__name__}"
        )
    return adasum


def _check_freeze(grad_freeze):
    # Checked by what is used (the schedule's `group_at`): the freezing
    # builds boost optimizers itself (`freeze_generate`), so this module
    # does not import it.
    if grad_freeze is not None and not callable(
        getattr(grad_freeze, "group_at", None)
    ):
        raise TypeError(
            "Argument `grad_freeze` must be a "
            "`keras_thor.boost.GradientFreeze` or None. "
            f"Received: grad_freeze={grad_freeze!r}"
        )
    return grad_freeze


@keras_thor_export
class BoostOptimizer(keras.optimizers.Optimizer):
    """Wraps an optimizer with gradient centralization, gradient freezing
    and gradient accumulation (MindSpore boost's optimizer side).

    Per training step, with `g` the gradients of the trained variables:

    ```
    g ← g − mean(g)             for `centralized_variables` (per output)
    k = sequence[t mod |sequence|]                  (with `grad_freeze`)
    acc ← acc + g / N                   (skipped when g is not finite)
    every N-th step: inner.apply(acc) on the variables of group k; acc ← 0
    t ← t + 1
    ```

    With `adasum` (under a `tf.distribute` strategy) each replica instead
    takes its own inner step and the weight deltas are combined:
    `w ← w + AdasumTree(Δ_group_0, ...)` (see `keras_thor.boost.AdaSum`).

    Notation:
        - `t`: the training steps so far (`micro_steps`), overflowed ones
          included; `N`: `grad_accumulation_step`.
        - `k`: with `grad_freeze`, the group trained at step `t`; its
          variables are the only ones that get gradients and updates.

    Gradient freezing and accumulation need a model that runs the step
    for them: `keras_thor.boost` returns one (`BoostFunctional`,
    `BoostSequential`). With neither, this optimizer (centralization,
    AdaSum) works in any Keras model. A non-finite gradient is applied as zero
    (a `keras.optimizers.LossScaleOptimizer` inside skips the step and
    lowers its scale instead).

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` that updates the
            weights (a `LossScaleOptimizer` included).
        grad_accumulation_step: Integer >= 1, micro-steps per update.
        grad_freeze: A `keras_thor.boost.GradientFreeze`, or None.
        centralized_variables: Paths (`variable.path`) of the variables
            whose gradients are centralized;
            `keras_thor.boost.OptimizerProcess.add_grad_centralization`
            selects them with MindSpore's rule.
        adasum: A `keras_thor.boost.AdaSum`, or None.
        name: The optimizer's name.
    """

    def __init__(
        self,
        inner_optimizer,
        grad_accumulation_step=1,
        grad_freeze=None,
        centralized_variables=(),
        adasum=None,
        name=None,
    ):
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "Argument `inner_optimizer` must be a "
                "`keras.optimizers.Optimizer`. "
                f"Received: inner_optimizer={inner_optimizer!r}"
            )
        if isinstance(inner_optimizer, BoostOptimizer):
            raise ValueError(
                "Argument `inner_optimizer` is already a `BoostOptimizer`. "
                f"Received: inner_optimizer={inner_optimizer!r}"
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self.grad_accumulation_step = check_int(
            "grad_accumulation_step", grad_accumulation_step, minimum=1
        )
        self.grad_freeze = _check_freeze(grad_freeze)
        if self.grad_freeze is not None and self.grad_accumulation_step > 1:
            raise ValueError(
                "Gradient freezing and gradient accumulation do not combine "
                "(MindSpore's combination is broken; keras_thor refuses "
                "it). Received: grad_freeze="
                f"{grad_freeze!r}, grad_accumulation_step="
                f"{grad_accumulation_step}"
            )
        if isinstance(centralized_variables, str) or not all(
            isinstance(path, str) for path in centralized_variables
        ):
            raise TypeError(
                "Argument `centralized_variables` must be a list of "
                "variable paths (strings). "
                f"Received: centralized_variables={centralized_variables!r}"
            )
        self.centralized_variables = list(centralized_variables)
        self.adasum = _check_adasum(
            adasum, self.inner_optimizer, self.grad_accumulation_step
        )

    def build(self, var_list):
        """Creates the step counter, then one accumulator per variable
        (with `grad_accumulation_step > 1`), then the inner state."""
        if self.built:
            return
        self.micro_steps = self.add_variable(
            (), "zeros", "int64", aggregation="none", name="micro_steps"
        )
        self._accumulators = []
        if self.grad_accumulation_step > 1:
            self._accumulators = [
                self.add_variable(
                    v.shape,
                    "zeros",
                    "float32",
                    aggregation="none",
                    name=f"{v.path.replace('/', '_')}_accumulator",
                )
                for v in var_list
            ]
        self.inner_optimizer.build(var_list)
        if self.adasum is not None:
            replicas.use_local_gradients(self.inner_optimizer)
        super().build(var_list)

    @property
    def variables(self):
        return (
            keras_internals.own_optimizer_variables(self)
            + self.inner_optimizer.variables
        )

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        """The inner optimizer's updates so far."""
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    @property
    def needs_boost_model(self):
        """Whether steps differ (which group, whether to apply), so that
        a `keras_thor.boost` model must run them."""
        return self.grad_freeze is not None or self.grad_accumulation_step > 1

    def applies_at(self, step):
        """Whether training step `step` updates the weights."""
        return (step + 1) % self.grad_accumulation_step == 0

    def apply(self, grads, trainable_variables=None):
        """Keras's entry point: one step that always updates (centralized
        gradients; no freezing or accumulation outside a boost model)."""
        if self.needs_boost_model:
            raise ValueError(
                "Gradient freezing and accumulation run in the training "
                "step of a `keras_thor.boost` model: pass your model through "
                "`keras_thor.boost.AutoBoost(...).network_auto_process_train`"
                " or `keras_thor.boost.to_boost_model`. Received: a "
                "`BoostOptimizer` applied by another training step."
            )
        if trainable_variables is None:
            trainable_variables = keras_internals.trained_variables(self)
        self.boost_apply(list(grads), list(trainable_variables), True)

    def boost_apply(self, grads, variables, update):
        """One training step's gradients of `variables` (per replica).

        `update`: whether this step updates the weights (the last of `N`
        micro-steps); otherwise the gradients are only accumulated.
        """
        if not self.built:
            self.build(variables)
        grads = self._centralize(grads, variables)
        loss_scaled = isinstance(
            self.inner_optimizer, keras.optimizers.LossScaleOptimizer
        )
        if self.adasum is not None:
            self._adasum_apply(grads, variables)
        elif self.grad_accumulation_step == 1 and loss_scaled:
            self.inner_optimizer.apply(
                replicas.overflow_on_every_replica(grads), variables
            )
        elif self.grad_accumulation_step == 1:
            self.inner_optimizer.apply(
                self._zeroed_unless_finite(grads), variables
            )
        else:
            self._accumulate(grads, variables, update, loss_scaled)
        replicas.assign_replicated([(self.micro_steps, self.micro_steps + 1)])

    def _centralize(self, grads, variables):
        paths = set(self.centralized_variables)
        return [
            centralize_gradient(g) if g is not None and v.path in paths else g
            for g, v in zip(grads, variables)
        ]

    def _zeroed_unless_finite(self, grads):
        finite = replicas.finite_on_all_replicas(grads)
        return [
            None if g is None else ops.where(finite, g, ops.zeros_like(g))
            for g in grads
        ]

    def _accumulate(self, grads, variables, update, loss_scaled):
        present = [(g, v) for g, v in zip(grads, variables) if g is not None]
        reduced = replicas.all_reduce_sum(
            [ops.cast(g, "float32") for g, _ in present]
        )
        finite = all_finite(reduced)
        scale = (
            ops.cast(self.inner_optimizer.dynamic_scale, "float32")
            if loss_scaled
            else 1.0
        )
        accumulators = [
            self._accumulators[keras_internals.trained_variable_index(self, v)]
            for _, v in present
        ]
        totals = [
            acc
            + ops.where(finite, g / (scale * self.grad_accumulation_step), 0)
            for acc, g in zip(accumulators, reduced)
        ]
        if loss_scaled:
            self._lower_scale_unless(finite)
        if not update:
            replicas.assign_replicated(zip(accumulators, totals))
            return
        count = replicas.replica_count()
        if loss_scaled:
            # The loss scale optimizer unscales by its (possibly lowered)
            # scale, and every replica's share is summed once more.
            new_scale = ops.cast(self.inner_optimizer.dynamic_scale, "float32")
            shares = [total * (new_scale / count) for total in totals]
        else:
            shares = [total / count for total in totals]
        self.inner_optimizer.apply(
            [ops.cast(s, v.dtype) for s, (_, v) in zip(shares, present)],
            [v for _, v in present],
        )
        replicas.assign_replicated(
            (acc, ops.zeros_like(acc)) for acc in accumulators
        )

    def _adasum_apply(self, grads, variables):
        """A local inner step on every replica, then `w ← w + AdaSum(Δ)`."""
        present = [(g, v) for g, v in zip(grads, variables) if g is not None]
        group_size = self.adasum.device_number
        groups = self.adasum.group_count(replicas.replica_count())
        # Each replica steps on the gradient of its own mean loss (Keras
        # divides each replica's loss by the replica count).
        count = replicas.replica_count()
        grads = [
            g * count
            for g in self._zeroed_unless_finite([g for g, _ in present])
        ]
        if group_size > 1:
            first = (replicas.replica_id() // group_size) * group_size
            members = first + ops.arange(group_size)
            grads = [
                ops.mean(ops.take(gathered, members, axis=0), axis=0)
                for gathered in replicas.all_gather(grads)
            ]
        variables = [v for _, v in present]
        before = [ops.copy(ops.convert_to_tensor(v)) for v in variables]
        self.inner_optimizer.apply(grads, variables)
        deltas = replicas.all_gather(
            [
                ops.convert_to_tensor(v) - old
                for v, old in zip(variables, before)
            ]
        )
        combined = [
            adasum_tree([gathered[g * group_size] for g in range(groups)])
            for gathered in deltas
        ]
        replicas.assign_replicated(
            (v, old + delta)
            for v, old, delta in zip(variables, before, combined)
        )

    def _lower_scale_unless(self, finite):
        lso = self.inner_optimizer
        replicas.assign_replicated(
            [
                (
                    lso.dynamic_scale,
                    ops.where(finite, lso.dynamic_scale, lso.dynamic_scale / 2),
                ),
                (lso.step_counter, ops.where(finite, lso.step_counter, 0)),
            ]
        )

    def replaced(self, **changes):
        """A new `BoostOptimizer` over the same inner optimizer, with
        `changes` to its other arguments."""
        arguments = {
            "inner_optimizer": self.inner_optimizer,
            "grad_accumulation_step": self.grad_accumulation_step,
            "grad_freeze": self.grad_freeze,
            "centralized_variables": self.centralized_variables,
            "adasum": self.adasum,
            "name": self.name,
        }
        return BoostOptimizer(**{**arguments, **changes})

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(
                self.inner_optimizer
            ),
            "grad_accumulation_step": self.grad_accumulation_step,
            "grad_freeze": keras.saving.serialize_keras_object(
                self.grad_freeze
            ),
            "centralized_variables": list(self.centralized_variables),
            "adasum": keras.saving.serialize_keras_object(self.adasum),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        for key in ("inner_optimizer", "grad_freeze", "adasum"):
            config[key] = keras.saving.deserialize_keras_object(
                config[key], custom_objects=custom_objects
            )
        return cls(**config)


def GradientAccumulation(max_accumulation_step, optimizer):
    """`optimizer` updating with the mean gradient of every
    `max_accumulation_step` micro-steps: MindSpore's
    `mindspore.boost.GradientAccumulation(max_accumulation_step,
    optimizer)`, as a `BoostOptimizer` for a `keras_thor.boost` model."""
    return BoostOptimizer(
        optimizer, grad_accumulation_step=max_accumulation_step
    )
