"""THOR's per-variable update: precondition, decay, clip, momentum.

Pure functions of tensors; `THOR` orchestrates them and assigns the
results. A variable the step's direction stage has preconditioned
(`StepPlan.preconditioned_in_step`) comes with no preconditioner here.
"""

from keras import ops

from keras_thor.src.thor.preconditioning import plain_direction
from keras_thor.src.utils.finite import if_finite
from keras_thor.src.utils.finite import is_finite


def clip_by_norm(gradient, clip_norm=1.0):
    """`g · clip_norm / max(‖g‖, clip_norm)` (MindSpore's `ClipByNorm`)."""
    norm = ops.sqrt(ops.sum(ops.square(gradient)))
    return gradient * (clip_norm / ops.maximum(norm, clip_norm))


def momentum_step(
    variable, velocity, direction, learning_rate, momentum, nesterov
):
    """MindSpore's `ApplyMomentum`: returns `(variable, velocity)`.

    `v ← μ·v + d; w ← w − lr·v`, or with Nesterov `w ← w − lr·(d + μ·v)`.
    """
    velocity = momentum * velocity + direction
    step = direction + momentum * velocity if nesterov else velocity
    return variable - learning_rate * step, velocity


def thor_update(
    variable,
    gradient,
    velocity,
    a_inverse,
    g_inverse,
    learning_rate,
    damping,
    preconditioner,
    weight_decay,
    batch_size,
    momentum,
    nesterov,
    clip_gradient,
):
    """One THOR step of one variable; returns `(variable, velocity,
    skipped)`.

    The order is MindSpore's: precondition, `+ weight_decay · w`, optional
    clip by norm 1.0, momentum. The arithmetic is float32. If the
    preconditioned gradient has a non-finite entry, the variable and its
    velocity are returned unchanged and `skipped` (a boolean scalar) is
    true.
    """
    w = ops.cast(variable, "float32")
    direction = plain_direction(
        preconditioner,
        ops.reshape(ops.cast(gradient, "float32"), variable.shape),
        a_inverse,
        g_inverse,
        damping,
        batch_size,
    )
    if weight_decay:
        direction = direction + weight_decay * w
    if clip_gradient:
        direction = clip_by_norm(direction)

    def updated():
        new_w, new_velocity = momentum_step(
            w,
            ops.cast(velocity, "float32"),
            direction,
            learning_rate,
            momentum,
            nesterov,
        )
        return (
            ops.cast(new_w, variable.dtype),
            ops.cast(new_velocity, velocity.dtype),
        )

    def unchanged():
        return ops.copy(variable), ops.copy(velocity)

    finite = is_finite(direction)
    new_variable, new_velocity = if_finite(finite, updated, unchanged)
    return new_variable, new_velocity, ops.logical_not(finite)


def thor_updates(
    variables,
    gradients,
    velocities,
    a_inverses,
    g_inverses,
    learning_rate,
    damping,
    preconditioners,
    weight_decays,
    batch_size,
    momentum,
    nesterov,
    clip_gradient,
):
    """`thor_update` for several variables at once (lists in, lists out)."""
    return [
        thor_update(
            variable,
            gradient,
            velocity,
            a_inverse,
            g_inverse,
            learning_rate,
            damping,
            preconditioner,
            weight_decay,
            batch_size,
            momentum,
            nesterov,
            clip_gradient,
        )
        for (
            variable,
            gradient,
            velocity,
            a_inverse,
            g_inverse,
            preconditioner,
            weight_decay,
        ) in zip(
            variables,
            gradients,
            velocities,
            a_inverses,
            g_inverses,
            preconditioners,
            weight_decays,
        )
    ]


ADAM_BETA_2 = 0.999
ADAM_EPSILON = 1e-7


def adam_update(
    variable,
    gradient,
    first,
    second,
    learning_rate,
    beta_1,
    step,
    weight_decay,
):
    """Adam's step of a variable without curvature (`first_order="adam"`);
    returns `(variable, first, second, skipped)`.

    `m ← β₁·m + (1 − β₁)·g`, `v ← β₂·v + (1 − β₂)·g²`,
    `w ← w − lr·(m̂ / (√v̂ + ε) + weight_decay·w)`, with
    `m̂ = m / (1 − β₁ᵗ)`, `v̂ = v / (1 − β₂ᵗ)` at step `t >= 1`. The
    arithmetic is float32; a non-finite step leaves all three unchanged
    and `skipped` true.

    Notation:
        g: the gradient; m, v: the first and second moments; β₁: THOR's
        `momentum`; β₂, ε: `ADAM_BETA_2`, `ADAM_EPSILON`.
    """
    w = ops.cast(variable, "float32")
    g = ops.reshape(ops.cast(gradient, "float32"), variable.shape)
    new_first = beta_1 * ops.cast(first, "float32") + (1.0 - beta_1) * g
    new_second = ADAM_BETA_2 * ops.cast(second, "float32") + (
        1.0 - ADAM_BETA_2
    ) * ops.square(g)
    first_hat = new_first / (1.0 - ops.power(beta_1, step))
    second_hat = new_second / (1.0 - ops.power(ADAM_BETA_2, step))
    direction = first_hat / (ops.sqrt(second_hat) + ADAM_EPSILON)
    if weight_decay:
        direction = direction + weight_decay * w

    def updated():
        return (
            ops.cast(w - learning_rate * direction, variable.dtype),
            ops.cast(new_first, first.dtype),
            ops.cast(new_second, second.dtype),
        )

    def unchanged():
        return ops.copy(variable), ops.copy(first), ops.copy(second)

    finite = is_finite(direction)
    new_variable, new_first, new_second = if_finite(finite, updated, unchanged)
    return new_variable, new_first, new_second, ops.logical_not(finite)


def adam_updates(
    variables,
    gradients,
    firsts,
    seconds,
    learning_rate,
    beta_1,
    step,
    weight_decays,
):
    """`adam_update` for several variables at once (lists in, lists out)."""
    return [
        adam_update(v, g, m, s, learning_rate, beta_1, step, decay)
        for v, g, m, s, decay in zip(
            variables, gradients, firsts, seconds, weight_decays
        )
    ]
