"""Moving averages of curvature factors (kfac-jax's normalized EMA).

Pure functions; `THOR` keeps the averaged factor blocks and the weight.

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


def average_weight(weight, decay):
    """`W_k = α · W_{k-1} + 1`."""
    return decay * weight + 1.0


def averaged_factor(average, new, weight):
    """`F_k = F_{k-1} + (F_new - F_{k-1}) / W_k` (`weight` is `W_k`)."""
    return average + (ops.cast(new, average.dtype) - average) / weight
