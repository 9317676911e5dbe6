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
kl_clip_steps="refresh": ν is measured on refresh steps only (a
    non-finite sum keeps the last ν); the steps between take the last
    refresh step's ν (no sum)
```

Notation:
    - `g_i`: kernel `i`'s gradient of the mean loss, summed across the
      replicas and unscaled, so `ν` is the same on every replica; for a
      joint block (`precondition_biases="joint"`) `g_i = [g_W; g_b]`, the
      kernel's and the bias's together, and `d_i = [d_W; d_b]`.
    - `A_i⁻¹`, `G_i⁻¹`: the inverses after the step's refresh; `lr`: the
      step's learning rate; the guarded kernels are the
      `StepPlan.guarded_kernels`, whose `d_i` the direction stage forms
      (`directions`).
    - `v_i`: the variable's momentum (`μ`: THOR's `momentum`), `F̂_i =
      c·A_i ⊗ c·G_i`: the block's averaged factors, undamped (the
      curvature the step's KL is measured in; `factor_decay`).
    - `ν`: the guard scale, 1 for a zero or non-finite sum; its state
      (`KlGuardState`) keeps the last one, for the logs
      (`thor_guard_scale`) and for the steps that hold it.

The direction's clip bounds one step's `d`; with momentum the weights
move by `lr · v`, about `d / (1 − μ)` once the velocity has built up, and
the direction's bound leaves that to grow: on a loss summed over many
outputs (benchmark 1's autoencoder) it did, and training diverged where
the velocity's clip kept it stable (docs/thor.md, "Curvature options").
"""

from keras import ops

from keras_thor.src.backend.values import numpy_value
from keras_thor.src.thor.option_state import OptionState


def kl_clip_scale(inner_product, learning_rate, kl_clip, fallback=None):
    """`ν = min(1, sqrt(kl_clip / |lr² · Σ ⟨d, g⟩|))`, 1 for a zero
    `inner_product`, `fallback` (default 1) for a non-finite one."""
    quadratic = ops.abs(learning_rate * learning_rate * inner_product)
    scale = ops.minimum(1.0, ops.sqrt(kl_clip / ops.maximum(quadratic, 1e-30)))
    if fallback is None:
        fallback = ops.ones_like(scale)
    return ops.where(ops.isfinite(quadratic), scale, fallback)


def guarded_directions(
    directions,
    gradients,
    velocities,
    curvature_norm,
    learning_rate,
    momentum,
    kl_clip,
    mode,
    held_scale=None,
    fallback_scale=None,
):
    """`({key: ν·u − μ·v}, ν)` of the guarded `directions`.

    `directions`, `gradients` and `velocities` are `{key: tensor}` of the
    guarded variables (`d`, `g` unscaled and summed across replicas, `v`;
    the velocities are read in `"velocity"` mode only);
    `curvature_norm(u)` is `Σ ⟨u_i, F̂_i u_i⟩` of `{key: u}`. With
    `mode="direction"`, `u = d` and no `μ·v` is kept. Non-finite inner
    products give `ν = fallback_scale`, default 1 (the update then leaves
    non-finite directions out). `held_scale`: a `ν` to apply instead of
    measuring one (the steps between refreshes with
    `kl_clip_steps="refresh"`, whose refresh steps fall back on the last
    `ν`).
    """
    if mode == "velocity":
        kept = {
            key: momentum * ops.reshape(velocities[key], direction.shape)
            for key, direction in directions.items()
        }
        steps = {key: kept[key] + d for key, d in directions.items()}
    else:
        kept, steps = {}, directions
    if held_scale is not None:
        scale = held_scale
    else:
        if mode == "velocity":
            inner = curvature_norm(steps)
        else:
            inner = sum(
                ops.sum(direction * gradients[key])
                for key, direction in directions.items()
            )
        scale = kl_clip_scale(inner, learning_rate, kl_clip, fallback_scale)
    return {
        key: scale * step - kept.get(key, 0.0) for key, step in steps.items()
    }, scale


class KlGuardState(OptionState):
    """`guard_scale`: the last step's `ν` (`kl_clip`), 1 at first."""

    option = "kl_clip"

    def __init__(self, options, table, add_variable):
        super().__init__(options, table, add_variable)
        self.scale = add_variable((), "ones", "float32", name="guard_scale")

    @property
    def last_scale(self):
        """The last step's `ν`, a float."""
        return float(numpy_value(self.scale))

    def training_logs(self):
        return {"thor_guard_scale": ops.convert_to_tensor(self.scale)}
