"""LessBN: which BatchNormalization layers go, and the rewritten model."""

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.src.backend.values import numpy_value
from tests.boost import models


def _batch_norms(model):
    return {
        layer.name
        for layer in model.layers
        if isinstance(layer, keras.layers.BatchNormalization)
    }


def test_resnet50_loses_the_first_two_bns_of_every_bottleneck():
    model = keras.applications.ResNet50(
        weights=None, input_shape=(32, 32, 3), classes=10
    )
    rewritten = keras_thor.boost.LessBN(model)
    blocks = {2: 3, 3: 4, 4: 6, 5: 3}
    expected = {
        f"conv{stage}_block{block}_{i}_bn"
        for stage, count in blocks.items()
        for block in range(1, count + 1)
        for i in (1, 2)
    }
    assert len(_batch_norms(model)) == 53
    assert _batch_norms(model) - _batch_norms(rewritten) == expected
    assert len(_batch_norms(rewritten)) == 21
    assert isinstance(rewritten, keras_thor.models.BoostFunctional)
    # The convolutions now feed the ReLUs directly.
    relu = rewritten.get_layer("conv2_block1_1_relu")
    assert relu._inbound_nodes[0].input_tensors[0]._keras_history[0] is (
        rewritten.get_layer("conv2_block1_1_conv")
    )
    x = np.random.default_rng(0).normal(size=(2, 32, 32, 3))
    assert rewritten.predict(x, verbose=0).shape == (2, 10)
    rewritten.compile(keras.optimizers.SGD(0.01), "categorical_crossentropy")
    loss = rewritten.train_on_batch(x, np.eye(10)[[1, 2]])
    assert np.isfinite(loss)


def test_small_resnet_both_add_orders_weights_kept_and_trains():
    model = models.bottleneck_resnet(main_first_in_second_block=True)
    x, y = models.image_data()
    rewritten = keras_thor.boost.LessBN(model, fn_flag=True)
    assert _batch_norms(model) - _batch_norms(rewritten) == {
        "b1_1_bn",
        "b1_2_bn",
        "b2_1_bn",
        "b2_2_bn",
    }
    for layer in rewritten.layers:
        if layer.weights and layer.name != "logits":
            original = model.get_layer(layer.name)
            for new, old in zip(layer.get_weights(), original.get_weights()):
                np.testing.assert_array_equal(new, old)
    head = rewritten.get_layer("logits")
    assert isinstance(head, keras_thor.layers.FullNorm)
    np.testing.assert_array_equal(
        numpy_value(head.kernel),
        numpy_value(model.get_layer("logits").kernel),
    )
    assert float(head.multiplier) == 1.0
    # Only the last Dense of the model becomes a FullNorm.
    assert type(rewritten.get_layer("hidden")) is keras.layers.Dense
    rewritten.compile(keras.optimizers.SGD(0.05), models.LOSS)
    history = rewritten.fit(x, y, epochs=4, batch_size=8, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


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
    rewritten = keras_thor.boost.LessBN(model)
    assert _batch_norms(rewritten) == _batch_norms(model)


def test_sequential_gets_the_head_swap_only():
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, name="a"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(3, name="b"),
        ]
    )
    rewritten = keras_thor.boost.LessBN(model, fn_flag=True)
    assert isinstance(rewritten, keras_thor.models.BoostSequential)
    assert [type(layer).__name__ for layer in rewritten.layers] == [
        "Dense",
        "BatchNormalization",
        "FullNorm",
    ]


def test_bad_models():
    class Subclassed(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(ValueError, match="LessBN.*subclassed"):
        keras_thor.boost.LessBN(Subclassed())
    with pytest.raises(TypeError, match="`model`"):
        keras_thor.boost.LessBN("model")
    with pytest.raises(TypeError, match="`fn_flag`"):
        keras_thor.boost.LessBN(models.bottleneck_resnet(), fn_flag=1)
