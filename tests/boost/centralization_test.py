"""Gradient centralization: the formula and MindSpore's variable choice."""

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.src.backend.values import numpy_value
from keras_thor.src.boost.centralization import centralize_gradient
from keras_thor.src.boost.centralization import centralized_variable_paths


@pytest.mark.parametrize("shape", [(32, 5), (3, 3, 16, 4), (2, 16, 7)])
def test_centralize_subtracts_the_mean_over_all_but_the_output_axis(shape):
    g = np.random.default_rng(0).normal(size=shape).astype("float32")
    expected = g - g.reshape(-1, shape[-1]).mean(axis=0)
    actual = keras.ops.convert_to_numpy(centralize_gradient(g))
    np.testing.assert_allclose(actual, expected, atol=1e-6)
    # Every output channel's gradient then sums to zero.
    np.testing.assert_allclose(
        actual.reshape(-1, shape[-1]).sum(axis=0), 0, atol=1e-5
    )


def test_mindspore_selection_rule():
    inputs = keras.Input((8, 8, 16))
    x = keras.layers.Conv2D(16, 3, name="conv")(inputs)  # fan-in 16: yes
    x = keras.layers.BatchNormalization(name="bn")(x)  # gamma/beta: no
    x = keras.layers.DepthwiseConv2D(3, name="depthwise")(x)  # no
    x = keras.layers.Conv2D(16, 1, groups=4, name="grouped")(x)  # no
    x = keras.layers.Conv2D(10, 1, name="conv_fan_in_16")(x)  # yes
    x = keras.layers.Conv2D(16, 1, name="conv_fan_in_10")(x)  # 10: no
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(32, name="dense")(x)  # fan-in 16: yes
    outputs = keras_thor.layers.FullNorm(4, name="head")(x)  # no
    model = keras.Model(inputs, outputs)
    assert centralized_variable_paths(model) == [
        "conv/kernel",
        "conv_fan_in_16/kernel",
        "dense/kernel",
    ]


@pytest.mark.tf_only
def test_optimizer_process_centralizes_the_chosen_gradients():
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(16, activation="tanh", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, name="out")(hidden)
    model = keras.Model(inputs, outputs)
    process = keras_thor.boost.OptimizerProcess(keras.optimizers.SGD(1.0))
    assert process.add_grad_centralization(model) == [
        "hidden/kernel",
        "out/kernel",
    ]
    optimizer = process.generate_new_optimizer()
    assert isinstance(optimizer, keras_thor.boost.BoostOptimizer)
    model.compile(optimizer=optimizer, loss="mse")
    x = np.random.default_rng(0).normal(size=(8, 16)).astype("float32")
    y = np.random.default_rng(1).normal(size=(8, 3)).astype("float32")
    before = [numpy_value(w) for w in model.trainable_weights]
    import tensorflow as tf

    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x))
    grads = [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]
    model.train_on_batch(x, y)  # plain Keras training step, lr 1
    after = [numpy_value(w) for w in model.trainable_weights]
    for variable, g, b, a in zip(model.trainable_weights, grads, before, after):
        if variable.path.endswith("kernel"):
            g = g - g.mean(axis=0, keepdims=True)
        np.testing.assert_allclose(b - a, g, atol=1e-5)
