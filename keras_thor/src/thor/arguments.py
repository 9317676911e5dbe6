"""Checks of `THOR`'s optimizer arguments (the curvature options are
checked by `CurvatureOptions`)."""

import keras
from keras import ops

from keras_thor.src.schedules.per_step import PerStepSchedule
from keras_thor.src.schedules.per_step import is_per_step_array
from keras_thor.src.schedules.per_step import per_step_values
from keras_thor.src.utils import validation


def check_not_a_model(learning_rate):
    """MindSpore's `nn.thor(net, ...)` takes the network; THOR does not."""
    if isinstance(learning_rate, keras.layers.Layer):
        raise TypeError(
            "THOR takes no model: MindSpore's `nn.thor(net, ...)` is "
            "`keras_thor.convert_to_thor_model(model)` followed by "
            "`model.compile(optimizer=THOR(learning_rate, damping, "
            "momentum, ...))`. Received: "
            f"learning_rate={type(learning_rate).__name__}"
        )


def checked_rate(name, value, strictly_positive, callable_ok):
    """A float, a schedule, a per-step array (wrapped), or a callable.

    A callable (Keras's no-argument learning-rate form) only if
    `callable_ok`.
    """
    schedule = keras.optimizers.schedules.LearningRateSchedule
    if isinstance(value, schedule):
        return value
    if callable(value) and not is_per_step_array(value):
        if callable_ok:
            return value
        raise TypeError(
            f"Argument `{name}` must be a float, a "
            "`keras.optimizers.schedules.LearningRateSchedule` or a 1-D array "
            f"of per-step values. Received: {name}={value!r}"
        )
    if is_per_step_array(value):
        values = per_step_values(name, value, 0.0, strictly_positive)
        return PerStepSchedule(values, name=name)
    if getattr(value, "shape", None) == ():
        value = ops.convert_to_numpy(value).item()
    value = validation.check_float(name, value)
    if strictly_positive and value <= 0:
        raise ValueError(
            f"Argument `{name}` must be > 0. Received: {name}={value}"
        )
    if value < 0:
        raise ValueError(
            f"Argument `{name}` must be >= 0.0. Received: {name}={value}"
        )
    return value


def checked_loss_scale(loss_scale, loss_scale_factor):
    """`(loss_scale, loss_scale_factor)`: THOR's `loss_scale` is Keras's
    `loss_scale_factor`; only one of them may be set."""
    loss_scale = validation.check_float("loss_scale", loss_scale, 0.0)
    if loss_scale == 0:
        raise ValueError(
            "Argument `loss_scale` must be > 0. Received: loss_scale=0.0"
        )
    if loss_scale_factor not in (None, loss_scale) and loss_scale != 1.0:
        raise ValueError(
            "Arguments `loss_scale` and `loss_scale_factor` both scale "
            "the loss; set one. Received: "
            f"loss_scale={loss_scale}, "
            f"loss_scale_factor={loss_scale_factor}"
        )
    if loss_scale != 1.0:
        loss_scale_factor = loss_scale
    return loss_scale, loss_scale_factor


def check_kl_clip_alone(kl_clip, clipnorm, clipvalue, global_clipnorm):
    """`kl_clip` and Keras's clipping options exclude each other."""
    if kl_clip is not None and (clipnorm or clipvalue or global_clipnorm):
        raise ValueError(
            "`kl_clip` hands Keras's clipping the guarded directions, "
            "not the gradients: set `kl_clip` or one of `clipnorm`, "
            "`clipvalue`, `global_clipnorm`. Received: "
            f"kl_clip={kl_clip}, clipnorm={clipnorm}, "
            f"clipvalue={clipvalue}, global_clipnorm={global_clipnorm}"
        )


def check_decay_filter(decay_filter):
    """`None` or a callable `variable -> bool`."""
    if decay_filter is not None and not callable(decay_filter):
        raise TypeError(
            "Argument `decay_filter` must be a callable "
            "`variable -> bool` or None. "
            f"Received: decay_filter={decay_filter!r}"
        )
