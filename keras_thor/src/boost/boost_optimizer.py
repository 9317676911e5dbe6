"""`BoostOptimizer`: the optimizer side of keras_thor's boost algorithms,
a façade over one wiring object per enabled algorithm."""

import keras

from keras_thor.src import keras_internals
from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.boost.accumulation_wiring import Accumulation
from keras_thor.src.boost.adasum_wiring import AdaSumCombination
from keras_thor.src.boost.algorithm import check_combination
from keras_thor.src.boost.algorithm import zeroed_unless_finite
from keras_thor.src.boost.centralization_wiring import Centralization
from keras_thor.src.boost.dim_reduce_wiring import DimReduceSearch
from keras_thor.src.boost.freeze_wiring import Freezing
from keras_thor.src.boost.group_loss_scale_wiring import GroupLossScaling
from keras_thor.src.boost.training import train_step
from keras_thor.src.distribute import replicas

# Every algorithm's wiring, in the order of the `BoostOptimizer` arguments
# (and of `get_config`); their state is built in this order too.
ALGORITHMS = (
    Accumulation,
    Freezing,
    Centralization,
    AdaSumCombination,
    DimReduceSearch,
    GroupLossScaling,
)


def wiring_of(argument):
    """The `BoostAlgorithm` class that `BoostOptimizer` argument
    `argument` switches on."""
    return next(cls for cls in ALGORITHMS if cls.argument == argument)


@keras_thor_export
class BoostOptimizer(keras.optimizers.Optimizer):
    """Wraps an optimizer with gradient centralization, gradient freezing,
    gradient accumulation, AdaSum, DimReduce or group loss scaling
    (MindSpore boost's optimizer side).

    Per training step, with `g` the gradients of the trained variables:

    ```
    g ← g − mean(g)             for `centralized_variables` (per output)
    k = sequence[t mod |sequence|]                  (with `grad_freeze`)
    acc ← acc + g / N                   (skipped when g is not finite)
    every N-th step: inner.apply(acc) on the variables of group k; acc ← 0
    t ← t + 1
    ```

    With `adasum` (under a `tf.distribute` strategy) each replica instead
    takes its own inner step and the weight deltas are combined:
    `w ← w + AdasumTree(Δ_group_0, ...)` (see `keras_thor.boost.AdaSum`).
    With `dim_reduce` the step is DimReduce's line search in a subspace
    (`keras_thor.boost.DimReduce`); with `group_loss_scale`, each group's
    gradients are unscaled by its own scale and the step is skipped on an
    overflow (`keras_thor.callbacks.GroupLossScale`). Both run alone.

    Notation:
        - `t`: the training steps so far (`micro_steps`), overflowed ones
          included; `N`: `grad_accumulation_step`.
        - `k`: with `grad_freeze`, the group trained at step `t`; its
          variables are the only ones that get gradients and updates.

    Gradient freezing, accumulation, DimReduce and group loss scaling
    need a model that runs the step for them: `keras_thor.boost` returns
    one (`BoostFunctional`, `BoostSequential`). With none of them, this
    optimizer (centralization, AdaSum) works in any Keras model. A
    non-finite gradient is applied as zero
    (a `keras.optimizers.LossScaleOptimizer` inside skips the step and
    lowers its scale instead).

    Each enabled algorithm is one `BoostAlgorithm` wiring (`algorithms`,
    `algorithm(argument)`), composed here as `optax.chain` composes
    transforms; a boost model's train function runs
    `prepare(model)`, then per micro-step `variant_step(model,
    variant_at(step))`.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` that updates the
            weights (a `LossScaleOptimizer` included).
        grad_accumulation_step: Integer >= 1, micro-steps per update.
        grad_freeze: A `keras_thor.boost.GradientFreeze`, or None.
        centralized_variables: Paths (`variable.path`) of the variables
            whose gradients are centralized;
            `keras_thor.boost.OptimizerProcess.add_grad_centralization`
            selects them with MindSpore's rule.
        adasum: A `keras_thor.boost.AdaSum`, or None.
        dim_reduce: A `keras_thor.boost.DimReduce`, or None; the inner
            optimizer must be `keras.optimizers.SGD(1.0)`.
        group_loss_scale: A `keras_thor.callbacks.GroupLossScale`, or
            None; the inner optimizer must not be a `LossScaleOptimizer`.
        name: The optimizer's name.
    """

    def __init__(
        self,
        inner_optimizer,
        grad_accumulation_step=1,
        grad_freeze=None,
        centralized_variables=(),
        adasum=None,
        dim_reduce=None,
        group_loss_scale=None,
        name=None,
    ):
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "Argument `inner_optimizer` must be a "
                "`keras.optimizers.Optimizer`. "
                f"Received: inner_optimizer={inner_optimizer!r}"
            )
        if isinstance(inner_optimizer, BoostOptimizer):
            raise ValueError(
                "Argument `inner_optimizer` is already a `BoostOptimizer`. "
                f"Received: inner_optimizer={inner_optimizer!r}"
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        settings = {
            "grad_accumulation_step": grad_accumulation_step,
            "grad_freeze": grad_freeze,
            "centralized_variables": centralized_variables,
            "adasum": adasum,
            "dim_reduce": dim_reduce,
            "group_loss_scale": group_loss_scale,
        }
        settings = {
            cls.argument: cls.validated(settings[cls.argument])
            for cls in ALGORITHMS
        }
        check_combination(ALGORITHMS, settings)
        for argument, setting in settings.items():
            setattr(self, argument, setting)
        self._algorithms = tuple(
            cls(settings[cls.argument])
            for cls in ALGORITHMS
            if cls.enabled(settings[cls.argument])
        )
        for algorithm in self._algorithms:
            algorithm.check_inner(inner_optimizer)

    @property
    def algorithms(self):
        """The wiring of each enabled algorithm (`BoostAlgorithm`s), in
        argument order."""
        return self._algorithms

    def algorithm(self, argument):
        """The enabled algorithm that `argument` (a `BoostOptimizer`
        argument name) switched on, or None."""
        return next(
            (a for a in self._algorithms if a.argument == argument), None
        )

    def build(self, var_list):
        """Creates the step counter, then each algorithm's state (in
        `ALGORITHMS` order), then the inner state."""
        if self.built:
            return
        self.micro_steps = self.add_variable(
            (), "zeros", "int64", aggregation="none", name="micro_steps"
        )
        for algorithm in self._algorithms:
            algorithm.build(self._add_state, var_list)
        self.inner_optimizer.build(var_list)
        if any(a.steps_on_local_gradients for a in self._algorithms):
            replicas.use_local_gradients(self.inner_optimizer)
        super().build(var_list)

    def _add_state(self, shape, name, initializer="zeros"):
        return self.add_variable(
            shape, initializer, "float32", aggregation="none", name=name
        )

    @property
    def variables(self):
        return (
            keras_internals.own_optimizer_variables(self)
            + self.inner_optimizer.variables
        )

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        """The inner optimizer's updates so far."""
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    @property
    def needs_boost_model(self):
        """Whether steps differ (which group, whether to apply), so that
        a `keras_thor.boost` model must run them."""
        return any(a.needs_boost_model for a in self._algorithms)

    @property
    def without_global_loss_scale(self):
        """Whether Keras's `mixed_float16` loss scale is dropped at compile
        rather than moved inside (group loss scaling, DimReduce)."""
        return any(a.without_global_loss_scale for a in self._algorithms)

    def applies_at(self, step):
        """Whether training step `step` updates the weights."""
        return all(a.updates_at(step) for a in self._algorithms)

    def prepare(self, model):
        """Builds this optimizer under `model`'s strategy (from its
        trainable variables) if it is not built, and binds every algorithm
        to `model`: DimReduce's `P`, the group loss scale markers, the
        freezing's parameter groups. Calling it again changes nothing."""
        variables = list(model.trainable_variables)
        if not self.built:
            # Its variables are the strategy's (a boost callback may have
            # made the optimizer outside its scope).
            with model.distribute_strategy.scope():
                self.build(variables)
        for algorithm in self._algorithms:
            algorithm.bind(model)

    def variant_at(self, step):
        """The variant of micro-step `step`: `(group, update)`, the group
        it trains and whether it updates the weights."""
        groups = (a.trained_group(step) for a in self._algorithms)
        group = next((g for g in groups if g is not None), 0)
        return (group, self.applies_at(step))

    def variant_step(self, model, key):
        """The per-replica step function `data -> logs` of variant `key`
        (from `variant_at`) on `model`, after `prepare(model)`; untraced."""
        group, update = key
        variables = list(model.trainable_variables)
        for algorithm in self._algorithms:
            variables = algorithm.trained_variables(group, variables)
        for algorithm in self._algorithms:
            step = algorithm.train_step(model, variables, update)
            if step is not None:
                return step
        return lambda data: train_step(model, data, variables, update)

    def apply(self, grads, trainable_variables=None):
        """Keras's entry point: one step that always updates (centralized
        gradients; no freezing or accumulation outside a boost model)."""
        if self.needs_boost_model:
            raise ValueError(
                "Gradient freezing, accumulation, DimReduce and group loss "
                "scaling run in the training step of a `keras_thor.boost` "
                "model: pass your model through "
                "`keras_thor.boost.AutoBoost(...).network_auto_process_train`"
                " or `keras_thor.boost.to_boost_model`, and open a saved "
                "one with `keras_thor.load_model`. Received: a "
                "`BoostOptimizer` applied by another training step."
            )
        if trainable_variables is None:
            trainable_variables = keras_internals.trained_variables(self)
        self.boost_apply(list(grads), list(trainable_variables), True)

    def overflow_probes(self):
        """The variables whose gradients the algorithms read (the group
        loss scale markers' overflow probes, one per group), or []."""
        return [p for a in self._algorithms for p in a.probes()]

    def boost_apply(self, grads, variables, update, segment_overflows=()):
        """One training step's gradients of `variables` (per replica).

        `update`: whether this step updates the weights (the last of `N`
        micro-steps); otherwise the gradients are only accumulated.
        `segment_overflows`: the gradients of `overflow_probes()` (with
        group loss scaling, 1 where a segment's backward pass overflowed).
        """
        if not self.built:
            self.build(variables)
        for algorithm in self._algorithms:
            grads = algorithm.transform(grads, variables)
        appliers = [a for a in self._algorithms if a.applies_updates]
        if appliers:
            (applier,) = appliers
            applier.apply(self, grads, variables, update, segment_overflows)
        else:
            self._plain_apply(grads, variables)
        replicas.assign_replicated([(self.micro_steps, self.micro_steps + 1)])

    def _plain_apply(self, grads, variables):
        """The inner step: a `LossScaleOptimizer` skips it on an overflow
        on any replica; any other steps on zeros instead."""
        inner = self.inner_optimizer
        if isinstance(inner, keras.optimizers.LossScaleOptimizer):
            inner.apply(replicas.overflow_on_every_replica(grads), variables)
        else:
            inner.apply(zeroed_unless_finite(grads), variables)

    def training_logs(self):
        """What the boost algorithms are doing, for the step's logs (and
        so `History` and `TensorBoard`)."""
        logs = {}
        for algorithm in self._algorithms:
            logs.update(algorithm.training_logs())
        return logs

    def _settings(self):
        return {cls.argument: getattr(self, cls.argument) for cls in ALGORITHMS}

    def replaced(self, **changes):
        """A new `BoostOptimizer` over the same inner optimizer, with
        `changes` to its other arguments."""
        arguments = {
            "inner_optimizer": self.inner_optimizer,
            **self._settings(),
            "name": self.name,
        }
        return BoostOptimizer(**{**arguments, **changes})

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(
                self.inner_optimizer
            ),
            **{
                cls.argument: cls.serialized(getattr(self, cls.argument))
                for cls in ALGORITHMS
            },
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["inner_optimizer"] = keras.saving.deserialize_keras_object(
            config["inner_optimizer"], custom_objects=custom_objects
        )
        for algorithm in ALGORITHMS:
            config[algorithm.argument] = algorithm.deserialized(
                config[algorithm.argument], custom_objects=custom_objects
            )
        return cls(**config)


def GradientAccumulation(max_accumulation_step, optimizer):
    """`optimizer` updating with the mean gradient of every
    `max_accumulation_step` micro-steps: MindSpore's
    `mindspore.boost.GradientAccumulation(max_accumulation_step,
    optimizer)`, as a `BoostOptimizer` for a `keras_thor.boost` model."""
    return BoostOptimizer(
        optimizer, grad_accumulation_step=max_accumulation_step
    )
