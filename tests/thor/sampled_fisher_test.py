"""`THOR(fisher="sampled")` in `fit` when the predictions go non-finite."""

import warnings

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.optimizers import THOR
from tests import helpers

pytestmark = pytest.mark.thor_training


@pytest.mark.parametrize(
    "loss",
    [
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.losses.CategoricalCrossentropy(from_logits=True),
    ],
)
def test_non_finite_logits_are_a_curvature_trouble_not_a_crash(loss):
    """One infinite input makes the first statistics step's logits
    non-finite: `fit` goes on, THOR counts a trouble, and the weights and
    the optimizer's state stay finite, as with the empirical Fisher."""
    base = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(4),
        ]
    )
    model = keras_thor.convert_to_thor_model(base)
    model.compile(
        optimizer=THOR(0.05, 0.05, 0.9, frequency=2, fisher="sampled"),
        loss=loss,
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 12)).astype("float32")
    y = x[:, :4].argmax(axis=1)
    if isinstance(loss, keras.losses.CategoricalCrossentropy):
        y = np.eye(4, dtype="float32")[y]
    x[3, 2] = np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert model.optimizer.curvature_troubles >= 1
    assert history.history["thor_curvature_troubles"][-1] >= 1
    assert all(np.isfinite(w).all() for w in helpers.weights_of(model))
    assert all(
        np.isfinite(v).all() for v in helpers.optimizer_state(model.optimizer)
    )
