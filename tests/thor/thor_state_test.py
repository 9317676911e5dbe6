"""THOR's config, `.keras` files, BackupAndRestore and tf.distribute."""

import contextlib

import keras
import numpy as np
import pytest

import keras_thor
from tests import helpers

pytestmark = pytest.mark.thor_training

STEPS_PER_EPOCH = 6


def _optimizer(**overrides):
    return keras_thor.optimizers.THOR(
        learning_rate=np.linspace(0.05, 0.02, 4 * STEPS_PER_EPOCH),
        damping=keras_thor.schedules.ThorResNetDamping(
            0.05, decay_rate=0.5, steps_per_epoch=STEPS_PER_EPOCH
        ),
        momentum=0.9,
        weight_decay=1e-3,
        frequency=4,
        split_dim=8,
        **overrides,
    )


def _model(strategy=None, **overrides):
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((12,))
        hidden = keras.layers.Dense(10, activation="tanh", name="hidden")(
            inputs
        )
        normed = keras.layers.LayerNormalization(name="norm")(hidden)
        outputs = keras.layers.Dense(4, name="logits")(normed)
        model = keras_thor.convert_to_thor_model(keras.Model(inputs, outputs))
        model.compile(
            optimizer=_optimizer(**overrides),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16 * STEPS_PER_EPOCH, 12)).astype("float32")
    return x, x[:, :4].argmax(axis=1)


def _fit(model, epochs, **kwargs):
    x, y = _data()
    return model.fit(
        x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, **kwargs
    )


def test_config_round_trip_with_schedules_and_arrays():
    optimizer = _optimizer()
    config = optimizer.get_config()
    restored = keras_thor.optimizers.THOR.from_config(config)
    assert restored.get_config() == config
    assert isinstance(
        restored._learning_rate, keras_thor.schedules.PerStepSchedule
    )
    assert isinstance(restored.damping, keras_thor.schedules.ThorResNetDamping)
    serialized = keras.optimizers.serialize(optimizer)
    assert serialized["registered_name"] == "keras_thor>THOR"
    assert keras.optimizers.deserialize(serialized).get_config() == config


def test_loss_scale_is_keras_loss_scale_factor():
    optimizer = keras_thor.optimizers.THOR(0.1, 0.1, 0.9, loss_scale=128)
    assert optimizer.loss_scale_factor == 128.0
    assert float(optimizer.scale_loss(2.0)) == 256.0
    config = optimizer.get_config()
    assert config["loss_scale"] == 128.0 and config["loss_scale_factor"] is None
    assert keras_thor.optimizers.THOR.from_config(config).loss_scale == 128.0


def test_state_is_created_in_build_in_a_fixed_order():
    model = _model()
    model.optimizer.build(model.trainable_variables)
    names = [v.name for v in model.optimizer.variables]
    assert names[0] == "iteration"  # no rate variable: it is a schedule
    momenta = [f"{v.path.replace('/', '_')}_momentum" for v in model.weights]
    assert names[1 : 1 + len(model.trainable_variables)] == [
        name for name, v in zip(momenta, model.weights) if v.trainable
    ]
    expected_tail = [
        "hidden_kernel_a_inverse",
        "hidden_kernel_g_inverse",
        "logits_kernel_a_inverse",
        "logits_kernel_g_inverse",
        "curvature_troubles",
        "skipped_updates",
        "trained_batch_size",
    ]
    assert names[-7:] == expected_tail
    shapes = {v.name: tuple(v.shape) for v in model.optimizer.variables}
    assert shapes["hidden_kernel_a_inverse"] == (2, 8, 8)  # 12 -> 2 blocks
    assert shapes["hidden_kernel_g_inverse"] == (2, 8, 8)  # 10 -> 2 blocks
    assert shapes["logits_kernel_g_inverse"] == (1, 4, 4)
    count = len(names)
    _fit(model, epochs=1)
    assert len(model.optimizer.variables) == count


def test_state_for_reads_a_block_and_refuses_other_variables():
    model = _model()
    model.optimizer.build(model.trainable_variables)
    hidden = model.get_layer("hidden")
    state = model.optimizer.state_for(hidden.kernel)
    np.testing.assert_array_equal(state.a_inverse, np.stack([np.eye(8)] * 2))
    assert state.g_inverse.shape == (2, 8, 8)
    # Options that are off leave their fields empty.
    assert state.a_factor is None and state.factor_weight is None
    assert state.last_trace is None and state.stopped is None
    with pytest.raises(ValueError, match="curvature block"):
        model.optimizer.state_for(hidden.bias)


def test_keras_file_resume_equals_uninterrupted(tmp_path):
    reference = _model()
    _fit(reference, epochs=4)

    model = _model()
    _fit(model, epochs=2)  # 12 steps: the next refresh is step 12
    path = tmp_path / "thor.keras"
    model.save(path)
    loaded = keras_thor.load_model(path)
    assert type(loaded) is type(model)
    assert type(loaded.optimizer) is keras_thor.optimizers.THOR
    helpers.assert_all_close(
        helpers.optimizer_state(loaded.optimizer),
        helpers.optimizer_state(model.optimizer),
        atol=0,
        rtol=0,
    )
    _fit(loaded, epochs=2)
    helpers.assert_all_close(
        helpers.weights_of(loaded), helpers.weights_of(reference), atol=1e-6
    )
    helpers.assert_all_close(
        helpers.optimizer_state(loaded.optimizer),
        helpers.optimizer_state(reference.optimizer),
        atol=1e-5,
    )


def test_backup_and_restore_resume_equals_uninterrupted(tmp_path):
    reference = _model()
    _fit(reference, epochs=4)
    resumed = helpers.resumed_after_interruption(
        _model,
        lambda model, epochs, callbacks: _fit(
            model, epochs, callbacks=callbacks
        ),
        str(tmp_path / "backup"),
        epochs=4,
        interrupt_at=3,
    )
    assert int(resumed.optimizer.iterations) == 4 * STEPS_PER_EPOCH
    helpers.assert_all_close(
        helpers.weights_of(resumed), helpers.weights_of(reference), atol=1e-6
    )
    helpers.assert_all_close(
        helpers.optimizer_state(resumed.optimizer),
        helpers.optimizer_state(reference.optimizer),
        atol=1e-5,
    )


def _strategy(replicas):
    return helpers.mirrored_strategy(replicas)


@pytest.mark.multi_device
def test_two_replicas_equal_one_device():
    # `batch_size` is per replica: by default the runs would take 16 and 8.
    single = _model(batch_size=8)
    single_history = _fit(single, epochs=2, validation_data=_data())
    mirrored = _model(_strategy(2), batch_size=8)
    mirrored_history = _fit(mirrored, epochs=2, validation_data=_data())
    np.testing.assert_allclose(
        mirrored_history.history["loss"],
        single_history.history["loss"],
        rtol=1e-5,
    )
    helpers.assert_all_close(
        helpers.weights_of(mirrored), helpers.weights_of(single), atol=2e-6
    )
    helpers.assert_all_close(
        helpers.optimizer_state(mirrored.optimizer),
        helpers.optimizer_state(single.optimizer),
        atol=1e-5,
        rtol=1e-5,
    )
    helpers.assert_replicas_identical(
        mirrored.optimizer.variables + mirrored.weights
    )


def _conv_model(strategy=None):
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6, 6, 2))
        x = keras.layers.Conv2D(3, 3, padding="same", activation="relu")(inputs)
        x = keras.layers.Conv2D(4, 2, strides=2)(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        outputs = keras.layers.Dense(3)(x)
        model = keras_thor.convert_to_thor_model(keras.Model(inputs, outputs))
        model.compile(
            optimizer=keras_thor.optimizers.THOR(
                0.05, 0.05, 0.9, frequency=3, split_dim=8, batch_size=8
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=2,
        )
    return model


@pytest.mark.multi_device
def test_two_replicas_equal_one_device_for_convolutions_in_chunks():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 6, 6, 2)).astype("float32")
    y = rng.integers(0, 3, 64)
    results = []
    for strategy in (None, _strategy(2)):
        model = _conv_model(strategy)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 8
        results.append(model)
    single, mirrored = results
    helpers.assert_all_close(
        helpers.weights_of(mirrored), helpers.weights_of(single), atol=2e-6
    )
    helpers.assert_all_close(
        helpers.optimizer_state(mirrored.optimizer),
        helpers.optimizer_state(single.optimizer),
        atol=1e-5,
        rtol=1e-5,
    )
