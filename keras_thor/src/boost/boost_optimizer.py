"""`BoostOptimizer`: the optimizer side of keras_thor's boost algorithms."""

import keras
from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.boost.adasum import AdaSum
from keras_thor.src.boost.adasum import adasum_tree
from keras_thor.src.boost.centralization import centralize_gradient
from keras_thor.src.boost.snapshots import snapshot
from keras_thor.src.boost.subspace_bfgs import armijo_step
from keras_thor.src.boost.subspace_bfgs import bfgs_inverse_update
from keras_thor.src.distribute import replicas
from keras_thor.src.utils.finite import all_finite
from keras_thor.src.utils.validation import check_int

# Group loss scales grow no further (a group whose gradients are all zero
# would otherwise reach infinity after ~10^5 steps; 1/2^126 is still a
# normal float32).
MAX_GROUP_SCALE = 2.0**126

# The optimizer that applies DimReduce's update as MindSpore does.
_SGD_SETTINGS = {
    "momentum": 0.0,
    "nesterov": False,
    "weight_decay": None,
    "clipnorm": None,
    "clipvalue": None,
    "global_clipnorm": None,
    "use_ema": False,
    "gradient_accumulation_steps": None,
    "loss_scale_factor": None,
}


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


def check_sgd_with_unit_rate(optimizer):
    """Raises unless `optimizer` is a plain `keras.optimizers.SGD(1.0)`,
    through which DimReduce's update `w ← w − Δ` is applied."""
    if isinstance(optimizer, keras.optimizers.SGD):
        config = optimizer.get_config()
        learning_rate = config["learning_rate"]
        plain = all(config.get(k) == v for k, v in _SGD_SETTINGS.items())
        if plain and learning_rate == 1.0:
            return
    raise ValueError(
        "DimReduce applies its update through "
        "`keras.optimizers.SGD(learning_rate=1.0)` (no momentum, weight "
        "decay, clipping, EMA or accumulation), as MindSpore does; its "
        "step size comes from the line search. Received: "
        f"optimizer={optimizer!r}"
        + (
            f" with config {optimizer.get_config()}"
            if isinstance(optimizer, keras.optimizers.Optimizer)
            else ""
        )
    )


def _check_alone(message, others, refused):
    """Raises `message` with the enabled algorithms among `others` (a
    dict, name to setting) that `refused` names, if there are any."""
    enabled = [(name, others[name]) for name in refused if others[name]]
    if enabled:
        raise ValueError(
            f"{message} Received: "
            + ", ".join(f"{name}={value!r}" for name, value in enabled)
        )


def _check_dim_reduce(dim_reduce, inner_optimizer, others):
    # Checked by what is used, as `grad_freeze` is (DimReduce makes boost
    # optimizers itself when it installs).
    if dim_reduce is None:
        return None
    if not callable(getattr(dim_reduce, "components_variable", None)):
        raise TypeError(
            "Argument `dim_reduce` must be a `keras_thor.boost.DimReduce` "
            f"or None. Received: dim_reduce={dim_reduce!r}"
        )
    _check_alone(
        "DimReduce runs alone (MindSpore's training cell takes its "
        "branch only): no gradient freezing, accumulation, "
        "centralization or AdaSum beside it.",
        others,
        (
            "grad_accumulation_step",
            "grad_freeze",
            "centralized_variables",
            "adasum",
        ),
    )
    check_sgd_with_unit_rate(inner_optimizer)
    return dim_reduce


def _check_group_loss_scale(group_loss_scale, inner_optimizer, others):
    # Checked by what is used, as `grad_freeze` is.
    if group_loss_scale is None:
        return None
    if not callable(getattr(group_loss_scale, "groups_of", None)):
        raise TypeError(
            "Argument `group_loss_scale` must be a "
            "`keras_thor.callbacks.GroupLossScale` or None. "
            f"Received: group_loss_scale={group_loss_scale!r}"
        )
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "Group loss scaling replaces the global loss scale: pass the "
            "optimizer without its `LossScaleOptimizer` (the "
            "`GroupLossScale` callback unwraps it). Received: "
            f"inner_optimizer={inner_optimizer!r}"
        )
    _check_alone(
        "Group loss scaling runs alone in this version (MindSpore's "
        "loss-scale cell has no freezing branch): no gradient "
        "freezing, accumulation, AdaSum or DimReduce beside it.",
        others,
        ("grad_accumulation_step", "grad_freeze", "adasum", "dim_reduce"),
    )
    return group_loss_scale


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
    """Wraps an optimizer with gradient centralization, gradient freezing,
    gradient accumulation, AdaSum, DimReduce or group loss scaling
    (MindSpore boost's optimizer side).

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
    With `dim_reduce` the step is DimReduce's line search in a subspace
    (`keras_thor.boost.DimReduce`); with `group_loss_scale`, each group's
    gradients are unscaled by its own scale and the step is skipped on an
    overflow (`keras_thor.callbacks.GroupLossScale`). Both run alone.

    Notation:
        - `t`: the training steps so far (`micro_steps`), overflowed ones
          included; `N`: `grad_accumulation_step`.
        - `k`: with `grad_freeze`, the group trained at step `t`; its
          variables are the only ones that get gradients and updates.

    Gradient freezing, accumulation, DimReduce and group loss scaling
    need a model that runs the step for them: `keras_thor.boost` returns
    one (`BoostFunctional`, `BoostSequential`). With none of them, this
    optimizer (centralization, AdaSum) works in any Keras model. A
    non-finite gradient is applied as zero
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
        dim_reduce: A `keras_thor.boost.DimReduce`, or None; the inner
            optimizer must be `keras.optimizers.SGD(1.0)`.
        group_loss_scale: A `keras_thor.callbacks.GroupLossScale`, or
            None; the inner optimizer must not be a `LossScaleOptimizer`.
        name: The optimizer's name.
    """

    def __init__(
        self,
        inner_optimizer,
        grad_accumulation_step=1,
        grad_freeze=None,
        centralized_variables=(),
        adasum=None,
        dim_reduce=None,
        group_loss_scale=None,
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
        # The other algorithms, which DimReduce and group loss scaling
        # check they run without.
        others = {
            "grad_accumulation_step": self.grad_accumulation_step
            if self.grad_accumulation_step > 1
            else None,
            "grad_freeze": self.grad_freeze,
            "centralized_variables": self.centralized_variables,
            "adasum": self.adasum,
        }
        self.dim_reduce = _check_dim_reduce(
            dim_reduce, self.inner_optimizer, others
        )
        others["dim_reduce"] = self.dim_reduce
        self.group_loss_scale = _check_group_loss_scale(
            group_loss_scale, self.inner_optimizer, others
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
        if self.dim_reduce is not None:
            self._build_dim_reduce(var_list)
        if self.group_loss_scale is not None:
            self._group_overflows = self.add_variable(
                (self.group_loss_scale.group_count,),
                "zeros",
                "float32",
                aggregation="none",
                name="group_loss_scale_overflows",
            )
        self.inner_optimizer.build(var_list)
        if self.adasum is not None:
            replicas.use_local_gradients(self.inner_optimizer)
        super().build(var_list)

    def _build_dim_reduce(self, var_list):
        k = self.dim_reduce.n_components

        def state(shape, name, initializer="zeros"):
            return self.add_variable(
                shape, initializer, "float32", aggregation="none", name=name
            )

        self._inverse_hessian = state(
            (k, k), "dim_reduce_inverse_hessian", keras.initializers.Identity()
        )
        self._subspace_step = state((k,), "dim_reduce_subspace_step")
        self._previous_subspace_gradient = state(
            (k,), "dim_reduce_previous_subspace_gradient"
        )
        self._line_search_step = state((), "dim_reduce_line_search_step")
        self._residual_momenta = [
            state(v.shape, f"{v.path.replace('/', '_')}_dim_reduce_momentum")
            for v in var_list
        ]

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
        return (
            self.grad_freeze is not None
            or self.grad_accumulation_step > 1
            or self.dim_reduce is not None
            or self.group_loss_scale is not None
        )

    def applies_at(self, step):
        """Whether training step `step` updates the weights."""
        return (step + 1) % self.grad_accumulation_step == 0

    def apply(self, grads, trainable_variables=None):
        """Keras's entry point: one step that always updates (centralized
        gradients; no freezing or accumulation outside a boost model)."""
        if self.needs_boost_model:
            raise ValueError(
                "Gradient freezing, accumulation, DimReduce and group loss "
                "scaling run in the training step of a `keras_thor.boost` "
                "model: pass your model through "
                "`keras_thor.boost.AutoBoost(...).network_auto_process_train`"
                " or `keras_thor.boost.to_boost_model`. Received: a "
                "`BoostOptimizer` applied by another training step."
            )
        if trainable_variables is None:
            trainable_variables = keras_internals.trained_variables(self)
        self.boost_apply(list(grads), list(trainable_variables), True)

    def overflow_probes(self):
        """The overflow probes of the group loss scale markers, one per
        group (their gradients tell which segments overflowed), or []."""
        if self.group_loss_scale is None:
            return []
        return self.group_loss_scale.overflow_probes()

    def boost_apply(self, grads, variables, update, segment_overflows=()):
        """One training step's gradients of `variables` (per replica).

        `update`: whether this step updates the weights (the last of `N`
        micro-steps); otherwise the gradients are only accumulated.
        `segment_overflows`: with group loss scaling, the gradients of
        `overflow_probes()` (1 where a segment's backward pass overflowed).
        """
        if not self.built:
            self.build(variables)
        grads = self._centralize(grads, variables)
        loss_scaled = isinstance(
            self.inner_optimizer, keras.optimizers.LossScaleOptimizer
        )
        if self.group_loss_scale is not None:
            self._group_scaled_apply(grads, variables, segment_overflows)
        elif self.adasum is not None:
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
        before = snapshot(variables)
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

    def training_logs(self):
        """What the boost algorithm is doing, for the step's logs (and so
        `History` and `TensorBoard`)."""
        logs = {}
        if self.dim_reduce is not None:
            logs["dim_reduce_step"] = ops.convert_to_tensor(
                self._line_search_step
            )
        if self.group_loss_scale is not None:
            scales = self.group_loss_scale.manager.scales
            for j in range(self.group_loss_scale.group_count):
                logs[f"group_{j}_loss_scale"] = scales[j + 1]
                logs[f"group_{j}_overflows"] = self._group_overflows[j]
        return logs

    def _group_scaled_apply(self, grads, variables, segment_overflows):
        """Per-group overflow checks, scale updates, and the inner step
        on gradients unscaled by their group's scale, skipped when any
        group overflowed (see `keras_thor.callbacks.GroupLossScale`)."""
        scaling = self.group_loss_scale
        manager = scaling.manager
        groups = scaling.groups_of(variables)
        scales = manager.scales
        # A group overflows when one of its gradients, or the gradient
        # its segment passes on (its marker's probe), is not finite.
        segments = replicas.all_reduce_sum(
            [
                ops.zeros(()) if o is None else ops.cast(o, "float32")
                for o in segment_overflows
            ]
        )
        overflow = ops.stack(
            [
                ops.logical_or(
                    ops.logical_not(
                        replicas.finite_on_all_replicas(
                            [
                                g
                                for g, group in zip(grads, groups)
                                if group == j and g is not None
                            ]
                        )
                    ),
                    segments[j] > 0,
                )
                for j in range(scaling.group_count)
            ]
        )
        skipped = ops.any(overflow)
        factors = ops.where(
            overflow, scaling.backoff_factor, scaling.growth_factor
        )
        present = [
            (g, v, group)
            for g, v, group in zip(grads, variables, groups)
            if g is not None
        ]
        unscaled = [
            ops.where(
                skipped,
                ops.zeros_like(g),
                g / ops.cast(scales[group + 1], g.dtype),
            )
            for g, _, group in present
        ]
        updated = [v for _, v, _ in present]
        overflows = (
            self._group_overflows,
            self._group_overflows + ops.cast(overflow, "float32"),
        )
        if not replicas.under_strategy():

            def apply():
                self.inner_optimizer.apply(unscaled, updated)
                return ops.zeros(())

            ops.cond(skipped, lambda: ops.zeros(()), apply)
            replicas.assign_replicated([overflows])
        else:
            # Under a strategy a skipped step runs the inner step on zeros
            # and undoes it (weights and optimizer state restored): a
            # `cond` around its merge call breaks under tf.distribute.
            kept = updated + list(self.inner_optimizer.variables)
            before = snapshot(kept)
            self.inner_optimizer.apply(unscaled, updated)
            replicas.assign_replicated(
                [
                    (v, ops.where(skipped, old, ops.convert_to_tensor(v)))
                    for v, old in zip(kept, before)
                ]
                + [overflows]
            )
        grown = ops.minimum(scales[1:-1] * factors, MAX_GROUP_SCALE)
        manager.assign_scales(ops.concatenate([scales[:1], grown, scales[-1:]]))

    def dim_reduce_direction(self, grads, components):
        """The subspace quantities of one DimReduce step (no assignment).

        `grads`: the gradients of the trained variables summed over the
        replicas (float32); `components`: `P`. Returns a dict with the
        flattened gradient `g`, `g_k`, the updated `B`, `d_k`, the slope
        `g_kᵀ d_k` and `d_n` split per variable.
        """
        flat = ops.concatenate([ops.reshape(g, (-1,)) for g in grads])
        subspace_gradient = ops.matmul(components, flat)
        # Until a step is accepted s = 0, so yᵀs = 0 keeps B = I: the
        # first step's skipped update.
        inverse_hessian = bfgs_inverse_update(
            self._inverse_hessian,
            self._subspace_step,
            subspace_gradient - self._previous_subspace_gradient,
        )
        direction = -ops.matmul(inverse_hessian, subspace_gradient)
        return {
            "flat_gradient": flat,
            "subspace_gradient": subspace_gradient,
            "inverse_hessian": inverse_hessian,
            "direction": direction,
            "slope": ops.sum(subspace_gradient * direction),
            "full_direction": _split_like(
                ops.matmul(direction, components), grads
            ),
        }

    def dim_reduce_apply(
        self, found, components, loss, trial_losses, grads, variables
    ):
        """Chooses the step from the line search and updates state and
        weights: `w ← w − (α·m − t·d_n)` through the inner SGD(1.0).

        A non-finite gradient or loss changes neither (the step is 0).
        """
        dim = self.dim_reduce
        step = armijo_step(
            loss, trial_losses, dim.trial_steps, dim.sigma, found["slope"]
        )
        finite = ops.logical_and(
            all_finite([found["flat_gradient"]]), ops.isfinite(loss)
        )
        step = ops.where(finite, step, 0.0)
        kept = step > 0  # never when not finite
        projected = _split_like(
            ops.matmul(found["subspace_gradient"], components), grads
        )
        momenta = [
            ops.where(finite, dim.gamma * m + (g - p), m)
            for m, g, p in zip(self._residual_momenta, grads, projected)
        ]
        deltas = [
            ops.where(finite, dim.alpha * m - step * d, 0.0)
            for m, d in zip(momenta, found["full_direction"])
        ]
        replicas.assign_replicated(
            [
                (
                    self._inverse_hessian,
                    ops.where(
                        kept, found["inverse_hessian"], self._inverse_hessian
                    ),
                ),
                (
                    self._previous_subspace_gradient,
                    ops.where(
                        kept,
                        found["subspace_gradient"],
                        self._previous_subspace_gradient,
                    ),
                ),
                (
                    self._subspace_step,
                    ops.where(
                        kept, step * found["direction"], self._subspace_step
                    ),
                ),
                (self._line_search_step, step),
                (self.micro_steps, self.micro_steps + 1),
                *zip(self._residual_momenta, momenta),
            ]
        )
        # Keras's optimizer sums the replicas' gradients: each passes its
        # share of the (replica-identical) update.
        count = replicas.replica_count()
        self.inner_optimizer.apply(
            [ops.cast(d / count, v.dtype) for d, v in zip(deltas, variables)],
            variables,
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
            "dim_reduce": self.dim_reduce,
            "group_loss_scale": self.group_loss_scale,
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
            "dim_reduce": keras.saving.serialize_keras_object(self.dim_reduce),
            "group_loss_scale": keras.saving.serialize_keras_object(
                self.group_loss_scale
            ),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        for key in (
            "inner_optimizer",
            "grad_freeze",
            "adasum",
            "dim_reduce",
            "group_loss_scale",
        ):
            config[key] = keras.saving.deserialize_keras_object(
                config[key], custom_objects=custom_objects
            )
        return cls(**config)


def _split_like(flat, tensors):
    """`flat` cut into pieces shaped like `tensors` (row-major)."""
    pieces = []
    offset = 0
    for t in tensors:
        size = 1
        for dim in t.shape:
            size *= dim
        pieces.append(ops.reshape(flat[offset : offset + size], t.shape))
        offset += size
    return pieces


def GradientAccumulation(max_accumulation_step, optimizer):
    """`optimizer` updating with the mean gradient of every
    `max_accumulation_step` micro-steps: MindSpore's
    `mindspore.boost.GradientAccumulation(max_accumulation_step,
    optimizer)`, as a `BoostOptimizer` for a `keras_thor.boost` model."""
    return BoostOptimizer(
        optimizer, grad_accumulation_step=max_accumulation_step
    )
