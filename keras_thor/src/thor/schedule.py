"""When THOR gathers curvature statistics and when it inverts them."""


class RefreshSchedule:
    """THOR's step schedule, read by the training step before each step.

    ```
    step t gathers statistics  if  t mod p == 0
    step t refreshes inverses  if  t mod f == 0
    ```

    Notation:
        - `t`: the 0-based step (the optimizer's `iterations`).
        - `f`: `frequency`, the steps between inverse refreshes.
        - `p`: the statistics period (`statistics_frequency`, else `f`).

    Args:
        frequency: `f`.
        statistics_period: `p`.
        per_step_arrays: `(argument name, PerStepSchedule)` pairs of the
            per-step arrays (MindSpore style `learning_rate`/`damping`),
            which end at their length.
    """

    def __init__(self, frequency, statistics_period, per_step_arrays=()):
        self.frequency = frequency
        self.statistics_period = statistics_period
        self.per_step_arrays = tuple(per_step_arrays)

    def refreshes_at(self, step):
        """Whether step `step` (0-based) refreshes the inverses."""
        return step % self.frequency == 0

    def gathers_statistics_at(self, step):
        """Whether step `step` (0-based) gathers curvature statistics."""
        return step % self.statistics_period == 0

    def check_covers(self, steps):
        """Raises a `ValueError` if a per-step array ends before `steps`."""
        for name, schedule in self.per_step_arrays:
            schedule.check_covers(name, steps)

    def steps_covered_from(self, step):
        """How many steps from `step` on the per-step arrays still cover."""
        lengths = [len(s) - step for _, s in self.per_step_arrays]
        return min(lengths, default=float("inf"))
