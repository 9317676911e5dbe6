"""FullNorm: MindSpore's CommonHeadLastFN formula, config and training."""

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.src.backend.values import numpy_value


def _reference(x, kernel, multiplier):
    x_hat = x / np.sqrt(np.maximum((x**2).sum(-1, keepdims=True), 1e-4))
    w_hat = kernel / np.sqrt(
        np.maximum((kernel**2).sum(0, keepdims=True), 1e-4)
    )
    return multiplier * x_hat @ w_hat


def test_formula():
    rng = np.random.default_rng(0)
    layer = keras_thor.layers.FullNorm(4)
    x = rng.normal(size=(5, 6)).astype("float32")
    x[0] = 1e-4  # below the epsilon floor
    layer.build(x.shape)
    layer.multiplier.assign(2.5)
    expected = _reference(x, numpy_value(layer.kernel), 2.5)
    actual = keras.ops.convert_to_numpy(layer(x))
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-7)


def test_config_round_trip_and_activation():
    layer = keras_thor.layers.FullNorm(3, activation="softmax", name="fn")
    clone = keras_thor.layers.FullNorm.from_config(layer.get_config())
    assert clone.units == 3 and clone.name == "fn"
    outputs = clone(np.ones((2, 4), "float32"))
    total = keras.ops.convert_to_numpy(keras.ops.sum(outputs, axis=-1))
    np.testing.assert_allclose(total, 1, rtol=1e-6)
    assert [w.name for w in clone.weights] == ["kernel", "multiplier"]


@pytest.mark.parametrize("units", [0, -1, 2.0, True])
def test_bad_units(units):
    with pytest.raises(ValueError, match="`units`.*Received: units="):
        keras_thor.layers.FullNorm(units)


def test_trains_in_fit_and_learns_its_temperature():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model = keras.Sequential(
        [keras.Input((6,)), keras_thor.layers.FullNorm(2, name="fn")]
    )
    model.compile(
        keras.optimizers.SGD(0.5),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(x, y, epochs=5, batch_size=16, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert float(model.get_layer("fn").multiplier) > 1.0
