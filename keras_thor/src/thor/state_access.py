"""What THOR's state reads as, for users, logs and the train function.

`ThorStateAccess` is a base of `THOR`: the read-only views of its state
(the estimator's blocks, troubles and per-block state, the skipped
updates, the schedule, the step's logs), the one place the step's new
curvature state is written (`write_state`), and the loading of files
saved before THOR's last variables existed. It reads the attributes
`THOR.build` sets.
"""

from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.backend.values import numpy_value
from keras_thor.src.schedules.per_step import PerStepSchedule
from keras_thor.src.thor.schedule import RefreshSchedule
from keras_thor.src.thor.step_plan import StepPlan


class ThorStateAccess:
    """THOR's state as read and written outside its update."""

    # The variables `build` adds last that files written before them lack.
    _ADDED_VARIABLES = ("skipped_updates", "trained_batch_size")

    def load_own_variables(self, store):
        """As Keras's, and a file written before `skipped_updates` and
        `trained_batch_size` existed loads the rest, those starting at 0
        and `batch_size`."""
        added = len(self._ADDED_VARIABLES)
        if len(store.keys()) == len(self.variables) - added:
            for i, variable in enumerate(self.variables[:-added]):
                variable.assign(store[str(i)])
        else:
            super().load_own_variables(store)
        if self._given_batch_size is None and self.built:
            self._trained_batch = (
                int(numpy_value(self._trained_batch_size)) or None
            )
            self._step_plan = None

    def velocity_of(self, variable):
        """The momentum `v` of `variable`, one of THOR's trained variables."""
        return self._velocities[
            keras_internals.trained_variable_index(self, variable)
        ]

    @property
    def estimator(self):
        """The `CurvatureEstimator` holding every block's curvature state
        (`estimator.state_for(variable)` reads one); set by `build`."""
        return self._estimator

    def state_for(self, variable):
        """The curvature state of `variable`'s block: a `BlockState` of
        NumPy arrays (its inverses; with `factor_decay` its averaged
        factors and their weight; with `trace_thresholds` its last trace
        and whether it stopped). Raises a `ValueError` for a variable
        without a curvature block."""
        return self._estimator.state_for(variable)

    @property
    def curvature_blocks(self):
        """`{variable index: block}` of the variables with curvature."""
        return self._estimator.blocks

    @property
    def curvature_troubles(self):
        """How many layer refreshes fell back or kept their old inverses."""
        return self._estimator.curvature_troubles if self.built else 0

    @property
    def skipped_updates(self):
        """How many steps skipped the update of at least one variable
        (its preconditioned gradient was not finite: the variable and its
        momentum kept their values). Steps a `LossScaleOptimizer` skips
        are not THOR's and are not counted."""
        return int(numpy_value(self._skipped_updates)) if self.built else 0

    @property
    def skipped_inversions(self):
        """How many block inversions the trace rule skipped, keeping the
        stored inverses (0 without `trace_thresholds`)."""
        return self._estimator.skipped_inversions if self.built else 0

    @property
    def refresh_schedule(self):
        """The `RefreshSchedule`: which steps burn in, which gather
        statistics and which refresh the inverses, and how far the per-step
        arrays reach."""
        return RefreshSchedule(
            self.frequency,
            self.statistics_period,
            self._per_step_arrays(),
            self.burn_in_steps,
        )

    def _per_step_arrays(self):
        return [
            (name, value)
            for name, value in (
                ("learning_rate", self._schedule),
                ("damping", self._damping),
            )
            if isinstance(value, PerStepSchedule)
        ]

    @property
    def step_plan(self):
        """The `StepPlan` of THOR's training step, made once THOR is built
        and its `batch_size` known."""
        if self._step_plan is None:
            if self.batch_size is None:
                raise ValueError(
                    "THOR's batch size is not known yet: without "
                    "`batch_size` it is the size of the first batch THOR's "
                    "train function (`fit`, `train_on_batch`) trains on. "
                    "Pass `THOR(batch_size=...)` to fix it beforehand."
                )
            self._step_plan = StepPlan.for_blocks(
                self._estimator.blocks,
                self._variable_index,
                self.curvature_options,
                self.batch_size,
                bool(self.clipnorm or self.clipvalue or self.global_clipnorm),
            )
        return self._step_plan

    def training_logs(self):
        """What THOR is doing, for the step's logs (and so `History` and
        `TensorBoard`): the damping, the number of inverse refreshes so
        far, the steps that skipped a variable's non-finite update so far,
        the layer refreshes in trouble so far, the last guard
        scale (with `kl_clip`), and the block inversions the trace rule
        skipped so far and the blocks it has stopped (with
        `trace_thresholds`)."""
        steps = ops.cast(self.iterations, "float32")
        return {
            "thor_damping": self.current_damping(),
            "thor_refreshes": ops.floor((steps - 1.0) / self.frequency) + 1.0,
            "thor_skipped_updates": ops.cast(self._skipped_updates, "float32"),
            **self._estimator.training_logs(),
        }

    def write_state(self, writes):
        """Writes the step's pending curvature state (`StateWrites`): the
        one place a training step assigns it."""
        writes.write(self.assign, self.assign_add)
