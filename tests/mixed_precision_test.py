"""Every optimizer and boost algorithm under `mixed_float16` and
`mixed_bfloat16`: `fit` with a partial last batch, float32 state, and the
state through `.keras` save/load."""

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.src.backend.values import numpy_value
from tests import helpers

pytestmark = pytest.mark.tf_only

POLICIES = ["mixed_float16", "mixed_bfloat16"]


@pytest.fixture(params=POLICIES)
def policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    try:
        yield request.param
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _network():
    return helpers.mlp(features=6, outputs=3, hidden=8)


def _plain(optimizer):
    def make(tmp_path):
        return _network(), optimizer(), []

    return make


def _thor(tmp_path):
    model = keras_thor.convert_to_thor_model(_network())
    return model, keras_thor.optimizers.THOR(0.05, 0.1, 0.9, frequency=2), []


def _boost(callback):
    def make(tmp_path):
        model = keras_thor.boost.to_boost_model(_network())
        return model, keras.optimizers.SGD(0.05, momentum=0.9), [callback()]

    return make


def _accumulation(tmp_path):
    model = keras_thor.boost.to_boost_model(_network())
    optimizer = keras_thor.boost.GradientAccumulation(
        2, keras.optimizers.SGD(0.05)
    )
    return model, optimizer, []


def _dim_reduce(tmp_path):
    model = keras_thor.boost.to_boost_model(_network())
    dimension = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    rng = np.random.default_rng(0)
    components = np.linalg.qr(rng.normal(size=(dimension, 3)))[0].T
    path = str(tmp_path / "P.npy")
    np.save(path, components.astype("float32"))
    callback = keras_thor.callbacks.DimReduce(n_components=3, pca_mat_path=path)
    return model, keras.optimizers.SGD(1.0), [callback]


def _group_loss_scale(tmp_path):
    manager = keras_thor.boost.GroupLossScaleManager(2.0**10)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(manager(inputs, 0, 1))
    outputs = manager(keras.layers.Dense(3)(manager(hidden, 1, 2)), 2, 3)
    network = keras.Model(inputs, outputs)
    variables = network.trainable_variables
    manager.loss_scale_groups = [variables[:2], variables[2:]]
    model = keras_thor.boost.to_boost_model(network)
    callback = keras_thor.callbacks.GroupLossScale(manager)
    return model, keras.optimizers.SGD(0.05), [callback]


SETUPS = {
    "asgd": _plain(lambda: keras_thor.optimizers.ASGD(0.05, t0=1)),
    "sag": _plain(lambda: keras_thor.optimizers.SAG(0.05, batch_num=3)),
    "thor": _thor,
    "freeze": _boost(
        lambda: keras_thor.callbacks.GradientFreeze(
            param_groups=2, freeze_type=0, freeze_p=0.5, total_steps=10
        )
    ),
    "accumulation": _accumulation,
    "dim_reduce": _dim_reduce,
    "group_loss_scale": _group_loss_scale,
}


# Boosted setups, and whether they keep Keras's global loss scale.
BOOSTED = {
    "freeze": True,
    "accumulation": True,
    "dim_reduce": False,
    "group_loss_scale": False,
}


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_trains_with_float32_state_and_round_trips(setup, policy, tmp_path):
    model, optimizer, callbacks = SETUPS[setup](tmp_path)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = helpers.regression_data(samples=40)  # a partial last batch
    history = model.fit(
        x, y, batch_size=16, epochs=2, verbose=0, callbacks=callbacks
    )
    assert np.all(np.isfinite(history.history["loss"]))
    if setup in BOOSTED:
        # The boost step ran, with Keras's dynamic loss scale inside the
        # `BoostOptimizer` where the algorithm keeps one.
        assert int(model.optimizer.micro_steps) == 6
        scaled = isinstance(
            model.optimizer.inner_optimizer,
            keras.optimizers.LossScaleOptimizer,
        )
        assert scaled == (policy == "mixed_float16" and BOOSTED[setup])
    assert model.compute_dtype == policy.removeprefix("mixed_")
    for variable in model.weights + model.optimizer.variables:
        assert variable.dtype not in ("float16", "bfloat16"), variable.path
        if variable.dtype == "float32":
            assert np.all(np.isfinite(numpy_value(variable))), variable.path
    model.save(tmp_path / "m.keras")
    # A converted model opens converted, with its optimizer's state,
    # through keras_thor's loader.
    loaded = keras_thor.load_model(tmp_path / "m.keras")
    helpers.assert_same_training_state(loaded, model, atol=0)
