"""THOR and boost on each backend (issues 25 and 36): THOR trains on
TensorFlow and JAX, boost on TensorFlow, so `compile` refuses them
elsewhere, naming the backend and the fix; models saved compiled with them
load compiled everywhere (`predict` and `evaluate` run), and where they
train keep training where they stopped."""

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
thor_refused = pytest.mark.skipif(
    BACKEND in ("tensorflow", "jax"), reason="THOR trains on this backend"
)
thor_trains = pytest.mark.skipif(
    BACKEND not in ("tensorflow", "jax"), reason="THOR does not train here"
)


def _thor_model():
    return keras_thor.convert_to_thor_model(helpers.mlp())


def _thor():
    return THOR(0.1, damping=0.03, momentum=0.9, frequency=2)


def _boost_model():
    return keras_thor.boost.to_boost_model(helpers.mlp())


def _refusal(feature):
    if feature == "THOR":
        trains = "the TensorFlow or JAX backends only"
        fix = "Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax"
    else:
        trains = "the TensorFlow backend only"
        fix = "Set KERAS_BACKEND=tensorflow"
    return (
        f"{feature} trains on {trains} .*{fix} before importing keras. "
        f"Received: backend='{BACKEND}'"
    )


@thor_refused
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
    ours = [str(w.message) for w in caught if "KERAS_BACKEND" in str(w.message)]
    return model, ours


LOADED = [
    pytest.param("thor_default", marks=thor_refused),
    pytest.param("thor_all_options", marks=thor_refused),
    "group_loss_scale",
]


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


@thor_trains
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


_CONTINUE_ON_OTHER_BACKEND = """
import os, sys
os.environ["KERAS_BACKEND"] = sys.argv[1]
import keras, numpy as np
import keras_thor
from tests.fixtures import generate_saved_states as saved
model = keras_thor.load_model(sys.argv[2])
saved.fit(model, saved.CASES["thor_default"].data(), 1, [])
np.savez(sys.argv[3], *saved.weights_of(model), *saved.optimizer_state(model))
"""


@thor_trains
def test_file_saved_here_resumes_on_the_other_backend(tmp_path):
    import subprocess
    import sys

    other = "jax" if BACKEND == "tensorflow" else "tensorflow"
    # `make test` installs JAX only for its run on the other backends (where
    # the TensorFlow fixtures of `saved_state_test` cover this direction).
    pytest.importorskip(other)
    case = saved.CASES["thor_default"]
    model, callbacks = case.make()
    saved.fit(model, case.data(), 1, callbacks())
    path = str(tmp_path / "thor.keras")
    model.save(path)
    saved.fit(model, case.data(), 1, [])
    here = saved.weights_of(model) + saved.optimizer_state(model)

    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _CONTINUE_ON_OTHER_BACKEND,
            other,
            path,
            str(tmp_path / "there.npz"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": root, "KERAS_BACKEND": other},
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with np.load(tmp_path / "there.npz") as there:
        there = [there[f"arr_{i}"] for i in range(len(there.files))]
    assert len(there) == len(here)
    for index, (a, b) in enumerate(zip(here, there)):
        np.testing.assert_allclose(
            a, b, rtol=1e-4, atol=1e-5, err_msg=f"variable {index}"
        )
