"""The `model.train_function` of keras_thor's boost models: one traced
variant per step kind the `BoostOptimizer` names, chosen in Python."""

from keras_thor.src.backend.values import numpy_value
from keras_thor.src.distribute.variant_train_function import (
    VariantTrainFunction,
)


class BoostTrainFunction(VariantTrainFunction):
    """`model.train_function` of a boost model with a `BoostOptimizer`.

    Each step runs the variant `optimizer.variant_at(step)` names (the
    group gradient freezing trains, whether gradient accumulation
    updates), counted by the optimizer's `micro_steps`; consecutive steps
    of one variant run as one compiled loop. Batches are fetched outside
    the traced steps, so `micro_steps` counts only the steps that ran.
    """

    def __init__(self, model):
        super().__init__(model)
        model.optimizer.prepare(model)

    def read_step(self):
        return int(numpy_value(self.model.optimizer.micro_steps))

    def variant_at(self, step):
        return self.model.optimizer.variant_at(step)

    def variant_step(self, key):
        return self.model.optimizer.variant_step(self.model, key)
