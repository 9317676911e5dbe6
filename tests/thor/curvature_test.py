"""THOR's curvature pieces alone, against NumPy and the reference."""

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.src.thor import block_inverse
from keras_thor.src.thor import conv_statistics
from keras_thor.src.thor import statistics
from tests.thor import reference


def _spd(rng, dim):
    m = rng.normal(size=(dim, dim))
    return (m @ m.T / dim + 0.1 * np.eye(dim)).astype("float32")


def _damped_block_inverse(factor, damping, split_dim):
    """THOR's inversion of a whole factor `(groups, d, d)`: cut, then
    damped on the factor's own diagonal."""
    groups, dim = factor.shape[0], factor.shape[-1]
    return block_inverse.damped_inverse_of_blocks(
        block_inverse.diagonal_blocks(factor, split_dim),
        damping,
        (groups, dim),
    )


def _dense_block_diagonal(blocks, dim):
    count, size = blocks.shape[0], blocks.shape[-1]
    full = np.zeros((count * size, count * size))
    for i in range(count):
        full[i * size : (i + 1) * size, i * size : (i + 1) * size] = blocks[i]
    return full[:dim, :dim]


@pytest.mark.parametrize("dim, split_dim", [(5, 8), (8, 8), (7, 3), (12, 4)])
def test_damped_block_inverse_matches_the_reference(dim, split_dim):
    rng = np.random.default_rng(dim)
    factor = _spd(rng, dim)
    blocks, fell_back = _damped_block_inverse(factor[None], 0.01, split_dim)
    assert not bool(fell_back)
    blocks = keras.ops.convert_to_numpy(blocks)
    assert (
        blocks.shape
        == (-(-dim // split_dim) if dim > split_dim else 1,)
        + (min(dim, split_dim),) * 2
    )
    expected = reference.block_inverse(
        factor.astype("float64") + 0.01 * np.eye(dim), split_dim
    )
    actual = _dense_block_diagonal(blocks, dim)
    np.testing.assert_allclose(actual, expected, rtol=2e-4, atol=1e-5)
    if split_dim >= dim:
        np.testing.assert_allclose(
            actual, np.linalg.inv(factor + 0.01 * np.eye(dim)), rtol=2e-4
        )


def test_padded_block_is_identity_beyond_the_factor():
    blocks, _ = _damped_block_inverse(np.eye(5, dtype="float32")[None], 1.0, 3)
    np.testing.assert_allclose(blocks[1][2:, 2:], [[1.0]])
    np.testing.assert_allclose(blocks[1][:2, :2], np.eye(2) / 2.0)


@pytest.mark.parametrize("dim, split_dim", [(6, 6), (7, 3), (10, 4)])
def test_block_products_equal_dense_products(dim, split_dim):
    rng = np.random.default_rng(1)
    blocks, _ = _damped_block_inverse(_spd(rng, dim)[None], 0.1, split_dim)
    dense = _dense_block_diagonal(keras.ops.convert_to_numpy(blocks), dim)
    matrix = rng.normal(size=(dim, 3)).astype("float32")
    np.testing.assert_allclose(
        block_inverse.multiply_left(blocks, matrix[None])[0],
        dense @ matrix,
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        block_inverse.multiply_right(matrix.T[None], blocks)[0],
        matrix.T @ dense,
        rtol=1e-5,
        atol=1e-6,
    )


CONVOLUTIONS = [
    dict(
        kernel_size=(3, 3), strides=(1, 1), dilation_rate=(1, 1), padding="same"
    ),
    dict(
        kernel_size=(3, 2), strides=(2, 1), dilation_rate=(1, 1), padding="same"
    ),
    dict(
        kernel_size=(2, 2),
        strides=(2, 2),
        dilation_rate=(1, 1),
        padding="valid",
    ),
    dict(
        kernel_size=(3, 3), strides=(1, 1), dilation_rate=(2, 2), padding="same"
    ),
    dict(
        kernel_size=(2, 3),
        strides=(1, 1),
        dilation_rate=(1, 2),
        padding="valid",
    ),
]


@pytest.mark.parametrize("options", CONVOLUTIONS)
def test_conv_factors_equal_brute_force_patch_statistics(options):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 7, 6, 2)).astype("float32")
    conv = keras.layers.Conv2D(4, **options)
    z = keras.ops.convert_to_numpy(conv(x))
    d = rng.normal(size=z.shape).astype("float32")
    a_sums, g_sums, rows = conv_statistics.grouped_conv_statistics(
        x, d, groups=1, **options
    )
    a_sum, g_sum = a_sums[0], g_sums[0]
    patches, (ho, wo) = reference.im2col(
        x.astype("float64"),
        options["kernel_size"],
        options["strides"],
        options["padding"],
        options["dilation_rate"],
    )
    assert (ho, wo) == z.shape[1:3]
    assert float(rows) == 3 * ho * wo
    np.testing.assert_allclose(a_sum, patches.T @ patches, rtol=1e-4, atol=1e-4)
    rows_d = d.reshape(-1, 4).astype("float64")
    np.testing.assert_allclose(g_sum, rows_d.T @ rows_d, rtol=1e-4, atol=1e-4)
    # The patches are the ones the layer multiplies by its kernel.
    kernel = keras.ops.convert_to_numpy(conv.kernel).reshape(-1, 4)
    bias = keras.ops.convert_to_numpy(conv.bias)
    np.testing.assert_allclose(
        (patches @ kernel + bias).reshape(z.shape), z, rtol=1e-4, atol=1e-5
    )


def test_embedding_statistics_are_dense_statistics_of_one_hot_ids():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 6, (4, 5)).astype("int32")
    d = rng.normal(size=(4, 5, 3)).astype("float32")
    counts, g_sum, rows = statistics.embedding_statistics(ids, d, 6)
    one_hot = np.eye(6, dtype="float32")[ids]
    a_sum, dense_g, dense_rows = statistics.dense_statistics(one_hot, d)
    np.testing.assert_allclose(counts, np.diag(a_sum))
    np.testing.assert_allclose(g_sum, dense_g, rtol=1e-6)
    assert float(rows) == float(dense_rows) == 20


@pytest.mark.thor_training
def test_one_step_lands_on_the_least_squares_solution():
    """THOR on a linear model with MSE is a scaled Gauss-Newton step.

    With full-batch statistics, damping -> 0, lr 1 and no momentum, THOR's
    step is the Gauss-Newton (here Newton) step `(XᵀX)⁻¹Xᵀr` divided by
    `2L` (`L` the loss; see tests/thor/reference_test.py), because G is
    the empirical Fisher of the residuals. At `L = 1/2` it is exactly the
    Gauss-Newton step, which lands on the least-squares solution.
    """
    rng = np.random.default_rng(4)
    x = rng.normal(size=(64, 4)).astype("float32")
    model = keras_thor.models.ThorSequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(1, use_bias=False, name="linear"),
        ]
    )
    kernel = keras.ops.convert_to_numpy(model.layers[0].kernel)
    residuals = rng.normal(size=(64, 1))
    residuals *= np.sqrt(0.5 / np.mean(residuals**2))
    y = (x @ kernel - residuals).astype("float32")
    model.compile(
        optimizer=keras_thor.optimizers.THOR(1.0, damping=1e-20, momentum=0.0),
        loss="mse",
    )
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    solution, *_ = np.linalg.lstsq(x.astype("float64"), y, rcond=None)
    np.testing.assert_allclose(
        model.layers[0].kernel, solution, rtol=1e-4, atol=1e-5
    )
