"""`AdaSum`: adaptive summation of replicas' weight updates (Maleki et al.)."""

from keras import ops

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.utils.validation import check_int


def adasum_pair(a, b):
    """`(1 − a·b / (2‖a‖²)) · a + (1 − a·b / (2‖b‖²)) · b` for one tensor.

    Orthogonal `a`, `b` give `a + b`; parallel ones their mean. The dot
    products are formed on `a` and `b` divided by their largest magnitude
    (the coefficients do not change), so tiny and huge tensors neither
    underflow nor overflow; a zero tensor gets coefficient 1.
    """
    scale = ops.maximum(ops.max(ops.abs(a)), ops.max(ops.abs(b)))
    scale = ops.where(scale > 0, scale, ops.ones_like(scale))
    a_scaled, b_scaled = a / scale, b / scale
    dot = ops.sum(a_scaled * b_scaled)
    a_squared = ops.sum(a_scaled * a_scaled)
    b_squared = ops.sum(b_scaled * b_scaled)
    a_coefficient = ops.where(
        a_squared > 0, 1 - dot / (2 * a_squared), ops.ones_like(dot)
    )
    b_coefficient = ops.where(
        b_squared > 0, 1 - dot / (2 * b_squared), ops.ones_like(dot)
    )
    return a_coefficient * a + b_coefficient * b


def adasum_tree(tensors):
    """AdaSum of `2^k` tensors as a binary tree: pairs `(0, 1), (2, 3), ...`,
    then pairs of the results, down to one."""
    level = list(tensors)
    while len(level) > 1:
        level = [
            adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)
        ]
    return level[0]


def is_power_of_two(number):
    return number >= 1 and number & (number - 1) == 0


@keras_thor_export
class AdaSum:
    """Combines the replicas' weight updates by adaptive summation.

    Each replica takes its own optimizer step (its optimizer state stays its
    own, as in MindSpore and Horovod); the weight deltas are then combined
    per tensor and every replica applies the result:

    ```
    ĝ_r = mean of the gradients of r's group            (device_number > 1)
    Δ_r = inner_step(w, ĝ_r) − w                       (state of replica r)
    w ← w + AdasumTree(Δ_group_0, Δ_group_1, ..., Δ_group_{G−1})
    AdasumTree(a, b) = (1 − a·b/(2‖a‖²))·a + (1 − a·b/(2‖b‖²))·b
    ```

    Notation:
        - `r`: a replica; groups are `device_number` consecutive replicas
          (MindSpore's devices of one node), `G = replicas / device_number`
          of them, which must be a power of two, at least 2.

    Pass it as `keras_thor.boost.BoostOptimizer(..., adasum=AdaSum())`
    inside a `tf.distribute` strategy scope, or switch on AutoBoost's
    `adasum`.

    Args:
        device_number: Integer >= 1, replicas per group (averaged inside
            the group; AdaSum runs across groups).
    """

    def __init__(self, device_number=1):
        self.device_number = check_int("device_number", device_number, 1)

    def group_count(self, replicas):
        """The number of groups for `replicas`; raises unless it is a
        power of two >= 2."""
        groups, remainder = divmod(replicas, self.device_number)
        if remainder or groups < 2 or not is_power_of_two(groups):
            raise ValueError(
                "AdaSum needs the replicas to form a power-of-two number "
                "(at least 2) of groups of `device_number` replicas. "
                f"Received: {replicas} replica(s) and "
                f"device_number={self.device_number}"
            )
        return groups

    def get_config(self):
        return {"device_number": self.device_number}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        return f"AdaSum(device_number={self.device_number})"
