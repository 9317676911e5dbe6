"""Group loss scaling's part of a `BoostOptimizer` step."""

from keras import ops

from keras_thor.src.boost.algorithm import BoostAlgorithm
from keras_thor.src.boost.algorithm import checked_setting
from keras_thor.src.boost.algorithm import has_method
from keras_thor.src.boost.algorithm import refuse_loss_scale_optimizer
from keras_thor.src.boost.snapshots import snapshot
from keras_thor.src.distribute import replicas

# Group loss scales grow no further (a group whose gradients are all zero
# would otherwise reach infinity after ~10^5 steps; 1/2^126 is still a
# normal float32).
MAX_GROUP_SCALE = 2.0**126


class GroupLossScaling(BoostAlgorithm):
    """Unscales each group's gradients by its own scale and skips the step
    on an overflow (the rule of `keras_thor.callbacks.GroupLossScale`,
    the `setting`); `overflows` counts each group's overflowed steps.
    """

    argument = "group_loss_scale"
    refuses = ("grad_accumulation_step", "grad_freeze", "adasum", "dim_reduce")
    refusal = (
        "Group loss scaling runs alone in this version (MindSpore's "
        "loss-scale cell has no freezing branch): no gradient "
        "freezing, accumulation, AdaSum or DimReduce beside it."
    )
    runs_alone = True
    needs_boost_model = True
    applies_updates = True
    without_global_loss_scale = True

    @classmethod
    def validated(cls, setting):
        # Checked by what is used, as `grad_freeze` is.
        return checked_setting(
            "group_loss_scale",
            setting,
            "keras_thor.callbacks.GroupLossScale",
            has_method("groups_of"),
        )

    def check_inner(self, inner_optimizer):
        refuse_loss_scale_optimizer(
            inner_optimizer,
            "Group loss scaling replaces the global loss scale: pass the "
            "optimizer without its `LossScaleOptimizer` (the "
            "`GroupLossScale` callback unwraps it). Received: "
            f"inner_optimizer={inner_optimizer!r}",
        )

    def build(self, add_state, var_list):
        self.overflows = add_state(
            (self.setting.group_count,), "group_loss_scale_overflows"
        )

    def bind(self, model):
        self.setting.bind(model)

    def probes(self):
        return self.setting.overflow_probes()

    def training_logs(self):
        scales = self.setting.manager.scales
        logs = {}
        for j in range(self.setting.group_count):
            logs[f"group_{j}_loss_scale"] = scales[j + 1]
            logs[f"group_{j}_overflows"] = self.overflows[j]
        return logs

    def apply(self, optimizer, grads, variables, update, probe_gradients):
        scaling = self.setting
        manager = scaling.manager
        groups = scaling.groups_of(variables)
        scales = manager.scales
        overflow = _group_overflows(
            grads, groups, probe_gradients, scaling.group_count
        )
        skipped = ops.any(overflow)
        factors = ops.where(
            overflow, scaling.backoff_factor, scaling.growth_factor
        )
        present = [
            (g, v, group)
            for g, v, group in zip(grads, variables, groups)
            if g is not None
        ]
        unscaled = [
            ops.where(
                skipped,
                ops.zeros_like(g),
                g / ops.cast(scales[group + 1], g.dtype),
            )
            for g, _, group in present
        ]
        updated = [v for _, v, _ in present]
        overflows = (
            self.overflows,
            self.overflows + ops.cast(overflow, "float32"),
        )
        inner = optimizer.inner_optimizer
        if not replicas.under_strategy():

            def apply():
                inner.apply(unscaled, updated)
                return ops.zeros(())

            ops.cond(skipped, lambda: ops.zeros(()), apply)
            replicas.assign_replicated([overflows])
        else:
            # Under a strategy a skipped step runs the inner step on zeros
            # and undoes it (weights and optimizer state restored): a
            # `cond` around its merge call breaks under tf.distribute.
            kept = updated + list(inner.variables)
            before = snapshot(kept)
            inner.apply(unscaled, updated)
            replicas.assign_replicated(
                [
                    (v, ops.where(skipped, old, ops.convert_to_tensor(v)))
                    for v, old in zip(kept, before)
                ]
                + [overflows]
            )
        grown = ops.minimum(scales[1:-1] * factors, MAX_GROUP_SCALE)
        manager.assign_scales(ops.concatenate([scales[:1], grown, scales[-1:]]))


def _group_overflows(grads, groups, segment_overflows, group_count):
    """Whether each group overflowed: one of its gradients, or the
    gradient its segment passes on (its marker's probe), is not finite on
    some replica."""
    segments = replicas.all_reduce_sum(
        [
            ops.zeros(()) if o is None else ops.cast(o, "float32")
            for o in segment_overflows
        ]
    )
    return ops.stack(
        [
            ops.logical_or(
                ops.logical_not(
                    replicas.finite_on_all_replicas(
                        [
                            g
                            for g, group in zip(grads, groups)
                            if group == j and g is not None
                        ]
                    )
                ),
                segments[j] > 0,
            )
            for j in range(group_count)
        ]
    )
