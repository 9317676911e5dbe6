"""THOR's direction stage: every preconditioned direction a step forms.

```
plain:     d = A⁻¹ · g · G⁻¹               (LayerNorm: g / (g²/N + √λ))
factored:  d = Σ_calls (A⁻¹Xᵀ)(D·G⁻¹)      (Dense, where cheaper)
joint:     [d_W; d_b] = A⁻¹ · [g_W; g_b] · G⁻¹   ([x, 1] rows)
guarded:   d ← ν·u − μ·v                   (`kl_guard`)
```

`step_directions` forms, once per training step, the directions of the
`StepPlan.preconditioned_in_step` variables, those that need the step:
the factored kernels (from the recorded calls, never forming `g`), the
joint pairs and, with `kl_clip`, every block (the guard needs them all
at once). The update forms the others (`plain_direction`) after the
cross-replica sum, inside its fused computation
(`preconditioning.plain_direction`): MindSpore's order, which Keras's
clipping options and LayerNorm's rule (not linear) need.

Notation:
    - `g`: a gradient; `X`, `D`: a call's input rows and output
      gradients; `A⁻¹`, `G⁻¹`: the block's inverses after the step's
      refresh; `v`, `μ`: the velocity and momentum; `λ`, `N`: the damping
      and THOR's `batch_size`.
"""

import dataclasses

from keras import ops

from keras_thor.src.backend.dense import dense
from keras_thor.src.distribute import replicas
from keras_thor.src.thor.kl_guard import guarded_directions


def curvature_norm(block, vectors, a_factor, g_factor):
    """`⟨u, F̂u⟩`, `F̂ = c·A ⊗ c·G` the block's factors, undamped; `vectors`
    is `(u_W,)` or, for a joint block, `(u_W, u_b)`."""
    kernel_vector = ops.reshape(
        ops.cast(vectors[0], "float32"), block.kernel.shape
    )
    # The preconditioner's products, the factors in the inverses' place.
    if len(vectors) == 1:
        product = block.precondition(
            kernel_vector, a_factor, g_factor, None, None
        )
        return ops.sum(product * kernel_vector)
    bias_vector = ops.reshape(ops.cast(vectors[1], "float32"), block.bias.shape)
    kernel_product, bias_product = block.precondition_pair(
        kernel_vector, bias_vector, a_factor, g_factor
    )
    return ops.sum(kernel_product * kernel_vector) + ops.sum(
        bias_product * bias_vector
    )


@dataclasses.dataclass(frozen=True)
class Guard:
    """What the step-size guard takes (`kl_guard`).

    Args:
        kl_clip: THOR's `kl_clip`; mode: its `kl_clip_mode`.
        learning_rate: The step's learning rate.
        momentum: THOR's momentum.
        velocity_of: `variable -> its velocity`.
        damping: The step's damping; batch_size: THOR's `batch_size`.
        loss_scale: The scale of the step's gradients.
        held_scale: `None` (the step measures `ν`) or the `ν` it applies
            (`kl_clip_steps="refresh"` between refreshes).
        fallback_scale: The `ν` of a non-finite sum (`None`: 1; the last
            `ν` on refresh steps with `kl_clip_steps="refresh"`).
    """

    kl_clip: float
    mode: str
    learning_rate: object
    momentum: float
    velocity_of: object
    damping: object
    batch_size: float
    loss_scale: object
    held_scale: object = None
    fallback_scale: object = None


def _positions(plan, variables, grads):
    """`{variable index: position}` of the variables with a gradient."""
    return {
        plan.variable_index(variable): position
        for position, variable in enumerate(variables)
        if grads[position] is not None
    }


def _factored(plan, blocks, curvature, variables, calls, output_grads):
    """`{position: Σ_calls (A⁻¹Xᵀ)(D·G⁻¹)}` of the factored kernels."""
    parts = {}
    for call, output_grad in zip(calls, output_grads):
        index = plan.variable_index(call.block.kernel)
        if index in plan.factored_kernels and output_grad is not None:
            part = blocks[index].factored_gradient(
                call.inputs, output_grad, *curvature.inverses(index)
            )
            parts.setdefault(index, []).append(part)
    directions = {}
    for position, variable in enumerate(variables):
        index = plan.variable_index(variable)
        if index in parts:
            total = sum(parts[index][1:], parts[index][0])
            directions[position] = ops.cast(total, variable.dtype)
    return directions


def _joint(plan, blocks, curvature, variables, grads):
    """`{position: direction}` of each joint pair, in the gradients' own
    (loss) scale."""
    at = _positions(plan, variables, grads)
    directions = {}
    for kernel_index, bias_index in plan.joint_biases.items():
        if kernel_index not in at or bias_index not in at:
            continue
        kernel, bias = at[kernel_index], at[bias_index]
        pair = blocks[kernel_index].precondition_pair(
            grads[kernel], grads[bias], *curvature.inverses(kernel_index)
        )
        for position, direction in zip((kernel, bias), pair):
            directions[position] = ops.cast(
                direction, variables[position].dtype
            )
    return directions


def _guarded(plan, blocks, curvature, variables, grads, guard):
    """`({position: ν·u − μ·v}, ν)` of the guarded blocks (joint pairs
    included), from the gradients summed across replicas (one collective)
    and unscaled; each replica passes its share `1 / replicas` in the loss
    scale, which the optimizer sums and unscales as it does gradients.
    `ν` is `None` without a guarded block."""
    at = _positions(plan, variables, grads)
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
        return {}, None
    positions = [p for k, b, _ in guarded for p in (k, b) if p is not None]
    raw = [ops.cast(dense(grads[p]), "float32") for p in positions]
    count = replicas.replica_count()
    if count > 1:
        raw = replicas.all_reduce_sum(raw)
    unscaled = {p: g / guard.loss_scale for p, g in zip(positions, raw)}
    directions, pairs = {}, {}
    for kernel, bias, index in guarded:
        block = blocks[index]
        if bias is None:
            directions[kernel] = block.precondition(
                ops.reshape(unscaled[kernel], block.kernel.shape),
                *curvature.inverses(index),
                guard.damping,
                guard.batch_size,
            )
            pairs[index] = (kernel,)
        else:
            directions[kernel], directions[bias] = block.precondition_pair(
                unscaled[kernel], unscaled[bias], *curvature.inverses(index)
            )
            pairs[index] = (kernel, bias)

    def norm(steps):
        return sum(
            curvature_norm(
                blocks[index],
                [steps[p] for p in pair],
                *curvature.averaged_factors(index),
            )
            for index, pair in pairs.items()
        )

    velocities = {}
    if guard.mode == "velocity":
        velocities = {
            p: ops.convert_to_tensor(guard.velocity_of(variables[p]))
            for p in directions
        }
    steps, scale = guarded_directions(
        directions,
        unscaled,
        velocities,
        norm,
        guard.learning_rate,
        guard.momentum,
        guard.kl_clip,
        guard.mode,
        guard.held_scale,
        guard.fallback_scale,
    )
    return {
        p: ops.cast(step * (guard.loss_scale / count), variables[p].dtype)
        for p, step in steps.items()
    }, scale


def step_directions(
    plan, blocks, curvature, variables, grads, calls, output_grads, guard
):
    """`(grads, ν)`: `grads` with the directions the step forms in place of
    the plan's in-step gradients (`grads[i]` is `None` for a factored
    kernel, whose `A⁻¹ · g · G⁻¹` comes from `calls` and their
    `output_grads`); `ν` is the guard scale, `None` without `guard`.

    `curvature` gives each block's `inverses(index)` and
    `averaged_factors(index)` after the step's refresh
    (`CurvatureValues`).
    """
    grads = list(grads)
    for position, direction in _factored(
        plan, blocks, curvature, variables, calls, output_grads
    ).items():
        grads[position] = direction
    scale = None
    if guard is not None:
        directions, scale = _guarded(
            plan, blocks, curvature, variables, grads, guard
        )
    else:
        directions = _joint(plan, blocks, curvature, variables, grads)
    for position, direction in directions.items():
        grads[position] = direction
    return grads, scale
