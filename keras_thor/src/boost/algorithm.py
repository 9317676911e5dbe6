"""The interface of one boost algorithm inside `BoostOptimizer`, and the
rule of which algorithms run together (used by `AutoBoost` too)."""

import keras
from keras import ops

from keras_thor.src.distribute import replicas


class BoostAlgorithm:
    """One boost algorithm's wiring in a `BoostOptimizer` (a base class:
    every hook does nothing until a subclass says otherwise).

    The façade holds one per enabled argument, in a fixed order, and:

    ```
    build:    build(add_state, var_list)            (state, in this order)
    prepare:  bind(model)
    variant:  group = trained_group(t); update = every updates_at(t)
              variables = trained_variables(group, trainable variables)
              step = train_step(model, variables, update) or the plain one
    step:     g ← transform(g, variables), algorithm after algorithm
              apply(optimizer, g, variables, update, probe_gradients)
              by the one that `applies_updates`, else the plain step
    logs:     the union of training_logs()
    ```

    Notation:
        - `t`: the micro-step (`BoostOptimizer.micro_steps`).
        - `setting`: the value of the `BoostOptimizer` argument
          `argument` (validated by `validated`).

    Class attributes:
        argument: The `BoostOptimizer` argument that enables it.
        refuses: The arguments it does not run beside; `refusal`, why.
        runs_alone: Whether `AutoBoost` turns the level's others off.
        needs_boost_model: Whether steps differ (a boost model runs them).
        applies_updates: Whether the subclass's
            `apply(optimizer, grads, variables, update, probe_gradients)`
            replaces the plain inner step (only such subclasses define
            `apply`; the base has none).
        steps_on_local_gradients: Whether the inner optimizer steps on
            each replica's own gradients.
        without_global_loss_scale: Whether Keras's `mixed_float16` loss
            scale is dropped at compile (not moved inside).
    """

    argument = None
    refuses = ()
    refusal = ""
    runs_alone = False
    needs_boost_model = False
    applies_updates = False
    steps_on_local_gradients = False
    without_global_loss_scale = False

    def __init__(self, setting):
        self.setting = setting

    @classmethod
    def validated(cls, setting):
        """`setting` if it is a valid value of `argument` (else raises)."""
        return setting

    @classmethod
    def enabled(cls, setting):
        """Whether `setting` switches the algorithm on."""
        return setting is not None

    @classmethod
    def serialized(cls, setting):
        """`setting` as it stands in `BoostOptimizer.get_config()`."""
        return keras.saving.serialize_keras_object(setting)

    @classmethod
    def deserialized(cls, config, custom_objects=None):
        """The setting `serialized` wrote."""
        return keras.saving.deserialize_keras_object(
            config, custom_objects=custom_objects
        )

    def check_inner(self, inner_optimizer):
        """Raises if the algorithm cannot run with `inner_optimizer`."""

    def build(self, add_state, var_list):
        """Creates the algorithm's state with `add_state(shape, name,
        initializer="zeros")` (float32, one value on every replica)."""

    def bind(self, model):
        """Finds what the algorithm needs in `model` (once per train
        function; calling it again changes nothing)."""

    def trained_variables(self, group, variables):
        """The variables that a step of `group` trains, of `variables`
        (those the algorithms before it left)."""
        return variables

    def trained_group(self, step):
        """The group micro-step `step` trains, or None (no say)."""
        return None

    def updates_at(self, step):
        """Whether micro-step `step` may update the weights."""
        return True

    def train_step(self, model, variables, update):
        """The per-replica step `data -> logs` replacing the plain one,
        or None."""
        return None

    def transform(self, grads, variables):
        """The gradients, changed before they are applied."""
        return grads

    def probes(self):
        """Variables whose gradients the step hands to `apply` as
        `probe_gradients` (their own order)."""
        return []

    def training_logs(self):
        """What the algorithm is doing, for the step's logs."""
        return {}


def enabled_settings(algorithms, settings):
    """`{argument: setting}` of the algorithm classes that `settings` (by
    argument) switches on, in `algorithms`' order."""
    return {
        cls.argument: settings[cls.argument]
        for cls in algorithms
        if cls.enabled(settings[cls.argument])
    }


def refused_beside(algorithm, enabled):
    """The arguments among `enabled` that `algorithm` refuses."""
    return [name for name in algorithm.refuses if name in enabled]


def check_combination(algorithms, settings):
    """Raises the `refusal` of the first enabled algorithm class that
    refuses another enabled one, naming both settings."""
    enabled = enabled_settings(algorithms, settings)
    for cls in algorithms:
        refused = (
            refused_beside(cls, enabled) if cls.argument in enabled else []
        )
        if refused:
            named = [cls.argument, *refused]
            raise ValueError(
                f"{cls.refusal} Received: "
                + ", ".join(f"{name}={enabled[name]!r}" for name in named)
            )


def checked_setting(argument, setting, expected, accepted):
    """`setting` when it is None or `accepted(setting)`; else a TypeError
    saying that `argument` must be an `expected` (a public name)."""
    if setting is not None and not accepted(setting):
        raise TypeError(
            f"Argument `{argument}` must be a `{expected}` or None. "
            f"Received: {argument}={setting!r}"
        )
    return setting


def has_method(name):
    """A test for `checked_setting`: the object has a callable `name`
    (for the settings whose classes import `BoostOptimizer` themselves)."""
    return lambda setting: callable(getattr(setting, name, None))


def refuse_loss_scale_optimizer(inner_optimizer, message):
    """Raises `message` (which names the inner optimizer) if
    `inner_optimizer` is a `keras.optimizers.LossScaleOptimizer`."""
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(message)


def zeroed_unless_finite(grads):
    """The gradients, all zero unless every one is finite on every
    replica (`None` entries kept)."""
    finite = replicas.finite_on_all_replicas(grads)
    return [
        None if g is None else ops.where(finite, g, ops.zeros_like(g))
        for g in grads
    ]
