"""THOR's `model.train_function`: refresh, statistics-only and plain steps
as separate traced functions, chosen in Python before each step."""

import warnings

import keras

from keras_thor.src.backend.values import numpy_value
from keras_thor.src.distribute.variant_train_function import (
    VariantTrainFunction,
)
from keras_thor.src.thor.training import thor_optimizer_of
from keras_thor.src.thor.training import train_step

BURN_IN = "burn_in"
REFRESH = "refresh"
STATISTICS = "statistics"
PLAIN = "plain"


class ThorTrainFunction(VariantTrainFunction):
    """`model.train_function` for THOR: refresh, statistics-only and plain
    steps, apart.

    The variants are `"burn_in"` (statistics into the averages, no update;
    with `burn_in_steps`), `"refresh"` (statistics, then inverses),
    `"statistics"` (statistics only, with `statistics_frequency`) and
    `"plain"`, from `THOR.refresh_schedule` at the training step (the
    optimizer's `iterations` plus the burn-in steps done). A refresh step
    runs alone; consecutive steps of one other variant (plain, statistics
    or burn-in steps) run as one compiled loop, with no host read inside.
    With one step per execution each call is one traced function that
    fetches its batch itself, as Keras's own; the step count is read back
    whenever a `LossScaleOptimizer` may skip steps, and the curvature
    troubles after each refresh step.
    """

    fetches_in_step = True

    def __init__(self, model):
        super().__init__(model)
        self._warned = False
        self._troubles_seen = None

    @property
    def _thor(self):
        return thor_optimizer_of(self.model.optimizer)

    def read_step(self):
        thor = self._thor
        burned_in = thor.estimator.steps_burned_in() if thor.built else 0
        return int(numpy_value(thor.iterations)) + int(numpy_value(burned_in))

    def recounts(self):
        return isinstance(
            self.model.optimizer, keras.optimizers.LossScaleOptimizer
        )

    def variant_at(self, step):
        schedule = self._thor.refresh_schedule
        if schedule.burns_in_at(step):
            return BURN_IN
        if schedule.refreshes_at(step):
            return REFRESH
        if schedule.gathers_statistics_at(step):
            return STATISTICS
        return PLAIN

    def variant_step(self, key):
        model = self.model
        statistics = key != PLAIN
        invert = key == REFRESH
        update = key != BURN_IN
        return lambda data: train_step(model, data, statistics, invert, update)

    def fuses(self, key):
        return key != REFRESH

    def steps_covered_from(self, step):
        return self._thor.refresh_schedule.steps_covered_from(step)

    def check_covers(self, steps):
        self._thor.refresh_schedule.check_covers(steps)

    def call_variant(self, key, function, argument):
        """Runs the step; after a refresh, warns once if it or the
        statistics since the last one had trouble (the only host read)."""
        thor = self._thor
        if self._troubles_seen is None:
            self._troubles_seen = thor.curvature_troubles
        logs = function(argument)
        if key != REFRESH:
            return logs
        troubles = thor.curvature_troubles - self._troubles_seen
        self._troubles_seen += troubles
        if troubles and not self._warned:
            warnings.warn(
                f"THOR could not use the fresh curvature of {troubles} "
                "layer(s): a factor was not positive definite (inverted with "
                "more damping) or not finite (the previous inverses were "
                "kept; under mixed precision an overflowed step, which the "
                "loss scale then skips, does this). Training goes on; if it "
                "repeats without overflow, raise `damping`. This warning is "
                "shown once.",
                stacklevel=4,
            )
            self._warned = True
        return logs
