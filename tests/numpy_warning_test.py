"""keras_thor's training steps never read variables through NumPy's
deprecated `__array__` path (NumPy 2's `copy` keyword warning)."""

import warnings

import keras
import numpy as np
import pytest

import keras_thor
from tests import helpers

pytestmark = pytest.mark.tf_only

MESSAGE = "__array__ implementation doesn't accept a copy keyword"


def _fit_without_the_warning(model, optimizer, callbacks=()):
    model.compile(optimizer=optimizer, loss="mse")
    x, y = helpers.regression_data(samples=40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(
            x, y, batch_size=16, epochs=2, verbose=0, callbacks=list(callbacks)
        )
        model.evaluate(x, y, verbose=0)
    assert not [w for w in caught if MESSAGE in str(w.message)]
    assert all(np.isfinite(w).all() for w in helpers.weights_of(model))


def test_thor_training_step():
    _fit_without_the_warning(
        keras_thor.convert_to_thor_model(helpers.mlp()),
        keras_thor.optimizers.THOR(0.05, 0.1, 0.9, frequency=2),
    )


def test_boost_training_step():
    boost = keras_thor.boost.AutoBoost(
        "O1", {"grad_freeze": {"total_steps": 6}}
    )
    model, optimizer, callbacks = boost.network_auto_process_train(
        helpers.mlp(), keras.optimizers.SGD(0.05, momentum=0.9)
    )
    _fit_without_the_warning(model, optimizer, callbacks)


def test_asgd_with_averaged_validation():
    _fit_without_the_warning(
        helpers.mlp(),
        keras_thor.optimizers.ASGD(learning_rate=0.05, t0=1),
        [keras_thor.callbacks.SwapAveragedWeights()],
    )


def test_dim_reduce_and_group_loss_scale_steps(tmp_path):
    model = keras_thor.boost.to_boost_model(helpers.mlp())
    dimension = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    path = str(tmp_path / "P.npy")
    np.save(path, np.eye(2, dimension, dtype="float32"))
    _fit_without_the_warning(
        model,
        keras.optimizers.SGD(1.0),
        [keras_thor.callbacks.DimReduce(n_components=2, pca_mat_path=path)],
    )
    manager = keras_thor.boost.GroupLossScaleManager(8.0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8)(manager(inputs, 0, 1))
    outputs = manager(keras.layers.Dense(3)(manager(hidden, 1, 2)), 2, 3)
    network = keras.Model(inputs, outputs)
    variables = network.trainable_variables
    manager.loss_scale_groups = [variables[:2], variables[2:]]
    _fit_without_the_warning(
        keras_thor.boost.to_boost_model(network),
        keras.optimizers.SGD(0.05),
        [keras_thor.callbacks.GroupLossScale(manager)],
    )
