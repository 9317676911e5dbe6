"""THOR's argument checks: MindSpore's rules, in Keras's message style."""

import numpy as np
import pytest

from keras_thor.optimizers import THOR
from tests.helpers import stable_id

GOOD = dict(learning_rate=0.1, damping=0.03, momentum=0.9)

BAD_ARGUMENTS = [
    ("loss_scale", "128", TypeError, "`loss_scale` must be a float"),
    ("loss_scale", 0.0, ValueError, "`loss_scale` must be > 0"),
    ("loss_scale", -1.0, ValueError, "`loss_scale` must be >= 0.0"),
    ("weight_decay", "0.1", TypeError, "`weight_decay` must be a float"),
    ("weight_decay", -1e-4, ValueError, "`weight_decay` must be >= 0.0"),
    ("momentum", True, TypeError, "`momentum` must be a float"),
    ("momentum", -0.1, ValueError, "`momentum` must be >= 0.0"),
    ("frequency", 1, ValueError, "`frequency` must be an integer >= 2"),
    ("frequency", 10.0, TypeError, "`frequency` must be an integer"),
    ("frequency", True, TypeError, "`frequency` must be an integer"),
    ("use_nesterov", 1, TypeError, "`use_nesterov` must be a boolean"),
    ("enable_clip_grad", "yes", TypeError, "`enable_clip_grad` must be"),
    ("damping", 0.0, ValueError, "`damping` must be > 0"),
    ("damping", -0.1, ValueError, r"`damping` must be > 0. Received: dampi"),
    ("damping", [0.1, 0.0], ValueError, r"`damping` must be finite and > 0"),
    ("damping", np.zeros((2, 2)), ValueError, "non-empty 1-D array"),
    ("learning_rate", [], ValueError, "non-empty 1-D array"),
    ("learning_rate", [0.1, np.nan], ValueError, r"learning_rate\[1\]=nan"),
    ("learning_rate", "fast", TypeError, "`learning_rate` must be a float"),
    ("batch_size", 0, ValueError, "`batch_size` must be an integer >= 1"),
    ("batch_size", 32.0, TypeError, "`batch_size` must be an integer"),
    ("split_dim", 0, ValueError, "`split_dim` must be an integer >= 1"),
    ("split_indices", [26, 13], ValueError, "strictly increasing"),
    ("split_indices", 26, TypeError, "non-empty list of integers"),
    ("split_indices", [], ValueError, "non-empty list of integers"),
    ("damping", lambda: 0.03, TypeError, "`damping` must be a float, a"),
    ("split_indices", [1.5], TypeError, "`split_indices` must be an integer"),
    ("decay_filter", "bias", TypeError, "`decay_filter` must be a callable"),
]


@pytest.mark.parametrize(
    "name, value, error, message",
    BAD_ARGUMENTS,
    ids=[f"{b[0]}={stable_id(b[1])}" for b in BAD_ARGUMENTS],
)
def test_bad_arguments_name_the_argument_and_the_value(
    name, value, error, message
):
    arguments = dict(GOOD, **{name: value})
    with pytest.raises(error, match=message) as raised:
        THOR(**arguments)
    assert "Received" in str(raised.value)


def test_loss_scale_and_loss_scale_factor_conflict():
    with pytest.raises(ValueError, match="set one"):
        THOR(**GOOD, loss_scale=8.0, loss_scale_factor=4.0)


def test_int_loss_scale_weight_decay_and_momentum_are_converted():
    optimizer = THOR(**{**GOOD, "momentum": 0}, loss_scale=128, weight_decay=0)
    assert optimizer.loss_scale == 128.0
    assert isinstance(optimizer.weight_decay, float)
    assert optimizer.momentum == 0.0 and isinstance(optimizer.momentum, float)


def test_a_model_as_first_argument_points_to_convert_to_thor_model():
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(TypeError, match="convert_to_thor_model"):
        THOR(model, 0.1, 0.9)


def test_split_indices_beyond_the_layers_fail_at_build():
    import keras

    import keras_thor

    model = keras_thor.convert_to_thor_model(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    )
    optimizer = THOR(**GOOD, split_indices=[0, 1])
    with pytest.raises(
        ValueError, match="must index one of the 1 layers with curvature"
    ):
        optimizer.build(model.trainable_variables)


def test_scalars_of_any_kind_are_floats_and_arrays_are_per_step():
    from keras_thor.schedules import PerStepSchedule

    optimizer = THOR(np.array(0.1), np.float32(0.03), 0.9)
    assert float(optimizer.learning_rate) == pytest.approx(0.1)
    assert optimizer.damping == pytest.approx(0.03)
    optimizer = THOR((0.1, 0.05), np.array([0.03, 0.02]), 0.9)
    assert isinstance(optimizer._learning_rate, PerStepSchedule)
    assert isinstance(optimizer.damping, PerStepSchedule)
    assert len(optimizer.damping) == 2


def test_bert_damping_must_stay_positive():
    from keras_thor.schedules import bert_thor_damping

    with pytest.raises(ValueError, match="`end_damping` must be > 0"):
        bert_thor_damping(end_damping=0.0)


def test_the_signature_lists_every_curvature_option_and_the_config_too():
    import dataclasses
    import inspect

    from keras_thor.src.thor.options import CurvatureOptions

    parameters = inspect.signature(THOR).parameters
    for field in dataclasses.fields(CurvatureOptions):
        assert parameters[field.name].default == field.default, field.name
    config = THOR(**GOOD, split_dim=7, kl_clip=0.5).get_config()
    assert config["split_dim"] == 7 and config["kl_clip"] == 0.5
    with pytest.raises(ValueError, match="split_dimm"):
        THOR(**GOOD, split_dimm=7)
