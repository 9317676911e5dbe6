"""When THOR burns in, gathers curvature statistics and inverts them."""


class RefreshSchedule:
    """THOR's step schedule, read by the training step before each step.

    ```
    step s burns in                   if  s < b
    step s gathers statistics         if  (s − b) mod p == 0
    step s refreshes inverses         if  (s − b) mod f == 0   (s ≥ b)
    ```

    Notation:
        - `s`: the 0-based training step, burn-in included (the optimizer's
          `iterations` plus the burn-in steps done: `iterations` counts
          updates only).
        - `b`: `burn_in_steps`: statistics-only steps before the first
          update.
        - `f`: `frequency`, the steps between inverse refreshes.
        - `p`: the statistics period (`statistics_frequency`, else `f`).

    Args:
        frequency: `f`.
        statistics_period: `p`.
        per_step_arrays: `(argument name, PerStepSchedule)` pairs of the
            per-step arrays (MindSpore style `learning_rate`/`damping`),
            which end at their length (in updates).
        burn_in_steps: `b`.
    """

    def __init__(
        self, frequency, statistics_period, per_step_arrays=(), burn_in_steps=0
    ):
        self.frequency = frequency
        self.statistics_period = statistics_period
        self.per_step_arrays = tuple(per_step_arrays)
        self.burn_in_steps = burn_in_steps

    def burns_in_at(self, step):
        """Whether step `step` (0-based) is a burn-in step."""
        return step < self.burn_in_steps

    def refreshes_at(self, step):
        """Whether step `step` (0-based) refreshes the inverses."""
        update = step - self.burn_in_steps
        return update >= 0 and update % self.frequency == 0

    def gathers_statistics_at(self, step):
        """Whether step `step` (0-based) gathers curvature statistics."""
        update = step - self.burn_in_steps
        return update < 0 or update % self.statistics_period == 0

    def check_covers(self, steps):
        """Raises a `ValueError` if a per-step array ends before `steps`."""
        updates = max(steps - self.burn_in_steps, 0)
        for name, schedule in self.per_step_arrays:
            schedule.check_covers(name, updates)

    def steps_covered_from(self, step):
        """How many steps from `step` on the per-step arrays still cover."""
        update = max(step - self.burn_in_steps, 0)
        burning = max(self.burn_in_steps - step, 0)
        lengths = [len(s) - update + burning for _, s in self.per_step_arrays]
        return min(lengths, default=float("inf"))
