"""THOR's curvature options: one frozen, validated record.

`THOR(...)` builds a `CurvatureOptions` from its arguments (its signature
lists every field; `with_curvature_options`); the
`CurvatureEstimator` and the training step's `StepPlan` read it. The
defaults are MindSpore's rule; every other value is an opt-in option
beyond it (docs/thor.md, "Curvature options").
"""

import dataclasses
import inspect

from keras_thor.src.thor.damping_split import DAMPING_SPLITS
from keras_thor.src.utils import validation

FISHER_KINDS = ("empirical", "sampled")
BIAS_RULES = (None, "shared", "all", "joint")
KL_CLIP_MODES = ("direction", "velocity")
KL_CLIP_STEPS = ("every", "refresh")
FIRST_ORDER_RULES = ("momentum", "adam")
# `statistics_rows` per layer: the fewest examples whose rows reach its
# widest factor.
STATISTICS_ROWS_WIDTH = "width"
# Faster at 2 and 4 CPU replicas (docs/benchmarks.md, "THOR's reductions").
SPREAD_INVERSES_DEFAULT = True

CURVATURE_OPTION_ARGS = """split_indices: Sorted layer indices after which the
            cross-replica reduction of the statistics is cut into a new
            bucket (MindSpore's all-reduce fusion points). Defaults to one
            bucket.
        frequency: Integer >= 2: refresh the curvature every `frequency`
            steps. Defaults to `100`.
        split_dim: Integer > 0: the block size of the block-diagonal
            inverses. Defaults to `128`.
        damping_split: `"uniform"` (MindSpore: `√λ` added to both
            factors) or `"pi"` (Martens & Grosse's π correction, the K-FAC
            peers' default: `π·√λ` to `A`, `√λ/π` to `G`, with
            `π = sqrt((tr A / d_A) / (tr G / d_G))` of the factors being
            inverted, per group; see `keras_thor.src.thor.damping_split`).
            Defaults to `"uniform"`.
        factor_decay: `None` (MindSpore: each refresh overwrites the
            factors with one batch's) or a float `α` in [0, 1): the factors
            are moving averages over the statistics steps, the first one
            the first batch's (kfac-jax's normalized average; kfac-pytorch
            starts from the identity). Defaults to `None`.
        statistics_frequency: `None` (statistics on refresh steps only) or
            an integer >= 1 dividing `frequency`: gather statistics every
            `statistics_frequency` steps and invert every `frequency`
            (kfac-jax: 1 and 5). Needs `factor_decay`. Defaults to `None`.
        burn_in_steps: Integer >= 0: the first `burn_in_steps` training
            steps only gather statistics into the factor averages (no
            weight, momentum or `iterations` moves; kfac-jax's
            `num_burnin_steps`, 10 by default there). Needs `factor_decay`.
            Defaults to `0`.
        statistics_rows: `None` (the whole batch), an integer >= 1: the
            statistics use only the first `statistics_rows` examples of
            each replica's batch; or `"width"`: each layer's statistics use
            the fewest first examples whose rows (its output positions:
            sequence positions, a convolution's output pixels) reach its
            widest factor, `⌈max(d_A, d_G) / rows per example⌉` (a joint
            bias row counts in `d_A`; an Embedding's diagonal `A` does not:
            `d_G` alone), the whole batch where the positions are unknown
            when traced. Defaults to `None`.
        conv_statistics_rows: `None` (as `statistics_rows`) or an integer
            >= 1: the statistics of convolutions (each example gives them
            one im2col row per output position) use only the first
            `conv_statistics_rows` examples of each replica's batch; other
            layers follow `statistics_rows`. Defaults to `None`.
        fisher: `"empirical"` (MindSpore: `G` from the gradients of the
            loss at the data's labels) or `"sampled"` (at targets drawn
            from the model's predictive distribution, one per example;
            for cross-entropy and mean squared error losses, see
            `keras_thor.src.thor.sampled_fisher`). Defaults to
            `"empirical"`.
        kl_clip: `None` or a float > 0: the step-size guard `ν` of
            THOR's update rule (`keras_thor.src.thor.kl_guard`).
            With it the kernels are preconditioned in the training step
            (never in the factored order). Defaults to `None`.
        kl_clip_mode: `"direction"` (kfac-pytorch: `kl_clip` bounds
            `lr² · Σ ⟨d, g⟩`, the step's preconditioned direction `d`) or
            `"velocity"`: it bounds `lr² · Σ ⟨u, F̂u⟩`, the new velocity
            `u = momentum · v + d` in the averaged factors' norm, and the
            update leaves the scaled velocity (momentum included; see
            `keras_thor.src.thor.kl_guard`). Without `kl_clip` there is no
            guard either way; `"velocity"` with `kl_clip` needs
            `factor_decay`. Defaults to `"direction"`.
        kl_clip_steps: `"every"` (kfac-pytorch: `ν` is measured on every
            step) or `"refresh"`: `ν` is measured on the refresh steps
            (every `frequency` steps; a non-finite sum keeps the last
            one) and the steps between apply it, without the guard's sum
            (on the velocity, one product with the factors per block),
            measured at the refresh step's learning rate. Defaults to
            `"every"`.
        precondition_biases: `None` (MindSpore: biases take the plain
            gradient), `"shared"` or `"all"`: precondition the biases of
            layers with Kronecker curvature as K-FAC's homogeneous
            coordinate, `(1 + √λ)⁻¹ · g_b · (G_b + √λ·I)⁻¹`, where
            `G_b = SᵀS / M` is the second moment of the per-example bias
            gradients `S` (the output gradients summed over the positions
            the bias is shared by) per loss term (`M` terms: the
            examples, times the positions of a per-position loss).
            `"shared"` does it only for biases
            added at several positions of each example (convolutions,
            Dense and EinsumDense layers on sequences), `"all"` for every
            such layer's bias. `"joint"`: every K-FAC peer's rule, the
            bias as the 1 appended to each input row of its Dense or
            convolution kernel's block (`[x, 1]`), kernel and bias
            preconditioned together; other layers' biases (EinsumDense,
            separable convolutions) as with `"all"`. Defaults to `None`.
        trace_thresholds: `None` (MindSpore: every layer is inverted at
            every refresh step) or `(ω₁, ω₂)` with `0 <= ω₂ <= ω₁` (a float
            is `(ω₁, 0.0)`): the THOR paper's trace rule. At a refresh
            step, a layer whose damped Kronecker factors' trace changed by
            a relative `Δ > ω₁` since its last inversion is inverted; one
            with `ω₂ <= Δ <= ω₁` keeps its inverses; one with `Δ < ω₂`
            keeps them for good. The paper uses `(0.01, 0.0)` and
            `(0.01, 0.001)`. Statistics are still gathered for every
            layer; the inversions are what is saved. Defaults to `None`.
        first_order: How the variables without curvature (biases THOR
            does not precondition, BatchNormalization, recurrent cells,
            layers with no rule) are updated. `"momentum"` (MindSpore:
            THOR's momentum SGD on their plain gradient, at THOR's learning
            rate) or `"adam"`: Adam's normalized step on them,
            `w ← w − lr·(m̂ / (√v̂ + ε) + weight_decay·w)` with
            `m ← μ·m + (1 − μ)·g`, `v ← β₂·v + (1 − β₂)·g²`, `μ` THOR's
            `momentum`, `β₂ = 0.999`, `ε = 1e-7`, bias-corrected, at THOR's
            learning rate (the route Muon's users take for such
            variables; `use_nesterov` and `enable_clip_grad` do not apply
            to them). Defaults to `"momentum"`.
        spread_inverses: Boolean: under a tf.distribute strategy, each
            replica inverts a share of the layers (balanced by cost) and
            the inverses are then summed across replicas (KAISA-style);
            otherwise every replica inverts every layer. No effect on one
            device. Defaults to `True`, measured faster on logical CPU
            devices (docs/distributed.md)."""


def with_curvature_option_args(cls):
    """Fills `{{curvature_option_args}}` in `cls.__doc__`."""
    cls.__doc__ = cls.__doc__.replace(
        "{{curvature_option_args}}", CURVATURE_OPTION_ARGS
    )
    return cls


def _option(name):
    return property(
        lambda self: getattr(self.curvature_options, name),
        doc=f"The `{name}` curvature option (`CurvatureOptions`).",
    )


def _with_option_parameters(init):
    """`init`'s signature with every option it does not name as a
    keyword-only parameter with the option's default, before `**kwargs`."""
    signature = inspect.signature(init)
    parameters = list(signature.parameters.values())
    if parameters[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        raise TypeError(f"{init.__qualname__} must end with `**kwargs`.")
    named = {parameter.name for parameter in parameters}
    options = [
        inspect.Parameter(
            field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default
        )
        for field in dataclasses.fields(CurvatureOptions)
        if field.name not in named
    ]
    init.__signature__ = signature.replace(
        parameters=parameters[:-1] + options + parameters[-1:]
    )


def with_curvature_options(cls):
    """`with_curvature_option_args`; each option (and the
    `statistics_period`) as a read-only attribute of `cls`, read from its
    `curvature_options`; and each option in the signature of `cls`, whose
    `__init__` takes the options it does not name through `**kwargs`
    (`CurvatureOptions.taken_from`)."""
    names = [field.name for field in dataclasses.fields(CurvatureOptions)]
    for name in names + ["statistics_period"]:
        setattr(cls, name, _option(name))
    _with_option_parameters(cls.__init__)
    return with_curvature_option_args(cls)


def _checked_split_indices(split_indices):
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


def _checked_trace_thresholds(trace_thresholds):
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


def _checked_factor_decay(factor_decay):
    if factor_decay is None:
        return None
    factor_decay = validation.check_float("factor_decay", factor_decay)
    if not 0.0 <= factor_decay < 1.0:
        raise ValueError(
            "Argument `factor_decay` must be in [0, 1) or None. "
            f"Received: factor_decay={factor_decay}"
        )
    return factor_decay


def _checked_statistics_frequency(statistics_frequency, frequency, decay):
    if statistics_frequency is None:
        return None
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
    if statistics_frequency < frequency and decay is None:
        raise ValueError(
            "Statistics between refreshes only count when they are "
            "averaged: set `factor_decay` (e.g. 0.95) with "
            "`statistics_frequency`. Received: "
            f"statistics_frequency={statistics_frequency}, "
            "factor_decay=None"
        )
    return statistics_frequency


def _checked_burn_in_steps(burn_in_steps, decay):
    burn_in_steps = validation.check_int("burn_in_steps", burn_in_steps, 0)
    if burn_in_steps and decay is None:
        raise ValueError(
            "Burn-in statistics only count when they are averaged: set "
            "`factor_decay` (e.g. 0.95) with `burn_in_steps`. Received: "
            f"burn_in_steps={burn_in_steps}, factor_decay=None"
        )
    return burn_in_steps


def _checked_statistics_rows(rows):
    if rows is None or rows == STATISTICS_ROWS_WIDTH:
        return rows
    if isinstance(rows, str):
        raise ValueError(
            "Argument `statistics_rows` must be None, an integer >= 1 or "
            f'"{STATISTICS_ROWS_WIDTH}". Received: statistics_rows={rows!r}'
        )
    return validation.check_int("statistics_rows", rows, 1)


def _checked_kl_clip(kl_clip):
    if kl_clip is None:
        return None
    kl_clip = validation.check_float("kl_clip", kl_clip)
    if kl_clip <= 0:
        raise ValueError(
            "Argument `kl_clip` must be > 0 or None. "
            f"Received: kl_clip={kl_clip}"
        )
    return kl_clip


def _check_kl_clip_mode(kl_clip_mode, kl_clip, decay):
    validation.check_one_of("kl_clip_mode", kl_clip_mode, KL_CLIP_MODES)
    if kl_clip_mode == "velocity" and kl_clip is not None and decay is None:
        raise ValueError(
            'The velocity\'s guard (`kl_clip_mode="velocity"`) measures '
            "the velocity in the averaged factors' norm: set `factor_decay` "
            '(e.g. 0.95), or use kl_clip_mode="direction". Received: '
            f"kl_clip_mode='velocity', kl_clip={kl_clip}, factor_decay=None"
        )


@with_curvature_option_args
@dataclasses.dataclass(frozen=True)
class CurvatureOptions:
    """How THOR estimates, refreshes and applies its curvature.

    Each field is the `THOR` argument of the same name. Construction
    validates them, with Keras's error messages, and normalizes them
    (`trace_thresholds` to a pair of floats, `split_indices` to a list).

    Args:
        {{curvature_option_args}}
    """

    split_indices: list = None
    frequency: int = 100
    split_dim: int = 128
    spread_inverses: bool = SPREAD_INVERSES_DEFAULT
    damping_split: str = "uniform"
    factor_decay: float = None
    statistics_frequency: int = None
    burn_in_steps: int = 0
    statistics_rows: int = None
    conv_statistics_rows: int = None
    fisher: str = "empirical"
    kl_clip: float = None
    kl_clip_mode: str = "direction"
    kl_clip_steps: str = "every"
    precondition_biases: str = None
    trace_thresholds: tuple = None
    first_order: str = "momentum"

    def __post_init__(self):
        validation.check_bool("spread_inverses", self.spread_inverses)
        validation.check_one_of(
            "precondition_biases", self.precondition_biases, BIAS_RULES
        )
        checked = {
            "frequency": validation.check_int("frequency", self.frequency, 2),
            "split_dim": validation.check_int("split_dim", self.split_dim, 1),
            "split_indices": _checked_split_indices(self.split_indices),
            "trace_thresholds": _checked_trace_thresholds(
                self.trace_thresholds
            ),
            "factor_decay": _checked_factor_decay(self.factor_decay),
        }
        checked["statistics_frequency"] = _checked_statistics_frequency(
            self.statistics_frequency,
            checked["frequency"],
            checked["factor_decay"],
        )
        checked["burn_in_steps"] = _checked_burn_in_steps(
            self.burn_in_steps, checked["factor_decay"]
        )
        checked["statistics_rows"] = _checked_statistics_rows(
            self.statistics_rows
        )
        if self.conv_statistics_rows is not None:
            checked["conv_statistics_rows"] = validation.check_int(
                "conv_statistics_rows", self.conv_statistics_rows, 1
            )
        validation.check_one_of("fisher", self.fisher, FISHER_KINDS)
        validation.check_one_of(
            "damping_split", self.damping_split, DAMPING_SPLITS
        )
        checked["kl_clip"] = _checked_kl_clip(self.kl_clip)
        _check_kl_clip_mode(
            self.kl_clip_mode, checked["kl_clip"], checked["factor_decay"]
        )
        validation.check_one_of(
            "kl_clip_steps", self.kl_clip_steps, KL_CLIP_STEPS
        )
        validation.check_one_of(
            "first_order", self.first_order, FIRST_ORDER_RULES
        )
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @classmethod
    def taken_from(cls, kwargs, **named):
        """`(options, other keyword arguments)`: the options among
        `kwargs` with those `named`, validated, and what is left."""
        fields = {field.name for field in dataclasses.fields(cls)}
        options = {key: kwargs[key] for key in kwargs if key in fields}
        others = {key: kwargs[key] for key in kwargs if key not in fields}
        return cls(**named, **options), others

    @property
    def statistics_period(self):
        """Steps between statistics steps (`statistics_frequency`, else
        `frequency`)."""
        return self.statistics_frequency or self.frequency

    def preconditions_bias(self, bias_block):
        """Whether `precondition_biases` selects the bias of `bias_block`
        (a `BiasKronecker`)."""
        if self.precondition_biases == "shared":
            return bias_block.shared
        return self.precondition_biases in ("all", "joint")
