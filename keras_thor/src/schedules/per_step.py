"""A value per training step, as MindSpore passes THOR's lr and damping."""

import keras
import numpy as np
from keras import ops

from keras_thor.src.api_export import keras_thor_export


def per_step_values(name, values, minimum, strictly_positive):
    """Checks a 1-D per-step array and returns it as a float32 NumPy array.

    Accepts a list/tuple of numbers, a NumPy array or a tensor. Raises a
    `ValueError` naming `name` when it is empty, not 1-D, non-finite or out
    of range.
    """
    try:
        array = np.asarray(ops.convert_to_numpy(values), dtype="float64")
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"Argument `{name}` must be a float, a `LearningRateSchedule` or "
            f"a 1-D array of per-step values. Received: {name}={values!r}"
        ) from error
    if array.ndim != 1 or array.size == 0:
        raise ValueError(
            f"Argument `{name}` must be a non-empty 1-D array of per-step "
            f"values. Received: {name} with shape {array.shape}"
        )
    bad = ~np.isfinite(array) | (
        array <= minimum if strictly_positive else array < minimum
    )
    if bad.any():
        first = int(np.argmax(bad))
        bound = f"> {minimum}" if strictly_positive else f">= {minimum}"
        raise ValueError(
            f"Every value of `{name}` must be finite and {bound}. Received: "
            f"{name}[{first}]={float(array[first])!r}"
        )
    return array.astype("float32")


def is_per_step_array(value):
    """Whether `value` is an array of one or more dimensions (not a scalar).

    Lists, tuples, NumPy arrays and tensors qualify; numbers, 0-d arrays,
    schedules and other callables do not.
    """
    if isinstance(value, (list, tuple)):
        return True
    if isinstance(value, keras.optimizers.schedules.LearningRateSchedule):
        return False
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) >= 1


@keras_thor_export
class PerStepSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The value of step `t` is `values[t]` (MindSpore's per-step Tensors).

    MindSpore's THOR takes its learning rate and damping as 1-D tensors
    holding one value per training step; this schedule is that array.
    `THOR` wraps such arrays in it. Training for more steps than there are
    values is an error (raised by `keras_thor.models.ThorModel` before the
    step runs); inside a compiled step the index is clamped to the last
    value.

    Args:
        values: A non-empty 1-D array of finite floats.
        name: Optional name.
    """

    def __init__(self, values, name="PerStepSchedule"):
        super().__init__()
        self.values = per_step_values(
            "values", values, minimum=-np.inf, strictly_positive=False
        )
        self.name = name

    def __len__(self):
        return int(self.values.shape[0])

    def __call__(self, step):
        index = ops.minimum(ops.cast(step, "int32"), len(self) - 1)
        return ops.take(ops.convert_to_tensor(self.values), index)

    def check_covers(self, name, steps):
        """Raises a `ValueError` unless there is a value for `steps` steps."""
        if steps > len(self):
            raise ValueError(
                f"`{name}` has one value per training step and {len(self)} "
                f"values (steps 0 to {len(self) - 1}), but training reached "
                f"step {steps - 1}. Give at least `epochs * steps_per_epoch` "
                "values, or a schedule."
            )

    def get_config(self):
        return {"values": self.values.tolist(), "name": self.name}
