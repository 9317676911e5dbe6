"""THOR's `model.train_function`: refresh, statistics-only and plain steps
as separate traced functions, chosen in Python before each step."""

import warnings

import keras

from keras_thor.src import keras_internals
from keras_thor.src.backend.values import numpy_value
from keras_thor.src.distribute.jax_variant_train_function import (
    JaxVariantTrainFunction,
)
from keras_thor.src.distribute.replicas import batch_value
from keras_thor.src.distribute.replicas import has_distributed_values
from keras_thor.src.distribute.variant_train_function import (
    VariantTrainFunction,
)
from keras_thor.src.thor.training import thor_optimizer_of
from keras_thor.src.thor.training import train_step

BURN_IN = "burn_in"
REFRESH = "refresh"
STATISTICS = "statistics"
PLAIN = "plain"


class ThorVariants:
    """THOR's choice of step variants and its host-side watch, for either
    backend's plumbing (`VariantTrainFunction`, `JaxVariantTrainFunction`):
    refresh, statistics-only and plain steps, apart.

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

    The first step it runs fetches its batch on the host: THOR takes that
    batch's per-replica size as its `batch_size` if it has none, else
    warns once if they differ. The count of steps with skipped updates is
    read where the step count or the troubles are read anyway (the start
    of each `fit`, the end of the data, after refresh steps and fused
    runs, every step under a `LossScaleOptimizer`) and when `fit` returns,
    and a warning says once that it grew.
    """

    fetches_in_step = True

    def __init__(self, model):
        super().__init__(model)
        self._warned = False
        self._troubles_seen = None
        self._batch_seen = False
        self._skips_seen = None
        self._skips_warned = False

    @property
    def _thor(self):
        return thor_optimizer_of(self.model.optimizer)

    def read_step(self):
        thor = self._thor
        self.check_skipped_updates()
        with self.state_values():
            burned_in = thor.estimator.steps_burned_in() if thor.built else 0
            return int(numpy_value(thor.iterations)) + int(
                numpy_value(burned_in)
            )

    def resync(self):
        # The start of a `fit` or the end of its data: a host read is due.
        # (The count seen first is read before the first step, after
        # `BackupAndRestore` has restored it.)
        if self._skips_seen is not None:
            self.check_skipped_updates()
        super().resync()

    def wants_batch(self):
        return not self._batch_seen

    def check_skipped_updates(self):
        """Warns once when THOR's count of steps with skipped updates has
        grown since this function first read it."""
        thor = self._thor
        if thor is None:
            return
        with self.state_values():
            skips = thor.skipped_updates
        if self._skips_seen is None:
            self._skips_seen = skips
        if skips > self._skips_seen and not self._skips_warned:
            warnings.warn(
                f"THOR skipped the update of some weights in "
                f"{skips - self._skips_seen} training step(s): their "
                "preconditioned gradient was not finite (NaN or inf in the "
                "inputs, labels or loss), so those weights and their "
                "momentum kept their values. The step's logged loss and "
                "metrics can be NaN; `thor_skipped_updates` in the logs "
                "counts such steps. This warning is shown once.",
                stacklevel=2,
            )
            self._skips_warned = True
        self._skips_seen = max(self._skips_seen, skips)

    def _take_batch(self, data):
        """Hands THOR the per-replica size of `data`, the first batch this
        function trains on (warns once if THOR's batch size differs), and
        builds the model and optimizer from it if they are not built yet
        (`build_from`)."""
        self._batch_seen = True
        rows = self.batch_rows(data)
        if rows is None:
            return
        with self.state_values():
            message = self._thor.take_batch_size(rows)
        if message:
            warnings.warn(message, stacklevel=5)
        self.build_from(data)

    def build_from(self, data):
        """Builds the model and optimizer from the batch `data` if needed."""

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
        """Runs the step (the first one hands THOR its batch's size); after
        a refresh, warns once if it or the statistics since the last one
        had trouble, or once if updates were skipped (host reads there)."""
        thor = self._thor
        if not self._batch_seen:
            self._take_batch(argument)
        if self._troubles_seen is None:
            with self.state_values():
                self._troubles_seen = thor.curvature_troubles
        logs = function(argument)
        if key != REFRESH:
            return logs
        self.check_skipped_updates()
        with self.state_values():
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


class ThorTrainFunction(ThorVariants, VariantTrainFunction):
    """THOR's `model.train_function` on TensorFlow (`ThorVariants` over
    `tf.function`s)."""

    def build_from(self, data):
        """Built here, outside the traced step, the first variant's first
        trace creates no variables; otherwise TensorFlow traces that
        variant a second time at its next call (about 0.5 s on the MNIST
        MLP, more on larger models). Under a strategy Keras's `fit` has
        built them already."""
        data = batch_value(data)
        if not self._thor.built and not has_distributed_values(data):
            keras_internals.symbolic_build(self.model, data)


class ThorJaxTrainFunction(ThorVariants, JaxVariantTrainFunction):
    """THOR's `model.train_function` on JAX (`ThorVariants` over `jax.jit`s
    of stateless steps). Keras's JAX `fit` and `train_on_batch` build the
    model and optimizer before the first step."""


def thor_train_function(model):
    """THOR's train function for the backend Keras runs on."""
    if keras.backend.backend() == "jax":
        return ThorJaxTrainFunction(model)
    return ThorTrainFunction(model)
