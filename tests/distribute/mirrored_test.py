"""ASGD and SAG under MirroredStrategy (2 and 4 replicas) equal one device
at the same global batch."""

import contextlib

import numpy as np
import pytest

import keras_thor
from keras_thor.callbacks import SwapAveragedWeights
from keras_thor.optimizers import ASGD
from keras_thor.optimizers import SAG
from keras_thor.src.backend.values import numpy_value
from tests import helpers

pytestmark = pytest.mark.multi_device

OPTIMIZERS = {
    "asgd": lambda: ASGD(learning_rate=0.05, t0=3.0, weight_decay=0.01),
    "sag": lambda: SAG(learning_rate=0.05, batch_num=4, weight_decay=0.01),
}


def _strategy(replicas):
    return helpers.mirrored_strategy(replicas)


def _model(make_optimizer, strategy=None):
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        model = helpers.mlp()
        model.compile(optimizer=make_optimizer(), loss="mse")
    return model


def _fit(model, epochs=3, callbacks=()):
    x, y = helpers.regression_data()
    return model.fit(
        x,
        y,
        batch_size=16,
        epochs=epochs,
        shuffle=False,
        validation_data=(x[:16], y[:16]),
        callbacks=list(callbacks),
        verbose=0,
    )


def _train(make_optimizer, strategy=None, callbacks=()):
    model = _model(make_optimizer, strategy)
    return model, _fit(model, callbacks=callbacks)


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_replicas_equal_one_device(name, replicas, fusion_mode):
    single, single_history = _train(OPTIMIZERS[name])
    strategy = _strategy(replicas)
    assert strategy.num_replicas_in_sync == replicas
    mirrored, mirrored_history = _train(OPTIMIZERS[name], strategy)
    np.testing.assert_allclose(
        mirrored_history.history["loss"],
        single_history.history["loss"],
        rtol=1e-5,
    )
    helpers.assert_all_close(
        helpers.weights_of(mirrored), helpers.weights_of(single), atol=1e-6
    )
    helpers.assert_all_close(
        helpers.optimizer_state(mirrored.optimizer),
        helpers.optimizer_state(single.optimizer),
        atol=1e-6,
    )
    helpers.assert_replicas_identical(
        mirrored.optimizer.variables + mirrored.weights
    )


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_backup_and_restore_resumes_as_uninterrupted(name, tmp_path):
    strategy = _strategy(2)
    reference, _ = _train(OPTIMIZERS[name], strategy)
    resumed = helpers.resumed_after_interruption(
        lambda: _model(OPTIMIZERS[name], strategy),
        _fit,
        str(tmp_path / "backup"),
        epochs=3,
        interrupt_at=2,
    )
    helpers.assert_same_training_state(resumed, reference, atol=1e-6)


def test_averaged_weights_swap_under_strategy():
    callbacks = [SwapAveragedWeights()]
    single, single_history = _train(OPTIMIZERS["asgd"], callbacks=callbacks)
    mirrored, mirrored_history = _train(
        OPTIMIZERS["asgd"], _strategy(2), callbacks=[SwapAveragedWeights()]
    )
    np.testing.assert_allclose(
        mirrored_history.history["val_loss"],
        single_history.history["val_loss"],
        rtol=1e-5,
    )
    with mirrored.optimizer.use_averaged_weights():
        helpers.assert_replicas_identical(mirrored.trainable_variables)
        averaged = helpers.weights_of(mirrored)
    helpers.assert_all_close(
        averaged,
        [np.asarray(a) for a in _averages_as_weights(mirrored)],
        atol=0,
    )


def _averages_as_weights(model):
    trainable = {id(v) for v in model.trainable_variables}
    return [
        numpy_value(
            model.optimizer.state_for(w)["ax"] if id(w) in trainable else w
        )
        for w in model.weights
    ]


@pytest.mark.parametrize(
    "option",
    [
        {"clipnorm": 1.0},
        {"clipvalue": 1.0},
        {"global_clipnorm": 1.0},
        {"gradient_accumulation_steps": 2},
    ],
)
@pytest.mark.parametrize("optimizer_class", [ASGD, SAG])
def test_options_keras_breaks_under_strategy_are_refused(
    optimizer_class, option
):
    # Keras 3.15 clips per replica before the all-reduce and cannot
    # accumulate gradients under a strategy: refuse instead of diverging.
    with _strategy(2).scope():
        model = helpers.mlp()
        model.compile(optimizer=optimizer_class(**option), loss="mse")
        name = next(iter(option))
        with pytest.raises(ValueError, match=f"cannot use {name}"):
            model.optimizer.build(model.trainable_variables)
        assert not model.optimizer.built


@pytest.mark.parametrize(
    "make",
    [
        lambda: (keras_thor.convert_to_thor_model(helpers.mlp()), ASGD(0.05)),
        lambda: (
            keras_thor.convert_to_thor_model(helpers.mlp()),
            keras_thor.optimizers.THOR(0.05, 0.1, 0.9),
        ),
        lambda: (
            keras_thor.boost.to_boost_model(helpers.mlp()),
            keras_thor.boost.BoostOptimizer(ASGD(0.05)),
        ),
    ],
)
def test_jit_compile_under_strategy_is_a_clear_error(make):
    x, y = helpers.regression_data()
    with _strategy(2).scope():
        model, optimizer = make()
        model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    for run in (
        lambda: model.fit(x, y, batch_size=16, verbose=0),
        lambda: model.evaluate(x, y, verbose=0),
    ):
        with pytest.raises(ValueError, match="`jit_compile=True` does not"):
            run()
    # Keras's prediction works there.
    assert model.predict(x, verbose=0).shape == y.shape
