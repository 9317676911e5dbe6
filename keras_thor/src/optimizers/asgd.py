"""Averaged stochastic gradient descent, as `torch.optim.ASGD`."""

import contextlib

from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.backend.dense import dense
from keras_thor.src.backend.fusion import fused
from keras_thor.src.backend.values import numpy_value
from keras_thor.src.optimizers.batched_update import BatchedUpdate
from keras_thor.src.optimizers.docstrings import with_base_keyword_args
from keras_thor.src.optimizers.reference_optimizer import ReferenceOptimizer
from keras_thor.src.utils import validation
from keras_thor.src.utils.finite import if_finite
from keras_thor.src.utils.finite import is_finite


def asgd_eta(learning_rate, lambd, alpha, step):
    """Step size after `step` updates: `lr / (1 + lambd * lr * step) ** alpha`.

    At `step=0` this is `learning_rate`, torch's initial `eta`.
    """
    return learning_rate / ops.power(1.0 + lambd * learning_rate * step, alpha)


def asgd_mu(step, t0):
    """Averaging weight after `step` updates: `1 / max(1, step - t0)`."""
    return 1.0 / ops.maximum(1.0, step - t0)


def asgd_parameter_update(variable, gradient, eta, lambd):
    """`p * (1 - lambd * eta) - eta * g`, rounded in torch's order."""
    decayed = variable * (1.0 - lambd * eta)
    return decayed - eta * gradient


def running_average(average, value, mu):
    """`value` when `mu == 1`, else `average + mu * (value - average)`."""
    return ops.where(
        ops.equal(mu, 1.0), value, average + mu * (value - average)
    )


def asgd_update(
    variable,
    gradient,
    average,
    step_and_eta,
    learning_rate,
    lambd,
    alpha,
    t0,
    weight_decay,
    maximize,
):
    """One torch ASGD step of one variable.

    `step_and_eta` holds torch's float32 `step` and `eta` (torch's `mu`
    follows from `step` and `t0`), `learning_rate` is the rate of this
    step; `lambd`, `alpha`, `t0`, `weight_decay` (Python floats) and
    `maximize` (a bool) are the optimizer's constants. Returns
    `(variable, average, step_and_eta)` after the step. A gradient with a
    non-finite entry leaves all three unchanged.
    """
    step, eta = step_and_eta[0], step_and_eta[1]

    def updated():
        # torch creates `eta` as the rate of the first step.
        eta_used = ops.where(ops.equal(step, 0.0), learning_rate, eta)
        direction = -gradient if maximize else gradient
        if weight_decay:
            direction = direction + weight_decay * variable
        new_variable = asgd_parameter_update(
            variable, direction, ops.cast(eta_used, variable.dtype), lambd
        )
        mu = ops.cast(asgd_mu(step, t0), variable.dtype)
        new_average = running_average(average, new_variable, mu)
        new_step = step + 1.0
        new_eta = asgd_eta(learning_rate, lambd, alpha, new_step)
        return new_variable, new_average, ops.stack([new_step, new_eta])

    def unchanged():
        return ops.copy(variable), ops.copy(average), ops.copy(step_and_eta)

    return if_finite(is_finite(gradient), updated, unchanged)


def asgd_updates(
    variables,
    gradients,
    averages,
    steps_and_etas,
    learning_rate,
    lambd,
    alpha,
    t0,
    weight_decays,
    maximize,
):
    """`asgd_update` for several variables at once (lists in, lists out)."""
    return [
        asgd_update(
            *inputs, learning_rate, lambd, alpha, t0, weight_decay, maximize
        )
        for *inputs, weight_decay in zip(
            variables, gradients, averages, steps_and_etas, weight_decays
        )
    ]


_fused_asgd_updates = fused(asgd_updates)


def _never_updated(step_and_eta):
    return float(numpy_value(step_and_eta)[0]) == 0.0


@keras_thor_export
@with_base_keyword_args
class ASGD(BatchedUpdate, ReferenceOptimizer):
    """Averaged stochastic gradient descent (`torch.optim.ASGD` semantics).

    SGD with a decaying step size `eta` and a running average `ax` of the
    weights that starts after `t0` steps (Polyak-Ruppert averaging). The
    averaged weights are usually the better model: evaluate with them through
    `keras_thor.callbacks.SwapAveragedWeights` or
    `optimizer.use_averaged_weights()`, or set `finalize_with_average=True` to
    write them into the model when `fit` ends.

    Update rule for step `t = 1, 2, ...` (`eta_0 = lr`, `mu_0 = 1`):

    ```
    g = (-grad if maximize else grad) + weight_decay * p
    p = p * (1 - lambd * eta_{t-1}) - eta_{t-1} * g
    ax = p                             if mu_{t-1} == 1
    ax = ax + mu_{t-1} * (p - ax)      otherwise
    eta_t = lr / (1 + lambd * lr * t) ** alpha
    mu_t = 1 / max(1, t - t0)
    ```

    Notation:
        - `p`: a trainable variable; `grad`: its gradient.
        - `lr`: the learning rate of step `t` (however it is set: a float,
          a schedule, or a callback assigning `optimizer.learning_rate`).
        - `lambd`, `alpha`, `t0`, `weight_decay`, `maximize`: the arguments.
        - `ax`, `t`, `eta`, `mu`: torch's per-variable state `ax`, `step`,
          `eta`, `mu` (see `state_for(variable)`; `mu` is computed from
          `step`, the others are stored).

    For an integer `t0`, averaging therefore first mixes weights at step
    `t0 + 3` (the first step whose `mu_{t-1} < 1`), and from then on `ax` is
    the plain mean of the weights after steps `t0 + 2, ..., t`.

    `weight_decay` is torch's L2 term added to the gradient, not Keras's
    decoupled weight decay; `exclude_from_weight_decay()` applies to it.

    A variable whose gradient has a non-finite entry is left unchanged on
    that step with all of its state, as if it had no gradient (torch would
    write the NaNs in). A variable without a gradient does not step, as in
    torch.

    Args:
        learning_rate: A float >= 0, a
            `keras.optimizers.schedules.LearningRateSchedule`, or a callable
            that takes no arguments. Defaults to `0.01`.
        lambd: Float >= 0, the decay term. Defaults to `1e-4`.
        alpha: Float >= 0, the power of the `eta` decay. Defaults to `0.75`.
        t0: Float >= 0 (infinity allowed), the step after which averaging
            starts. Defaults to `1e6`.
        weight_decay: Float >= 0, the L2 penalty added to the gradient.
            Defaults to `0.0`.
        maximize: Boolean. If `True`, maximize the objective instead of
            minimizing it. Defaults to `False`.
        finalize_with_average: Boolean. If `True`, `fit` ends by writing the
            averaged weights into the model (as `use_ema` does with its
            average). Defaults to `False`.
        {{base_optimizer_keyword_args}}

    Example:

    ```python
    optimizer = keras_thor.optimizers.ASGD(learning_rate=0.05, t0=100)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, callbacks=[keras_thor.callbacks.SwapAveragedWeights()])
    with optimizer.use_averaged_weights():
        model.evaluate(x_test, y_test)
    ```

    References:
        - [Polyak and Juditsky, 1992](https://doi.org/10.1137/0330046)
        - [Bottou, 2012](https://leon.bottou.org/papers/bottou-tricks-2012)
    """

    def __init__(
        self,
        learning_rate=0.01,
        lambd=1e-4,
        alpha=0.75,
        t0=1e6,
        weight_decay=0.0,
        maximize=False,
        finalize_with_average=False,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        name="asgd",
        **kwargs,
    ):
        validation.check_learning_rate(learning_rate)
        lambd = validation.check_float("lambd", lambd, minimum=0.0)
        alpha = validation.check_float("alpha", alpha, minimum=0.0)
        t0 = validation.check_float("t0", t0, minimum=0.0, allow_inf=True)
        weight_decay = validation.check_float(
            "weight_decay", weight_decay, minimum=0.0
        )
        validation.check_bool("maximize", maximize)
        validation.check_bool("finalize_with_average", finalize_with_average)
        if finalize_with_average and use_ema:
            raise ValueError(
                "Arguments `finalize_with_average` and `use_ema` both "
                "overwrite the weights when training ends; set only one. "
                f"Received: finalize_with_average={finalize_with_average}, "
                f"use_ema={use_ema}"
            )
        super().__init__(
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=name,
            **kwargs,
        )
        self.lambd = lambd
        self.alpha = alpha
        self.t0 = t0
        self.maximize = maximize
        self.finalize_with_average = finalize_with_average

    def build(self, var_list):
        """Creates torch's state for every variable, then the swap flag.

        For each variable, in the order of `var_list`: `ax` (its shape) and
        torch's `step` and `eta` (one float32 vector of 2). Then one boolean
        that records whether the model currently holds the averaged weights.
        """
        if self.built:
            return
        super().build(var_list)
        self._averages = []
        self._steps_and_etas = []
        for variable in var_list:
            self._averages.append(
                self.add_variable_from_reference(variable, "ax")
            )
            self._steps_and_etas.append(
                self.add_variable(
                    (2,),
                    dtype="float32",
                    name=f"{variable.path.replace('/', '_')}_step_and_eta",
                )
            )
        self._averages_in_model = self.add_variable(
            (), dtype="bool", name="averages_in_model"
        )

    def _update_variables(self, grads, variables, learning_rate):
        """One ASGD step of `variables`, as one (compiled) computation."""
        indices = [
            keras_internals.trained_variable_index(self, v) for v in variables
        ]
        averages = [self._averages[i] for i in indices]
        steps_and_etas = [self._steps_and_etas[i] for i in indices]
        results = _fused_asgd_updates(
            list(variables),
            [ops.cast(dense(g), v.dtype) for g, v in zip(grads, variables)],
            averages,
            steps_and_etas,
            ops.cast(learning_rate, "float32"),
            self.lambd,
            self.alpha,
            self.t0,
            [self.decay_for(v) for v in variables],
            self.maximize,
        )
        for variable, average, step_and_eta, new in zip(
            variables, averages, steps_and_etas, results
        ):
            self.assign(variable, new[0])
            self.assign(average, new[1])
            self.assign(step_and_eta, new[2])

    def state_for(self, variable):
        """torch's `optimizer.state[p]` for `variable`, as a dict.

        `"step"`, `"eta"`, `"mu"`: float32 scalars, the values the next step
        uses; `"ax"`: the averaged weights (an optimizer variable).
        """
        index = self._variable_index(variable)
        step_and_eta = ops.convert_to_tensor(self._steps_and_etas[index])
        step, eta = step_and_eta[0], step_and_eta[1]
        return {
            "step": step,
            "eta": ops.where(
                ops.equal(step, 0.0),
                ops.cast(self.learning_rate, "float32"),
                eta,
            ),
            "mu": asgd_mu(step, self.t0),
            "ax": self._averages[index],
        }

    def _check_built(self):
        if not self.built:
            raise ValueError(
                "The optimizer has no state before it is built. Train with it "
                "(or call `optimizer.build(variables)`) first."
            )

    def _variable_index(self, variable):
        self._check_built()
        index = keras_internals.variable_index(self, variable)
        if index is None:
            raise ValueError(
                "The optimizer does not train this variable. "
                f"Received: variable={variable.path}"
            )
        return index

    @property
    def averaged_weights_in_model(self):
        """Whether the model currently holds the averaged weights.

        This is optimizer state: it is saved and restored with the rest, so
        a model saved while the averages are in it knows it after loading.
        """
        if not self.built:
            return False
        return bool(numpy_value(self._averages_in_model))

    def swap_averaged_weights(self):
        """Exchanges the trained weights and their averages `ax`, in place.

        Calling it twice restores the trained weights. A variable that has
        not been updated yet has no average and is left as it is.
        """
        self._check_built()
        for variable, average, step_and_eta in zip(
            keras_internals.trained_variables(self),
            self._averages,
            self._steps_and_etas,
        ):
            if _never_updated(step_and_eta):
                continue
            trained = ops.copy(variable.value)
            variable.assign(average)
            average.assign(trained)
        self._averages_in_model.assign(not self.averaged_weights_in_model)

    def set_averaged_weights_in_model(self, averaged):
        """Puts the averaged (`True`) or trained (`False`) weights in."""
        if self.averaged_weights_in_model != bool(averaged):
            self.swap_averaged_weights()

    @contextlib.contextmanager
    def use_averaged_weights(self):
        """Context manager: the model holds the averaged weights inside it.

        On exit the model holds what it held on entry, also after an
        exception.

        ```python
        with optimizer.use_averaged_weights():
            model.evaluate(x, y)
        ```
        """
        previous = self.averaged_weights_in_model
        self.set_averaged_weights_in_model(True)
        try:
            yield
        finally:
            self.set_averaged_weights_in_model(previous)

    def finalize_variable_values(self, var_list):
        """Writes the averages into `var_list` if `finalize_with_average`."""
        super().finalize_variable_values(var_list)
        if not self.finalize_with_average:
            return
        self.set_averaged_weights_in_model(False)
        for variable in var_list:
            index = keras_internals.variable_index(self, variable)
            if index is None:
                continue
            if not _never_updated(self._steps_and_etas[index]):
                variable.assign(self._averages[index])

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "lambd": self.lambd,
                "alpha": self.alpha,
                "t0": self.t0,
                "weight_decay": self.weight_decay,
                "maximize": self.maximize,
                "finalize_with_average": self.finalize_with_average,
            }
        )
        return config
