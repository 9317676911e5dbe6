"""THOR's curvature options in NumPy float64, on top of `reference.py`.

`OptionsReferenceTHOR` is `reference.ReferenceTHOR` with the options of
`keras_thor.optimizers.THOR` beyond MindSpore's rule, written from their
documentation and independent of keras_thor:

```
burn-in: the first `burn_in_steps` batches only gather statistics (the
    weights, momenta and t stay; their factors enter the averages)
statistics steps: t = 0, k, 2k, ...   (k = statistics_frequency or frequency)
    A_t, G_t from the first `statistics_rows` examples of the batch
    (per sample: D = N · dL/dz, N the whole batch), at targets drawn by
    `fisher_targets(t, predictions)` if given (sampled Fisher)
    with factor_decay α: F = Σ_i α^(t_last - t_i) F_i / Σ_i α^(t_last - t_i)
        over the statistics steps so far (kept as the list of all of them)
refresh steps: t = 0, f, 2f, ...: inverses of F (as reference.layer_inverses)
    with damping_split="pi": (c·A + π√λI)⁻¹, (c·G + √λ/π·I)⁻¹,
        π = sqrt((tr A / d_A) / (tr G / d_G)) of the whole F (1 at a 0 trace)
    with trace_thresholds (ω₁, ω₂), per layer,
    T = tr((c·A + π√λI) ⊗ (c·G + √λ/π·I)) formed as a Kronecker product,
    T_last its value at the layer's last inversion, Δ = |T − T_last| / T_last:
        first inversion or Δ > ω₁: invert; Δ < ω₂: the layer stops for good;
        otherwise keep the inverses
with joint_biases (precondition_biases="joint"): a Dense or conv2d layer's
    A is that of its input rows (patches) with a 1 appended, and its kernel
    and bias directions are [d_W; d_b] = A⁻¹ [g_W; g_b] G⁻¹
every step: d = A⁻¹ g G⁻¹ for the THOR kernels,
    ν = min(1, sqrt(kl_clip / |lr² · Σ ⟨d, g⟩|))  (1 without kl_clip; the
    sum takes a joint block's bias with its kernel),
    d ← ν · d, then weight decay, clipping and momentum as MindSpore;
    with kl_clip_mode="velocity" (Dense layers), u = μ·v + d, the sum is
    Σ ⟨u, F u⟩ with F = A ⊗ G of the averaged factors cut into their
    split_dim blocks (split_dim + 1 for A with the bias row), and
    d ← ν · u − μ·v; with kl_clip_steps="refresh" ν is measured at
    t = 0, f, 2f, ... only and the steps between take the last one.
```
"""

import math

import numpy as np

from tests.thor import reference


def averaged(factors, decay):
    """`Σ_i α^(k-i) F_i / Σ_i α^(k-i)` of a list of factors `F_1..F_k`."""
    weights = [decay ** (len(factors) - 1 - i) for i in range(len(factors))]
    total = sum(w * np.asarray(f, np.float64) for w, f in zip(weights, factors))
    return total / sum(weights)


def pi_correction(layer_spec, factors):
    """K-FAC's `π = sqrt((tr A / d_A) / (tr G / d_G))`, 1 at a 0 trace."""
    a_factor, g_factor, _ = factors
    a_factor = np.asarray(a_factor, np.float64)
    if layer_spec["type"] == "embedding":
        a_mean = a_factor.mean()
    else:
        a_mean = np.trace(a_factor) / len(a_factor)
    g_mean = np.trace(g_factor) / len(g_factor)
    if a_mean <= 0 or g_mean <= 0:
        return 1.0
    return math.sqrt(a_mean / g_mean)


def damped_factors(layer_spec, factors, damping, split):
    """`(c·A + π√λI, c·G + √λ/π·I)` as dense matrices (π = 1 for the
    "uniform" split)."""
    a_factor, g_factor, scale = factors
    pi = 1.0 if split == "uniform" else pi_correction(layer_spec, factors)
    shift = math.sqrt(damping)
    if layer_spec["type"] == "embedding":
        a_damped = np.diag(np.asarray(a_factor, np.float64) + pi * shift)
    else:
        a_damped = scale * a_factor + pi * shift * np.eye(len(a_factor))
    g_damped = scale * g_factor + shift / pi * np.eye(len(g_factor))
    return a_damped, g_damped


def damped_trace(layer_spec, factors, damping, split="uniform"):
    """`tr((c·A + π√λI) ⊗ (c·G + √λ/π·I))`, the Kronecker product formed."""
    a_damped, g_damped = damped_factors(layer_spec, factors, damping, split)
    return float(np.trace(np.kron(a_damped, g_damped)))


def layer_inverses(
    layer_spec, factors, damping, split_dim, split, a_split_dim=None
):
    """`{"A_inv", "G_inv"}` of one layer with the damping `split`, `A` cut
    into blocks of `a_split_dim` (default `split_dim`)."""
    if split == "uniform" and a_split_dim is None:
        return reference.layer_inverses(layer_spec, factors, damping, split_dim)
    a_damped, g_damped = damped_factors(layer_spec, factors, damping, split)
    g_inv = reference.block_inverse(g_damped, split_dim)
    if layer_spec["type"] == "embedding":
        return {"A_inv": 1.0 / np.diag(a_damped), "G_inv": g_inv}
    return {
        "A_inv": reference.block_inverse(a_damped, a_split_dim or split_dim),
        "G_inv": g_inv,
    }


def _joins(layer_spec):
    return layer_spec["type"] in ("dense", "conv2d") and layer_spec.get(
        "use_bias", True
    )


def joint_factors(layer_spec, inputs, output_grad, batch_size_n):
    """`reference.thor_factors` with a 1 appended to every input row (a
    Dense layer's inputs, a convolution's im2col patches)."""
    _, g_factor, scale = reference.thor_factors(
        layer_spec, inputs, output_grad, batch_size_n
    )
    if layer_spec["type"] == "dense":
        rows = np.asarray(inputs, np.float64).reshape(-1, inputs.shape[-1])
    else:
        rows, _ = reference.im2col(inputs, *reference._conv_args(layer_spec))
    rows = np.concatenate([rows, np.ones((len(rows), 1))], axis=1)
    return rows.T @ rows / len(rows), g_factor, scale


def joint_directions(inverses, kernel_grad, bias_grad):
    """`(d_W, d_b)` from `[d_W; d_b] = A⁻¹ [g_W; g_b] G⁻¹`."""
    rows = kernel_grad.reshape(-1, kernel_grad.shape[-1])
    product = (
        inverses["A_inv"]
        @ np.vstack([rows, bias_grad[None]])
        @ inverses["G_inv"]
    )
    return product[:-1].reshape(kernel_grad.shape), product[-1]


def block_diagonal(matrix, size):
    """`matrix` with its entries outside the diagonal `size` blocks zeroed."""
    kept = np.zeros_like(matrix)
    for start in range(0, len(matrix), size):
        part = slice(start, start + size)
        kept[part, part] = matrix[part, part]
    return kept


def guard_scale(directions, gradients, learning_rate, kl_clip):
    """kfac-pytorch's KL clip `ν` over pairs of directions and gradients."""
    inner = sum(float(np.sum(d * g)) for d, g in zip(directions, gradients))
    return scale_of(inner, learning_rate, kl_clip)


def scale_of(inner, learning_rate, kl_clip):
    """`min(1, sqrt(kl_clip / |lr² · inner|))`, 1 at 0 or not finite."""
    quadratic = abs(learning_rate**2 * inner)
    if quadratic == 0.0 or not math.isfinite(quadratic):
        return 1.0
    return min(1.0, math.sqrt(kl_clip / quadratic))


class OptionsReferenceTHOR(reference.ReferenceTHOR):
    """`ReferenceTHOR` with `factor_decay`, `statistics_frequency`,
    `statistics_rows`, a sampled Fisher, `kl_clip`, `trace_thresholds`,
    `damping_split` and `burn_in_steps`.

    `fisher_targets(step, predictions)`, if given, returns the targets
    whose loss gradients give `G` on statistics steps (the sampled Fisher);
    `statistics_loss` is the loss they are taken at (default: `loss`).
    After each step, `guard_scales` holds every step's `ν` and
    `statistics_steps` the statistics steps so far; `factors[i]` is
    layer `i`'s list of `(A, G, c)` of every statistics step;
    `trace_decisions` the trace rule's `(step, layer, "invert" | "keep" |
    "stop" | "stopped")` of every refresh.
    """

    def __init__(
        self,
        model,
        loss,
        factor_decay=None,
        statistics_frequency=None,
        statistics_rows=None,
        kl_clip=None,
        kl_clip_mode="direction",
        kl_clip_steps="every",
        fisher_targets=None,
        statistics_loss=None,
        trace_thresholds=None,
        damping_split="uniform",
        burn_in_steps=0,
        joint_biases=False,
        **hyper,
    ):
        super().__init__(model, loss, **hyper)
        self.damping_split = damping_split
        self.burn_in_steps = burn_in_steps
        self.burned_in = 0
        self.joint_biases = joint_biases
        self.factor_decay = factor_decay
        self.statistics_period = int(statistics_frequency or self.frequency)
        self.statistics_rows = statistics_rows
        self.kl_clip = kl_clip
        self.kl_clip_mode = kl_clip_mode
        self.kl_clip_steps = kl_clip_steps
        self.fisher_targets = fisher_targets
        self.statistics_loss = statistics_loss or loss
        self.guard_scales = []
        self.statistics_steps = []
        self.factors = {}
        self.trace_thresholds = trace_thresholds
        self.last_traces = {}
        self.stopped = set()
        self.trace_decisions = []

    def step(self, weights, x, y, sample_weight=None):
        step = self.iterations
        learning_rate = reference.value_at_step(
            self.learning_rate, step, "learning_rate"
        )
        damping = reference.value_at_step(self.damping, step, "damping")
        weights = reference._as_float64(weights)
        _, grads, captures = reference.forward_backward(
            self.model, weights, x, y, self.loss, sample_weight, self.loss_scale
        )
        if self.burned_in < self.burn_in_steps:
            self._gather(weights, x, captures)
            self.burned_in += 1
            return weights
        if step % self.statistics_period == 0:
            self._gather(weights, x, captures)
        if step % self.frequency == 0:
            self._invert(damping)
        if self.velocities is None:
            self.velocities = [
                {name: np.zeros_like(w) for name, w in layer.items()}
                for layer in weights
            ]
        directions = self._directions(grads, damping)
        scale = 1.0
        if self.kl_clip is not None:
            kernels = [
                (i, reference.THOR_KERNELS[spec["type"]])
                for i, spec in enumerate(self.model)
                if spec["type"] in reference.THOR_LAYERS
            ]
            # A joint block's bias is guarded with its kernel.
            kernels += [
                (i, "bias")
                for i, spec in enumerate(self.model)
                if self.joint_biases and _joins(spec)
            ]
            held = None
            if self.kl_clip_steps == "refresh" and step % self.frequency:
                held = self.guard_scales[-1]
            if self.kl_clip_mode == "velocity":
                scale = self._guard_velocity(
                    directions, kernels, learning_rate, held
                )
            else:
                scale = held
                if held is None:
                    scale = guard_scale(
                        [directions[i][name] for i, name in kernels],
                        [grads[i][name] for i, name in kernels],
                        learning_rate,
                        self.kl_clip,
                    )
                for i, name in kernels:
                    directions[i][name] = scale * directions[i][name]
        self.guard_scales.append(scale)
        new_weights = [{} for _ in weights]
        for index, layer in enumerate(weights):
            for name, weight in layer.items():
                new_weights[index][name] = self._momentum_step(
                    index, name, weight, directions[index][name], learning_rate
                )
        self.iterations += 1
        return new_weights

    def _guard_velocity(self, directions, kernels, learning_rate, held):
        """`kl_clip_mode="velocity"` on Dense layers: replaces the guarded
        directions by `ν·u − μ·v`; returns `ν` (`held` if given)."""
        kept = {
            (i, name): self.momentum * self.velocities[i][name]
            for i, name in kernels
        }
        steps = {key: kept[key] + directions[key[0]][key[1]] for key in kept}
        scale = (
            held
            if held is not None
            else self._velocity_scale(steps, learning_rate)
        )
        for i, name in kernels:
            directions[i][name] = scale * steps[(i, name)] - kept[(i, name)]
        return scale

    def _velocity_scale(self, steps, learning_rate):
        """`ν` of the velocities `steps`: `Σ ⟨u, F u⟩` in the averaged
        factors' `split_dim` blocks."""
        inner = 0.0
        for index in {i for i, _ in steps}:
            assert self.model[index]["type"] == "dense"
            a_factor, g_factor, scale = self.current_factors(index)
            joint = (index, "bias") in steps
            a_blocks = block_diagonal(
                scale * a_factor,
                self.split_dim + 1 if joint else self.split_dim,
            )
            g_blocks = block_diagonal(scale * g_factor, self.split_dim)
            rows = [steps[(index, "kernel")]]
            if joint:
                rows.append(steps[(index, "bias")][None])
            u = np.vstack(rows)
            inner += float(np.sum(u * (a_blocks @ u @ g_blocks)))
        return scale_of(inner, learning_rate, self.kl_clip)

    def _gather(self, weights, x, captures):
        """Appends this step's `(A, G, c)` of every THOR layer."""
        examples = np.shape(x)[0]
        if self.fisher_targets is not None:
            predictions = reference.predict(self.model, weights, x)
            targets = self.fisher_targets(
                self.iterations + self.burned_in, predictions
            )
            _, _, captures = reference.forward_backward(
                self.model, weights, x, targets, self.statistics_loss
            )
        rows = self.statistics_rows or examples
        for index, capture in captures.items():
            joint = self.joint_biases and _joins(self.model[index])
            factors = (joint_factors if joint else reference.thor_factors)(
                self.model[index],
                capture["inputs"][:rows],
                capture["output_grad"][:rows],
                examples,
            )
            self.factors.setdefault(index, []).append(factors)
        self.statistics_steps.append(self.iterations)

    def current_factors(self, index):
        """Layer `index`'s `(A, G, c)` the next inversion uses."""
        history = self.factors[index]
        if self.factor_decay is None:
            return history[-1]
        scale = history[-1][2]
        return (
            averaged([f[0] for f in history], self.factor_decay),
            averaged([f[1] for f in history], self.factor_decay),
            scale,
        )

    def _trace_decision(self, index, factors, damping):
        """`"invert"`, `"keep"`, `"stop"` or `"stopped"` for one layer."""
        if self.trace_thresholds is None:
            return "invert"
        update, stop = self.trace_thresholds
        if index in self.stopped:
            return "stopped"
        last = self.last_traces.get(index)
        trace = damped_trace(
            self.model[index], factors, damping, self.damping_split
        )
        change = math.inf if last is None else abs(trace - last) / last
        if change > update:
            self.last_traces[index] = trace
            return "invert"
        if change < stop:
            self.stopped.add(index)
            return "stop"
        return "keep"

    def _invert(self, damping):
        for index in self.factors:
            decision = self._trace_decision(
                index, self.current_factors(index), damping
            )
            self.trace_decisions.append((self.iterations, index, decision))
            if decision != "invert":
                continue
            joint = self.joint_biases and _joins(self.model[index])
            self.inverses[index] = layer_inverses(
                self.model[index],
                self.current_factors(index),
                damping,
                self.split_dim,
                self.damping_split,
                # The [x, 1] row does not count toward split_dim.
                a_split_dim=self.split_dim + 1 if joint else None,
            )
        self.refresh_steps.append(self.iterations)

    def _directions(self, grads, damping):
        directions = []
        for index, layer in enumerate(grads):
            if self.joint_biases and _joins(self.model[index]):
                kernel, bias = joint_directions(
                    self.inverses[index], layer["kernel"], layer["bias"]
                )
                directions.append({"kernel": kernel, "bias": bias})
                continue
            directions.append(
                {
                    name: reference.precondition(
                        self.model[index],
                        name,
                        grad,
                        self.inverses.get(index),
                        damping,
                        self.batch_size,
                    )
                    for name, grad in layer.items()
                }
            )
        return directions

    def _momentum_step(self, index, name, weight, direction, learning_rate):
        if self.decay_filter(index, name):
            direction = direction + self.weight_decay * weight
        if self.enable_clip_grad:
            direction = reference.clip_by_unit_norm(direction)
        velocity = self.momentum * self.velocities[index][name] + direction
        self.velocities[index][name] = velocity
        if self.use_nesterov:
            return weight - learning_rate * (
                direction + self.momentum * velocity
            )
        return weight - learning_rate * velocity


def run_options_reference(model, weights, batches, loss, **hyper):
    """`(weights after every step, the reference optimizer)`."""
    optimizer = OptionsReferenceTHOR(model, loss, **hyper)
    history = []
    for batch in batches:
        weights = optimizer.step(weights, *batch)
        history.append(weights)
    return history, optimizer
