"""Joint bias rows (`THOR(precondition_biases="joint")`) on grouped and
depthwise convolutions: the `[patches, 1]` factors against NumPy, the
kernel-and-bias matrices' layout, and training. `model.fit` against the
NumPy reference (Dense, Conv2D) is in `thor_options_reference_test`.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_thor
from keras_thor.optimizers import THOR
from keras_thor.src.thor import conv_statistics
from keras_thor.src.thor.curvature import layer_curvature
from keras_thor.src.thor.factor_inverses import block_factor_inverses
from keras_thor.src.thor.joint_bias import JointBiasKronecker


def _layer(kind):
    if kind == "grouped":
        layer = keras.layers.Conv2D(4, 3, groups=2, padding="same")
    elif kind == "depthwise":
        layer = keras.layers.DepthwiseConv2D(3, depth_multiplier=2)
    else:
        layer = keras.layers.Dense(3)
    layer.build((None, 5, 5, 2) if kind != "dense" else (None, 6))
    return layer


def _joint_block(layer):
    curvature = layer_curvature(layer)
    kernel_block = curvature.preconditioners[layer.kernel.path]
    return JointBiasKronecker(kernel_block, layer.bias)


@pytest.mark.parametrize(
    "inputs, split_dim, a_shape",
    [
        (256, 256, (1, 257, 257)),  # whole: not two 256-wide blocks
        (512, 256, (2, 257, 257)),
        (300, 256, (2, 257, 257)),
        (6, 128, (1, 7, 7)),
    ],
)
def test_the_bias_row_does_not_count_toward_split_dim(
    inputs, split_dim, a_shape
):
    layer = keras.layers.Dense(3)
    layer.build((None, inputs))
    block = _joint_block(layer)
    a_shape_of, g_shape = block.inverse_shapes(split_dim)
    assert a_shape_of == a_shape and g_shape == (1, 3, 3)
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(2 * inputs + 2, inputs + 1)).astype("float32")
    factor = rows.T @ rows / len(rows)
    statistics = (factor[None], np.eye(3, dtype="float32")[None], 1.0)
    a_blocks, _ = block.factor_blocks(statistics, split_dim)
    assert tuple(a_blocks.shape) == a_shape
    a_inverse, _, trouble = block_factor_inverses(
        *block.factor_blocks(statistics, split_dim),
        block.a_is_diagonal,
        0.01,
        np.zeros(a_shape, "float32"),
        np.zeros((1, 3, 3), "float32"),
        layouts=block.factor_layouts,
    )
    assert tuple(a_inverse.shape) == a_shape and not bool(trouble)
    size = a_shape[1]
    first = factor[:size, :size] + 0.1 * np.eye(size)
    np.testing.assert_allclose(
        ops.convert_to_numpy(a_inverse)[0],
        np.linalg.inv(first),
        rtol=2e-3,
        atol=1e-4,
    )


@pytest.mark.parametrize("kind", ["dense", "grouped", "depthwise"])
def test_kernel_and_bias_matrices_round_trip(kind):
    """With identity inverses the joint step is the gradient itself: the
    bias row sits where each group's outputs are."""
    layer = _layer(kind)
    block = _joint_block(layer)
    rng = np.random.default_rng(0)
    kernel_grad = rng.normal(size=layer.kernel.shape).astype("float32")
    bias_grad = rng.normal(size=layer.bias.shape).astype("float32")
    a_identity = np.eye(block.a_dim, dtype="float32")[None].repeat(
        block.groups, 0
    )
    g_identity = np.eye(block.g_dim, dtype="float32")[None].repeat(
        block.groups, 0
    )
    kernel_direction, bias_direction = block.precondition_pair(
        kernel_grad, bias_grad, a_identity, g_identity
    )
    np.testing.assert_allclose(
        ops.convert_to_numpy(kernel_direction), kernel_grad
    )
    np.testing.assert_allclose(ops.convert_to_numpy(bias_direction), bias_grad)
    # A bias gradient on group 1's outputs only moves group 1's row.
    if kind == "grouped":
        one_group = np.zeros(4, "float32")
        one_group[2:] = 1.0
        a_scaled = a_identity * np.array([1.0, 3.0])[:, None, None]
        _, bias_direction = block.precondition_pair(
            np.zeros_like(kernel_grad), one_group, a_scaled, g_identity
        )
        np.testing.assert_allclose(
            ops.convert_to_numpy(bias_direction), [0, 0, 3, 3]
        )


def test_grouped_patches_end_in_a_one():
    rng = np.random.default_rng(1)
    inputs = rng.normal(size=(2, 5, 5, 4)).astype("float32")
    grads = rng.normal(size=(2, 5, 5, 6)).astype("float32")
    args = ((3, 3), (1, 1), (1, 1), "same", 2)
    plain, g_plain, rows = conv_statistics.grouped_conv_statistics(
        inputs, grads, *args
    )
    joint, g_joint, _ = conv_statistics.grouped_conv_statistics(
        inputs, grads, *args, bias_row=True
    )
    plain, joint = ops.convert_to_numpy(plain), ops.convert_to_numpy(joint)
    assert joint.shape == (2, 19, 19)
    np.testing.assert_allclose(joint[:, :18, :18], plain, rtol=1e-5)
    np.testing.assert_allclose(joint[:, 18, 18], [float(rows)] * 2)
    np.testing.assert_allclose(g_joint, g_plain)
    # The last column sums each group's patch entries: channels 0-1 for
    # group 0, 2-3 for group 1 (zero padding adds nothing).
    for group in range(2):
        channels = inputs[..., 2 * group : 2 * group + 2]
        centre = joint[group, 18, 4 * 2 : 4 * 2 + 2]  # the centre tap
        np.testing.assert_allclose(
            centre, channels.sum(axis=(0, 1, 2)), rtol=1e-4
        )


@pytest.mark.thor_training
def test_joint_rows_train_a_grouped_and_depthwise_cnn():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(4, 3, groups=2, activation="relu")(inputs)
    x = keras.layers.DepthwiseConv2D(3, depth_multiplier=2)(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(3)(x)
    model = keras_thor.convert_to_thor_model(keras.Model(inputs, outputs))
    model.compile(
        optimizer=THOR(
            0.05, 0.05, 0.9, frequency=2, precondition_biases="joint"
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8, 8, 2)).astype("float32")
    y = (x[..., 0].mean(axis=(1, 2)) > 0).astype("int32")
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    thor = model.optimizer
    assert len(thor.step_plan.joint_biases) == 3
    assert thor.curvature_troubles == 0
    assert history.history["loss"][-1] < history.history["loss"][0]
