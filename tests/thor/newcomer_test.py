"""A newcomer's first fits: skipped updates are said, the batch size is
read from `fit` (issue 25, items 4 and 5)."""

import contextlib
import os
import warnings

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.optimizers import THOR
from tests import helpers

pytestmark = pytest.mark.thor_training

SAMPLES, BATCH = 40, 16  # a partial last batch of 8


def _data(nan_at=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    y = (x[:, :3].argmax(axis=1)).astype("int32")
    if nan_at is not None:
        x[nan_at, 0] = np.nan
    return x, y


def _model(optimizer, norm=False):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((6,)), keras.layers.Dense(8, activation="tanh")]
    if norm:
        layers.append(keras.layers.LayerNormalization())
    layers.append(keras.layers.Dense(3))
    model = keras_thor.convert_to_thor_model(keras.Sequential(layers))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _thor(**overrides):
    return THOR(
        **{"learning_rate": 0.05, "damping": 0.1, "momentum": 0.9, **overrides}
    )


def _messages(records, word):
    return [str(r.message) for r in records if word in str(r.message)]


# Skipped updates.


def test_skipped_updates_are_counted_logged_warned_and_saved(tmp_path):
    model = _model(_thor(frequency=2))
    x, y = _data(nan_at=20)  # in the second batch of each epoch
    log_dir = str(tmp_path / "logs")
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[keras.callbacks.TensorBoard(log_dir)],
        )
    assert history.history["thor_skipped_updates"] == [1.0, 2.0]
    assert np.isnan(history.history["loss"]).all()
    assert model.optimizer.skipped_updates == 2
    assert all(np.isfinite(w).all() for w in helpers.weights_of(model))
    assert len(_messages(records, "skipped the update")) == 1
    event_files = [
        os.path.join(root, name)
        for root, _, names in os.walk(log_dir)
        for name in names
    ]
    assert any(
        b"epoch_thor_skipped_updates" in open(path, "rb").read()
        for path in event_files
    )

    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras_thor.load_model(path)
    assert loaded.optimizer.skipped_updates == 2


def test_a_skip_with_no_refresh_after_it_warns_when_fit_returns():
    # Arrays give a known step count (no end of data) and no refresh step
    # follows the NaN batch: the warning comes as `fit` returns.
    model = _model(_thor(frequency=50))
    x, y = _data(nan_at=20)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert model.optimizer.skipped_updates == 1
    assert len(_messages(records, "skipped the update")) == 1


@pytest.mark.multi_device
def test_skipped_updates_on_two_replicas_are_counted_as_on_one_device():
    x, y = _data(nan_at=20)  # replica 0's share of the second batch
    histories = []
    for strategy in (None, helpers.mirrored_strategy(2)):
        scope = strategy.scope() if strategy else contextlib.nullcontext()
        with scope:
            model = _model(_thor(frequency=2, batch_size=8))
        histories.append(
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        )
    for history in histories:
        assert history.history["thor_skipped_updates"] == [1.0]
    helpers.assert_replicas_identical(model.optimizer.variables + model.weights)
    assert all(np.isfinite(w).all() for w in helpers.weights_of(model))


def test_finite_training_skips_nothing():
    model = _model(_thor(frequency=2))
    x, y = _data()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert history.history["thor_skipped_updates"] == [0.0]
    assert not _messages(records, "skipped the update")


def test_steps_a_loss_scale_optimizer_skips_are_not_counted():
    optimizer = keras.optimizers.LossScaleOptimizer(_thor(frequency=2))
    model = _model(optimizer)
    x, y = _data(nan_at=20)
    history = model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0
    )
    assert history.history["thor_skipped_updates"] == [0.0]
    assert model.optimizer.inner_optimizer.skipped_updates == 0
    assert int(model.optimizer.iterations.numpy()) == 2


# The batch size from `fit`.


def test_batch_size_is_taken_from_fit_and_saved(tmp_path):
    optimizer = _thor()
    assert optimizer.batch_size is None
    assert optimizer.get_config()["batch_size"] is None
    model = _model(optimizer, norm=True)
    x, y = _data()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert optimizer.batch_size == BATCH  # not the partial batch's 8
    assert optimizer.get_config()["batch_size"] is None
    assert not _messages(records, "per replica")

    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras_thor.load_model(path)
    assert loaded.optimizer.batch_size == BATCH
    assert loaded.optimizer.get_config()["batch_size"] is None
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        loaded.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert loaded.optimizer.batch_size == BATCH
    assert len(_messages(records, "first trained on")) == 1


def test_batch_size_from_a_dataset_without_drop_remainder():
    import tensorflow as tf

    optimizer = _thor(**THOR.RECOMMENDED)
    model = _model(optimizer, norm=True)
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    model.fit(dataset, epochs=2, verbose=0)
    assert optimizer.batch_size == BATCH


def test_a_given_batch_size_is_used_as_given_with_one_warning():
    optimizer = _thor(batch_size=32)
    model = _model(optimizer, norm=True)
    x, y = _data()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert optimizer.batch_size == 32
    assert optimizer.get_config()["batch_size"] == 32
    assert len(_messages(records, "THOR(batch_size=32)")) == 1


def test_batch_size_is_restored_by_backup_and_restore(tmp_path):
    x, y = _data()
    backup = str(tmp_path / "backup")
    model = _model(_thor())
    with pytest.raises(RuntimeError):
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[
                keras.callbacks.BackupAndRestore(backup),
                helpers.InterruptAtEpoch(1),
            ],
        )
    resumed = _model(_thor())
    # The resumed fit's first batch is smaller; the restored value wins.
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        resumed.fit(
            x,
            y,
            batch_size=8,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup)],
        )
    assert resumed.optimizer.batch_size == BATCH
    assert len(_messages(records, "first trained on")) == 1


def test_step_plan_needs_the_batch_size():
    model = _model(_thor())
    model.optimizer.build(model.trainable_variables)
    with pytest.raises(ValueError, match="batch size is not known"):
        model.optimizer.step_plan  # noqa: B018
