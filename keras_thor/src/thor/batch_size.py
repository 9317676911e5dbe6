"""THOR's batch size `N`: given, or taken from the first batch `fit`
trains on, and the warning when a later `fit` trains on another."""


class BatchSizeFromFit:
    """`THOR`'s batch-size policy (a base of `THOR`, which sets
    `_given_batch_size`, `_trained_batch` and, once built,
    `_trained_batch_size`)."""

    @property
    def batch_size(self):
        """`N`: the `batch_size` given, else the per-replica size of the
        first batch THOR trained on (kept in the saved state); `None`
        until that batch is seen."""
        if self._given_batch_size is not None:
            return self._given_batch_size
        return self._trained_batch

    def take_batch_size(self, rows):
        """Takes `rows`, the per-replica size of the first batch a `fit`
        trains on (read by THOR's train function before the step runs).

        Without a batch size yet it becomes THOR's; otherwise returns a
        warning message if it differs from THOR's, else `None`.
        """
        rows = int(rows)
        if self.batch_size is not None:
            return batch_size_mismatch(
                rows, self.batch_size, self._given_batch_size is not None
            )
        self._trained_batch = rows
        if self.built:
            self.assign(self._trained_batch_size, rows)
        return None


def batch_size_mismatch(rows, batch_size, given):
    """The warning for a `fit` whose per-replica batch `rows` differs from
    THOR's `batch_size` (`given`: passed as `THOR(batch_size=...)`, else
    taken from an earlier `fit`), else `None`."""
    if rows == batch_size:
        return None
    if given:
        source = f"`THOR(batch_size={batch_size})` was given"
        fix = (
            "Pass the per-replica batch you train with, or leave "
            "`batch_size` out to take it from `fit`."
        )
    else:
        source = (
            f"THOR keeps batch_size={batch_size}, the per-replica "
            "batch it first trained on"
        )
        fix = "Compile a new THOR to take the new batch size."
    return (
        f"{source}, but this `fit` trains on batches of {rows} "
        f"examples per replica. THOR uses {batch_size}: it is `N` "
        "of the LayerNorm rule and chooses each Dense layer's "
        f"preconditioning order. {fix} This warning is shown once."
    )
