"""Evaluating with ASGD's averaged weights: callback, context, finalize."""

import keras
import numpy as np
import pytest

from keras_thor.callbacks import SwapAveragedWeights
from keras_thor.optimizers import ASGD
from keras_thor.src.backend.values import numpy_value
from tests import helpers


def _trained(epochs=3, callbacks=(), **optimizer_kwargs):
    x, y = helpers.regression_data()
    model = helpers.mlp()
    optimizer = ASGD(learning_rate=0.05, t0=2.0, **optimizer_kwargs)
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=epochs,
        shuffle=False,
        validation_data=(x[:16], y[:16]),
        callbacks=list(callbacks),
        verbose=0,
    )
    return model, history


def _averages(model):
    optimizer = model.optimizer
    return [
        numpy_value(optimizer.state_for(v)["ax"])
        for v in model.trainable_variables
    ]


def _trainable(model):
    return [numpy_value(v) for v in model.trainable_variables]


def test_validation_uses_averaged_weights_and_training_keeps_its_own():
    model, history = _trained(callbacks=[SwapAveragedWeights()])
    trained = _trainable(model)
    averages = _averages(model)
    assert not np.allclose(trained[0], averages[0])
    x, y = helpers.regression_data()
    with model.optimizer.use_averaged_weights():
        helpers.assert_all_close(_trainable(model), averages, atol=0, rtol=0)
        averaged_loss = model.evaluate(x[:16], y[:16], verbose=0)
    helpers.assert_all_close(_trainable(model), trained, atol=0, rtol=0)
    plain_loss = model.evaluate(x[:16], y[:16], verbose=0)
    assert history.history["val_loss"][-1] == pytest.approx(
        averaged_loss, rel=1e-5
    )
    assert averaged_loss != pytest.approx(plain_loss, rel=1e-4)


def test_callback_leaves_training_identical_to_no_callback():
    with_callback, _ = _trained(callbacks=[SwapAveragedWeights()])
    without, _ = _trained()
    helpers.assert_all_close(
        _trainable(with_callback), _trainable(without), atol=0, rtol=0
    )


def test_evaluate_and_predict_with_callback_use_averages():
    model, _ = _trained()
    x, _ = helpers.regression_data()
    with model.optimizer.use_averaged_weights():
        expected = model.predict(x, verbose=0)
    actual = model.predict(x, verbose=0, callbacks=[SwapAveragedWeights()])
    np.testing.assert_allclose(actual, expected, rtol=1e-6)
    assert not model.optimizer.averaged_weights_in_model


class _RecordWeights(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append(_trainable(self.model))


def test_swap_on_epoch_shows_averages_to_later_callbacks():
    recorder = _RecordWeights()
    model, _ = _trained(
        epochs=2, callbacks=[SwapAveragedWeights(swap_on_epoch=True), recorder]
    )
    helpers.assert_all_close(recorder.weights[-1], _averages(model), atol=0)
    assert not model.optimizer.averaged_weights_in_model


def test_finalize_with_average_writes_averages_at_the_end():
    model, _ = _trained(finalize_with_average=True)
    helpers.assert_all_close(_trainable(model), _averages(model), atol=0)


def test_context_manager_restores_after_an_exception():
    model, _ = _trained(epochs=1)
    trained = _trainable(model)
    with pytest.raises(KeyError):
        with model.optimizer.use_averaged_weights():
            raise KeyError("boom")
    helpers.assert_all_close(_trainable(model), trained, atol=0, rtol=0)


def test_callback_inside_the_context_restores_what_it_found():
    model, _ = _trained(epochs=1)
    averages = _averages(model)
    x, y = helpers.regression_data()
    with model.optimizer.use_averaged_weights():
        model.evaluate(x, y, verbose=0, callbacks=[SwapAveragedWeights()])
        model.predict(x, verbose=0, callbacks=[SwapAveragedWeights()])
        helpers.assert_all_close(_trainable(model), averages, atol=0)
    assert not model.optimizer.averaged_weights_in_model


def test_saved_while_swapped_knows_it_after_loading(tmp_path):
    model, _ = _trained(epochs=2)
    trained, averages = _trainable(model), _averages(model)
    with model.optimizer.use_averaged_weights():
        model.save(tmp_path / "averaged.keras")
    loaded = keras.models.load_model(tmp_path / "averaged.keras")
    assert loaded.optimizer.averaged_weights_in_model
    helpers.assert_all_close(_trainable(loaded), averages, atol=0)
    loaded.optimizer.set_averaged_weights_in_model(False)
    helpers.assert_all_close(_trainable(loaded), trained, atol=0)


def test_backup_with_averages_swapped_in_resumes_exactly(tmp_path):
    x, y = helpers.regression_data()

    def run(epochs, callbacks):
        model = helpers.mlp()
        model.compile(optimizer=ASGD(learning_rate=0.05, t0=2.0), loss="mse")
        model.fit(
            x,
            y,
            batch_size=16,
            epochs=epochs,
            shuffle=False,
            callbacks=callbacks,
            verbose=0,
        )
        return model

    reference = run(4, [SwapAveragedWeights(swap_on_epoch=True)])

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError):
        run(
            4,
            [
                SwapAveragedWeights(swap_on_epoch=True),
                keras.callbacks.BackupAndRestore(backup),
                Interrupt(),
            ],
        )
    resumed = run(
        4,
        [
            SwapAveragedWeights(swap_on_epoch=True),
            keras.callbacks.BackupAndRestore(backup),
        ],
    )
    helpers.assert_all_close(
        _trainable(resumed), _trainable(reference), atol=1e-6
    )
    helpers.assert_all_close(
        _averages(resumed), _averages(reference), atol=1e-6
    )


def test_swap_before_training_is_a_no_op():
    model = helpers.mlp()
    optimizer = ASGD()
    model.compile(optimizer=optimizer, loss="mse")
    optimizer.build(model.trainable_variables)
    before = _trainable(model)
    with optimizer.use_averaged_weights():
        helpers.assert_all_close(_trainable(model), before, atol=0)


def test_callback_requires_an_averaging_optimizer():
    model = helpers.mlp()
    model.compile(optimizer="sgd", loss="mse")
    x, y = helpers.regression_data()
    with pytest.raises(ValueError, match="averaging optimizer"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[SwapAveragedWeights()])


def test_callback_argument_is_checked():
    with pytest.raises(TypeError, match="swap_on_epoch"):
        SwapAveragedWeights(swap_on_epoch="yes")
