"""MindSpore's ResNet-50 THOR damping, as a Keras schedule."""

import keras
from keras import ops

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.utils import validation


@keras_thor_export
class ThorResNetDamping(keras.optimizers.schedules.LearningRateSchedule):
    """Exponential damping decay (MindSpore's `get_thor_damping`).

    The damping schedule of MindSpore's ResNet-50 THOR recipe
    (`official/cv/ResNet/src/lr_generator.py`), evaluated per step:

    ```
    e = (step + 1) / steps_per_epoch
    damping = initial_damping * decay_rate ** (e / 10)
    ```

    Notation:
        - `step`: the optimizer's step (0-based); `e`: epochs completed
          after it, fractional.
        - `initial_damping`, `decay_rate`, `steps_per_epoch`: the arguments.

    MindSpore also takes `total_epochs`, which only sizes its precomputed
    array; a per-step schedule needs no length.

    Args:
        initial_damping: Float > 0 (MindSpore's `damping_init`).
        decay_rate: Float > 0, the factor per 10 epochs (`damping_decay`).
        steps_per_epoch: Integer >= 1.
        name: Optional name.

    Example:

    ```python
    damping = keras_thor.schedules.ThorResNetDamping(
        0.02345, decay_rate=0.5467, steps_per_epoch=5004)
    ```
    """

    def __init__(
        self,
        initial_damping,
        decay_rate,
        steps_per_epoch,
        name="ThorResNetDamping",
    ):
        super().__init__()
        self.initial_damping = validation.check_float(
            "initial_damping", initial_damping, minimum=0.0
        )
        self.decay_rate = validation.check_float(
            "decay_rate", decay_rate, minimum=0.0
        )
        for argument, value in (
            ("initial_damping", self.initial_damping),
            ("decay_rate", self.decay_rate),
        ):
            if value == 0:
                raise ValueError(
                    f"Argument `{argument}` must be > 0. "
                    f"Received: {argument}={value!r}"
                )
        self.steps_per_epoch = validation.check_int(
            "steps_per_epoch", steps_per_epoch, minimum=1
        )
        self.name = name

    def __call__(self, step):
        epochs = (ops.cast(step, "float32") + 1.0) / self.steps_per_epoch
        return self.initial_damping * ops.power(self.decay_rate, epochs / 10.0)

    def get_config(self):
        return {
            "initial_damping": self.initial_damping,
            "decay_rate": self.decay_rate,
            "steps_per_epoch": self.steps_per_epoch,
            "name": self.name,
        }
