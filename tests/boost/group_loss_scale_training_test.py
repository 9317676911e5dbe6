"""Group loss scaling in `fit`: the GroupLossScale callback and AutoBoost's
`loss_scale_group`, against plain training, under `mixed_float16`, with
overflows, save/load and MirroredStrategy."""

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.boost import AutoBoost
from keras_thor.boost import GroupLossScaleManager
from keras_thor.callbacks import GroupLossScale
from keras_thor.src.backend.values import numpy_value
from tests import helpers
from tests.boost.models import segmented_network

pytestmark = pytest.mark.tf_only

GROWTH = 2.0 ** (1 / 1000)
BACKOFF = 2.0**-0.5


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _data(samples=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 6)).astype("float32")
    y = (x[:, :1] - 0.5 * x[:, 1:2]).astype("float32")
    return x, y


def _compiled(init, small=None, optimizer=None):
    manager = GroupLossScaleManager(init)
    model = keras_thor.boost.to_boost_model(segmented_network(manager, small))
    model.compile(optimizer or keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    return model, manager


def _trained(model):
    return [numpy_value(v) for v in model.trainable_variables]


def _fit(model, x, y, callbacks, epochs=2):
    return model.fit(
        x,
        y,
        batch_size=16,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )


def test_unscaled_training_equals_plain_training():
    # Powers of two at first, then MindSpore's growth every step: the
    # gradients are unscaled by the scales the backward pass ran at.
    x, y = _data()
    plain, _ = _compiled(1.0)
    _fit(plain, x, y, [])
    model, manager = _compiled([4.0, 1024.0])
    history = _fit(model, x, y, [GroupLossScale(manager)])
    helpers.assert_all_close(_trained(model), _trained(plain), 2e-6)
    steps = 6  # 40 examples in batches of 16, twice
    # The user's manager follows the rebuilt model that trained.
    assert model.optimizer.group_loss_scale.manager is manager
    np.testing.assert_allclose(
        manager.get_loss_scale(),
        [4.0 * GROWTH**steps, 1024.0 * GROWTH**steps],
        rtol=1e-6,
    )
    assert history.history["group_1_loss_scale"][-1] == pytest.approx(
        1024.0 * GROWTH**steps, rel=1e-6
    )
    assert history.history["group_0_overflows"] == [0.0, 0.0]


def test_overflowing_step_is_skipped_and_the_group_backs_off():
    x, y = _data()
    x, y = 100.0 * x[:16], y[:16]
    # Group 1's weight gradients (large activations times a gradient at
    # 1e37) overflow float32; the gradient reaching group 0 does not.
    model, manager = _compiled([4.0, 1e37])
    callback = GroupLossScale(manager)
    weights = _trained(model)
    history = _fit(model, x, y, [callback], epochs=1)
    assert int(model.optimizer.iterations) == 0  # skipped
    helpers.assert_all_close(_trained(model), weights, 0, 0)
    np.testing.assert_allclose(
        callback.manager.get_loss_scale(),
        [4.0 * GROWTH, 1e37 * BACKOFF],
        rtol=1e-6,
    )
    assert history.history["group_1_overflows"] == [1.0]
    assert history.history["group_0_overflows"] == [0.0]
    # It backs off until the step goes through.
    for _ in range(200):
        _fit(model, x, y, [callback], epochs=1)
        if int(model.optimizer.iterations) > 0:
            break
    assert int(model.optimizer.iterations) == 1
    overflows = numpy_value(
        model.optimizer.algorithm("group_loss_scale").overflows
    )
    np.testing.assert_allclose(
        callback.manager.get_loss_scale()[1],
        1e37 * BACKOFF ** overflows[1] * GROWTH,
        rtol=1e-4,
    )


def _front_momentum(model):
    sgd = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    index = [v.path for v in model.trainable_variables].index("front/kernel")
    return numpy_value(sgd.momentums[index])


def test_global_scale_loses_a_segment_that_group_scales_train(
    mixed_float16,
):
    x, y = _data(16)
    keras.mixed_precision.set_global_policy("float32")
    exact, _ = _compiled(1.0, small=1e-6)
    _fit(exact, x, y, [], epochs=1)
    expected = _front_momentum(exact)  # −lr·g after one step, float32
    keras.mixed_precision.set_global_policy("mixed_float16")
    # One global scale (Keras's LossScaleOptimizer, 2^15): the front's
    # gradient is 1e-12 of the head's and underflows float16.
    model, _ = _compiled(1.0, small=1e-6)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    _fit(model, x, y, [], epochs=1)
    assert np.abs(expected).min() > 0
    np.testing.assert_array_equal(_front_momentum(model), 0.0)
    # Group scales: the front's backward runs 2^20 higher.
    model, manager = _compiled([2.0**35, 2.0**15], small=1e-6)
    history = _fit(model, x, y, [GroupLossScale(manager)], epochs=1)
    assert not isinstance(
        model.optimizer.inner_optimizer, keras.optimizers.LossScaleOptimizer
    )
    # float16 holds 1e-6 as 1.013e-6: the two factors give 2.7% more.
    np.testing.assert_allclose(_front_momentum(model), expected, rtol=4e-2)
    assert history.history["group_0_overflows"] == [0.0]


def test_lenet_example_trains_under_mixed_float16(mixed_float16):
    manager = GroupLossScaleManager(4096.0)
    inputs = keras.Input((12, 12, 1))
    x = manager(inputs, 0, 1)
    x = keras.layers.Conv2D(4, 3, activation="relu", name="conv1")(x)
    x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Conv2D(8, 3, activation="relu", name="conv2")(x)
    x = manager(keras.layers.Flatten()(x), 1, 2)
    x = keras.layers.Dense(16, activation="relu", name="fc1")(x)
    outputs = manager(keras.layers.Dense(3, name="fc2")(x), 2, 3)
    network = keras.Model(inputs, outputs)
    variables = network.trainable_variables
    manager.loss_scale_groups = [variables[:4], variables[4:]]
    boost = AutoBoost(
        "O0", {"boost": {"mode": "manual", "loss_scale_group": True}}
    )
    model, optimizer, callbacks = boost.network_auto_process_train(
        network, keras.optimizers.SGD(0.05), loss_scale_manager=manager
    )
    model.compile(optimizer, "sparse_categorical_crossentropy")
    assert model.optimizer is optimizer  # not wrapped in a loss scale
    rng = np.random.default_rng(0)
    images = rng.normal(size=(36, 12, 12, 1)).astype("float32")
    labels = rng.integers(0, 3, 36)
    history = model.fit(
        images, labels, batch_size=8, epochs=3, verbose=0, callbacks=callbacks
    )
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    scales = history.history["group_0_loss_scale"]
    assert np.all(np.isfinite(scales)) and min(scales) > 0


def test_save_load_resumes_as_uninterrupted(tmp_path):
    x, y = _data()
    reference, manager = _compiled([4.0, 64.0])
    _fit(reference, x, y, [GroupLossScale(manager)], epochs=3)
    model, manager = _compiled([4.0, 64.0])
    _fit(model, x, y, [GroupLossScale(manager)], epochs=2)
    model.save(tmp_path / "m.keras")
    loaded = keras_thor.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer.group_loss_scale, GroupLossScale)
    _fit(loaded, x, y, [], epochs=1)
    helpers.assert_same_training_state(loaded, reference, atol=1e-6)


def test_backup_and_restore_resumes_as_uninterrupted(tmp_path):
    x, y = _data()
    reference, manager = _compiled([4.0, 64.0])
    _fit(reference, x, y, [GroupLossScale(manager)], epochs=3)

    def make():
        model, make.manager = _compiled([4.0, 64.0])
        return model

    def fit(model, epochs, callbacks):
        _fit(model, x, y, [GroupLossScale(make.manager), *callbacks], epochs)

    resumed = helpers.resumed_after_interruption(
        make, fit, str(tmp_path / "backup"), epochs=3, interrupt_at=2
    )
    helpers.assert_same_training_state(resumed, reference, atol=1e-6)


@pytest.mark.multi_device
def test_mirrored_strategy_equals_one_device():
    x, y = _data()
    single, manager = _compiled([4.0, 64.0])
    _fit(single, x, y, [GroupLossScale(manager)])
    with helpers.mirrored_strategy(2).scope():
        mirrored, manager = _compiled([4.0, 64.0])
    _fit(mirrored, x, y, [GroupLossScale(manager)])
    helpers.assert_same_training_state(mirrored, single, atol=1e-5)


def test_bad_groups_and_combinations():
    x, y = _data()
    model, manager = _compiled(4.0)
    front_kernel = model.get_layer("front").kernel
    manager.loss_scale_groups = [
        [front_kernel],
        [v for v in model.trainable_variables if v is not front_kernel][:2],
    ]
    with pytest.raises(ValueError, match="in no loss scale group"):
        _fit(model, x, y, [GroupLossScale(manager)])
    with pytest.raises(ValueError, match="replaces the global loss scale"):
        keras_thor.boost.BoostOptimizer(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
            group_loss_scale=GroupLossScale(
                manager_name="m", init_loss_scale=1.0, group_paths=[["a"]]
            ),
        )
    with pytest.raises(ValueError, match="loss_scale_manager"):
        AutoBoost(
            "O0", {"boost": {"mode": "manual", "loss_scale_group": True}}
        ).network_auto_process_train(model, keras.optimizers.SGD())
    with pytest.raises(ValueError, match="`growth_factor`"):
        GroupLossScale(manager, growth_factor=0.5)
    with pytest.raises(TypeError, match="`manager`"):
        GroupLossScale("manager")


def test_an_overflow_passed_on_by_a_segment_is_charged_to_it():
    # The head's input gradient (δ·W, W = 1e10) overflows at scale 1e20
    # while its kernel gradient (x·δ) does not: the marker's probe charges
    # the overflow to the head's group, which backs off until its
    # segment's gradients are finite again (else it would grow for ever).
    manager = GroupLossScaleManager([1.0, 1e20])
    inputs = keras.Input((6,))
    x = keras.layers.Dense(4, name="front")(manager(inputs, 0, 1))
    head = keras.layers.Dense(
        1, name="head", kernel_initializer=keras.initializers.Constant(1e10)
    )
    network = keras.Model(inputs, manager(head(manager(x, 1, 2)), 2, 3))
    variables = network.trainable_variables
    manager.loss_scale_groups = [variables[:2], variables[2:]]
    model = keras_thor.boost.to_boost_model(network)
    model.compile(keras.optimizers.SGD(1e-30), "mse")
    callback = GroupLossScale(manager)
    x_data, y_data = _data(16)
    history = _fit(model, x_data, y_data, [callback], epochs=1)
    assert history.history["group_1_overflows"] == [1.0]
    assert manager.get_loss_scale()[1] == pytest.approx(1e20 * BACKOFF)
    for _ in range(12):
        _fit(model, x_data, y_data, [callback], epochs=1)
    assert int(model.optimizer.iterations) > 0
    assert manager.get_loss_scale()[1] < 3e19


@pytest.mark.multi_device
def test_one_replica_strategy_equals_no_strategy():
    # Under a strategy a skipped step is undone, not branched around.
    x, y = _data()
    x, y = 100.0 * x[:16], y[:16]
    single, manager = _compiled([4.0, 1e37])
    _fit(single, x, y, [GroupLossScale(manager)], epochs=3)
    with helpers.mirrored_strategy(1).scope():
        mirrored, manager = _compiled([4.0, 1e37])
    _fit(mirrored, x, y, [GroupLossScale(manager)], epochs=3)
    assert numpy_value(mirrored.optimizer.iterations) < 3  # one skipped
    helpers.assert_same_training_state(mirrored, single, atol=1e-6)
