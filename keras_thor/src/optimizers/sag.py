"""Stochastic average gradient, as `paddle.optimizer.ASGD`."""

import warnings

from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.backend.dense import dense
from keras_thor.src.backend.memory_update import assign_row
from keras_thor.src.backend.memory_update import read_row
from keras_thor.src.optimizers.docstrings import with_base_keyword_args
from keras_thor.src.optimizers.reference_optimizer import ReferenceOptimizer
from keras_thor.src.utils import validation
from keras_thor.src.utils.finite import if_finite
from keras_thor.src.utils.finite import is_finite

_LOW_PRECISION = ("float16", "bfloat16")


def sag_gradient_sum(gradient_sum, stored_gradient, gradient):
    """`d - y_i + g`: the sum of the most recent gradient of every slot."""
    return gradient_sum - stored_gradient + gradient


def sag_parameter_update(variable, gradient_sum, learning_rate, slots_filled):
    """`x - (lr / n) * d`, with `n = min(m + 1, batch_num)` slots filled."""
    return variable - (learning_rate / slots_filled) * gradient_sum


def sag_update(
    weights,
    gradient,
    gradient_sum,
    stored,
    count,
    learning_rate,
    batch_num,
    weight_decay,
):
    """One Paddle SAG step of one variable.

    `stored` is the memory slot `y_i` of this step and `count` the number
    of steps this variable has taken (Paddle's `m`); `batch_num` (an int)
    and `weight_decay` (a Python float) are the optimizer's constants.
    Returns `(gradient_sum, stored_gradient, weights, count)` after the
    step. A gradient with a non-finite entry leaves all four unchanged.
    """

    def updated():
        decayed = (
            gradient + weight_decay * weights if weight_decay else gradient
        )
        new_sum = sag_gradient_sum(gradient_sum, stored, decayed)
        slots_filled = ops.cast(
            ops.minimum(count + 1, batch_num), weights.dtype
        )
        new_weights = sag_parameter_update(
            weights,
            new_sum,
            ops.cast(learning_rate, weights.dtype),
            slots_filled,
        )
        return new_sum, decayed, new_weights, count + 1

    def unchanged():
        return (
            ops.copy(gradient_sum),
            ops.copy(stored),
            ops.copy(weights),
            ops.copy(count),
        )

    return if_finite(is_finite(gradient), updated, unchanged)


def follow_variable(master, variable):
    """The float32 master copy, re-seeded wherever `variable` was rewritten.

    An entry whose low-precision value is not the rounded master (a fresh
    master, `set_weights`, a constraint, an EMA overwrite) is taken from the
    variable.
    """
    master = ops.convert_to_tensor(master)
    variable = ops.convert_to_tensor(variable)
    rounded = ops.cast(master, variable.dtype)
    return ops.where(
        ops.equal(rounded, variable), master, ops.cast(variable, master.dtype)
    )


@keras_thor_export
@with_base_keyword_args
class SAG(ReferenceOptimizer):
    """Stochastic average gradient (`paddle.optimizer.ASGD` semantics).

    Paddle calls this optimizer ASGD; it is the stochastic average gradient
    method of Schmidt, Le Roux and Bach, not averaged SGD (for that, see
    `keras_thor.optimizers.ASGD`). It keeps the last gradient seen in each
    of `batch_num` slots and steps along their mean.

    Update rule for step `m = 0, 1, ...` (`d = 0`, `y_i = 0`):

    ```
    g = grad + weight_decay * x
    i = m % batch_num
    d = d - y_i + g
    y_i = g
    x = x - lr / min(m + 1, batch_num) * d
    ```

    Notation:
        - `x`: a trainable variable; `grad`: its (clipped) gradient.
        - `lr`: `learning_rate`; `weight_decay`, `batch_num`: the arguments.
        - `d`: the sum of the stored gradients; `y`: the `batch_num` stored
          gradients (a ring buffer); `m`: the variable's step count (as
          Paddle, one per variable: a variable without a gradient does not
          step).

    Slot `i` holds the gradient of batch `i` only when batches come in a
    fixed cyclic order of `batch_num` batches (`fit(..., shuffle=False)` on a
    dataset of `batch_num` batches); otherwise each slot holds one of the
    `batch_num` most recent gradients.

    The weight-decay term enters the stored gradients, which is what Paddle's
    code does (`weight_decay` becomes an L2 regularizer added to the gradient
    before the optimizer op). Paddle's docstring formula instead adds
    `lr * weight_decay * x` outside the average; the two agree only for
    `batch_num=1`. `exclude_from_weight_decay()` applies to this term.

    Memory: `batch_num + 1` extra copies of every trainable variable (`y` and
    `d`), plus a float32 master copy per float16/bfloat16 variable when
    `multi_precision=True`. Lower `batch_num` when memory is tight.

    A variable whose gradient has a non-finite entry is left unchanged on
    that step with all of its state, as if it had no gradient.

    Args:
        learning_rate: A float >= 0, a
            `keras.optimizers.schedules.LearningRateSchedule`, or a callable
            that takes no arguments. Defaults to `0.001`.
        batch_num: Integer >= 1, the number of stored gradients; Paddle
            recommends the number of batches in an epoch. Defaults to `1`
            (plain SGD).
        weight_decay: `None` or a float >= 0, the L2 coefficient added to the
            gradient. Defaults to `None`.
        multi_precision: Boolean. If `True`, float16 and bfloat16 variables
            are updated through a float32 master copy, and `d` and `y` are
            kept in float32. The master copy follows the variable: an entry
            rewritten from outside (`set_weights`, a constraint) is taken
            from the variable. Defaults to `False`.
        {{base_optimizer_keyword_args}}

    Example:

    ```python
    batch_size = 64
    batches = math.ceil(len(x) / batch_size)  # one slot per batch
    optimizer = keras_thor.optimizers.SAG(learning_rate=0.01, batch_num=batches)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch_size, shuffle=False)
    ```

    References:
        - [Schmidt, Le Roux and Bach, 2017](https://arxiv.org/abs/1309.2388)
    """

    def __init__(
        self,
        learning_rate=0.001,
        batch_num=1,
        weight_decay=None,
        multi_precision=False,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        name="sag",
        **kwargs,
    ):
        validation.check_learning_rate(learning_rate)
        batch_num = validation.check_int("batch_num", batch_num, minimum=1)
        if weight_decay is not None:
            weight_decay = validation.check_float(
                "weight_decay", weight_decay, minimum=0.0
            )
        validation.check_bool("multi_precision", multi_precision)
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
        self.batch_num = batch_num
        self.multi_precision = multi_precision

    def _uses_master_copy(self, variable):
        return self.multi_precision and variable.dtype in _LOW_PRECISION

    def build(self, var_list):
        """Creates `d`, the `y` ring buffer, `m` and master copies.

        For each variable, in the order of `var_list`: `d` (its shape), `y`
        (`(batch_num, *shape)`), the step count `m` and, with
        `multi_precision`, a float32 master copy of each float16/bfloat16
        variable.
        """
        if self.built:
            return
        super().build(var_list)
        self._gradient_sums = []
        self._gradient_memories = []
        self._counts = []
        self._master_weights = []
        for variable in var_list:
            prefix = variable.path.replace("/", "_")
            master = self._uses_master_copy(variable)
            dtype = "float32" if master else variable.dtype
            if variable.dtype in _LOW_PRECISION and not master:
                warnings.warn(
                    f"SAG accumulates `{variable.path}` in {variable.dtype}, "
                    "which can give poor accuracy or slow convergence. "
                    "Consider `multi_precision=True`.",
                    stacklevel=2,
                )
            self._gradient_sums.append(
                self.add_variable(
                    variable.shape, dtype=dtype, name=f"{prefix}_gradient_sum"
                )
            )
            self._gradient_memories.append(
                self.add_variable(
                    (self.batch_num, *variable.shape),
                    dtype=dtype,
                    name=f"{prefix}_gradient_memory",
                )
            )
            self._counts.append(
                self.add_variable(
                    (), dtype=self.iterations.dtype, name=f"{prefix}_m"
                )
            )
            self._master_weights.append(
                self.add_variable(
                    variable.shape, dtype="float32", name=f"{prefix}_master"
                )
                if master
                else None
            )

    def update_step(self, gradient, variable, learning_rate):
        index = keras_internals.trained_variable_index(self, variable)
        gradient_sum = self._gradient_sums[index]
        memory = self._gradient_memories[index]
        count = self._counts[index]
        master = self._master_weights[index]
        weights = (
            ops.convert_to_tensor(variable)
            if master is None
            else follow_variable(master, variable)
        )
        count_value = ops.convert_to_tensor(count)
        slot = count_value % self.batch_num
        stored = read_row(memory, slot)
        # Plain ops: unlike ASGD's, this update runs no faster compiled
        # (docs/benchmarks.md), the slot gather and scatter stay outside.
        new_sum, new_row, new_weights, new_count = sag_update(
            weights,
            ops.cast(dense(gradient), gradient_sum.dtype),
            ops.convert_to_tensor(gradient_sum),
            stored,
            count_value,
            learning_rate,
            self.batch_num,
            self.decay_for(variable),
        )
        self.assign(gradient_sum, new_sum)
        assign_row(self, memory, slot, new_row)
        self.assign(count, new_count)
        if master is not None:
            self.assign(master, new_weights)
        self.assign(variable, ops.cast(new_weights, variable.dtype))

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "batch_num": self.batch_num,
                "weight_decay": self.weight_decay,
                "multi_precision": self.multi_precision,
            }
        )
        return config
