"""LessBN: which BatchNormalization layers it bypasses, and the model it
changes in place (keras-hub's included)."""

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.src.backend.values import numpy_value
from keras_thor.src.boost.boost_model import is_boost_model
from keras_thor.src.boost.less_bn import is_bypassed
from keras_thor.src.layers.full_norm import is_full_norm_head
from tests.boost import models


def _bypassed(model):
    return {
        layer.name
        for layer in model.layers
        if isinstance(layer, keras.layers.BatchNormalization)
        and is_bypassed(layer)
    }


@pytest.mark.tf_only
def test_resnet50_loses_the_first_two_bns_of_every_bottleneck():
    model = keras.applications.ResNet50(
        weights=None, input_shape=(32, 32, 3), classes=10
    )
    assert keras_thor.boost.LessBN(model) is model
    blocks = {2: 3, 3: 4, 4: 6, 5: 3}
    expected = {
        f"conv{stage}_block{block}_{i}_bn"
        for stage, count in blocks.items()
        for block in range(1, count + 1)
        for i in (1, 2)
    }
    assert _bypassed(model) == expected
    assert is_boost_model(model)
    x = np.random.default_rng(0).normal(size=(2, 32, 32, 3))
    model.compile(keras.optimizers.SGD(0.01), "categorical_crossentropy")
    loss = model.train_on_batch(x, np.eye(10)[[1, 2]])
    assert np.isfinite(loss)


def test_small_resnet_both_add_orders_in_place_and_trains():
    model = models.bottleneck_resnet(main_first_in_second_block=True)
    x, y = models.image_data()
    kernel = numpy_value(model.get_layer("logits").kernel)
    before = {v.path: numpy_value(v) for v in model.weights}
    assert keras_thor.boost.LessBN(model, fn_flag=True) is model
    bypassed = {"b1_1_bn", "b1_2_bn", "b2_1_bn", "b2_2_bn"}
    assert _bypassed(model) == bypassed
    for name in bypassed:
        layer = model.get_layer(name)
        assert not layer.trainable
        np.testing.assert_allclose(
            numpy_value(layer.moving_variance), 1 - layer.epsilon
        )
    # The convolutions feed the ReLUs directly: the BN passes through.
    probe = keras.Model(
        model.input,
        [
            model.get_layer("b1_1_conv").output,
            model.get_layer("b1_1_bn").output,
        ],
    )
    conv, bn = probe.predict(x, verbose=0)
    np.testing.assert_array_equal(conv, bn)
    for variable in model.weights:
        layer_name = variable.path.split("/")[0]
        if layer_name not in bypassed and not layer_name.startswith("logits"):
            np.testing.assert_array_equal(
                numpy_value(variable), before[variable.path]
            )
    head = model.get_layer("logits")
    assert type(head) is keras.layers.Dense and is_full_norm_head(head)
    np.testing.assert_array_equal(numpy_value(head.kernel), kernel)
    assert not np.any(numpy_value(head.bias)) and not head.bias.trainable
    multiplier = head.full_norm_multiplier.multiplier
    assert float(numpy_value(multiplier)) == 1.0
    assert any(v is multiplier for v in model.trainable_variables)
    # The head computes FullNorm's cosines (MindSpore's L2Normalize floor).
    features = keras.Model(model.input, model.get_layer("hidden").output)
    h = features.predict(x, verbose=0)
    cosines = (h / np.sqrt(np.maximum((h**2).sum(-1, keepdims=True), 1e-4))) @ (
        kernel / np.sqrt(np.maximum((kernel**2).sum(0, keepdims=True), 1e-4))
    )
    np.testing.assert_allclose(model.predict(x, verbose=0), cosines, atol=1e-5)
    # Only the last Dense of the model becomes a FullNorm.
    assert not is_full_norm_head(model.get_layer("hidden"))
    model.compile(keras.optimizers.SGD(0.05), models.LOSS)
    history = model.fit(x, y, epochs=4, batch_size=8, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert float(numpy_value(multiplier)) != 1.0


def test_identity_shortcut_must_come_from_a_relu_and_basic_blocks_stay():
    inputs = keras.Input((8, 8, 16))
    # A bottleneck whose identity shortcut is the raw input: no match.
    y = inputs
    for index in (1, 2):
        y = keras.layers.Conv2D(4, 1 if index == 1 else 3, padding="same")(y)
        y = keras.layers.BatchNormalization()(y)
        y = keras.layers.ReLU()(y)
    y = keras.layers.Conv2D(16, 1)(y)
    y = keras.layers.BatchNormalization()(y)
    y = keras.layers.ReLU()(keras.layers.Add()([inputs, y]))
    # A two-convolution basic block: never matched.
    z = keras.layers.Conv2D(16, 3, padding="same")(y)
    z = keras.layers.BatchNormalization()(z)
    z = keras.layers.ReLU()(z)
    z = keras.layers.Conv2D(16, 3, padding="same")(z)
    z = keras.layers.BatchNormalization()(z)
    outputs = keras.layers.Add()([y, z])
    model = keras.Model(inputs, outputs)
    keras_thor.boost.LessBN(model)
    assert _bypassed(model) == set()


def test_sequential_and_subclassed_get_the_head_swap_only():
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, name="a"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(3, name="b"),
        ]
    )
    keras_thor.boost.LessBN(model, fn_flag=True)
    assert [is_full_norm_head(layer) for layer in model.layers] == [
        False,
        False,
        True,
    ]
    assert _bypassed(model) == set()

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(8, activation="relu")
            self.head = keras.layers.Dense(3)

        def call(self, x):
            return self.head(self.hidden(x))

    model = Subclassed()
    model(np.zeros((1, 4)))
    keras_thor.boost.LessBN(model, fn_flag=True)
    assert is_full_norm_head(model.head) and not is_full_norm_head(model.hidden)
    model.compile(keras.optimizers.SGD(0.1), models.LOSS)
    x = np.random.default_rng(0).normal(size=(9, 4))
    model.fit(x, np.arange(9) % 3, batch_size=4, verbose=0)


def test_bad_models():
    with pytest.raises(TypeError, match="`model`"):
        keras_thor.boost.LessBN("model")
    with pytest.raises(ValueError, match="must be built"):
        keras_thor.boost.LessBN(keras.Sequential([keras.layers.Dense(2)]))
    with pytest.raises(TypeError, match="`fn_flag`"):
        keras_thor.boost.LessBN(models.bottleneck_resnet(), fn_flag=1)
