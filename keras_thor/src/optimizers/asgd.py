"""Averaged stochastic gradient descent, as `torch.optim.ASGD`."""

import contextlib

import keras
from keras import ops

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.backend.fusion import fused
from keras_thor.src.optimizers.docstrings import with_base_keyword_args
from keras_thor.src.optimizers.finite import if_finite
from keras_thor.src.optimizers.finite import is_finite
from keras_thor.src.utils import validation


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
    variable, gradient, average, eta, mu, lambd, weight_decay, maximize
):
    """One torch ASGD step of one variable: `(new_variable, new_average)`.

    `eta` and `mu` are tensors; `lambd`, `weight_decay` (Python floats) and
    `maximize` (a bool) are the optimizer's constants. A gradient with a
    non-finite entry leaves both unchanged.
    """

    def updated():
        direction = -gradient if maximize else gradient
        if weight_decay:
            direction = direction + weight_decay * variable
        new_variable = asgd_parameter_update(variable, direction, eta, lambd)
        return new_variable, running_average(average, new_variable, mu)

    def unchanged():
        return ops.copy(variable), ops.copy(average)

    return if_finite(is_finite(gradient), updated, unchanged)


_fused_asgd_update = fused(asgd_update)


@keras_thor_export
@with_base_keyword_args
class ASGD(keras.optimizers.Optimizer):
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
        - `lr`: `learning_rate` (with a schedule, `eta_t` uses the rate of
          step `t`, as torch's `eta` uses the group's rate when it is
          computed at the end of a step).
        - `lambd`, `alpha`, `t0`, `weight_decay`, `maximize`: the arguments.
        - `ax`: the averaged weights, one slot per variable.

    For an integer `t0`, averaging therefore first mixes weights at step
    `t0 + 3` (the first step whose `mu_{t-1} < 1`), and from then on `ax` is
    the plain mean of the weights after steps `t0 + 2, ..., t`. `eta` and
    `mu` are not stored: they follow from the step counter and are exposed
    as the `eta` and `mu` properties.

    `weight_decay` is torch's L2 term added to the gradient, not Keras's
    decoupled weight decay; `exclude_from_weight_decay()` applies to it.

    A variable whose gradient has a non-finite entry is left unchanged on
    that step, together with its average (torch would write the NaNs in).

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
            weight_decay=None,
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
        # Coupled L2 (torch); Keras's decoupled decay is switched off below.
        self.weight_decay = weight_decay
        self.maximize = maximize
        self.finalize_with_average = finalize_with_average
        self._averaged_weights_in_model = False

    def build(self, var_list):
        """Creates one average slot `ax` per trainable variable."""
        if self.built:
            return
        super().build(var_list)
        self._averages = self.add_optimizer_variables(var_list, "average")

    def _apply_weight_decay(self, variables):
        # `weight_decay` is torch's L2 term, added to the gradient in
        # `update_step`; Keras's decoupled decay must not run as well.
        return

    def _previous_learning_rate(self, learning_rate):
        """The rate of the previous update, which torch's `eta` was built on."""
        schedule = self._learning_rate
        if not isinstance(
            schedule, keras.optimizers.schedules.LearningRateSchedule
        ):
            return learning_rate
        steps_per_update = self.gradient_accumulation_steps or 1
        previous = ops.maximum(self._iterations - steps_per_update, 0)
        return ops.where(
            ops.equal(self.iterations, 0), learning_rate, schedule(previous)
        )

    def _step_sizes(self, learning_rate):
        """`(eta_{t-1}, mu_{t-1})` in float32, as torch stores them."""
        steps_done = ops.cast(self.iterations, "float32")
        rate = ops.cast(self._previous_learning_rate(learning_rate), "float32")
        eta = asgd_eta(rate, self.lambd, self.alpha, steps_done)
        return eta, asgd_mu(steps_done, self.t0)

    @property
    def eta(self):
        """The step size the next update uses (torch's `state["eta"]`)."""
        steps_done = ops.cast(self.iterations, "float32")
        rate = ops.cast(self.learning_rate, "float32")
        return asgd_eta(rate, self.lambd, self.alpha, steps_done)

    @property
    def mu(self):
        """The averaging weight the next update uses (torch's `state["mu"]`)."""
        return asgd_mu(ops.cast(self.iterations, "float32"), self.t0)

    def update_step(self, gradient, variable, learning_rate):
        dtype = variable.dtype
        eta, mu = self._step_sizes(learning_rate)
        decays = self._use_weight_decay(variable)
        average = self._averages[self._get_variable_index(variable)]
        new_variable, new_average = _fused_asgd_update(
            variable,
            ops.cast(ops.convert_to_tensor(gradient), dtype),
            average,
            ops.cast(eta, dtype),
            ops.cast(mu, dtype),
            self.lambd,
            self.weight_decay if decays else 0.0,
            self.maximize,
        )
        self.assign(average, new_average)
        self.assign(variable, new_variable)

    def swap_averaged_weights(self):
        """Swaps the trained weights and their averages `ax`, in place.

        Calling it twice restores the trained weights. Before the first
        update there is no average yet and nothing is swapped.
        """
        if not self.built:
            raise ValueError(
                "The optimizer has no averaged weights before it is built. "
                "Train with it (or call `optimizer.build(variables)`) first."
            )
        self._averaged_weights_in_model = not self._averaged_weights_in_model
        if int(ops.convert_to_numpy(self.iterations)) == 0:
            return
        for variable, average in zip(self._trainable_variables, self._averages):
            trained = ops.copy(variable.value)
            variable.assign(average)
            average.assign(trained)

    @property
    def averaged_weights_in_model(self):
        """Whether the model currently holds the averaged weights."""
        return self._averaged_weights_in_model

    @contextlib.contextmanager
    def use_averaged_weights(self):
        """Context manager: the model holds the averaged weights inside it.

        ```python
        with optimizer.use_averaged_weights():
            model.evaluate(x, y)
        ```
        """
        if self._averaged_weights_in_model:
            yield
            return
        self.swap_averaged_weights()
        try:
            yield
        finally:
            self.swap_averaged_weights()

    def finalize_variable_values(self, var_list):
        """Writes the averages into `var_list` if `finalize_with_average`."""
        super().finalize_variable_values(var_list)
        if not self.finalize_with_average:
            return
        if self._averaged_weights_in_model:
            self.swap_averaged_weights()
        if int(ops.convert_to_numpy(self.iterations)) == 0:
            return
        for variable in var_list:
            key = self._var_key(variable)
            if key in self._trainable_variables_indices:
                index = self._trainable_variables_indices[key]
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
