"""Moving averages of curvature factors (kfac-jax's normalized EMA).

Pure functions, and the averages' state (`FactorAverages`): per block the
averaged factor blocks and their weight.

```
W_k = α · W_{k-1} + 1                  (W_0 = 0)
F_k = F_{k-1} + (F_new - F_{k-1}) / W_k
```

which is `Σ_i α^(k-i) F_i / Σ_i α^(k-i)`: the first average is the first
batch's factor (no start from zero or from the identity), and later ones
weigh past batches by `α` per statistics step.

Notation:
    - `α`: `factor_decay`; `F_new`: a statistics step's factor blocks;
      `W_k`: the sum of the weights after `k` statistics steps.
"""

from keras import ops

from keras_thor.src.backend.values import numpy_value
from keras_thor.src.thor.option_state import OptionState
from keras_thor.src.utils.finite import all_finite


def average_weight(weight, decay):
    """`W_k = α · W_{k-1} + 1`."""
    return decay * weight + 1.0


def averaged_factor(average, new, weight):
    """`F_k = F_{k-1} + (F_new - F_{k-1}) / W_k` (`weight` is `W_k`)."""
    return average + (ops.cast(new, average.dtype) - average) / weight


class FactorAverages(OptionState):
    """The averages of `factor_decay`: per block, in block order, zero
    `a_factor` and `g_factor` in its inverses' shapes, then a zero
    `factor_weight`."""

    option = "factor_decay"

    def __init__(self, options, table, add_variable):
        super().__init__(options, table, add_variable)
        self.averages = {}
        for index, (name, a_inverse, g_inverse) in table.items():
            a_factor, g_factor = (
                add_variable(
                    inverse.shape, "zeros", "float32", name=f"{name}_{part}"
                )
                for part, inverse in (
                    ("a_factor", a_inverse),
                    ("g_factor", g_inverse),
                )
            )
            weight = add_variable(
                (), "zeros", "float32", name=f"{name}_factor_weight"
            )
            self.averages[index] = (a_factor, g_factor, weight)

    def block_state(self, index, position):
        a_factor, g_factor, weight = self.averages[index]
        return {
            "a_factor": numpy_value(a_factor),
            "g_factor": numpy_value(g_factor),
            "factor_weight": numpy_value(weight),
        }

    def factors_of(self, index, writes):
        """Block `index`'s averaged `(c·A, c·G)` after `writes`."""
        a_factor, g_factor, _ = self.averages[index]
        return writes.value(a_factor), writes.value(g_factor)

    def take(self, index, a_new, g_new, writes):
        """Takes a statistics step's factor blocks into block `index`'s
        averages (into `writes`) if they are finite; otherwise the averages
        and the weight stay. Returns `(c·A, c·G, seen, finite)`: the
        averages after the step, whether they hold any statistics, and
        whether the new factors were taken."""
        a_factor, g_factor, previous = self.averages[index]
        finite = all_finite([a_new, g_new])
        weight = average_weight(previous, self.options.factor_decay)
        averaged = []
        for average, new in ((a_factor, a_new), (g_factor, g_new)):
            average_value = ops.convert_to_tensor(average)
            updated = averaged_factor(average_value, new, weight)
            averaged.append(ops.where(finite, updated, average_value))
            writes.set(average, averaged[-1])
        weight = ops.where(finite, weight, ops.convert_to_tensor(previous))
        writes.set(previous, weight)
        return (*averaged, weight > 0, finite)
