"""AdaSum's part of a `BoostOptimizer` step."""

from keras import ops

from keras_thor.src.boost.adasum import AdaSum
from keras_thor.src.boost.adasum import adasum_tree
from keras_thor.src.boost.algorithm import BoostAlgorithm
from keras_thor.src.boost.algorithm import checked_setting
from keras_thor.src.boost.algorithm import refuse_loss_scale_optimizer
from keras_thor.src.boost.algorithm import zeroed_unless_finite
from keras_thor.src.boost.snapshots import snapshot
from keras_thor.src.distribute import replicas

_REFUSAL = (
    "AdaSum combines with neither gradient accumulation nor a "
    "`LossScaleOptimizer` in this version."
)


class AdaSumCombination(BoostAlgorithm):
    """A local inner step on every replica, then the weight deltas of the
    replica groups combined (see `keras_thor.boost.AdaSum`):

    ```
    Δ_r = inner.step(w, mean of the gradients of r's group) − w
    w ← w + AdasumTree(Δ_group_0, Δ_group_1, ...)
    ```

    Notation:
        - `r`: a replica; a group is `setting.device_number` replicas.
    """

    argument = "adasum"
    refuses = ("grad_accumulation_step",)
    refusal = _REFUSAL
    applies_updates = True
    steps_on_local_gradients = True

    @classmethod
    def validated(cls, setting):
        return checked_setting(
            "adasum",
            setting,
            "keras_thor.boost.AdaSum",
            lambda value: isinstance(value, AdaSum),
        )

    def check_inner(self, inner_optimizer):
        refuse_loss_scale_optimizer(
            inner_optimizer,
            f"{_REFUSAL} Received: adasum={self.setting!r}, "
            f"inner_optimizer={type(inner_optimizer).__name__}",
        )

    def apply(self, optimizer, grads, variables, update, probe_gradients):
        present = [(g, v) for g, v in zip(grads, variables) if g is not None]
        group_size = self.setting.device_number
        groups = self.setting.group_count(replicas.replica_count())
        # Each replica steps on the gradient of its own mean loss (Keras
        # divides each replica's loss by the replica count).
        count = replicas.replica_count()
        grads = [
            g * count for g in zeroed_unless_finite([g for g, _ in present])
        ]
        if group_size > 1:
            first = (replicas.replica_id() // group_size) * group_size
            members = first + ops.arange(group_size)
            grads = [
                ops.mean(ops.take(gathered, members, axis=0), axis=0)
                for gathered in replicas.all_gather(grads)
            ]
        variables = [v for _, v in present]
        before = snapshot(variables)
        optimizer.inner_optimizer.apply(grads, variables)
        deltas = replicas.all_gather(
            [
                ops.convert_to_tensor(v) - old
                for v, old in zip(variables, before)
            ]
        )
        combined = [
            adasum_tree([gathered[g * group_size] for g in range(groups)])
            for gathered in deltas
        ]
        replicas.assign_replicated(
            (v, old + delta)
            for v, old, delta in zip(variables, before, combined)
        )
