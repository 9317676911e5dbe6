"""THOR's step-size guard (`kl_clip`): kfac-pytorch's KL clip of the
direction, or of the velocity the step leaves (`kl_clip_mode`).

```
d_i = A_i⁻¹ · g_i · G_i⁻¹                 for each guarded kernel i
"direction" (kfac-pytorch):
    ν   = min(1, sqrt(kl_clip / |lr² · Σ_i ⟨d_i, g_i⟩|))
    d_i ← ν · d_i
"velocity":
    u_i = μ · v_i + d_i                   the velocity the step would leave
    ν   = min(1, sqrt(kl_clip / |lr² · Σ_i ⟨u_i, F̂_i u_i⟩|))
    d_i ← ν · u_i − μ · v_i               so the step leaves ν · u_i
```

Notation:
    - `g_i`: kernel `i`'s gradient of the mean loss, summed across the
      replicas and unscaled, so `ν` is the same on every replica; for a
      joint block (`precondition_biases="joint"`) `g_i = [g_W; g_b]`, the
      kernel's and the bias's together, and `d_i = [d_W; d_b]`.
    - `A_i⁻¹`, `G_i⁻¹`: the stored inverses; `lr`: the step's learning
      rate; the guarded kernels are the `StepPlan.guarded_kernels`.
    - `v_i`: the variable's momentum (`μ`: THOR's `momentum`), `F̂_i =
      c·A_i ⊗ c·G_i`: the block's averaged factors, undamped (the
      curvature the step's KL is measured in; `factor_decay`).
    - `ν`: the guard scale, 1 for a zero or non-finite sum; the estimator
      keeps the last one for the logs (`thor_guard_scale`).

The direction's clip bounds one step's `d`; with momentum the weights
move by `lr · v`, about `d / (1 − μ)` once the velocity has built up, and
the direction's bound leaves that to grow: on a loss summed over many
outputs (benchmark 1's autoencoder) it did, and training diverged where
the velocity's clip kept it stable (docs/thor.md, "Curvature options").
"""

from keras import ops

from keras_thor.src.backend.dense import dense
from keras_thor.src.distribute import replicas


def kl_clip_scale(inner_product, learning_rate, kl_clip):
    """`ν = min(1, sqrt(kl_clip / |lr² · Σ ⟨d, g⟩|))`, 1 for a zero or
    non-finite `inner_product`."""
    quadratic = ops.abs(learning_rate * learning_rate * inner_product)
    scale = ops.minimum(1.0, ops.sqrt(kl_clip / ops.maximum(quadratic, 1e-30)))
    return ops.where(ops.isfinite(quadratic), scale, ops.ones_like(scale))


def guarded_gradients(thor, variables, grads, loss_scale):
    """`grads` with the guarded kernels' gradients (and their joint
    biases') replaced by `ν · d`.

    One collective sums the guarded gradients across replicas; each
    replica then passes `ν · d / replicas` in the loss's scale
    (`loss_scale`), which the optimizer sums and unscales as it does
    gradients. Records `ν` in `thor.estimator`.
    """
    plan = thor.step_plan
    at = {}
    for position, variable in enumerate(variables):
        if grads[position] is not None:
            at[plan.variable_index(variable)] = position
    # (kernel position, bias position or None, kernel index) per block.
    guarded = []
    for position, variable in enumerate(variables):
        index = plan.variable_index(variable)
        if index not in plan.guarded_kernels or grads[position] is None:
            continue
        bias = plan.joint_biases.get(index)
        if bias is not None and bias not in at:
            continue
        guarded.append((position, at.get(bias), index))
    if not guarded:
        return grads
    positions = [p for k, b, _ in guarded for p in (k, b) if p is not None]
    raw = [ops.cast(dense(grads[p]), "float32") for p in positions]
    count = replicas.replica_count()
    if count > 1:
        raw = replicas.all_reduce_sum(raw)
    unscaled = dict(zip(positions, (g / loss_scale for g in raw)))
    damping = thor.current_damping()
    directions = {}
    for kernel, bias, index in guarded:
        if bias is None:
            directions[kernel] = thor.estimator.precondition(
                index, unscaled[kernel], damping, float(thor.batch_size)
            )
        else:
            directions[kernel], directions[bias] = plan.blocks[
                index
            ].precondition_pair(
                unscaled[kernel],
                unscaled[bias],
                *thor.estimator.inverses_of(index),
            )
    if thor.kl_clip_mode == "velocity":
        steps, kept, inner = _velocity_steps(
            thor, variables, guarded, directions
        )
    else:
        steps, kept = directions, {}
        inner = sum(ops.sum(directions[p] * unscaled[p]) for p in positions)
    # Non-finite inner products give ν = 1 (the update then leaves
    # non-finite directions out).
    scale = kl_clip_scale(
        inner, ops.cast(thor.learning_rate, "float32"), thor.kl_clip
    )
    thor.estimator.record_guard_scale(scale)
    grads = list(grads)
    for position in positions:
        grads[position] = ops.cast(
            (scale * steps[position] - kept.get(position, 0.0))
            * (loss_scale / count),
            variables[position].dtype,
        )
    return grads


def _velocity_steps(thor, variables, guarded, directions):
    """`(u, μ·v, Σ ⟨u, F̂u⟩)` of the guarded blocks' `directions`
    (`kl_clip_mode="velocity"`), the first two by variable position (the
    direction's guard keeps no `μ·v`)."""
    momentum = thor.momentum
    kept, steps = {}, {}
    for position, direction in directions.items():
        velocity = thor.velocity_of(variables[position])
        kept[position] = momentum * ops.reshape(
            ops.convert_to_tensor(velocity), direction.shape
        )
        steps[position] = kept[position] + direction
    inner = 0.0
    for kernel, bias, index in guarded:
        inner += thor.estimator.curvature_norm(
            index, steps[kernel], None if bias is None else steps[bias]
        )
    return steps, kept, inner
