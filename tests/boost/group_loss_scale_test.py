"""GroupLossScaleManager and its LossScaleGroup markers: the per-segment
gradient scales against NumPy, live updates, float32 ratios, saving."""

import math

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.src.backend.values import numpy_value
from keras_thor.src.boost.group_loss_scale_manager import GroupLossScaleManager
from tests import helpers

LossScaleGroup = keras_thor.layers.LossScaleGroup


def _two_dense_model(manager):
    """x → (0,1) → Dense(tanh) → (1,2) → Dense → (2,3)."""
    inputs = keras.Input((4,))
    x = manager(inputs, 0, 1)
    x = keras.layers.Dense(3, activation="tanh", name="d1")(x)
    x = manager(x, 1, 2)
    x = keras.layers.Dense(2, name="d2")(x)
    return keras.Model(inputs, manager(x, 2, 3))


def _numpy_gradients(model, x, target):
    """Unscaled gradients of `0.5 Σ (model(x) − target)²`: dW1, dW2, dx."""
    w1, b1, w2, b2 = (
        numpy_value(w).astype("float64")
        for name in ("d1", "d2")
        for w in model.get_layer(name).weights
    )
    h = np.tanh(x @ w1 + b1)
    dy2 = h @ w2 + b2 - target
    dh1 = (dy2 @ w2.T) * (1 - h**2)
    return x.T @ dh1, h.T @ dy2, dh1 @ w1.T


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 4)).astype("float32")
    return x, rng.normal(size=(5, 2)).astype("float32")


def _tf_gradients(model, x, target):
    import tensorflow as tf

    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = 0.5 * tf.reduce_sum((model(x) - target) ** 2)
    kernels = [model.get_layer("d1").kernel, model.get_layer("d2").kernel]
    return tape.gradient(loss, [*kernels, x])


def _assert_scaled(actual, model, x, target, s1, s2):
    dw1, dw2, dx = _numpy_gradients(model, x, target)
    for got, want in zip(actual, (s1 * dw1, s2 * dw2, dx)):
        atol = 1e-6 * np.abs(want).max()
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=atol)


def test_marker_is_the_identity_forward():
    marker = LossScaleGroup(0, 1)
    x = np.arange(6, dtype="float32").reshape(2, 3)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(marker(x)), x)
    assert [w.name for w in marker.weights] == [
        "first_scale",
        "second_scale",
        "overflow_probe",
    ]
    assert marker.trainable_weights == []


@pytest.mark.tf_only
def test_segment_gradients_match_numpy():
    manager = GroupLossScaleManager(8.0)
    model = _two_dense_model(manager)
    x, target = _data()
    _assert_scaled(_tf_gradients(model, x, target), model, x, target, 1, 1)
    manager.set_loss_scale_status(2, [8.0, 256.0])
    _assert_scaled(_tf_gradients(model, x, target), model, x, target, 8, 256)
    np.testing.assert_array_equal(manager.get_loss_scale(), [8.0, 256.0])
    assert manager.get_loss_scale().dtype == np.float32
    ratios = [float(numpy_value(m.ratio())) for m in manager.markers]
    assert ratios == [1 / 8, 8 / 256, 256.0]


@pytest.mark.tf_only
def test_new_scales_take_effect_in_a_traced_function():
    import tensorflow as tf

    manager = GroupLossScaleManager(4.0)
    model = _two_dense_model(manager)
    manager.set_loss_scale_status(2, 4.0)
    x, target = _data()

    @tf.function
    def gradients(x):
        return _tf_gradients(model, x, target)

    _assert_scaled(gradients(x), model, x, target, 4, 4)
    manager.set_loss_scale_status(2, [2.0, 64.0])
    _assert_scaled(gradients(x), model, x, target, 2, 64)
    manager.assign_scales([1.0, 16.0, 0.5, 1.0])
    np.testing.assert_array_equal(numpy_value(manager.scales), [1, 16, 0.5, 1])
    _assert_scaled(gradients(x), model, x, target, 16, 0.5)
    assert gradients.experimental_get_tracing_count() == 1


@pytest.mark.tf_only
def test_ratio_in_float32_under_mixed_precision():
    import tensorflow as tf

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        manager = GroupLossScaleManager(2.0**20)
        inputs = keras.Input((3,))
        x = keras.layers.Dense(4)(inputs)
        x = manager(x, 0, 1)
        model = keras.Model(inputs, manager(keras.layers.Dense(2)(x), 1, 2))
        marker = manager.marker(0, 1)
        assert x.dtype == "float16" and marker.dtype_policy.name == "float32"
        # The scales 2^20 and 2^30 overflow float16, their ratio does not.
        manager.set_loss_scale_status(1, 2.0**20)
        manager.assign_scales([2.0**20, 2.0**30, 1.0])
        h = tf.constant([[1.0, -2.0]], "float16")
        with tf.GradientTape() as tape:
            tape.watch(h)
            y = marker(h)
        upstream = tf.fill((1, 2), tf.constant(2.0**12, "float16"))
        grad = tape.gradient(y, h, output_gradients=upstream)
        assert y.dtype == tf.float16 and grad.dtype == tf.float16
        np.testing.assert_array_equal(grad.numpy(), [[4.0, 4.0]])
        assert model(np.ones((1, 3))).dtype == "float16"
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.tf_only
def test_save_load_keeps_the_scales(tmp_path):
    manager = GroupLossScaleManager(1.0, name="glsm")
    model = _two_dense_model(manager)
    manager.set_loss_scale_status(2, [32.0, 4.0])
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert [layer.name for layer in loaded.layers[1::2]] == [
        "glsm_0_1",
        "glsm_1_2",
        "glsm_2_3",
    ]
    x, target = _data()
    _assert_scaled(_tf_gradients(loaded, x, target), loaded, x, target, 32, 4)
    again = GroupLossScaleManager.from_model(loaded, 1.0)
    assert again.name == "glsm" and again.loss_scale_number == 2
    np.testing.assert_array_equal(again.get_loss_scale(), [32.0, 4.0])
    again.set_loss_scale_status(2, 2.0)
    _assert_scaled(_tf_gradients(loaded, x, target), loaded, x, target, 2, 2)
    # No shared state between layers: a clone takes the weights in order.
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    _assert_scaled(_tf_gradients(clone, x, target), clone, x, target, 32, 4)


@pytest.mark.multi_device
def test_scales_update_in_replica_context():
    import tensorflow as tf

    strategy = helpers.mirrored_strategy(2)
    with strategy.scope():
        manager = GroupLossScaleManager(4.0)
        model = _two_dense_model(manager)
    manager.set_loss_scale_status(2, [4.0, 8.0])
    x, target = _data()

    @tf.function
    def step():
        def replica_step():
            gradients = _tf_gradients(model, x, target)
            manager.assign_scales(manager.scales * [1.0, 2.0, 0.5, 1.0])
            return gradients

        return strategy.run(replica_step)

    gradients = step()
    for replica in strategy.experimental_local_results(gradients):
        _assert_scaled(replica, model, x, target, 4, 8)
    np.testing.assert_array_equal(manager.get_loss_scale(), [8.0, 4.0])
    helpers.assert_replicas_identical(model.non_trainable_weights)


def test_configs_round_trip():
    marker = LossScaleGroup(1, 2, manager_name="m", name="m_1_2")
    clone = LossScaleGroup.from_config(marker.get_config())
    assert (clone.first, clone.second, clone.manager_name) == (1, 2, "m")
    assert clone.name == "m_1_2" and clone.dtype_policy.name == "float32"
    manager = GroupLossScaleManager([4.0, 8.0], name="m")
    again = GroupLossScaleManager.from_config(manager.get_config())
    assert again.init_loss_scale == [4.0, 8.0] and again.name == "m"
    assert manager.get_update_cell() is manager


def test_lenet_example_builds_and_groups_its_variables():
    manager = GroupLossScaleManager(4096, [])
    inputs = keras.Input((32, 32, 1))
    x = manager(inputs, 0, 1)
    for filters in (6, 16):
        x = keras.layers.Conv2D(filters, 5, activation="relu")(x)
        x = keras.layers.MaxPooling2D(2)(x)
    x = manager(keras.layers.Flatten()(x), 1, 2)
    x = keras.layers.Dense(120, activation="relu")(x)
    x = keras.layers.Dense(84, activation="relu")(x)
    model = keras.Model(inputs, manager(keras.layers.Dense(10)(x), 2, 3))
    manager(inputs, 0, 1)  # the same pair: the same marker
    assert len(manager.markers) == 3
    assert model.get_layer("group_loss_scale_1_2") is manager.marker(1, 2)
    variables = model.trainable_variables
    convs = [v for v in variables if "conv" in v.path]
    manager.loss_scale_groups = [
        convs,
        [v for v in variables if "conv" not in v.path],
    ]
    manager.set_loss_scale_status(2, manager.init_loss_scale)
    assert manager.group_of_variables(variables) == [0] * 4 + [1] * 6
    np.testing.assert_array_equal(manager.get_loss_scale(), [4096, 4096])
    assert model(np.ones((1, 32, 32, 1), "float32")).shape == (1, 10)
    with pytest.raises(ValueError, match="`.*scale.*` is in no loss scale"):
        manager.group_of_variables([manager.marker(0, 1).first_scale])


@pytest.mark.parametrize(
    "value, error",
    [
        (0, ValueError),
        (-1.0, ValueError),
        (math.inf, ValueError),
        (math.nan, ValueError),
        ([], ValueError),
        ([8.0, 0.0], ValueError),
        ("8", TypeError),
        (True, TypeError),
    ],
)
def test_bad_init_loss_scale(value, error):
    with pytest.raises(error, match="`init_loss_scale.*Received: init_loss"):
        GroupLossScaleManager(value)


def test_bad_markers_and_status():
    manager = GroupLossScaleManager(2.0)
    x = keras.Input((2,))
    with pytest.raises(ValueError, match="`first \\+ 1` = 1.*second=2"):
        manager(x, 0, 2)
    with pytest.raises(ValueError, match="`first` must be an integer >= 0"):
        manager(x, -1, 0)
    with pytest.raises(TypeError, match="`second` must be an integer"):
        LossScaleGroup(0, 1.0)
    with pytest.raises(ValueError, match="status is not set"):
        manager.get_loss_scale()
    manager(manager(x, 0, 1), 2, 3)
    with pytest.raises(ValueError, match="beyond the 1 loss scale groups"):
        manager.set_loss_scale_status(1, 2.0)
    with pytest.raises(ValueError, match="one scale per group.*length 3"):
        manager.set_loss_scale_status(2, [2.0, 2.0, 2.0])
    manager.set_loss_scale_status(2, 2.0)
    with pytest.raises(ValueError, match="beyond the 2 loss scale groups"):
        manager(x, 3, 4)
    with pytest.raises(ValueError, match="no markers for the pairs \\[\\(1"):
        manager.scales  # noqa: B018
    manager(x, 1, 2)
    with pytest.raises(ValueError, match="shape \\(4,\\)"):
        manager.assign_scales([1.0, 2.0])


def test_bad_loss_scale_groups():
    a, b = (keras.Variable(np.zeros(2), name=n) for n in ("a", "b"))
    with pytest.raises(TypeError, match="lists of `keras.Variable`s.*\\[0\\]"):
        GroupLossScaleManager(2.0, [a, b])
    with pytest.raises(TypeError, match="Received: loss_scale_groups=1.0"):
        GroupLossScaleManager(2.0, 1.0)
    with pytest.raises(TypeError, match="loss_scale_groups\\[0\\]\\[1\\]=1"):
        GroupLossScaleManager(2.0, [[a, 1.0]])
    with pytest.raises(ValueError, match="overlap.*`a` in groups 0 and 1"):
        GroupLossScaleManager(2.0, [[a], [b, a]])
    manager = GroupLossScaleManager(2.0, [[a], [b]])
    with pytest.raises(ValueError, match="2 groups.*loss_scale_number=3"):
        manager.set_loss_scale_status(3, 2.0)
    with pytest.raises(ValueError, match="`loss_scale_groups` is not set"):
        GroupLossScaleManager(2.0).group_of_variables([a])
