"""THOR, MindSpore's trace-based, hardware-driven natural gradient."""

import dataclasses

import keras
from keras import ops

from keras_thor.src import keras_internals
from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.backend.dense import dense
from keras_thor.src.backend.fusion import fused
from keras_thor.src.optimizers.batched_update import BatchedUpdate
from keras_thor.src.optimizers.docstrings import with_base_keyword_args
from keras_thor.src.optimizers.reference_optimizer import ReferenceOptimizer
from keras_thor.src.thor import arguments
from keras_thor.src.thor import capture
from keras_thor.src.thor import update
from keras_thor.src.thor.batch_size import BatchSizeFromFit
from keras_thor.src.thor.curvature import NOT_CONVERTED
from keras_thor.src.thor.curvature import first_order_indices
from keras_thor.src.thor.curvature import preconditioners_of
from keras_thor.src.thor.estimator import CurvatureEstimator
from keras_thor.src.thor.options import CurvatureOptions
from keras_thor.src.thor.options import with_curvature_options
from keras_thor.src.thor.state_access import ThorStateAccess
from keras_thor.src.utils import validation

_fused_thor_updates = fused(update.thor_updates)
_fused_adam_updates = fused(update.adam_updates)


@keras_thor_export
@with_base_keyword_args
@with_curvature_options
class THOR(
    BatchSizeFromFit, ThorStateAccess, BatchedUpdate, ReferenceOptimizer
):
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
        A⁻¹ = blocks of (c·A + π√λ_t·I)⁻¹,
        G⁻¹ = blocks of (c·G + √λ_t/π·I)⁻¹
    d = A⁻¹ · g · G⁻¹                  (LayerNorm: g / (g²/N + √λ_t))
    d_b = g_b · G_b⁻¹ / (1 + π√λ_t)    (biases, with precondition_biases)
    d = ν · d                          (kernels with curvature; with
                                        kl_clip_mode="velocity":
                                        d = ν·(momentum·v + d) − momentum·v)
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
          replicas' batches under tf.distribute; a sample is a term of the
          loss: a position of a per-token loss); Embedding uses the
          diagonal of token counts, convolutions im2col patches.
        - `c`: `√T` for a convolution with `T` output positions, else 1;
          `π`: 1 (MindSpore), or with `damping_split="pi"` K-FAC's
          `sqrt((tr A / d_A) / (tr G / d_G))`.
        - `G_b⁻¹`: blocks of `(G_b + √λ_t/π·I)⁻¹`, `G_b = SᵀS / M` with `S`
          the per-example bias gradients (output gradients `D` summed
          over the positions the bias is shared by) and `M` the loss
          terms (`N`, times the positions of a per-position loss).
        - `λ_t`, `lr_t`: the damping and learning rate of step `t`;
          `N`: `batch_size`; blocks are `split_dim` wide.
        - `ν`: the step-size guard, 1 unless `kl_clip` is set:
          `ν = min(1, sqrt(kl_clip / |lr_t² · Σ ⟨d, g⟩|))`, the sum over the
          kernels with curvature, and the biases if preconditioned
          (kfac-pytorch's KL clip); with `kl_clip_mode="velocity"` the sum
          is `Σ ⟨u, F̂u⟩` of the velocity `u = momentum·v + d` the step
          would leave, `F̂ = c·A ⊗ c·G` the averaged factors; with
          `kl_clip_steps="refresh"` the steps between refreshes take the
          last refresh step's `ν`.

    MindSpore's rule is the default. The options beyond it, from kfac-jax
    and kfac-pytorch (`factor_decay` to `trace_thresholds`; docs/thor.md
    gives their sources and measured effect), make one `CurvatureOptions`,
    `THOR.curvature_options`; `THOR.recommended()` is a starting point for
    any model. Once built, `THOR.estimator` holds every block's curvature
    state (`THOR.state_for(layer.kernel)` reads one) and
    `THOR.step_plan` is how the training step treats each kernel.

    Train a model `keras_thor.convert_to_thor_model` converted (or a
    `keras_thor.models.ThorModel`): its training step captures the
    statistics on refresh steps only, with a separately traced function, so
    other steps never compute them. A failed factorization falls back to a
    more damped inverse, and non-finite statistics keep the previous
    inverses; a warning says so once. A non-finite preconditioned gradient
    leaves its variable and momentum unchanged; `THOR.skipped_updates`
    counts the steps where that happened (logged as `thor_skipped_updates`,
    warned once).

    Args:
        learning_rate: A float >= 0, a `LearningRateSchedule`, or a 1-D
            array with one value per training step (MindSpore style).
        damping: A float > 0, a `LearningRateSchedule`, or a 1-D array with
            one value per step: `λ`.
        momentum: Float in `[0, 1]`.
        weight_decay: Float >= 0, added to the preconditioned gradient of
            the variables `decay_filter` selects. Defaults to `0.0`.
        loss_scale: Float > 0: the loss is multiplied by it before
            differentiation and the gradients are divided by it (Keras's
            `loss_scale_factor`). Defaults to `1.0`.
        batch_size: Integer > 0 or `None`: `N` of the LayerNorm rule,
            and the per-replica batch assumed when a Dense layer's
            preconditioning order is chosen (once, before the first
            training step). `None` (the default) takes the per-replica
            size of the first batch `fit` trains on and keeps it (saved
            with the optimizer); a given value is used as it is (a warning
            says when `fit`'s batch differs). The factors use the actual
            size of each batch.
        use_nesterov: Boolean. Defaults to `False`.
        decay_filter: A callable `variable -> bool` choosing the variables
            that get weight decay. Defaults to all of them (MindSpore's
            default).
        enable_clip_grad: Boolean: clip each preconditioned gradient to
            norm 1.0. Defaults to `False`.
        {{curvature_option_args}}
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
        batch_size=None,
        use_nesterov=False,
        decay_filter=None,
        split_indices=None,
        enable_clip_grad=False,
        frequency=100,
        *,
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
        arguments.check_not_a_model(learning_rate)
        learning_rate = arguments.checked_rate(
            "learning_rate", learning_rate, False, True
        )
        damping = arguments.checked_rate("damping", damping, True, False)
        momentum = validation.check_float(
            "momentum", momentum, minimum=0.0, maximum=1.0
        )
        weight_decay = validation.check_float(
            "weight_decay", weight_decay, minimum=0.0
        )
        loss_scale, loss_scale_factor = arguments.checked_loss_scale(
            loss_scale, loss_scale_factor
        )
        if batch_size is not None:
            batch_size = validation.check_int("batch_size", batch_size, 1)
        validation.check_bool("use_nesterov", use_nesterov)
        validation.check_bool("enable_clip_grad", enable_clip_grad)
        arguments.check_decay_filter(decay_filter)
        options, kwargs = CurvatureOptions.taken_from(
            kwargs, split_indices=split_indices, frequency=frequency
        )
        arguments.check_kl_clip_alone(
            options.kl_clip, clipnorm, clipvalue, global_clipnorm
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
        self._given_batch_size = batch_size
        # The batch size taken from training (`batch_size=None`).
        self._trained_batch = None
        self._step_plan = None
        self.momentum = momentum
        self.loss_scale = loss_scale
        self.use_nesterov = use_nesterov
        self.decay_filter = decay_filter
        self.enable_clip_grad = enable_clip_grad
        self.curvature_options = options
        if options.first_order == "adam" and momentum >= 1.0:
            raise ValueError(
                "Argument `momentum` must be < 1 with first_order='adam' "
                "(it is Adam's β₁ there). Received: momentum=1.0"
            )

    RECOMMENDED = {
        "learning_rate": 1e-3,
        "damping": 1e-3,
        "momentum": 0.9,
        "frequency": 5,
        "statistics_frequency": 1,
        "factor_decay": 0.95,
        "damping_split": "pi",
        "precondition_biases": "joint",
        "split_dim": 256,
        "kl_clip": 0.01,
        "kl_clip_mode": "velocity",
        "conv_statistics_rows": 32,
        "first_order": "adam",
    }

    @classmethod
    def recommended(cls, **kwargs):
        """THOR set up as a starting point for any model: K-FAC grade.

        `learning_rate=1e-3, damping=1e-3, momentum=0.9, frequency=5,
        statistics_frequency=1, factor_decay=0.95, damping_split="pi",
        precondition_biases="joint", split_dim=256, kl_clip=0.01,
        kl_clip_mode="velocity", conv_statistics_rows=32,
        first_order="adam"` (`THOR.RECOMMENDED`): statistics every step
        into an average (a convolution's from the first 32 examples of
        each batch), inverses every 5 steps, Martens & Grosse's damping
        split, biases in their kernels' blocks, whole factors up to 256
        wide (wider ones in 256-wide diagonal blocks), a step-size guard on
        the velocity, and Adam's step on the variables without curvature
        (measured on recurrent models: docs/benchmarks.md, "THOR's rule
        for variables without curvature"); the rest chosen on the
        held-out seed of the benchmark tasks, one setting for all of them,
        by epochs and then by seconds (docs/thor.md, "Tuning THOR").
        Without `batch_size` THOR takes the batch `fit` trains with.

        Example:

        ```python
        optimizer = keras_thor.optimizers.THOR.recommended(
            learning_rate=3e-3
        )
        ```

        Args:
            **kwargs: Any argument of `THOR`; each overrides the preset's.

        Returns:
            A `THOR`.
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
        """Creates the momentum of every variable, then the curvature state.

        One momentum per variable, in `var_list` order; with
        `first_order="adam"` a second moment per variable without
        curvature, in the same order; then the `CurvatureEstimator` of the
        kernels with a curvature block (marked by `convert_to_thor_model`,
        a preconditioned bias counting as a
        kernel), which creates their `A⁻¹` blocks `(groups·n, s, s)` (a
        vector for an Embedding) and `G⁻¹` blocks as identities, and the
        state its options need, in the order its docstring gives; then
        `skipped_updates` and `trained_batch_size` (the batch size taken
        from training, 0 while unknown). The `step_plan` is made when it
        is first needed, once the batch size is known.
        """
        if self.built:
            return
        preconditioners, blocks = preconditioners_of(
            var_list,
            self.curvature_options.preconditions_bias,
            self.precondition_biases == "joint",
        )
        if not blocks:
            # Not a converted model's variables (Keras's loading builds
            # the optimizer of every model it compiles): THOR builds once
            # it is, and its training step says so until then.
            return
        super().build(var_list)
        self._velocities = [
            self.add_variable_from_reference(v, "momentum") for v in var_list
        ]
        self._second_moments = {
            index: self.add_variable_from_reference(
                var_list[index], "second_moment"
            )
            for index in first_order_indices(var_list, preconditioners, blocks)
            if self.first_order == "adam"
        }
        self._weight_decays = [self._decay_of(v) for v in var_list]
        self._estimator = CurvatureEstimator(
            self.curvature_options,
            var_list,
            preconditioners,
            blocks,
            self._variable_index,
            self.add_variable,
        )
        self._skipped_updates = self.add_variable(
            (), "zeros", "int32", name="skipped_updates"
        )
        self._trained_batch_size = self.add_variable(
            (),
            keras.initializers.Constant(self.batch_size or 0),
            "int32",
            name="trained_batch_size",
        )
        # Whether this step skipped a variable's update: scratch, reset by
        # every step, so kept out of the saved state.
        object.__setattr__(
            self,
            "_step_skipped",
            keras.Variable(
                0,
                dtype="int32",
                trainable=False,
                aggregation="none",
                name="step_skipped",
            ),
        )
        self._step_plan = None

    def _variable_index(self, variable):
        return keras_internals.variable_index(self, variable)

    def _decay_of(self, variable):
        if self.decay_filter is not None and not self.decay_filter(variable):
            return 0.0
        return self.decay_for(variable)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        if not self.built:
            raise ValueError(
                "THOR is not built: none of the variables it was given has "
                f"curvature. {NOT_CONVERTED}"
            )
        return super().stateless_apply(
            optimizer_variables, grads, trainable_variables
        )

    def apply(self, grads, trainable_variables=None):
        if not capture.in_thor_training_step():
            raise ValueError(
                "THOR gets its curvature from its own training step, and "
                f"this model trains with Keras's. {NOT_CONVERTED}"
            )
        result = super().apply(grads, trainable_variables)
        # Keras updates the variables one by one under a strategy: their
        # flags meet in `_step_skipped`; each replica counts its own
        # (identical) copy.
        self.assign_add(
            self._skipped_updates, ops.convert_to_tensor(self._step_skipped)
        )
        self.assign(self._step_skipped, 0)
        return result

    def _update_variables(self, grads, variables, learning_rate):
        indices = [
            keras_internals.trained_variable_index(self, v) for v in variables
        ]
        learning_rate = ops.cast(learning_rate, "float32")
        grads = [dense(g) for g in grads]
        adam = [k for k, i in enumerate(indices) if i in self._second_moments]
        thor = [k for k in range(len(indices)) if k not in set(adam)]
        skipped = []
        if thor:
            skipped += self._thor_updates(
                [variables[k] for k in thor],
                [grads[k] for k in thor],
                [indices[k] for k in thor],
                learning_rate,
            )
        if adam:
            skipped += self._adam_updates(
                [variables[k] for k in adam],
                [grads[k] for k in adam],
                [indices[k] for k in adam],
                learning_rate,
            )
        skipped = ops.any(ops.stack(skipped))
        self.assign(
            self._step_skipped,
            ops.maximum(self._step_skipped, ops.cast(skipped, "int32")),
        )

    def _thor_updates(self, variables, grads, indices, learning_rate):
        """THOR's rule on `variables`; returns their skipped flags."""
        velocities = [self._velocities[i] for i in indices]
        inverses = [self._estimator.inverses_of(i) for i in indices]
        in_step = self.step_plan.preconditioned_in_step
        results = _fused_thor_updates(
            list(variables),
            grads,
            velocities,
            [a_inverse for a_inverse, _ in inverses],
            [g_inverse for _, g_inverse in inverses],
            learning_rate,
            self.current_damping(),
            [
                None if i in in_step else self._estimator.preconditioner(i)
                for i in indices
            ],
            [self._weight_decays[i] for i in indices],
            float(self.batch_size),
            self.momentum,
            self.use_nesterov,
            self.enable_clip_grad,
        )
        for variable, velocity, (new_variable, new_velocity, _) in zip(
            variables, velocities, results
        ):
            self.assign(variable, new_variable)
            self.assign(velocity, new_velocity)
        return [result[2] for result in results]

    def _adam_updates(self, variables, grads, indices, learning_rate):
        """Adam's step on the variables without curvature
        (`first_order="adam"`); returns their skipped flags."""
        firsts = [self._velocities[i] for i in indices]
        seconds = [self._second_moments[i] for i in indices]
        results = _fused_adam_updates(
            list(variables),
            grads,
            firsts,
            seconds,
            learning_rate,
            self.momentum,
            ops.cast(self.iterations + 1, "float32"),
            [self._weight_decays[i] for i in indices],
        )
        for variable, first, second, result in zip(
            variables, firsts, seconds, results
        ):
            self.assign(variable, result[0])
            self.assign(first, result[1])
            self.assign(second, result[2])
        return [result[3] for result in results]

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
                "batch_size": self._given_batch_size,
                "use_nesterov": self.use_nesterov,
                "decay_filter": keras.saving.serialize_keras_object(
                    self.decay_filter
                ),
                "enable_clip_grad": self.enable_clip_grad,
            }
        )
        options = self.curvature_options
        for field in dataclasses.fields(options):
            config[field.name] = getattr(options, field.name)
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
