"""Grouped and depthwise conv statistics against NumPy and Keras layers."""

import math

import keras
import numpy as np
import pytest

from keras_thor.src.thor import conv_statistics
from tests.thor.patches_test import brute_force_patches

# (input shape, C_out, groups, kernel_size, strides, dilation_rate, padding)
GROUPED = [
    ((2, 9, 6), 6, 3, (3,), (2,), (1,), "same"),
    ((2, 8, 4), 6, 2, (2,), (1,), (2,), "causal"),
    ((2, 7, 6, 4), 6, 2, (3, 2), (2, 1), (1, 1), "same"),
    ((2, 6, 5, 3), 6, 3, (2, 2), (1, 1), (1, 2), "valid"),
    ((2, 6, 5, 3), 4, 1, (3, 2), (2, 2), (1, 1), "same"),
    ((1, 4, 5, 4, 4), 4, 2, (2, 3, 2), (1, 2, 1), (1, 1, 1), "same"),
    # Depthwise, multiplier 2: groups = C_in, C_out = 2 C_in.
    ((2, 7, 6, 3), 6, 3, (3, 3), (2, 2), (1, 1), "same"),
]
LAYERS = {1: keras.layers.Conv1D, 2: keras.layers.Conv2D}
LAYERS[3] = keras.layers.Conv3D


def _brute_force_statistics(x, d, groups, *options):
    """Per group `Σ patchᵀpatch` and `Σ dᵀd`, in float64."""
    patches = brute_force_patches(x, *options)
    taps, c_in = patches.shape[-2:]
    patches = patches.reshape(-1, taps, groups, c_in // groups)
    d = d.astype("float64").reshape(patches.shape[0], groups, -1)
    a_sums, g_sums = [], []
    for g in range(groups):
        group = patches[:, :, g, :].reshape(patches.shape[0], -1)
        a_sums.append(group.T @ group)
        g_sums.append(d[:, g].T @ d[:, g])
    return np.stack(a_sums), np.stack(g_sums), patches.shape[0]


def _case(case):
    shape, c_out, groups, *options = case
    x = np.random.normal(size=shape).astype("float32")
    layer = LAYERS[len(shape) - 2](
        c_out,
        options[0],
        strides=options[1],
        dilation_rate=options[2],
        padding=options[3],
        groups=groups,
    )
    z = keras.ops.convert_to_numpy(layer(x))
    d = np.random.normal(size=z.shape).astype("float32")
    return x, d, groups, options


@pytest.mark.parametrize("case", GROUPED)
def test_grouped_statistics_equal_per_group_patch_sums(case):
    x, d, groups, options = _case(case)
    a_sums, g_sums, rows = conv_statistics.grouped_conv_statistics(
        x, d, *options, groups
    )
    expected_a, expected_g, expected_rows = _brute_force_statistics(
        x, d, groups, *options
    )
    assert float(rows) == expected_rows == d.size // d.shape[-1]
    np.testing.assert_allclose(a_sums, expected_a, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(g_sums, expected_g, rtol=1e-5, atol=1e-4)


def test_one_group_is_dense_statistics_of_the_patches():
    x, d, _, options = _case(GROUPED[4])
    a_sums, g_sums, rows = conv_statistics.grouped_conv_statistics(
        x, d, *options, 1
    )
    patches = brute_force_patches(x, *options).reshape(int(rows), -1)
    d = d.reshape(int(rows), -1).astype("float64")
    np.testing.assert_allclose(a_sums[0], patches.T @ patches, rtol=1e-5)
    np.testing.assert_allclose(g_sums[0], d.T @ d, rtol=1e-5)


def _grouped_outputs(patches, matrices):
    """Per-group `patch @ W_g`, output channels in group order."""
    taps, c_in = patches.shape[-2:]
    groups = matrices.shape[0]
    patches = patches.reshape(-1, taps, groups, c_in // groups)
    return np.concatenate(
        [
            patches[:, :, g, :].reshape(patches.shape[0], -1) @ matrices[g]
            for g in range(groups)
        ],
        axis=-1,
    )


@pytest.mark.parametrize(
    "make_layer, options",
    [
        (
            lambda: keras.layers.Conv2D(6, (3, 2), strides=(2, 1), groups=2),
            ((3, 2), (2, 1), (1, 1), "valid"),
        ),
        (
            lambda: keras.layers.Conv2D(4, 2, dilation_rate=2, padding="same"),
            ((2, 2), (1, 1), (2, 2), "same"),
        ),
        (
            lambda: keras.layers.DepthwiseConv2D(
                (3, 2), strides=2, padding="same", depth_multiplier=2
            ),
            ((3, 2), (2, 2), (1, 1), "same"),
        ),
        (
            lambda: keras.layers.DepthwiseConv1D(
                3, dilation_rate=2, padding="same"
            ),
            ((3,), (1,), (2,), "same"),
        ),
        (
            lambda: keras.layers.DepthwiseConv1D(
                2, strides=2, depth_multiplier=3
            ),
            ((2,), (2,), (1,), "valid"),
        ),
    ],
    ids=["grouped", "one_group", "depthwise2d", "dilated1d", "multiplier3"],
)
def test_kernel_matrices_reproduce_the_layer(make_layer, options):
    layer = make_layer()
    rank = len(options[0])
    x = np.random.normal(size=(2,) + (7,) * rank + (4,)).astype("float32")
    layer.bias_initializer = keras.initializers.RandomNormal()
    z = keras.ops.convert_to_numpy(layer(x))
    depthwise = isinstance(
        layer, (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
    )
    kernel = layer.kernel
    groups = 4 if depthwise else layer.groups
    matrices = conv_statistics.grouped_kernel_matrices(
        kernel, groups, depthwise
    )
    matrices = keras.ops.convert_to_numpy(matrices).astype("float64")
    cout_g = z.shape[-1] // groups
    assert matrices.shape == (
        groups,
        math.prod(options[0]) * 4 // groups,
        cout_g,
    )
    outputs = _grouped_outputs(brute_force_patches(x, *options), matrices)
    bias = keras.ops.convert_to_numpy(layer.bias)
    np.testing.assert_allclose(
        outputs + bias, z.reshape(outputs.shape), rtol=1e-5, atol=1e-5
    )
    back = conv_statistics.kernel_from_grouped_matrices(
        matrices, kernel.shape, groups, depthwise
    )
    np.testing.assert_array_equal(back, keras.ops.convert_to_numpy(kernel))


def test_kernel_from_grouped_matrices_inverts_the_matrices():
    for kernel_shape, groups, depthwise in [
        ((3, 2, 6), 2, False),
        ((2, 3, 2, 4), 1, False),
        ((2, 1, 2, 3, 6), 3, False),
        ((3, 5, 2), 5, True),
        ((2, 2, 2, 3, 1), 3, True),
    ]:
        kernel = np.random.normal(size=kernel_shape).astype("float32")
        matrices = conv_statistics.grouped_kernel_matrices(
            kernel, groups, depthwise
        )
        back = conv_statistics.kernel_from_grouped_matrices(
            matrices, kernel_shape, groups, depthwise
        )
        np.testing.assert_array_equal(back, kernel)
        matrices = np.random.normal(size=matrices.shape).astype("float32")
        kernel = conv_statistics.kernel_from_grouped_matrices(
            matrices, kernel_shape, groups, depthwise
        )
        np.testing.assert_array_equal(
            conv_statistics.grouped_kernel_matrices(kernel, groups, depthwise),
            matrices,
        )


def test_depthwise_kernel_needs_one_group_per_channel():
    with pytest.raises(ValueError, match="groups"):
        conv_statistics.grouped_kernel_matrices(np.zeros((3, 4, 2)), 2, True)


def test_factor_scale_is_the_root_of_the_output_positions():
    scale = conv_statistics.conv_factor_scale(np.zeros((2, 3, 4, 5, 6)))
    assert isinstance(scale, float)
    assert scale == math.sqrt(60)
    assert conv_statistics.conv_factor_scale(np.zeros((2, 7, 6))) == (
        math.sqrt(7)
    )


@pytest.mark.tf_only
def test_statistics_with_unknown_batch_and_spatial_sizes():
    import tensorflow as tf

    x, d, groups, options = _case(GROUPED[2])
    signature = [
        tf.TensorSpec([None, None, None, x.shape[-1]], "float32"),
        tf.TensorSpec([None, None, None, d.shape[-1]], "float32"),
    ]

    @tf.function(input_signature=signature)
    def statistics(inputs, grads):
        a_sums, g_sums, rows = conv_statistics.grouped_conv_statistics(
            inputs, grads, *options, groups
        )
        return a_sums, g_sums, rows, conv_statistics.conv_factor_scale(grads)

    a_sums, g_sums, rows, scale = statistics(x, d)
    expected_a, expected_g, expected_rows = _brute_force_statistics(
        x, d, groups, *options
    )
    assert float(rows) == expected_rows
    np.testing.assert_allclose(a_sums, expected_a, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(g_sums, expected_g, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(scale, math.sqrt(d.shape[1] * d.shape[2]))
