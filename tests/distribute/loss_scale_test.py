"""An overflow on replica 1 alone: keras_thor's steps skip it, as one device
does; Keras's own `LossScaleOptimizer` step looks at replica 0 only."""

import contextlib

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.boost import BoostOptimizer
from keras_thor.boost import to_boost_model
from keras_thor.optimizers import ASGD
from tests import helpers

pytestmark = pytest.mark.multi_device

BATCH = 16


def _data():
    x, y = helpers.regression_data()
    # Step 1's second half: replica 1's share under 2 replicas.
    y[BATCH + BATCH // 2 + 3, 0] = np.inf
    return x, y


def _scaled(inner):
    return keras.optimizers.LossScaleOptimizer(inner, initial_scale=256.0)


MODELS = {
    "thor": lambda: (
        keras_thor.convert_to_thor_model(helpers.mlp()),
        # The same per-replica `batch_size` on one and two replicas.
        _scaled(
            keras_thor.optimizers.THOR(
                0.05, 0.1, 0.9, frequency=3, batch_size=BATCH
            )
        ),
    ),
    "asgd": lambda: (
        keras_thor.convert_to_thor_model(helpers.mlp()),
        _scaled(ASGD(learning_rate=0.05, t0=3.0)),
    ),
    "boost": lambda: (
        to_boost_model(helpers.mlp()),
        BoostOptimizer(_scaled(keras.optimizers.SGD(0.05, momentum=0.9))),
    ),
    # Decides on the all-reduced accumulation (its own path).
    "boost_accumulation": lambda: (
        to_boost_model(helpers.mlp()),
        BoostOptimizer(
            _scaled(keras.optimizers.SGD(0.05, momentum=0.9)),
            grad_accumulation_step=2,
        ),
    ),
    "keras": lambda: (
        helpers.mlp(),
        _scaled(keras.optimizers.SGD(0.05, momentum=0.9)),
    ),
    "asgd_in_keras_model": lambda: (
        helpers.mlp(),
        _scaled(ASGD(learning_rate=0.05, t0=3.0)),
    ),
}


def _train(name, strategy=None, steps=None):
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        keras.utils.set_random_seed(0)
        model, optimizer = MODELS[name]()
        model.compile(optimizer=optimizer, loss="mse")
    x, y = _data()
    if steps is not None:
        x, y = x[: steps * BATCH], y[: steps * BATCH]
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model


def _scale(model):
    optimizer = model.optimizer
    if isinstance(optimizer, BoostOptimizer):
        optimizer = optimizer.inner_optimizer
    return float(optimizer.dynamic_scale.numpy())


@pytest.mark.parametrize(
    "name", ["thor", "asgd", "boost", "boost_accumulation"]
)
def test_overflow_on_one_replica_is_skipped_as_on_one_device(name):
    single = _train(name)
    mirrored = _train(name, helpers.mirrored_strategy(2))
    assert _scale(single) == 128.0
    assert _scale(mirrored) == 128.0
    assert all(np.isfinite(w).all() for w in helpers.weights_of(mirrored))
    helpers.assert_same_training_state(mirrored, single, atol=1e-5)


def test_keras_own_step_lets_it_through():
    # Why keras_thor's models mend the step (Keras 3.15).
    mirrored = _train("keras", helpers.mirrored_strategy(2), steps=2)
    assert _scale(mirrored) == 256.0
    assert not all(np.isfinite(w).all() for w in helpers.weights_of(mirrored))


def test_asgd_in_a_keras_model_keeps_its_weights_finite():
    # Keras's step decides from replica 0; ASGD's own guard skips the
    # all-reduced non-finite gradient, but the scale is not lowered: a
    # keras_thor model class (above) is needed for that.
    mirrored = _train("asgd_in_keras_model", helpers.mirrored_strategy(2))
    assert _scale(mirrored) == 256.0
    assert all(np.isfinite(w).all() for w in helpers.weights_of(mirrored))
    state = helpers.optimizer_state(mirrored.optimizer)
    assert all(np.isfinite(v).all() for v in state)
