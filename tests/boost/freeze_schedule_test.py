"""Gradient freezing's groups and index sequences against MindSpore's code."""

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.src.boost import freeze_schedule
from tests.boost import mindspore_freeze_reference as mindspore


@pytest.mark.parametrize("groups", [1, 2, 3, 10, 17])
@pytest.mark.parametrize("freeze_type", [0, 1])
@pytest.mark.parametrize("freeze_p", [0.0, 0.3, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("total_steps", [1, 50, 3000])
def test_sequence_equals_mindspore(groups, freeze_type, freeze_p, total_steps):
    if freeze_type == 0 and freeze_p == 1.0 and groups > 1:
        # MindSpore divides by zero; keras_thor trains everything.
        expected = [0] * int(total_steps * 1.01)
    else:
        expected = mindspore.generate_freeze_index_sequence(
            groups, freeze_type, freeze_p, total_steps, seed=7
        )
    actual = freeze_schedule.freeze_index_sequence(
        groups, freeze_type, freeze_p, total_steps, 7
    )
    np.testing.assert_array_equal(actual, expected)


def test_default_sequence_statistics():
    sequence = (
        keras_thor.boost.GradientFreeze().generate_freeze_index_sequence()
    )
    assert len(sequence) == int(65536 * 1.01)
    # freeze_p is the fraction of steps that train every group.
    assert abs(np.mean(sequence == 0) - 0.7) < 1e-3
    frozen = sequence[sequence > 0]
    frequencies = np.bincount(frozen, minlength=10)[1:] / len(frozen)
    expected = np.arange(9, 0, -1) / 45  # P(k) = (n - k) / (n(n-1)/2)
    np.testing.assert_allclose(frequencies, expected, atol=0.01)


def test_sequence_is_reproducible_and_seeded():
    first = keras_thor.boost.GradientFreeze(seed=3)
    again = keras_thor.boost.GradientFreeze(seed=3)
    other = keras_thor.boost.GradientFreeze(seed=4)
    np.testing.assert_array_equal(
        first.generate_freeze_index_sequence(),
        again.generate_freeze_index_sequence(),
    )
    assert not np.array_equal(
        first.generate_freeze_index_sequence(),
        other.generate_freeze_index_sequence(),
    )


NAMES = [
    "conv1.weight",
    "bn1.gamma",
    "bn1.beta",
    "conv2.weight",
    "conv2.bias",
    "x",
    "y",
    "z",
    "w",
    "fc.bias",
] * 3


@pytest.mark.parametrize("groups", [1, 2, 3, 5, 40])
def test_groups_equal_mindspore(groups):
    attaches = [("bn" in n or "bias" in n) for n in NAMES]
    units = freeze_schedule.layer_units(attaches)
    actual = [
        [NAMES[i] for i in group]
        for group in freeze_schedule.suffix_groups(units, groups)
    ]
    assert actual == mindspore.split_parameters_groups(NAMES, groups)


def test_resnet50_groups_equal_mindspore_on_its_names():
    model = keras.applications.ResNet50(
        weights=None, input_shape=(32, 32, 3), classes=10
    )
    freeze = keras_thor.boost.GradientFreeze(param_groups=10)
    groups = freeze.split_parameters_groups(model)
    paths = [v.path for v in model.trainable_variables]
    expected = mindspore.split_parameters_groups(paths, 10)
    assert [[v.path for v in group] for group in groups] == expected
    assert len(groups[0]) == len(paths)
    for shorter, longer in zip(groups[1:], groups):
        assert len(shorter) < len(longer)
        assert [v.path for v in shorter] == paths[-len(shorter) :]


def test_keras_normalization_weights_stay_with_their_layer():
    stack = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(4, use_bias=False, name="a"),
            keras.layers.LayerNormalization(name="norm"),
            keras.layers.Dense(4, use_bias=False, name="c"),
            keras.layers.Dense(4, use_bias=False, name="d"),
            keras.layers.Dense(4, use_bias=False, name="e"),
            keras.layers.Dense(4, use_bias=False, name="f"),
        ]
    )
    freeze = keras_thor.boost.GradientFreeze(param_groups=2)
    groups = freeze.split_parameters_groups(stack)
    # Units: [a, norm/gamma, norm/beta], [c, d, e], [f].
    assert len(groups[0]) == 7
    assert [v.path.split("/")[-2] for v in groups[1]] == ["c", "d", "e", "f"]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"param_groups": 0}, ValueError, "param_groups"),
        ({"param_groups": 2.0}, TypeError, "param_groups"),
        ({"freeze_type": 2}, ValueError, "freeze_type"),
        ({"freeze_type": True}, TypeError, "freeze_type"),
        ({"freeze_p": 1.5}, ValueError, "freeze_p"),
        ({"freeze_p": -0.1}, ValueError, "freeze_p"),
        ({"freeze_p": "0.7"}, TypeError, "freeze_p"),
        ({"total_steps": 0}, ValueError, "total_steps"),
        ({"seed": -1}, ValueError, "seed"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=f"`{match}`.*Received: {match}="):
        keras_thor.boost.GradientFreeze(**kwargs)
