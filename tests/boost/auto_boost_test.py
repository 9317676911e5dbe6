"""AutoBoost: levels, configuration, combinations, and O1 end to end."""

import json

import keras
import numpy as np
import pytest

from keras_thor.boost import AutoBoost
from keras_thor.src.boost.boost_model import is_boost_model
from keras_thor.src.boost.less_bn import is_bypassed
from keras_thor.src.layers.full_norm import is_full_norm_head
from tests.boost import models

ALL_OFF = dict.fromkeys(
    [
        "less_bn",
        "grad_freeze",
        "adasum",
        "grad_accumulation",
        "dim_reduce",
        "loss_scale_group",
    ],
    False,
)


@pytest.mark.parametrize(
    "level, on",
    [
        ("O0", []),
        ("O1", ["less_bn", "grad_freeze"]),
        ("O2", ["less_bn", "grad_freeze", "adasum"]),
    ],
)
def test_level_presets(level, on):
    assert AutoBoost(level).flags == {**ALL_OFF, **dict.fromkeys(on, True)}


def test_modes():
    manual = AutoBoost(
        "O1", {"boost": {"mode": "manual", "grad_freeze": False}}
    )
    assert manual.flags == {**ALL_OFF, "less_bn": True}
    assert AutoBoost("O0", {"boost": {"mode": "disable_all"}}).flags == ALL_OFF
    with pytest.warns(UserWarning, match="accumulation off"):
        enabled = AutoBoost("O0", {"boost": {"mode": "enable_all"}}).flags
    # Every algorithm keras_thor runs; freezing then turns accumulation off.
    assert enabled == {
        **ALL_OFF,
        "less_bn": True,
        "grad_freeze": True,
        "adasum": True,
    }


def test_configurations_are_independent():
    first = AutoBoost("O1", {"grad_freeze": {"param_groups": 4}})
    second = AutoBoost("O2")
    assert first.level == "O1" and second.level == "O2"
    assert first.grad_freeze.param_groups == 4
    assert second.grad_freeze.param_groups == 10


def test_json_file(tmp_path):
    path = tmp_path / "boost.json"
    path.write_text(
        json.dumps(
            {
                "boost": {"mode": "manual", "grad_accumulation": True},
                "common": {"grad_accumulation_step": 3},
            }
        )
    )
    boost = AutoBoost("O0", str(path))
    assert boost.flags["grad_accumulation"]
    assert boost.grad_accumulation_step == 3


@pytest.mark.parametrize(
    "level, config, error, match",
    [
        ("O3", "", ValueError, "`level` must be one of 'O0', 'O1', 'O2'"),
        ("O1", {"boost": {"mode": "fast"}}, ValueError, "'auto', 'manual'"),
        (
            "O1",
            {"lessbn": {}},
            ValueError,
            "Unknown section 'lessbn'.*'less_bn'",
        ),
        (
            "O1",
            {"grad_freeze": {"freeze_prob": 0.5}},
            ValueError,
            "Unknown key 'freeze_prob'.*'freeze_p'",
        ),
        (
            "O1",
            {"dim_reduce": {"n_component": 32}},
            ValueError,
            "'n_components'",
        ),
        ("O1", {"less_bn": []}, TypeError, "must be a dict"),
        ("O1", 3, TypeError, "`boost_config_dict`"),
        ("O1", "/no/such/file.json", ValueError, "no such file"),
        (
            "O1",
            {"boost": {"less_bn": False}},
            ValueError,
            "only with mode='manual'",
        ),
        (
            "O0",
            {"boost": {"mode": "manual", "less_bn": 1}},
            TypeError,
            "`less_bn`",
        ),
        (
            "O0",
            {"boost": {"mode": "manual", "dim_reduce": True}},
            ValueError,
            "needs its PCA matrix",
        ),
        (
            "O0",
            {
                "boost": {
                    "mode": "manual",
                    "loss_scale_group": True,
                    "dim_reduce": True,
                }
            },
            ValueError,
            "do not combine",
        ),
        ("O1", {"grad_freeze": {"freeze_type": 2}}, ValueError, "freeze_type"),
        ("O1", {"less_bn": {"fn_flag": "yes"}}, TypeError, "`fn_flag`"),
        (
            "O0",
            {"grad_accumulation": {"grad_accumulation_step": 0}},
            ValueError,
            "grad_accumulation_step",
        ),
        ("O0", {"common": {"device_number": 0}}, ValueError, "device_number"),
    ],
)
def test_bad_configurations(level, config, error, match):
    with pytest.raises(error, match=match):
        AutoBoost(level, config)


def test_freezing_turns_accumulation_off():
    with pytest.warns(UserWarning, match="accumulation off"):
        boost = AutoBoost(
            "O1",
            {
                "boost": {"mode": "manual", "grad_accumulation": True},
                "grad_accumulation": {"grad_accumulation_step": 4},
            },
        )
    assert not boost.flags["grad_accumulation"]
    _, optimizer, _ = boost.network_auto_process_train(
        models.bottleneck_resnet(), keras.optimizers.SGD()
    )
    assert optimizer.grad_accumulation_step == 1
    assert optimizer.grad_freeze is not None


def test_o0_changes_nothing():
    model, optimizer = models.bottleneck_resnet(), keras.optimizers.SGD()
    assert AutoBoost("O0").network_auto_process_train(model, optimizer) == (
        model,
        optimizer,
        [],
    )


def test_o2_on_one_device_runs_o1_and_says_so():
    with pytest.warns(UserWarning, match="AdaSum.*make one group"):
        model, optimizer, _ = AutoBoost("O2").network_auto_process_train(
            models.bottleneck_resnet(), keras.optimizers.SGD()
        )
    assert is_boost_model(model)


def test_built_optimizer_is_refused():
    optimizer = keras.optimizers.SGD()
    optimizer.build(models.bottleneck_resnet().trainable_variables)
    with pytest.raises(ValueError, match="`optimizer` must not be built"):
        AutoBoost("O1").network_auto_process_train(
            models.bottleneck_resnet(), optimizer
        )


@pytest.mark.tf_only
def test_o1_end_to_end():
    x, y = models.image_data(64)
    boost = AutoBoost(
        "O1",
        {"grad_freeze": {"param_groups": 3, "total_steps": 40}},
    )
    model, optimizer, callbacks = boost.network_auto_process_train(
        models.bottleneck_resnet(), keras.optimizers.SGD(0.05, momentum=0.9)
    )
    assert is_boost_model(model)
    assert is_full_norm_head(model.get_layer("logits"))
    assert is_bypassed(model.get_layer("b1_1_bn"))
    assert optimizer.grad_freeze.param_groups == 3
    # Gradient centralization: kernels with fan-in a multiple of 16.
    assert sorted(optimizer.centralized_variables) == [
        "b1_0_conv/kernel",
        "b1_1_conv/kernel",
        "b2_1_conv/kernel",
        "hidden/kernel",
    ]
    model.compile(optimizer=optimizer, loss=models.LOSS, metrics=["accuracy"])
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=5,
        validation_data=(x[:16], y[:16]),
        callbacks=callbacks,
        verbose=0,
    )
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert int(optimizer.micro_steps) == 40
    evaluated = boost.network_auto_process_eval(model)
    assert evaluated is model
    assert np.isfinite(evaluated.evaluate(x, y, verbose=0)[0])


def test_eval_network_is_rewritten_when_not_yet():
    boost = AutoBoost("O1")
    model = models.bottleneck_resnet()
    evaluated = boost.network_auto_process_eval(model)
    assert evaluated is model
    assert is_bypassed(evaluated.get_layer("b1_1_bn"))


def test_eval_of_an_unrewritten_model_keeps_its_head_and_outputs():
    # MindSpore evaluates with `LessBN(network)`, fn_flag False: the BNs are
    # bypassed, the Dense head stays (fn_flag=True in the config is for
    # training).
    model = models.bottleneck_resnet()
    x, _ = models.image_data()
    expected = model.predict(x, verbose=0)
    evaluated = AutoBoost(
        "O1", {"less_bn": {"fn_flag": True}}
    ).network_auto_process_eval(model)
    assert is_bypassed(evaluated.get_layer("b1_1_bn"))
    assert not is_full_norm_head(evaluated.get_layer("logits"))
    # The bypassed BNs are untrained (moving mean 0, variance 1, gamma 1,
    # beta 0): bypassing them only drops a factor 1/sqrt(1 + epsilon).
    np.testing.assert_allclose(
        evaluated.predict(x, verbose=0), expected, rtol=0, atol=1e-3
    )


def test_eval_rewrites_a_nested_model_without_changing_its_head():
    inner = models.bottleneck_resnet()
    inputs = keras.Input((8, 8, 3))
    model = keras.Model(inputs, inner(inputs), name="outer")
    evaluated = AutoBoost("O1").network_auto_process_eval(model)
    nested = evaluated.get_layer("small_resnet")
    assert is_bypassed(nested.get_layer("b1_1_bn"))
    assert not is_full_norm_head(nested.get_layer("logits"))


def test_eval_of_a_model_rewritten_for_training_keeps_its_full_norm_head():
    boost = AutoBoost("O1")
    model, _, _ = boost.network_auto_process_train(
        models.bottleneck_resnet(), keras.optimizers.SGD(0.01)
    )
    x, _ = models.image_data()
    expected = model.predict(x, verbose=0)
    evaluated = boost.network_auto_process_eval(model)
    assert evaluated is model
    assert is_full_norm_head(evaluated.get_layer("logits"))
    np.testing.assert_array_equal(evaluated.predict(x, verbose=0), expected)
