"""THOR and boost on each backend (issue 25): they train on TensorFlow
only, so `compile` refuses them elsewhere, naming the backend and the fix;
models saved compiled with them load compiled everywhere (`predict` and
`evaluate` run), and on TensorFlow keep training where they stopped."""

import os
import warnings

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.optimizers import THOR
from tests import helpers
from tests.fixtures import generate_saved_states as saved

BACKEND = keras.backend.backend()
not_tensorflow = pytest.mark.skipif(
    BACKEND == "tensorflow", reason="the other backends' behaviour"
)
tensorflow_only = pytest.mark.tf_only
FIX = "Set KERAS_BACKEND=tensorflow before importing keras"


def _thor_model():
    return keras_thor.convert_to_thor_model(helpers.mlp())


def _thor():
    return THOR(0.1, damping=0.03, momentum=0.9, frequency=2)


def _boost_model():
    return keras_thor.boost.to_boost_model(helpers.mlp())


def _refusal(feature):
    return (
        f"{feature} trains on the TensorFlow backend only .*{FIX}. "
        f"Received: backend='{BACKEND}'"
    )


@not_tensorflow
@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "loss_scaled"])
def test_compile_with_thor_names_the_backend_and_the_fix(wrapped):
    model = _thor_model()
    optimizer = _thor()
    if wrapped:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    with pytest.raises(ValueError, match=_refusal("THOR")):
        model.compile(optimizer=optimizer, loss="mse")
    assert not model.compiled


@not_tensorflow
def test_compile_with_a_boost_optimizer_names_the_backend_and_the_fix():
    model = _boost_model()
    optimizer = keras_thor.boost.BoostOptimizer(
        keras.optimizers.SGD(0.1), grad_accumulation_step=2
    )
    with pytest.raises(ValueError, match=_refusal("A `BoostOptimizer`")):
        model.compile(optimizer, "mse")


@pytest.mark.parametrize("make", [_thor_model, _boost_model])
def test_other_optimizers_train_on_every_backend(make):
    model = make()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x, y = helpers.regression_data()
    model.fit(x, y, batch_size=24, epochs=1, verbose=0)  # 24, 24, 16
    assert int(model.optimizer.iterations) == 3


def _load(name):
    path = os.path.join(saved.DIRECTORY, f"{name}.keras")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = keras.models.load_model(path)
    ours = [str(w.message) for w in caught if "TensorFlow" in str(w.message)]
    return model, ours


LOADED = ["thor_default", "thor_all_options", "group_loss_scale"]


@not_tensorflow
@pytest.mark.parametrize("name", LOADED)
def test_saved_on_tensorflow_loads_compiled_and_predicts(name):
    model, ours = _load(name)
    feature = "A `BoostOptimizer`" if name.startswith("group") else "THOR"
    assert len(ours) == 1 and ours[0].startswith(feature), ours
    assert f"backend='{BACKEND}'" in ours[0] and "KERAS_BACKEND" in ours[0]
    assert model.compiled and int(model.optimizer.iterations) == 9
    x, y = saved.CASES[name].data()
    assert np.all(np.isfinite(model.predict(x, verbose=0)))
    assert np.all(np.isfinite(model.evaluate(x, y, verbose=0)))
    with pytest.raises(ValueError, match=_refusal(feature)):
        model.fit(x, y, epochs=1, verbose=0)


@tensorflow_only
def test_saved_thor_model_loads_compiled_and_keeps_training():
    model, ours = _load("thor_default")
    assert ours == []
    assert isinstance(model.optimizer, THOR)
    assert int(model.optimizer.iterations) == 9
    assert model.optimizer.frequency == 4
    x, y = saved.CASES["thor_default"].data()
    before = helpers.weights_of(model)
    model.fit(x, y, batch_size=saved.BATCH, epochs=1, verbose=0)
    assert int(model.optimizer.iterations) == 9 + saved.STEPS_PER_EPOCH
    after = helpers.weights_of(model)
    assert any(not np.allclose(a, b) for a, b in zip(before, after))
