"""MindSpore's ResNet-50 THOR learning rate, as a Keras schedule."""

import keras
from keras import ops

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.utils import validation


@keras_thor_export
class ThorResNetLearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """Polynomial decay with two halvings (MindSpore's `get_thor_lr`).

    The schedule MindSpore trains ResNet-50 with THOR under
    (`official/cv/ResNet/src/lr_generator.py`), evaluated per step instead of
    precomputed as an array:

    ```
    e = (step + 1) / steps_per_epoch
    lr = initial_learning_rate * (1 - e / total_epochs) ** decay
    lr = lr / 2    if e >= decay_epochs
    lr = lr / 2    if e >= decay_epochs + 1      (a second time)
    ```

    Notation:
        - `step`: the optimizer's step (0-based); `e`: epochs completed
          after it, fractional.
        - `initial_learning_rate`, `decay`, `total_epochs`,
          `steps_per_epoch`, `decay_epochs`: the arguments.

    MindSpore's array ends after `total_epochs` epochs; here `e` is capped
    there, so later steps get a rate of 0 instead of an index error.

    Args:
        initial_learning_rate: Float > 0 (MindSpore's `lr_init`).
        decay: Float >= 0, the power of the decay (`lr_decay`).
        total_epochs: Float > 0, where the rate reaches 0 (`lr_end_epoch`).
        steps_per_epoch: Integer >= 1.
        decay_epochs: Float >= 0, the epoch of the first halving. Defaults
            to `100` (MindSpore's default; its ResNet-50 recipe uses `39`).
        name: Optional name.

    Example:

    ```python
    # MindSpore's GPU recipe: 5004 steps an epoch on 8 x 32 images.
    schedule = keras_thor.schedules.ThorResNetLearningRate(
        0.05672, decay=4.9687, total_epochs=50, steps_per_epoch=5004,
        decay_epochs=39)
    ```
    """

    def __init__(
        self,
        initial_learning_rate,
        decay,
        total_epochs,
        steps_per_epoch,
        decay_epochs=100,
        name="ThorResNetLearningRate",
    ):
        super().__init__()
        self.initial_learning_rate = validation.check_float(
            "initial_learning_rate", initial_learning_rate, minimum=0.0
        )
        self.decay = validation.check_float("decay", decay, minimum=0.0)
        self.total_epochs = validation.check_float(
            "total_epochs", total_epochs, minimum=0.0
        )
        if self.total_epochs == 0:
            raise ValueError(
                "Argument `total_epochs` must be > 0. "
                f"Received: total_epochs={total_epochs!r}"
            )
        self.steps_per_epoch = validation.check_int(
            "steps_per_epoch", steps_per_epoch, minimum=1
        )
        self.decay_epochs = validation.check_float(
            "decay_epochs", decay_epochs, minimum=0.0
        )
        self.name = name

    def __call__(self, step):
        epochs = (ops.cast(step, "float32") + 1.0) / self.steps_per_epoch
        epochs = ops.minimum(epochs, self.total_epochs)
        rate = self.initial_learning_rate * ops.power(
            1.0 - epochs / self.total_epochs, self.decay
        )
        rate = ops.where(epochs >= self.decay_epochs, 0.5 * rate, rate)
        return ops.where(epochs >= self.decay_epochs + 1, 0.5 * rate, rate)

    def get_config(self):
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay": self.decay,
            "total_epochs": self.total_epochs,
            "steps_per_epoch": self.steps_per_epoch,
            "decay_epochs": self.decay_epochs,
            "name": self.name,
        }
