"""THOR schedules against NumPy transcriptions of MindSpore's generators."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_thor.schedules import ThorResNetDamping
from keras_thor.schedules import ThorResNetLearningRate
from keras_thor.schedules import bert_thor_damping
from keras_thor.schedules import bert_thor_learning_rate


def mindspore_get_thor_lr(
    lr_init, decay, total_epochs, steps_per_epoch, decay_epochs=100
):
    """`official/cv/ResNet/src/lr_generator.py::get_thor_lr`, as written."""
    lr_each_step = []
    for i in range(steps_per_epoch * total_epochs):
        epoch = (i + 1) / steps_per_epoch
        base = 1.0 - float(epoch) / total_epochs
        lr_local = lr_init * base**decay
        if epoch >= decay_epochs:
            lr_local = lr_local * 0.5
        if epoch >= decay_epochs + 1:
            lr_local = lr_local * 0.5
        lr_each_step.append(lr_local)
    return np.array(lr_each_step, dtype=np.float32)


def mindspore_get_thor_damping(
    damping_init, decay_rate, total_epochs, steps_per_epoch
):
    """`official/cv/ResNet/src/lr_generator.py::get_thor_damping`."""
    damping_each_step = []
    for step in range(steps_per_epoch * total_epochs):
        epoch = (step + 1) / steps_per_epoch
        damping_here = damping_init * (decay_rate ** (epoch / 10))
        damping_each_step.append(damping_here)
    return np.array(damping_each_step, dtype=np.float32)


def _evaluate(schedule, steps):
    return ops.convert_to_numpy(schedule(ops.arange(steps)))


@pytest.mark.parametrize(
    "lr_init, decay, total_epochs, steps_per_epoch, decay_epochs",
    [
        (0.05672, 4.9687, 50, 7, 39),  # MindSpore's GPU recipe, short epochs
        (0.05803, 4.0839, 53, 5, 39),  # its Ascend recipe
        (0.1, 2.0, 6, 4, 100),  # default decay_epochs: no halving
        (0.1, 1.0, 6, 3, 2),  # both halvings inside the run
    ],
)
def test_resnet_learning_rate_matches_mindspore(
    lr_init, decay, total_epochs, steps_per_epoch, decay_epochs
):
    expected = mindspore_get_thor_lr(
        lr_init, decay, total_epochs, steps_per_epoch, decay_epochs
    )
    schedule = ThorResNetLearningRate(
        lr_init, decay, total_epochs, steps_per_epoch, decay_epochs
    )
    actual = _evaluate(schedule, len(expected))
    np.testing.assert_allclose(actual, expected, rtol=2e-5, atol=1e-9)


def test_resnet_learning_rate_is_zero_after_total_epochs():
    schedule = ThorResNetLearningRate(0.1, 2.0, 2, 3)
    np.testing.assert_array_equal(_evaluate(schedule, 10)[5:], 0.0)


@pytest.mark.parametrize(
    "damping_init, decay_rate, total_epochs, steps_per_epoch",
    [(0.02345, 0.5467, 70, 5), (0.03, 0.50036, 70, 3), (0.05, 0.87, 10, 11)],
)
def test_resnet_damping_matches_mindspore(
    damping_init, decay_rate, total_epochs, steps_per_epoch
):
    expected = mindspore_get_thor_damping(
        damping_init, decay_rate, total_epochs, steps_per_epoch
    )
    schedule = ThorResNetDamping(damping_init, decay_rate, steps_per_epoch)
    actual = _evaluate(schedule, len(expected))
    np.testing.assert_allclose(actual, expected, rtol=2e-5)


def test_bert_schedules_are_mindspore_poly():
    steps = np.arange(0, 30000, 997)
    lr = bert_thor_learning_rate(0.006464, 1e-6, 2.0, 30000)
    damping = bert_thor_damping(0.007035, 1e-6, 4.0, 30000)
    for schedule, (high, low, power) in (
        (lr, (0.006464, 1e-6, 2.0)),
        (damping, (0.007035, 1e-6, 4.0)),
    ):
        expected = (high - low) * (1 - steps / 30000) ** power + low
        np.testing.assert_allclose(
            ops.convert_to_numpy(schedule(steps)), expected, rtol=1e-5
        )


@pytest.mark.parametrize(
    "schedule",
    [
        ThorResNetLearningRate(0.05, 4.0, 50, 100, 39),
        ThorResNetDamping(0.03, 0.5, 100),
    ],
    ids=["learning_rate", "damping"],
)
def test_serialization_round_trip(schedule):
    restored = type(schedule).from_config(schedule.get_config())
    np.testing.assert_allclose(
        _evaluate(restored, 300), _evaluate(schedule, 300), rtol=0
    )
    serialized = keras.optimizers.schedules.serialize(schedule)
    assert serialized["registered_name"].startswith("keras_thor>")
    again = keras.optimizers.schedules.deserialize(serialized)
    assert again.get_config() == schedule.get_config()


def test_drives_an_optimizer_in_fit():
    from tests import helpers

    x, y = helpers.regression_data()
    model = helpers.mlp()
    schedule = ThorResNetLearningRate(0.05, 2.0, 3, 4, decay_epochs=1)
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert float(model.optimizer.learning_rate) == pytest.approx(
        float(schedule(8)), rel=1e-6
    )


@pytest.mark.parametrize(
    "cls, kwargs, error",
    [
        (ThorResNetLearningRate, {"initial_learning_rate": "a"}, TypeError),
        (ThorResNetLearningRate, {"decay": -1.0}, ValueError),
        (ThorResNetLearningRate, {"total_epochs": 0}, ValueError),
        (ThorResNetLearningRate, {"steps_per_epoch": 2.5}, TypeError),
        (ThorResNetLearningRate, {"steps_per_epoch": 0}, ValueError),
        (ThorResNetDamping, {"initial_damping": 0.0}, ValueError),
        (ThorResNetDamping, {"decay_rate": None}, TypeError),
        (ThorResNetDamping, {"steps_per_epoch": True}, TypeError),
    ],
)
def test_bad_arguments(cls, kwargs, error):
    defaults = {
        ThorResNetLearningRate: {
            "initial_learning_rate": 0.1,
            "decay": 2.0,
            "total_epochs": 10,
            "steps_per_epoch": 5,
        },
        ThorResNetDamping: {
            "initial_damping": 0.03,
            "decay_rate": 0.5,
            "steps_per_epoch": 5,
        },
    }[cls]
    ((argument, value),) = kwargs.items()
    with pytest.raises(error, match=f"Argument `{argument}`.*{argument}="):
        cls(**{**defaults, **kwargs})
