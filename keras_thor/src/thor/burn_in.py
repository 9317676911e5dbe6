"""Burn-in (`THOR(burn_in_steps=b)`): the first `b` steps only gather
statistics into the factor averages; the state counts them.

The training step is `iterations + burn-in steps done` (`RefreshSchedule`):
`iterations` counts updates only.
"""

from keras import ops

from keras_thor.src.thor.option_state import OptionState


class BurnInState(OptionState):
    """`burn_in_steps_done`: how many burn-in steps have run."""

    option = "burn_in_steps"

    def __init__(self, options, table, add_variable):
        super().__init__(options, table, add_variable)
        self.done = add_variable(
            (), "zeros", "int32", name="burn_in_steps_done"
        )

    @classmethod
    def enabled(cls, options):
        return bool(options.burn_in_steps)  # 0: off

    def steps_done(self):
        """The burn-in steps run so far, an int32 tensor."""
        return ops.convert_to_tensor(self.done)

    def record(self, writes):
        """Counts one burn-in step (into `writes`)."""
        writes.add(self.done, 1)
