"""`conv_patches` against a NumPy loop and the Keras convolutions."""

import itertools
import math

import keras
import numpy as np
import pytest

from keras_thor.src.backend.patches import conv_patches


def _axis_geometry(size, kernel, stride, dilation, padding):
    """(output size, zeros before) of one axis, as TensorFlow pads."""
    span = (kernel - 1) * dilation + 1
    if padding == "valid":
        return -(-(size - span + 1) // stride), 0
    if padding == "causal":
        return -(-size // stride), span - 1
    output = -(-size // stride)
    return output, max((output - 1) * stride + span - size, 0) // 2


def brute_force_patches(inputs, kernel_size, strides, dilation_rate, padding):
    """`(N, *out_spatial, K, C)` float64 patches, one loop per position."""
    inputs = np.asarray(inputs, np.float64)
    spatial = inputs.shape[1:-1]
    geometry = [
        _axis_geometry(*axis, padding)
        for axis in zip(spatial, kernel_size, strides, dilation_rate)
    ]
    out_spatial = tuple(size for size, _ in geometry)
    patches = np.zeros(
        (
            inputs.shape[0],
            *out_spatial,
            math.prod(kernel_size),
            inputs.shape[-1],
        )
    )
    for position in np.ndindex(*out_spatial):
        for tap, offset in enumerate(np.ndindex(*kernel_size)):
            index = [
                p * s + k * d - before
                for p, k, s, d, (_, before) in zip(
                    position, offset, strides, dilation_rate, geometry
                )
            ]
            if all(0 <= i < size for i, size in zip(index, spatial)):
                patches[(slice(None), *position, tap)] = inputs[
                    (slice(None), *index)
                ]
    return patches


CONV_LAYERS = {1: keras.layers.Conv1D, 2: keras.layers.Conv2D}
CONV_LAYERS[3] = keras.layers.Conv3D
INPUT_SHAPES = {1: (2, 9, 3), 2: (2, 7, 6, 2), 3: (2, 5, 6, 5, 2)}

# (kernel_size, strides, dilation_rate, padding); Keras convolutions reject
# strides > 1 with dilation > 1, so those only meet the NumPy loop.
OPTIONS = [
    ((3,), (1,), (1,), "valid"),
    ((3,), (2,), (1,), "same"),
    ((4,), (2,), (1,), "same"),
    ((2,), (1,), (3,), "same"),
    ((3,), (1,), (2,), "causal"),
    ((2,), (3,), (1,), "causal"),
    ((3, 2), (2, 1), (1, 1), "same"),
    ((2, 3), (1, 1), (2, 1), "same"),
    ((3, 3), (2, 2), (1, 1), "valid"),
    ((2, 2), (1, 1), (1, 2), "valid"),
    ((2, 3, 2), (1, 2, 1), (1, 1, 1), "same"),
    ((3, 2, 2), (1, 1, 1), (2, 1, 1), "same"),
    ((2, 2, 3), (2, 1, 2), (1, 1, 1), "valid"),
    ((3, 3, 3), (2, 2, 2), (1, 1, 1), "same"),
]
STRIDED_AND_DILATED = [
    ((3,), (2,), (2,), "same"),
    ((2,), (2,), (2,), "causal"),
    ((3, 2), (2, 3), (2, 2), "same"),
    ((2, 2, 2), (2, 1, 2), (1, 2, 2), "same"),
    ((2, 2, 2), (2, 2, 1), (2, 1, 1), "valid"),
]


def _rows(patches):
    return keras.ops.convert_to_numpy(patches).reshape(-1, patches.shape[-1])


def _check_against_the_loop(x, options):
    patches = conv_patches(x, *options)
    expected = brute_force_patches(x, *options)
    assert tuple(patches.shape) == expected.shape[:-2] + (
        expected.shape[-2] * expected.shape[-1],
    )
    np.testing.assert_array_equal(
        _rows(patches), expected.reshape(-1, patches.shape[-1])
    )
    return patches


@pytest.mark.parametrize("options", STRIDED_AND_DILATED)
def test_strided_and_dilated_patches_equal_a_numpy_loop(options):
    rank = len(options[0])
    x = np.random.normal(size=INPUT_SHAPES[rank]).astype("float32")
    _check_against_the_loop(x, options)


@pytest.mark.parametrize("options", OPTIONS)
def test_patches_times_the_kernel_are_the_keras_convolution(options):
    kernel_size, strides, dilation_rate, padding = options
    rank = len(kernel_size)
    x = np.random.normal(size=INPUT_SHAPES[rank]).astype("float32")
    conv = CONV_LAYERS[rank](
        3,
        kernel_size,
        strides=strides,
        dilation_rate=dilation_rate,
        padding=padding,
        bias_initializer="random_normal",
    )
    z = keras.ops.convert_to_numpy(conv(x))
    patches = _check_against_the_loop(x, options)
    assert tuple(patches.shape) == z.shape[:-1] + (patches.shape[-1],)
    kernel = keras.ops.convert_to_numpy(conv.kernel).astype("float64")
    bias = keras.ops.convert_to_numpy(conv.bias).astype("float64")
    np.testing.assert_allclose(
        _rows(patches) @ kernel.reshape(-1, 3) + bias,
        z.reshape(-1, 3),
        rtol=1e-5,
        atol=1e-5,
    )


def test_causal_padding_is_only_for_one_dimension():
    with pytest.raises(ValueError, match="causal"):
        conv_patches(np.zeros((1, 4, 4, 1)), (2, 2), (1, 1), (1, 1), "causal")


@pytest.mark.tf_only
@pytest.mark.parametrize(
    "options",
    [
        ((3,), (2,), (1,), "causal"),
        ((3, 2), (2, 1), (1, 2), "same"),
        ((2, 3, 2), (2, 1, 1), (1, 1, 2), "same"),
    ],
)
def test_patches_with_unknown_batch_and_spatial_sizes(options):
    import tensorflow as tf

    rank = len(options[0])
    x = np.random.normal(size=INPUT_SHAPES[rank]).astype("float32")
    signature = tf.TensorSpec([None] * (rank + 1) + [x.shape[-1]], "float32")

    @tf.function(input_signature=[signature])
    def patches(inputs):
        return conv_patches(inputs, *options)

    expected = brute_force_patches(x, *options)
    np.testing.assert_array_equal(
        patches(x).numpy(), expected.reshape(*expected.shape[:-2], -1)
    )
    assert patches.get_concrete_function().structured_outputs.shape[-1] == (
        math.prod(options[0]) * x.shape[-1]
    )


def test_every_tap_and_channel_lands_once():
    # Distinct values: each patch entry names the input it copied.
    x = np.arange(1, 2 * 4 * 5 * 3 * 2 + 1, dtype="float32")
    x = x.reshape(2, 4, 5, 3, 2)
    options = ((2, 3, 2), (1, 2, 1), (1, 1, 1), "valid")
    patches = keras.ops.convert_to_numpy(conv_patches(x, *options))
    for n, i, j, k in itertools.product(*map(range, patches.shape[:4])):
        window = x[n, i : i + 2, 2 * j : 2 * j + 3, k : k + 2, :]
        np.testing.assert_array_equal(patches[n, i, j, k], window.ravel())
