"""DimReduce's part of a `BoostOptimizer`: its state, its training step
(gradient, trial losses, line search) and its update."""

import keras
from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.boost.algorithm import BoostAlgorithm
from keras_thor.src.boost.algorithm import checked_setting
from keras_thor.src.boost.algorithm import has_method
from keras_thor.src.boost.snapshots import snapshot
from keras_thor.src.boost.subspace_bfgs import armijo_step
from keras_thor.src.boost.subspace_bfgs import bfgs_inverse_update
from keras_thor.src.boost.training import taped_gradients
from keras_thor.src.distribute import replicas
from keras_thor.src.distribute.train_step import training_call
from keras_thor.src.utils.finite import all_finite

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


def check_sgd_with_unit_rate(optimizer):
    """Raises unless `optimizer` is a plain `keras.optimizers.SGD(1.0)`,
    through which DimReduce's update `w ← w − Δ` is applied."""
    if isinstance(optimizer, keras.optimizers.SGD):
        config = optimizer.get_config()
        plain = all(config.get(k) == v for k, v in _SGD_SETTINGS.items())
        if plain and config["learning_rate"] == 1.0:
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


def split_like(flat, tensors):
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


class DimReduceSearch(BoostAlgorithm):
    """The training step and state of `keras_thor.boost.DimReduce` (the
    `setting`, whose docstring gives the rule): `inverse_hessian` (`B`),
    `subspace_step` (`s`), `previous_subspace_gradient` (`g_k_prev`),
    `line_search_step` (`t`) and `residual_momenta` (`m`)."""

    argument = "dim_reduce"
    refuses = (
        "grad_accumulation_step",
        "grad_freeze",
        "centralized_variables",
        "adasum",
    )
    refusal = (
        "DimReduce runs alone (MindSpore's training cell takes its "
        "branch only): no gradient freezing, accumulation, "
        "centralization or AdaSum beside it."
    )
    runs_alone = True
    needs_boost_model = True
    without_global_loss_scale = True

    @classmethod
    def validated(cls, setting):
        # Checked by what is used, as `grad_freeze` is (DimReduce makes
        # boost optimizers itself when it installs).
        return checked_setting(
            "dim_reduce",
            setting,
            "keras_thor.boost.DimReduce",
            has_method("components_variable"),
        )

    def check_inner(self, inner_optimizer):
        check_sgd_with_unit_rate(inner_optimizer)

    def build(self, add_state, var_list):
        k = self.setting.n_components
        self.inverse_hessian = add_state(
            (k, k), "dim_reduce_inverse_hessian", keras.initializers.Identity()
        )
        self.subspace_step = add_state((k,), "dim_reduce_subspace_step")
        self.previous_subspace_gradient = add_state(
            (k,), "dim_reduce_previous_subspace_gradient"
        )
        self.line_search_step = add_state((), "dim_reduce_line_search_step")
        self.residual_momenta = [
            add_state(
                v.shape, f"{v.path.replace('/', '_')}_dim_reduce_momentum"
            )
            for v in var_list
        ]

    def bind(self, model):
        self.components = self.setting.components_variable(model)

    def train_step(self, model, variables, update):
        return lambda data: self.step(model, data, variables)

    def training_logs(self):
        return {"dim_reduce_step": ops.convert_to_tensor(self.line_search_step)}

    def direction(self, grads):
        """The subspace quantities of one step (no assignment).

        `grads`: the gradients of the trained variables summed over the
        replicas (float32). Returns a dict with the flattened gradient
        `g`, `g_k`, the updated `B`, `d_k`, the slope `g_kᵀ d_k` and `d_n`
        split per variable.
        """
        components = self.components
        flat = ops.concatenate([ops.reshape(g, (-1,)) for g in grads])
        subspace_gradient = ops.matmul(components, flat)
        # Until a step is accepted s = 0, so yᵀs = 0 keeps B = I: the
        # first step's skipped update.
        inverse_hessian = bfgs_inverse_update(
            self.inverse_hessian,
            self.subspace_step,
            subspace_gradient - self.previous_subspace_gradient,
        )
        direction = -ops.matmul(inverse_hessian, subspace_gradient)
        return {
            "flat_gradient": flat,
            "subspace_gradient": subspace_gradient,
            "inverse_hessian": inverse_hessian,
            "direction": direction,
            "slope": ops.sum(subspace_gradient * direction),
            "full_direction": split_like(
                ops.matmul(direction, components), grads
            ),
        }

    def update(self, optimizer, found, loss, trial_losses, grads, variables):
        """Chooses the step from the line search and updates state and
        weights: `w ← w − (α·m − t·d_n)` through the inner SGD(1.0).

        A non-finite gradient or loss changes neither (the step is 0).
        """
        dim = self.setting
        step = armijo_step(
            loss, trial_losses, dim.trial_steps, dim.sigma, found["slope"]
        )
        finite = ops.logical_and(
            all_finite([found["flat_gradient"]]), ops.isfinite(loss)
        )
        step = ops.where(finite, step, 0.0)
        kept = step > 0  # never when not finite
        projected = split_like(
            ops.matmul(found["subspace_gradient"], self.components), grads
        )
        momenta = [
            ops.where(finite, dim.gamma * m + (g - p), m)
            for m, g, p in zip(self.residual_momenta, grads, projected)
        ]
        deltas = [
            ops.where(finite, dim.alpha * m - step * d, 0.0)
            for m, d in zip(momenta, found["full_direction"])
        ]

        def kept_or_old(variable, new):
            return (variable, ops.where(kept, new, variable))

        replicas.assign_replicated(
            [
                kept_or_old(self.inverse_hessian, found["inverse_hessian"]),
                kept_or_old(
                    self.previous_subspace_gradient,
                    found["subspace_gradient"],
                ),
                kept_or_old(self.subspace_step, step * found["direction"]),
                (self.line_search_step, step),
                (optimizer.micro_steps, optimizer.micro_steps + 1),
                *zip(self.residual_momenta, momenta),
            ]
        )
        # Keras's optimizer sums the replicas' gradients: each passes its
        # share of the (replica-identical) update.
        count = replicas.replica_count()
        optimizer.inner_optimizer.apply(
            [ops.cast(d / count, v.dtype) for d, v in zip(deltas, variables)],
            variables,
        )

    def step(self, model, data, variables):
        """One step: the gradient, one or two trial forward passes on the
        same batch, then `update`.

        The trials run in training mode from the step's own random state
        (dropout masks) and leave the model's other variables (moving
        statistics, random state) and the metrics as the step left them.
        """
        states = list(model.non_trainable_variables)
        states_before = snapshot(states)
        (x, y, sample_weight), y_pred, loss, grads = taped_gradients(
            model, data, variables
        )
        states_after = snapshot(states)
        metrics = list(model.metrics_variables)
        metrics_after = snapshot(metrics)
        grads = replicas.all_reduce_sum(
            [
                ops.zeros(v.shape, "float32")
                if g is None
                else ops.cast(ops.convert_to_tensor(g), "float32")
                for g, v in zip(grads, variables)
            ]
        )
        (loss,) = replicas.all_reduce_sum([ops.cast(loss, "float32")])
        found = self.direction(grads)
        weights = snapshot(variables)

        def trial_loss(t):
            """The batch loss at `w + t·d_n` (replica mean)."""
            tried = [
                ops.cast(w + t * d, v.dtype)
                for w, d, v in zip(weights, found["full_direction"], variables)
            ]
            _restore(variables + states, tried + states_before)
            trial_pred = training_call(model, x)
            trial = keras_internals.compute_loss(
                model, x, y, trial_pred, sample_weight
            )
            return replicas.all_reduce_sum([ops.cast(trial, "float32")])[0]

        trial_losses = self._trial_losses(loss, found["slope"], trial_loss)
        _restore(
            variables + states + metrics,
            weights + states_after + metrics_after,
        )
        self.update(
            model.optimizer, found, loss, trial_losses, grads, variables
        )
        logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return {**logs, **model.optimizer.training_logs()}

    def _trial_losses(self, loss, slope, trial_loss):
        """The losses at the trial steps `(1, ρ)`; the second one only
        when the first fails, outside a strategy (MindSpore's order).
        Under a strategy both run: a collective or merge call in a `cond`
        breaks under tf.distribute."""
        first, second = self.setting.trial_steps
        first_loss = trial_loss(first)
        if replicas.under_strategy():
            return [first_loss, trial_loss(second)]
        accepted = ops.logical_and(
            loss + self.setting.sigma * first * slope > first_loss,
            ops.isfinite(first_loss),
        )
        second_loss = ops.cond(
            accepted, lambda: first_loss, lambda: trial_loss(second)
        )
        return [first_loss, second_loss]


def _restore(variables, values):
    """Puts `values` back: metrics (each replica's own) by plain
    assignment, the model's variables in one cross-replica update."""
    local = [(v, x) for v, x in zip(variables, values) if _on_read(v)]
    for variable, value in local:
        variable.assign(value)
    replicas.assign_replicated(
        (v, x) for v, x in zip(variables, values) if not _on_read(v)
    )


def _on_read(variable):
    return getattr(variable, "synchronization", None) == "on_read"
