"""BoostOptimizer as a façade over one wiring per algorithm: the argument
table, the combination rule, the train function's interface."""

import inspect

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.boost import AdaSum
from keras_thor.boost import BoostOptimizer
from keras_thor.boost import GradientFreeze
from keras_thor.src.backend.values import numpy_value
from keras_thor.src.boost import auto_boost
from keras_thor.src.boost.boost_optimizer import ALGORITHMS
from keras_thor.src.boost.boost_optimizer import wiring_of
from tests.boost import models

pytestmark = pytest.mark.tf_only


def _freeze():
    # 3 groups; continuous sequence 0 0 1 2 0 0 1 2 ...
    return GradientFreeze(
        param_groups=3, freeze_type=0, freeze_p=0.5, total_steps=10
    )


def test_the_wirings_follow_the_arguments_and_the_config():
    parameters = list(inspect.signature(BoostOptimizer).parameters)
    arguments = [cls.argument for cls in ALGORITHMS]
    assert parameters == ["inner_optimizer", *arguments, "name"]
    config = BoostOptimizer(keras.optimizers.SGD()).get_config()
    assert list(config) == ["name", "inner_optimizer", *arguments]


def test_auto_boost_reads_the_rules_of_the_wirings():
    assert auto_boost.ALONE == ("dim_reduce", "loss_scale_group")
    freezing = wiring_of(auto_boost.ARGUMENTS["grad_freeze"])
    assert freezing.refuses == (auto_boost.ARGUMENTS["grad_accumulation"],)


def test_a_refused_combination_names_both_settings():
    with pytest.raises(
        ValueError,
        match="AdaSum combines with neither.*Received: adasum=.*, "
        "grad_accumulation_step=2$",
    ):
        BoostOptimizer(
            keras.optimizers.SGD(), grad_accumulation_step=2, adasum=AdaSum()
        )
    with pytest.raises(ValueError, match="LossScaleOptimizer"):
        BoostOptimizer(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
            adasum=AdaSum(),
        )


def test_only_enabled_algorithms_are_wired():
    optimizer = BoostOptimizer(keras.optimizers.SGD(), grad_accumulation_step=2)
    assert [a.argument for a in optimizer.algorithms] == [
        "grad_accumulation_step"
    ]
    assert optimizer.algorithm("grad_freeze") is None
    assert BoostOptimizer(keras.optimizers.SGD()).algorithms == ()


def test_prepare_binds_once_and_names_each_steps_variant():
    model = keras_thor.boost.to_boost_model(models.dense_stack())
    model.compile(
        optimizer=BoostOptimizer(keras.optimizers.SGD(), grad_freeze=_freeze()),
        loss=models.LOSS,
    )
    optimizer = model.optimizer
    optimizer.prepare(model)
    count = len(optimizer.variables)
    optimizer.prepare(model)  # idempotent
    assert len(optimizer.variables) == count
    keys = [optimizer.variant_at(step) for step in range(4)]
    assert keys == [(0, True), (0, True), (1, True), (2, True)]
    x = np.zeros((4, 8), "float32")
    y = np.zeros((4,), "int64")
    before = [numpy_value(v) for v in model.trainable_variables]
    optimizer.variant_step(model, (2, True))((x, y))
    groups = optimizer.algorithm("grad_freeze").groups
    trained = {id(v) for v in groups[2]}
    for variable, value in zip(model.trainable_variables, before):
        if id(variable) not in trained:
            np.testing.assert_array_equal(numpy_value(variable), value)
    assert int(optimizer.micro_steps) == 1
