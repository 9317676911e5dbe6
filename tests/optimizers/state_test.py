"""Config, `.keras` and BackupAndRestore round trips for every optimizer."""

import keras
import numpy as np
import pytest

from keras_thor.optimizers import ASGD
from keras_thor.optimizers import SAG
from tests import helpers

OPTIMIZERS = {
    "asgd": lambda: ASGD(
        learning_rate=0.05, lambd=0.01, t0=3.0, weight_decay=0.01
    ),
    "sag": lambda: SAG(learning_rate=0.05, batch_num=4, weight_decay=0.01),
}
BATCH = 16  # 64 samples: 4 batches an epoch, in a fixed order


def _compiled_model(make_optimizer):
    model = helpers.mlp()
    model.compile(optimizer=make_optimizer(), loss="mse")
    return model


def _fit(model, epochs, **kwargs):
    x, y = helpers.regression_data()
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        **kwargs,
    )


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_config_round_trip(name):
    optimizer = OPTIMIZERS[name]()
    config = optimizer.get_config()
    restored = type(optimizer).from_config(config)
    assert restored.get_config() == config
    serialized = keras.optimizers.serialize(optimizer)
    assert (
        serialized["registered_name"]
        == f"keras_thor>{type(optimizer).__name__}"
    )
    assert keras.optimizers.deserialize(serialized).get_config() == config


def test_config_keeps_own_weight_decay_and_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    optimizer = ASGD(learning_rate=schedule, weight_decay=0.3, maximize=True)
    restored = ASGD.from_config(optimizer.get_config())
    assert restored.weight_decay == 0.3
    assert restored.maximize is True
    assert isinstance(
        restored._learning_rate, keras.optimizers.schedules.ExponentialDecay
    )


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_keras_file_resume_equals_uninterrupted(name, tmp_path):
    reference = _compiled_model(OPTIMIZERS[name])
    _fit(reference, epochs=4)

    model = _compiled_model(OPTIMIZERS[name])
    _fit(model, epochs=2)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is type(model.optimizer)
    helpers.assert_all_close(
        helpers.optimizer_state(loaded.optimizer),
        helpers.optimizer_state(model.optimizer),
        atol=0,
        rtol=0,
    )
    _fit(loaded, epochs=2)
    helpers.assert_same_training_state(loaded, reference)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_backup_and_restore_resume_equals_uninterrupted(name, tmp_path):
    reference = _compiled_model(OPTIMIZERS[name])
    _fit(reference, epochs=4)

    resumed = helpers.resumed_after_interruption(
        lambda: _compiled_model(OPTIMIZERS[name]),
        lambda model, epochs, callbacks: _fit(
            model, epochs, callbacks=callbacks
        ),
        str(tmp_path / "backup"),
        epochs=4,
        interrupt_at=2,
    )
    assert int(resumed.optimizer.iterations) == 16
    helpers.assert_same_training_state(resumed, reference)


SLOTS = {
    "asgd": (["ax", "step_and_eta"], ["averages_in_model"]),
    "sag": (["gradient_sum", "gradient_memory", "m"], []),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_variables_are_created_in_build_in_a_fixed_order(name):
    # `.keras` files store optimizer variables by position: this order is
    # part of the file format.
    model = _compiled_model(OPTIMIZERS[name])
    model.optimizer.build(model.trainable_variables)
    per_variable, trailing = SLOTS[name]
    expected = ["iteration", "learning_rate"]
    for variable in model.trainable_variables:
        prefix = variable.path.replace("/", "_")
        expected += [f"{prefix}_{slot}" for slot in per_variable]
    expected += trailing
    assert [v.name for v in model.optimizer.variables] == expected
    _fit(model, epochs=1)
    assert len(model.optimizer.variables) == len(expected)


@pytest.mark.tf_only
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize(
    "clip", [{"clipnorm": 0.5}, {"clipvalue": 0.2}, {"global_clipnorm": 0.5}]
)
def test_sparse_gradients_are_clipped_as_their_dense_sum(name, clip):
    # TensorFlow's Embedding gradient has one row per lookup (row 1 twice);
    # torch and Paddle clip the summed, dense gradient.
    import tensorflow as tf

    values = np.array([[0.3, -0.4], [0.3, 0.1], [-0.2, 0.5]], "float32")
    sparse = tf.IndexedSlices(
        tf.constant(values), tf.constant([1, 1, 3]), tf.constant([4, 2])
    )
    results = []
    for gradient in (sparse, tf.convert_to_tensor(sparse)):
        variable = keras.Variable(np.ones((4, 2), "float32"))
        optimizer = type(OPTIMIZERS[name]())(learning_rate=0.1, **clip)
        optimizer.apply([gradient], [variable])
        results.append(variable.numpy())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)
