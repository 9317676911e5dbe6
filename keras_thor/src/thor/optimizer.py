"""THOR, MindSpore's trace-based, hardware-driven natural gradient."""

import keras
from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.backend.dense import dense
from keras_thor.src.backend.fusion import fused
from keras_thor.src.backend.values import numpy_value
from keras_thor.src.distribute import replicas
from keras_thor.src.optimizers.batched_update import BatchedUpdate
from keras_thor.src.optimizers.docstrings import with_base_keyword_args
from keras_thor.src.optimizers.reference_optimizer import ReferenceOptimizer
from keras_thor.src.schedules.per_step import PerStepSchedule
from keras_thor.src.schedules.per_step import is_per_step_array
from keras_thor.src.schedules.per_step import per_step_values
from keras_thor.src.thor import capture
from keras_thor.src.thor import update
from keras_thor.src.thor.blocks import BiasKronecker
from keras_thor.src.thor.blocks import KroneckerBlock
from keras_thor.src.thor.curvature import preconditioner_of
from keras_thor.src.thor.factor_averaging import average_weight
from keras_thor.src.thor.factor_averaging import averaged_factor
from keras_thor.src.thor.inverse_placement import inverse_owners
from keras_thor.src.thor.inverse_placement import inversion_cost
from keras_thor.src.thor.preconditioning import factored_is_cheaper
from keras_thor.src.thor.schedule import RefreshSchedule
from keras_thor.src.thor.trace_rule import damped_kronecker_trace
from keras_thor.src.thor.trace_rule import trace_decision
from keras_thor.src.utils import validation
from keras_thor.src.utils.finite import all_finite

_fused_thor_updates = fused(update.thor_updates)
FISHER_KINDS = ("empirical", "sampled")
BIAS_RULES = (None, "shared", "all")
# Faster at 2 and 4 CPU replicas (docs/benchmarks.md, "THOR's reductions").
SPREAD_INVERSES_DEFAULT = True


def _identity_blocks(shape, dtype=None):
    return ops.broadcast_to(ops.eye(shape[-1], dtype=dtype), shape)


def _check_rate(name, value, strictly_positive, callable_ok):
    """A float, a schedule, a per-step array (wrapped), or a callable.

    A callable (Keras's no-argument learning-rate form) only if
    `callable_ok`.
    """
    schedule = keras.optimizers.schedules.LearningRateSchedule
    if isinstance(value, schedule):
        return value
    if callable(value) and not is_per_step_array(value):
        if callable_ok:
            return value
        raise TypeError(
            f"Argument `{name}` must be a float, a "
            "`keras.optimizers.schedules.LearningRateSchedule` or a 1-D array "
            f"of per-step values. Received: {name}={value!r}"
        )
    if is_per_step_array(value):
        values = per_step_values(name, value, 0.0, strictly_positive)
        return PerStepSchedule(values, name=name)
    if getattr(value, "shape", None) == ():
        value = ops.convert_to_numpy(value).item()
    value = validation.check_float(name, value)
    if strictly_positive and value <= 0:
        raise ValueError(
            f"Argument `{name}` must be > 0. Received: {name}={value}"
        )
    if value < 0:
        raise ValueError(
            f"Argument `{name}` must be >= 0.0. Received: {name}={value}"
        )
    return value


def _check_split_indices(split_indices):
    if split_indices is None:
        return None
    if not isinstance(split_indices, (list, tuple)):
        raise TypeError(
            "Argument `split_indices` must be a non-empty list of integers. "
            f"Received: split_indices={split_indices!r}"
        )
    if not split_indices:
        raise ValueError(
            "Argument `split_indices` must be a non-empty list of integers "
            "(or None for one bucket). Received: split_indices=[]"
        )
    indices = [
        validation.check_int("split_indices", i, 0) for i in split_indices
    ]
    if indices != sorted(set(indices)):
        raise ValueError(
            "Argument `split_indices` must be strictly increasing. "
            f"Received: split_indices={split_indices!r}"
        )
    return indices


def _check_options(
    *,
    factor_decay,
    frequency,
    statistics_frequency,
    statistics_rows,
    fisher,
    kl_clip,
):
    """Validates the curvature options beyond MindSpore's rule; returns
    `(factor_decay, statistics_frequency, statistics_rows, kl_clip)`."""
    if factor_decay is not None:
        factor_decay = validation.check_float("factor_decay", factor_decay)
        if not 0.0 <= factor_decay < 1.0:
            raise ValueError(
                "Argument `factor_decay` must be in [0, 1) or None. "
                f"Received: factor_decay={factor_decay}"
            )
    if statistics_frequency is not None:
        statistics_frequency = validation.check_int(
            "statistics_frequency", statistics_frequency, 1
        )
        if frequency % statistics_frequency:
            raise ValueError(
                "Argument `statistics_frequency` must divide `frequency` "
                "(the inverses are refreshed on a statistics step). "
                f"Received: statistics_frequency={statistics_frequency}, "
                f"frequency={frequency}"
            )
        if statistics_frequency < frequency and factor_decay is None:
            raise ValueError(
                "Statistics between refreshes only count when they are "
                "averaged: set `factor_decay` (e.g. 0.95) with "
                "`statistics_frequency`. Received: "
                f"statistics_frequency={statistics_frequency}, "
                "factor_decay=None"
            )
    if statistics_rows is not None:
        statistics_rows = validation.check_int(
            "statistics_rows", statistics_rows, 1
        )
    validation.check_one_of("fisher", fisher, FISHER_KINDS)
    if kl_clip is not None:
        kl_clip = validation.check_float("kl_clip", kl_clip)
        if kl_clip <= 0:
            raise ValueError(
                "Argument `kl_clip` must be > 0 or None. "
                f"Received: kl_clip={kl_clip}"
            )
    return factor_decay, statistics_frequency, statistics_rows, kl_clip


def _check_trace_thresholds(trace_thresholds):
    """`None`, or `(ω₁, ω₂)` as floats with `0 <= ω₂ <= ω₁` (a float `ω₁`
    means `(ω₁, 0.0)`)."""
    if trace_thresholds is None:
        return None
    message = (
        "Argument `trace_thresholds` must be None, a float ω₁ >= 0 or a "
        "pair (ω₁, ω₂) of floats with 0 <= ω₂ <= ω₁. Received: "
        f"trace_thresholds={trace_thresholds!r}"
    )
    if isinstance(trace_thresholds, str):
        raise TypeError(message)
    if hasattr(trace_thresholds, "__len__"):
        pair = tuple(trace_thresholds)
        if len(pair) != 2:
            raise ValueError(message)
    else:
        pair = (trace_thresholds, 0.0)
    try:
        update, stop = (
            validation.check_float("trace_thresholds", value, minimum=0.0)
            for value in pair
        )
    except (TypeError, ValueError) as error:
        raise type(error)(message) from None
    if stop > update:
        raise ValueError(message)
    return update, stop


@keras_thor_export
@with_base_keyword_args
class THOR(BatchedUpdate, ReferenceOptimizer):
    """THOR: Kronecker-factored natural gradient with stale inverses.

    MindSpore's `nn.thor` for Keras. Each layer with a curvature block
    (see `keras_thor.convert_to_thor_model` and
    `keras_thor.curvature_coverage`) gets a Kronecker-factored Fisher
    `A ⊗ G` (one per group of a grouped convolution), refreshed every
    `frequency` steps from that step's batch and inverted block by block;
    in between the stored inverses are reused, so those steps cost an SGD
    step plus two small matrix products per layer (formed as
    `(A⁻¹Xᵀ)(D·G⁻¹)` for a Dense layer whose batch is smaller than about
    its width, where that is cheaper). Update of a kernel `w` at step `t`:

    ```
    every `frequency` steps (t = 0, f, 2f, ...), per layer (with
    trace_thresholds, only if its trace has changed by more than ω₁ since
    its last inversion, and never once the rule has stopped it):
        A⁻¹ = blocks of (c·A + √λ_t·I)⁻¹,  G⁻¹ = blocks of (c·G + √λ_t·I)⁻¹
    d = A⁻¹ · g · G⁻¹                  (LayerNorm: g / (g²/N + √λ_t))
    d_b = g_b · G_b⁻¹ / (1 + √λ_t)     (biases, with precondition_biases)
    d = ν · d                          (kernels with curvature)
    d = d + weight_decay · w           where decay_filter(w)
    d = d · min(1, 1 / ‖d‖)            if enable_clip_grad
    v = momentum · v + d
    w = w − lr_t · v                   (Nesterov: w − lr_t · (d + momentum·v))
    ```

    Notation:
        - `g`: the gradient of the mean loss (already divided by
          `loss_scale`); biases and other variables use `d = g`.
        - `A = XᵀX / rows`, `G = DᵀD / rows`: the layer's input and
          per-sample output-gradient second moments over the batch (all
          replicas' batches under tf.distribute); Embedding uses the
          diagonal of token counts, convolutions im2col patches.
        - `c`: `√T` for a convolution with `T` output positions, else 1.
        - `G_b⁻¹`: blocks of `(G_b + √λ_t·I)⁻¹`, `G_b = SᵀS / N` with `S`
          the per-example bias gradients (output gradients `D` summed
          over the positions the bias is shared by).
        - `λ_t`, `lr_t`: the damping and learning rate of step `t`;
          `N`: `batch_size`; blocks are `split_dim` wide.
        - `ν`: the step-size guard, 1 unless `kl_clip` is set:
          `ν = min(1, sqrt(kl_clip / |lr_t² · Σ ⟨d, g⟩|))`, the sum over the
          kernels with curvature, and the biases if preconditioned
          (kfac-pytorch's KL clip).

    MindSpore's rule is the default. The options beyond it (from kfac-jax
    and kfac-pytorch; docs/thor.md gives their sources and measured
    effect): `factor_decay` keeps moving averages of the factors
    (`A ← A + (A_new − A) / W`, `W ← α·W + 1`, see
    `keras_thor.src.thor.factor_averaging`) and inverts those;
    `statistics_frequency` gathers statistics more often than it inverts;
    `statistics_rows` takes them from the first rows of each batch only;
    `fisher="sampled"` takes `G` from targets drawn from the model's
    predictive distribution; `kl_clip` scales the step by `ν`;
    `trace_thresholds` is the THOR paper's per-layer refresh rule (see
    `keras_thor.src.thor.trace_rule`).
    `THOR.recommended()` is a starting point for any model.

    Train with `keras_thor.models.ThorModel` (what `convert_to_thor_model`
    returns): its training step captures the statistics on refresh steps
    only, with a separately traced function, so other steps never compute
    them. A failed factorization falls back to a more damped inverse, and
    non-finite statistics keep the previous inverses; a warning says so
    once. A non-finite preconditioned gradient leaves its variable and
    momentum unchanged.

    Args:
        learning_rate: A float >= 0, a `LearningRateSchedule`, or a 1-D
            array with one value per training step (MindSpore style).
        damping: A float > 0, a `LearningRateSchedule`, or a 1-D array with
            one value per step: `λ`.
        momentum: Float >= 0.
        weight_decay: Float >= 0, added to the preconditioned gradient of
            the variables `decay_filter` selects. Defaults to `0.0`.
        loss_scale: Float > 0: the loss is multiplied by it before
            differentiation and the gradients are divided by it (Keras's
            `loss_scale_factor`). Defaults to `1.0`.
        batch_size: Integer > 0, `N` of the LayerNorm rule, and the
            per-replica batch assumed when a Dense layer's preconditioning
            order is chosen (once, when THOR is built). The factors use the
            actual size of each batch. Defaults to `32`.
        use_nesterov: Boolean. Defaults to `False`.
        decay_filter: A callable `variable -> bool` choosing the variables
            that get weight decay. Defaults to all of them (MindSpore's
            default).
        split_indices: Sorted layer indices after which the cross-replica
            reduction of the statistics is cut into a new bucket (MindSpore's
            all-reduce fusion points). Defaults to one bucket.
        enable_clip_grad: Boolean: clip each preconditioned gradient to
            norm 1.0. Defaults to `False`.
        frequency: Integer >= 2: refresh the curvature every `frequency`
            steps. Defaults to `100`.
        split_dim: Integer > 0: the block size of the block-diagonal
            inverses. Defaults to `128`.
        factor_decay: `None` (MindSpore: each refresh overwrites the
            factors with one batch's) or a float `α` in [0, 1): the factors
            are moving averages over the statistics steps, the first one
            the first batch's (kfac-jax's normalized average; kfac-pytorch
            starts from the identity). Defaults to `None`.
        statistics_frequency: `None` (statistics on refresh steps only) or
            an integer >= 1 dividing `frequency`: gather statistics every
            `statistics_frequency` steps and invert every `frequency`
            (kfac-jax: 1 and 5). Needs `factor_decay`. Defaults to `None`.
        statistics_rows: `None` (the whole batch) or an integer >= 1: the
            statistics use only the first `statistics_rows` examples of
            each replica's batch. Defaults to `None`.
        fisher: `"empirical"` (MindSpore: `G` from the gradients of the
            loss at the data's labels) or `"sampled"` (at targets drawn
            from the model's predictive distribution, one per example;
            for cross-entropy and mean squared error losses, see
            `keras_thor.src.thor.sampled_fisher`). Defaults to
            `"empirical"`.
        kl_clip: `None` or a float > 0: the step-size guard `ν` above.
            With it the kernels are preconditioned in the training step
            (never in the factored order). Defaults to `None`.
        precondition_biases: `None` (MindSpore: biases take the plain
            gradient), `"shared"` or `"all"`: precondition the biases of
            layers with Kronecker curvature as K-FAC's homogeneous
            coordinate, `(1 + √λ)⁻¹ · g_b · (G_b + √λ·I)⁻¹`, where
            `G_b = SᵀS / N` is the second moment of the per-example bias
            gradients `S` (the output gradients summed over the positions
            the bias is shared by). `"shared"` does it only for biases
            added at several positions of each example (convolutions,
            Dense and EinsumDense layers on sequences), `"all"` for every
            such layer's bias. Defaults to `None`.
        trace_thresholds: `None` (MindSpore: every layer is inverted at
            every refresh step) or `(ω₁, ω₂)` with `0 <= ω₂ <= ω₁` (a float
            is `(ω₁, 0.0)`): the THOR paper's trace rule. At a refresh
            step, a layer whose damped Kronecker factors' trace changed by
            a relative `Δ > ω₁` since its last inversion is inverted; one
            with `ω₂ <= Δ <= ω₁` keeps its inverses; one with `Δ < ω₂`
            keeps them for good. The paper uses `(0.01, 0.0)` and
            `(0.01, 0.001)`. Statistics are still gathered for every
            layer; the inversions are what is saved. Defaults to `None`.
        spread_inverses: Boolean: under a tf.distribute strategy, each
            replica inverts a share of the layers (balanced by cost) and
            the inverses are then summed across replicas (KAISA-style);
            otherwise every replica inverts every layer. No effect on one
            device. Defaults to `True`, measured faster on logical CPU
            devices (docs/distributed.md).
        {{base_optimizer_keyword_args}}

    Example:

    ```python
    model = keras_thor.convert_to_thor_model(model)
    model.compile(
        optimizer=keras_thor.optimizers.THOR(0.05, damping=0.03, momentum=0.9,
                                             frequency=50),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, epochs=5, validation_split=0.1)
    ```

    References:
        - [Chen et al., 2021](https://ojs.aaai.org/index.php/AAAI/article/view/16867)
        - [Martens and Grosse, 2015](https://arxiv.org/abs/1503.05671)
    """

    def __init__(
        self,
        learning_rate,
        damping,
        momentum,
        weight_decay=0.0,
        loss_scale=1.0,
        batch_size=32,
        use_nesterov=False,
        decay_filter=None,
        split_indices=None,
        enable_clip_grad=False,
        frequency=100,
        split_dim=128,
        spread_inverses=SPREAD_INVERSES_DEFAULT,
        factor_decay=None,
        statistics_frequency=None,
        statistics_rows=None,
        fisher="empirical",
        kl_clip=None,
        precondition_biases=None,
        trace_thresholds=None,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        name="thor",
        **kwargs,
    ):
        if isinstance(learning_rate, keras.layers.Layer):
            raise TypeError(
                "THOR takes no model: MindSpore's `nn.thor(net, ...)` is "
                "`keras_thor.convert_to_thor_model(model)` followed by "
                "`model.compile(optimizer=THOR(learning_rate, damping, "
                "momentum, ...))`. Received: "
                f"learning_rate={type(learning_rate).__name__}"
            )
        learning_rate = _check_rate("learning_rate", learning_rate, False, True)
        damping = _check_rate("damping", damping, True, False)
        momentum = validation.check_float("momentum", momentum, minimum=0.0)
        weight_decay = validation.check_float(
            "weight_decay", weight_decay, minimum=0.0
        )
        loss_scale = validation.check_float("loss_scale", loss_scale, 0.0)
        if loss_scale == 0:
            raise ValueError(
                "Argument `loss_scale` must be > 0. Received: loss_scale=0.0"
            )
        if loss_scale_factor not in (None, loss_scale) and loss_scale != 1.0:
            raise ValueError(
                "Arguments `loss_scale` and `loss_scale_factor` both scale "
                "the loss; set one. Received: "
                f"loss_scale={loss_scale}, "
                f"loss_scale_factor={loss_scale_factor}"
            )
        if loss_scale != 1.0:
            loss_scale_factor = loss_scale
        if kl_clip is not None and (clipnorm or clipvalue or global_clipnorm):
            raise ValueError(
                "`kl_clip` hands Keras's clipping the guarded directions, "
                "not the gradients: set `kl_clip` or one of `clipnorm`, "
                "`clipvalue`, `global_clipnorm`. Received: "
                f"kl_clip={kl_clip}, clipnorm={clipnorm}, "
                f"clipvalue={clipvalue}, global_clipnorm={global_clipnorm}"
            )
        batch_size = validation.check_int("batch_size", batch_size, 1)
        validation.check_bool("use_nesterov", use_nesterov)
        validation.check_bool("enable_clip_grad", enable_clip_grad)
        validation.check_bool("spread_inverses", spread_inverses)
        validation.check_one_of(
            "precondition_biases", precondition_biases, BIAS_RULES
        )
        if decay_filter is not None and not callable(decay_filter):
            raise TypeError(
                "Argument `decay_filter` must be a callable "
                "`variable -> bool` or None. "
                f"Received: decay_filter={decay_filter!r}"
            )
        frequency = validation.check_int("frequency", frequency, 2)
        split_dim = validation.check_int("split_dim", split_dim, 1)
        split_indices = _check_split_indices(split_indices)
        trace_thresholds = _check_trace_thresholds(trace_thresholds)
        factor_decay, statistics_frequency, statistics_rows, kl_clip = (
            _check_options(
                factor_decay=factor_decay,
                frequency=frequency,
                statistics_frequency=statistics_frequency,
                statistics_rows=statistics_rows,
                fisher=fisher,
                kl_clip=kl_clip,
            )
        )
        super().__init__(
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=name,
            **kwargs,
        )
        self._damping = damping
        # The learning rate as given (Keras keeps schedules privately).
        self._schedule = learning_rate
        self.batch_size = batch_size
        self.frequency = frequency
        self.split_dim = split_dim
        self.split_indices = split_indices
        self.momentum = momentum
        self.loss_scale = loss_scale
        self.use_nesterov = use_nesterov
        self.decay_filter = decay_filter
        self.enable_clip_grad = enable_clip_grad
        self.spread_inverses = spread_inverses
        self.factor_decay = factor_decay
        self.statistics_frequency = statistics_frequency
        self.statistics_rows = statistics_rows
        self.fisher = fisher
        self.kl_clip = kl_clip
        self.precondition_biases = precondition_biases
        self.trace_thresholds = trace_thresholds

    RECOMMENDED = {
        "learning_rate": 0.03,
        "damping": 0.1,
        "momentum": 0.9,
        "frequency": 20,
        "kl_clip": 0.01,
        "precondition_biases": "shared",
        "factor_decay": 0.5,
    }

    @classmethod
    def recommended(cls, **kwargs):
        """THOR set up as a starting point for any model.

        MindSpore's rule with a step-size guard, a shorter refresh period,
        factor moving averages and curvature for the biases shared by
        positions: `learning_rate=0.03, damping=0.1, momentum=0.9,
        frequency=20, kl_clip=0.01, precondition_biases="shared",
        factor_decay=0.5` (`THOR.RECOMMENDED`),
        chosen on the held-out seed of the benchmark tasks, one setting for
        all of them (docs/thor.md, "Tuning THOR", gives the measured
        sensitivity). Any argument of `THOR` overrides these, e.g.
        `THOR.recommended(learning_rate=0.1, batch_size=128)`.
        """
        return cls(**{**cls.RECOMMENDED, **kwargs})

    @property
    def damping(self):
        """The damping: a float or a schedule of the step."""
        return self._damping

    def current_damping(self):
        """`λ` of the current step, a float32 scalar."""
        if callable(self._damping):
            return ops.cast(self._damping(self.iterations), "float32")
        return ops.convert_to_tensor(self._damping, "float32")

    def build(self, var_list):
        """Creates the momentum of every variable, then the inverses.

        In `var_list` order: one momentum per variable; then, for every
        kernel with a curvature block (marked by `convert_to_thor_model`),
        its `A⁻¹` blocks `(groups·n, s, s)` (a vector for an Embedding) and
        its `G⁻¹` blocks, starting as identities; then one counter of
        curvature refreshes that needed a fallback. With `factor_decay`,
        then, per kernel, the averaged factor blocks (`A`, `G`, in the
        inverses' shapes) and their weight `W`; with `kl_clip`, the last
        step's guard scale `ν`; with `trace_thresholds`, each kernel's
        trace at its last inversion, which kernels have stopped (both in
        the order of the kernels), and the count of inversions the rule
        skipped. A preconditioned bias (`precondition_biases`) counts as a
        kernel here: its `a_inverse` is a vector of one.
        """
        if self.built:
            return
        preconditioners = [preconditioner_of(v) for v in var_list]
        preconditioners = [
            None
            if isinstance(p, BiasKronecker) and not self._preconditions(p)
            else p
            for p in preconditioners
        ]
        if not any(isinstance(p, KroneckerBlock) for p in preconditioners):
            raise ValueError(
                "THOR found no layer with curvature among the "
                f"{len(var_list)} variables it trains. Convert the model "
                "first: `model = keras_thor.convert_to_thor_model(model)`, "
                "or subclass `keras_thor.models.ThorModel` instead of "
                "`keras.Model` (`keras_thor.curvature_coverage(model)` "
                "lists what THOR can precondition)."
            )
        super().build(var_list)
        self._velocities = [
            self.add_variable_from_reference(v, "momentum") for v in var_list
        ]
        self._preconditioners = preconditioners
        self._a_inverses = [None] * len(var_list)
        self._g_inverses = [None] * len(var_list)
        self._blocks = {}
        for index, (variable, block) in enumerate(
            zip(var_list, preconditioners)
        ):
            if not isinstance(block, KroneckerBlock):
                continue
            a_shape, g_shape = block.inverse_shapes(self.split_dim)
            prefix = variable.path.replace("/", "_")
            self._a_inverses[index] = self.add_variable(
                a_shape,
                "ones" if block.a_is_diagonal else _identity_blocks,
                "float32",
                name=f"{prefix}_a_inverse",
            )
            self._g_inverses[index] = self.add_variable(
                g_shape, _identity_blocks, "float32", name=f"{prefix}_g_inverse"
            )
            self._blocks[index] = block
        if self.split_indices and self.split_indices[-1] >= len(self._blocks):
            raise ValueError(
                "Every entry of `split_indices` must index one of the "
                f"{len(self._blocks)} layers with curvature. "
                f"Received: split_indices={self.split_indices}"
            )
        self._factored = frozenset(
            index
            for index, block in self._blocks.items()
            if self._takes_factored_order(block)
        )
        self._weight_decays = [self._decay_of(v) for v in var_list]
        self._curvature_troubles = self.add_variable(
            (), "zeros", "int32", name="curvature_troubles"
        )
        self._a_factors = [None] * len(var_list)
        self._g_factors = [None] * len(var_list)
        self._factor_weights = [None] * len(var_list)
        if self.factor_decay is not None:
            for index in sorted(self._blocks):
                prefix = var_list[index].path.replace("/", "_")
                for factors, inverses, part in (
                    (self._a_factors, self._a_inverses, "a"),
                    (self._g_factors, self._g_inverses, "g"),
                ):
                    factors[index] = self.add_variable(
                        inverses[index].shape,
                        "zeros",
                        "float32",
                        name=f"{prefix}_{part}_factor",
                    )
                self._factor_weights[index] = self.add_variable(
                    (), "zeros", "float32", name=f"{prefix}_factor_weight"
                )
        if self.kl_clip is not None:
            self._guard_scale = self.add_variable(
                (), "ones", "float32", name="guard_scale"
            )
        if self.trace_thresholds is not None:
            kernels = (len(self._blocks),)
            self._last_traces = self.add_variable(
                kernels, "zeros", "float32", name="last_traces"
            )
            self._stopped = self.add_variable(
                kernels, "zeros", "int32", name="stopped_blocks"
            )
            self._skipped_inversions = self.add_variable(
                (), "zeros", "int32", name="skipped_inversions"
            )

    def _preconditions(self, bias_block):
        if self.precondition_biases == "shared":
            return bias_block.shared
        return self.precondition_biases == "all"

    def _decay_of(self, variable):
        if self.decay_filter is not None and not self.decay_filter(variable):
            return 0.0
        return self.decay_for(variable)

    def _takes_factored_order(self, block):
        """Whether `block`'s kernel is preconditioned in the factored order.

        Only for Dense kernels where it costs fewer flops for the rows a
        call is expected to have (`batch_size` times the other leading
        dimensions the layer was built for), and never with Keras's
        clipping options (which would then clip a preconditioned
        gradient). Decided once, when the optimizer is built.
        """
        if not block.factored or self.kl_clip is not None:
            return False
        if self.clipnorm or self.clipvalue or self.global_clipnorm:
            return False
        shape = keras_internals.built_input_shape(block.layer)
        rows = self.batch_size
        for dimension in (shape or (None, None))[1:-1]:
            if dimension is None:
                return False
            rows *= dimension
        return factored_is_cheaper(block.a_dim, block.g_dim, rows)

    @property
    def curvature_troubles(self):
        """How many layer refreshes fell back or kept their old inverses."""
        if not self.built:
            return 0
        return int(numpy_value(self._curvature_troubles))

    @property
    def skipped_inversions(self):
        """How many block inversions the trace rule skipped, keeping the
        stored inverses (0 without `trace_thresholds`)."""
        if not self.built or self.trace_thresholds is None:
            return 0
        return int(numpy_value(self._skipped_inversions))

    @property
    def statistics_period(self):
        """Steps between statistics steps (`frequency` unless
        `statistics_frequency` is set)."""
        return self.statistics_frequency or self.frequency

    @property
    def refresh_schedule(self):
        """The `RefreshSchedule`: which steps gather statistics and which
        refresh the inverses, and how far the per-step arrays reach."""
        return RefreshSchedule(
            self.frequency, self.statistics_period, self._per_step_arrays()
        )

    def training_logs(self):
        """What THOR is doing, for the step's logs (and so `History` and
        `TensorBoard`): the damping, the number of inverse refreshes so
        far, the layer refreshes in trouble so far, the last guard
        scale (with `kl_clip`), and the block inversions the trace rule
        skipped so far and the blocks it has stopped (with
        `trace_thresholds`)."""
        steps = ops.cast(self.iterations, "float32")
        logs = {
            "thor_damping": self.current_damping(),
            "thor_refreshes": ops.floor((steps - 1.0) / self.frequency) + 1.0,
            "thor_curvature_troubles": ops.cast(
                self._curvature_troubles, "float32"
            ),
        }
        if self.kl_clip is not None:
            logs["thor_guard_scale"] = ops.convert_to_tensor(self._guard_scale)
        if self.trace_thresholds is not None:
            logs["thor_skipped_inversions"] = ops.cast(
                self._skipped_inversions, "float32"
            )
            logs["thor_stopped_blocks"] = ops.cast(
                ops.sum(self._stopped), "float32"
            )
        return logs

    def _per_step_arrays(self):
        return [
            (name, value)
            for name, value in (
                ("learning_rate", self._schedule),
                ("damping", self._damping),
            )
            if isinstance(value, PerStepSchedule)
        ]

    @property
    def curvature_blocks(self):
        """`{variable index: block}` of the kernels with curvature."""
        return dict(self._blocks)

    @property
    def factored_kernels(self):
        """The variable indices preconditioned in the factored order: the
        training step forms their preconditioned gradient, and the update
        takes it as it is."""
        return self._factored

    @property
    def preconditioned_in_step(self):
        """The variable indices whose update takes an already
        preconditioned gradient: the factored kernels, or with `kl_clip`
        every kernel with curvature, biases included where
        `precondition_biases` selects them (the guard needs their
        directions before any update)."""
        if self.kl_clip is not None:
            return frozenset(self._blocks)
        return self._factored

    def precondition_kernel(self, index, gradient):
        """`A⁻¹ · g · G⁻¹` of kernel (or bias) `index` from the stored
        inverses."""
        block = self._blocks[index]
        return block.precondition(
            ops.reshape(ops.cast(gradient, "float32"), block.kernel.shape),
            self._a_inverses[index],
            self._g_inverses[index],
            self.current_damping(),
            float(self.batch_size),
        )

    def guard(self, directions, gradients):
        """`ν · d` for each kernel direction `d`, the guard scale `ν` from
        the kernels' `(d, g)` (unscaled, global), which is also kept for
        the logs. Non-finite inner products give `ν = 1` (the update then
        leaves non-finite directions out)."""
        inner = sum(
            ops.sum(d * ops.cast(g, "float32"))
            for d, g in zip(directions, gradients)
        )
        learning_rate = ops.cast(self.learning_rate, "float32")
        scale = update.kl_clip_scale(inner, learning_rate, self.kl_clip)
        self.assign(self._guard_scale, scale)
        return [scale * d for d in directions]

    def block_buckets(self):
        """The variable indices of the blocks, per reduction bucket.

        One bucket by default; `split_indices=[i, j]` cuts after the blocks
        `i` and `j` (MindSpore's all-reduce fusion points).
        """
        indices = sorted(self._blocks)
        cuts = [0] + [i + 1 for i in (self.split_indices or [])]
        cuts = sorted(set(cuts + [len(indices)]))
        return [indices[a:b] for a, b in zip(cuts[:-1], cuts[1:])]

    def variable_index(self, variable):
        """The position of `variable` in the trained variables, or `None`."""
        return keras_internals.variable_index(self, variable)

    def refresh_curvature(self, statistics, invert=True):
        """Takes a statistics step's factors; replaces the inverses if
        `invert`.

        `statistics` maps a kernel's variable index to `(A, G, c)`: the
        factors averaged over the (global) batch and the factor scale. With
        `factor_decay` they first update the moving averages (a layer whose
        new factors are not finite keeps its averages), and the inverses
        are those of the averages. With `trace_thresholds`, only the layers
        the trace rule selects are inverted. Runs inside the training step,
        before `apply_gradients`.
        """
        if not statistics:
            return
        indices = sorted(statistics)
        accepted = {}
        if self.factor_decay is not None:
            accepted = self._average_factors(indices, statistics)
        if not invert:
            return
        refresh = {}
        if self.trace_thresholds is not None:
            refresh = self._apply_trace_rule(indices, statistics, accepted)
        # Not compiled: XLA's CPU Cholesky and triangular solve were 10x
        # slower than TensorFlow's (docs/benchmarks.md).
        if self.spread_inverses and replicas.replica_count() > 1:
            results = self._spread_layer_inverses(indices, statistics, refresh)
        else:
            results = [
                self._layer_inverses_if(i, statistics[i], refresh.get(i))
                for i in indices
            ]
        troubles = []
        for index, (a_inverse, g_inverse, trouble) in zip(indices, results):
            self.assign(self._a_inverses[index], a_inverse)
            self.assign(self._g_inverses[index], g_inverse)
            troubles.append(ops.cast(trouble, "int32"))
        self.assign_add(self._curvature_troubles, ops.sum(ops.stack(troubles)))

    def _average_factors(self, indices, statistics):
        """Each layer's averages and weight take its new factors if they
        are finite; otherwise both stay (a trouble is counted). Returns
        `{index: whether its new factors were taken}`."""
        accepted = {}
        troubles = []
        for index in indices:
            a_new, g_new = self._blocks[index].factor_blocks(
                statistics[index], self.split_dim
            )
            finite = all_finite([a_new, g_new])
            previous = self._factor_weights[index]
            weight = average_weight(previous, self.factor_decay)
            for average, new in (
                (self._a_factors[index], a_new),
                (self._g_factors[index], g_new),
            ):
                self.assign(
                    average,
                    ops.where(
                        finite, averaged_factor(average, new, weight), average
                    ),
                )
            self.assign(previous, ops.where(finite, weight, previous))
            troubles.append(ops.cast(ops.logical_not(finite), "int32"))
            accepted[index] = finite
        self.assign_add(self._curvature_troubles, ops.sum(ops.stack(troubles)))
        return accepted

    def _current_factors(self, index, statistics):
        """`(c·A, c·G, seen)` the inversion of kernel `index` would use, as
        diagonal blocks: the averages (seen once a statistics step was
        accepted) with `factor_decay`, else this step's factors."""
        if self.factor_decay is not None:
            return (
                self._a_factors[index],
                self._g_factors[index],
                self._factor_weights[index] > 0,
            )
        a, g = self._blocks[index].factor_blocks(
            statistics[index], self.split_dim
        )
        return a, g, True

    def _apply_trace_rule(self, indices, statistics, accepted):
        """`{index: refresh}` of the kernels in `indices` by the trace rule
        (`trace_rule.trace_decision`); updates the last traces, the stopped
        blocks and the count of skipped inversions.

        `accepted` tells, with `factor_decay`, whether a kernel's averages
        took this step's factors: if not, the rule does not decide (an
        unchanged average would look settled and stop the layer).
        """
        damping = self.current_damping()
        last_traces = ops.unstack(ops.convert_to_tensor(self._last_traces))
        stopped = ops.unstack(ops.convert_to_tensor(self._stopped) > 0)
        refresh = {}
        for position, index in enumerate(sorted(self._blocks)):
            if index not in indices:
                continue
            block = self._blocks[index]
            a, g, seen = self._current_factors(index, statistics)
            trace = damped_kronecker_trace(
                a, g, block.groups, block.a_dim, block.g_dim, damping
            )
            refresh[index], stopped[position] = trace_decision(
                trace,
                last_traces[position],
                stopped[position],
                ops.logical_and(seen, accepted.get(index, True)),
                self.trace_thresholds,
            )
            taken = ops.logical_and(refresh[index], ops.isfinite(trace))
            last_traces[position] = ops.where(
                ops.logical_and(taken, seen), trace, last_traces[position]
            )
        self.assign(self._last_traces, ops.stack(last_traces))
        self.assign(self._stopped, ops.cast(ops.stack(stopped), "int32"))
        skipped = [
            ops.cast(ops.logical_not(r), "int32") for r in refresh.values()
        ]
        self.assign_add(self._skipped_inversions, ops.sum(ops.stack(skipped)))
        return refresh

    def _stored_inverses(self, index):
        """`(A⁻¹, G⁻¹, no trouble)` as stored for kernel `index`."""
        return (
            ops.convert_to_tensor(self._a_inverses[index]),
            ops.convert_to_tensor(self._g_inverses[index]),
            ops.convert_to_tensor(False),
        )

    def _layer_inverses_if(self, index, statistics, refresh):
        """`layer_inverses`, or the stored inverses when `refresh` (a
        boolean tensor, or `None` for always) is false."""
        if refresh is None:
            return self.layer_inverses(index, statistics)
        return ops.cond(
            refresh,
            lambda: self.layer_inverses(index, statistics),
            lambda: self._stored_inverses(index),
        )

    def layer_inverses(self, index, statistics):
        """`(A⁻¹, G⁻¹, trouble)` of kernel `index` from its `(A, G, c)`
        (with `factor_decay`, from its averaged factors)."""
        if self.factor_decay is not None:
            a_inverse, g_inverse, trouble = self._blocks[
                index
            ].inverses_of_blocks(
                self._a_factors[index],
                self._g_factors[index],
                self.current_damping(),
                self._a_inverses[index],
                self._g_inverses[index],
            )
            # No accepted statistics yet: keep the starting inverses.
            seen = self._factor_weights[index] > 0
            return (
                ops.where(seen, a_inverse, self._a_inverses[index]),
                ops.where(seen, g_inverse, self._g_inverses[index]),
                trouble,
            )
        return self._blocks[index].inverses(
            statistics,
            self.current_damping(),
            self.split_dim,
            self._a_inverses[index],
            self._g_inverses[index],
        )

    def _spread_layer_inverses(self, indices, statistics, refresh):
        """`layer_inverses` of every kernel in `indices`, each computed on
        one replica (balanced by cost) and summed across the replicas (the
        others contribute zeros): one collective. A kernel whose entry in
        `refresh` is false is inverted nowhere and keeps its inverses."""
        owners = inverse_owners(
            [
                inversion_cost(
                    [self._a_inverses[i].shape, self._g_inverses[i].shape]
                )
                for i in indices
            ],
            replicas.replica_count(),
        )
        this_replica = replicas.replica_id()
        flat = []
        for index, owner in zip(indices, owners):

            def mine(index=index):
                a_inverse, g_inverse, trouble = self.layer_inverses(
                    index, statistics[index]
                )
                return a_inverse, g_inverse, ops.cast(trouble, "float32")

            def others(index=index):
                return (
                    ops.zeros(self._a_inverses[index].shape, "float32"),
                    ops.zeros(self._g_inverses[index].shape, "float32"),
                    ops.convert_to_tensor(0.0),
                )

            owns = this_replica == owner
            if index in refresh:
                owns = ops.logical_and(owns, refresh[index])
            if isinstance(owns, bool):
                parts = mine() if owns else others()
            else:
                parts = ops.cond(owns, mine, others)
            flat.extend(parts)
        flat = replicas.all_reduce_sum(flat)
        results = []
        for k, index in enumerate(indices):
            result = (flat[3 * k], flat[3 * k + 1], flat[3 * k + 2] > 0)
            if index in refresh:
                result = ops.cond(
                    refresh[index],
                    lambda result=result: result,
                    lambda index=index: self._stored_inverses(index),
                )
            results.append(result)
        return results

    def factored_gradient(self, index, inputs, output_grads):
        """`A⁻¹ · g · G⁻¹` of one call of kernel `index`'s layer, in the
        factored order, from the stored inverses."""
        return self._blocks[index].factored_gradient(
            inputs,
            output_grads,
            self._a_inverses[index],
            self._g_inverses[index],
        )

    def apply(self, grads, trainable_variables=None):
        if not capture.in_thor_training_step():
            raise ValueError(
                "THOR gets its curvature from the training step of a "
                "`keras_thor.models.ThorModel`. Convert the model with "
                "`keras_thor.convert_to_thor_model(model)`, or subclass "
                "`keras_thor.models.ThorModel` instead of `keras.Model`."
            )
        return super().apply(grads, trainable_variables)

    def _update_variables(self, grads, variables, learning_rate):
        indices = [
            keras_internals.trained_variable_index(self, v) for v in variables
        ]
        velocities = [self._velocities[i] for i in indices]
        results = _fused_thor_updates(
            list(variables),
            [dense(g) for g in grads],
            velocities,
            [self._a_inverses[i] for i in indices],
            [self._g_inverses[i] for i in indices],
            ops.cast(learning_rate, "float32"),
            self.current_damping(),
            [
                None
                if i in self.preconditioned_in_step
                else self._preconditioners[i]
                for i in indices
            ],
            [self._weight_decays[i] for i in indices],
            float(self.batch_size),
            self.momentum,
            self.use_nesterov,
            self.enable_clip_grad,
        )
        for variable, velocity, (new_variable, new_velocity) in zip(
            variables, velocities, results
        ):
            self.assign(variable, new_variable)
            self.assign(velocity, new_velocity)

    def get_config(self):
        config = super().get_config()
        if config.get("loss_scale_factor") == self.loss_scale:
            config["loss_scale_factor"] = None
        config.update(
            {
                "damping": keras.saving.serialize_keras_object(self._damping),
                "momentum": self.momentum,
                "weight_decay": self.weight_decay,
                "loss_scale": self.loss_scale,
                "batch_size": self.batch_size,
                "use_nesterov": self.use_nesterov,
                "decay_filter": keras.saving.serialize_keras_object(
                    self.decay_filter
                ),
                "split_indices": self.split_indices,
                "enable_clip_grad": self.enable_clip_grad,
                "frequency": self.frequency,
                "split_dim": self.split_dim,
                "spread_inverses": self.spread_inverses,
                "factor_decay": self.factor_decay,
                "statistics_frequency": self.statistics_frequency,
                "statistics_rows": self.statistics_rows,
                "fisher": self.fisher,
                "kl_clip": self.kl_clip,
                "precondition_biases": self.precondition_biases,
                "trace_thresholds": self.trace_thresholds,
            }
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        for key in ("damping", "decay_filter"):
            if isinstance(config.get(key), dict):
                config[key] = keras.saving.deserialize_keras_object(
                    config[key], custom_objects=custom_objects
                )
        return super().from_config(config, custom_objects=custom_objects)
