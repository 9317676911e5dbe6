"""`GradientFreeze`: MindSpore's gradient freezing for Keras models."""

import keras

from keras_thor.src.api_export import keras_thor_export
from keras_thor.src.boost import boost_callbacks
from keras_thor.src.boost import freeze_schedule
from keras_thor.src.boost.boost_model import to_boost_model
from keras_thor.src.boost.boost_optimizer import BoostOptimizer
from keras_thor.src.boost.centralization import owning_layers
from keras_thor.src.utils.validation import check_float
from keras_thor.src.utils.validation import check_int

_NORMALIZATION_LAYERS = (
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
)


def _attaches_to_previous(variable, layer):
    """MindSpore's `'bn' in name or 'bias' in name`, plus Keras's own
    normalization layers (whose weights need not be named `bn`)."""
    return (
        "bn" in variable.path
        or "bias" in variable.path
        or isinstance(layer, _NORMALIZATION_LAYERS)
    )


@keras_thor_export
class GradientFreeze(boost_callbacks.BoostCallback):
    """Trains a suffix of the network on some steps: MindSpore's
    `mindspore.boost.GradientFreeze`, and the Keras callback that runs it.

    The trainable variables are cut into "layer units" (a kernel with its
    bias and normalization weights, at least 3 variables each); group `i`
    is the suffix of the network from unit `i · stride`
    (`stride = units // param_groups`), so group 0 is the whole network and
    higher groups freeze more front layers. A fixed, seeded sequence names
    the group trained at each step; on a step of group `k` only its
    variables get gradients (backpropagation stops at its first layer) and
    updates.

    Pass it to `fit(callbacks=[...])` of a boost model
    (`keras_thor.boost.to_boost_model`) compiled with any Keras optimizer:
    it wraps the optimizer in a `BoostOptimizer` that freezes (its step
    count saved with the model). `freeze_generate` and `AutoBoost` are
    MindSpore's ways to the same training.

    Args:
        param_groups: Integer >= 1, the number of groups.
        freeze_type: 0, periods of `z` whole-network steps followed by
            groups `1, ..., n−1` ("00001234"); or 1, whole-network steps
            interleaved with random groups, shallow freezes likelier
            ("01020304").
        freeze_p: Float in [0, 1]: the fraction of steps that train the
            whole network (MindSpore's name suggests the opposite; this is
            what its code does).
        total_steps: Integer >= 1; the sequence is
            `int(total_steps · 1.01)` long and then repeats.
        seed: Integer >= 0 for the interval sequence's draws (MindSpore
            draws from NumPy's global generator; a seed makes every
            replica and every resumed run draw the same).
    """

    def __init__(
        self,
        param_groups=10,
        freeze_type=1,
        freeze_p=0.7,
        total_steps=65536,
        seed=0,
    ):
        super().__init__()
        self.param_groups = check_int("param_groups", param_groups, minimum=1)
        self.freeze_type = check_int("freeze_type", freeze_type)
        if self.freeze_type not in (
            freeze_schedule.CONTINUOUS,
            freeze_schedule.INTERVAL,
        ):
            raise ValueError(
                "Argument `freeze_type` must be 0 (continuous) or 1 "
                f"(interval). Received: freeze_type={freeze_type!r}"
            )
        self.freeze_p = check_float("freeze_p", freeze_p, minimum=0.0)
        if self.freeze_p > 1.0:
            raise ValueError(
                "Argument `freeze_p` must be a float in [0, 1]. "
                f"Received: freeze_p={freeze_p!r}"
            )
        self.total_steps = check_int("total_steps", total_steps, minimum=1)
        self.seed = check_int("seed", seed, minimum=0)
        self._sequence = None

    def set_model(self, model):
        super().set_model(model)
        boost_callbacks.install(self, model, "grad_freeze")

    def split_parameters_groups(self, model, freeze_para_groups_number=None):
        """The groups of `model`'s trainable variables (lists, suffixes)."""
        number = (
            self.param_groups
            if freeze_para_groups_number is None
            else check_int(
                "freeze_para_groups_number",
                freeze_para_groups_number,
                minimum=1,
            )
        )
        variables = list(model.trainable_variables)
        owners = owning_layers(model)
        units = freeze_schedule.layer_units(
            [_attaches_to_previous(v, owners[id(v)]) for v in variables]
        )
        return [
            [variables[i] for i in group]
            for group in freeze_schedule.suffix_groups(units, number)
        ]

    def generate_freeze_index_sequence(
        self,
        parameter_groups_number=None,
        freeze_strategy=None,
        freeze_p=None,
        total_steps=None,
    ):
        """The group index of every step (a NumPy int array); arguments
        left as None take this object's settings."""
        settings = GradientFreeze(
            self.param_groups
            if parameter_groups_number is None
            else parameter_groups_number,
            self.freeze_type if freeze_strategy is None else freeze_strategy,
            self.freeze_p if freeze_p is None else freeze_p,
            self.total_steps if total_steps is None else total_steps,
            self.seed,
        )
        return freeze_schedule.freeze_index_sequence(
            settings.param_groups,
            settings.freeze_type,
            settings.freeze_p,
            settings.total_steps,
            settings.seed,
        )

    def group_at(self, step):
        """The group trained at training step `step`."""
        if self._sequence is None:
            self._sequence = self.generate_freeze_index_sequence()
        return int(self._sequence[step % len(self._sequence)])

    def freeze_generate(self, model, optimizer):
        """`(model, optimizer)` that train with this freezing.

        The model becomes a `keras_thor.boost` model (weights and names
        kept) and the optimizer a `BoostOptimizer` carrying this object
        (an existing `BoostOptimizer` keeps its other settings).
        """
        if isinstance(optimizer, BoostOptimizer):
            boosted = optimizer.replaced(grad_freeze=self)
        else:
            boosted = BoostOptimizer(optimizer, grad_freeze=self)
        return to_boost_model(model), boosted

    def get_config(self):
        return {
            "param_groups": self.param_groups,
            "freeze_type": self.freeze_type,
            "freeze_p": self.freeze_p,
            "total_steps": self.total_steps,
            "seed": self.seed,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        settings = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"GradientFreeze({settings})"
