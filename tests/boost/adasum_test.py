"""AdaSum's operator: Horovod's property tests and a NumPy tree reference."""

import keras
import numpy as np
import pytest

from keras_thor.boost import AdaSum
from keras_thor.src.boost.adasum import adasum_pair
from keras_thor.src.boost.adasum import adasum_tree


def _reference_pair(a, b):
    """Horovod's `adasum_reference_operation` (float64)."""
    dot = np.dot(a.ravel(), b.ravel())
    a_squared, b_squared = (
        np.dot(a.ravel(), a.ravel()),
        np.dot(b.ravel(), b.ravel()),
    )
    a_coefficient = 1 - dot / a_squared / 2 if a_squared != 0 else 1
    b_coefficient = 1 - dot / b_squared / 2 if b_squared != 0 else 1
    return a_coefficient * a + b_coefficient * b


def _reference_tree(tensors):
    """Horovod's `reference_tree_reduction`, level by level."""
    level = [t.astype(np.float64) for t in tensors]
    while len(level) > 1:
        level = [
            _reference_pair(level[2 * i], level[2 * i + 1])
            for i in range(len(level) // 2)
        ]
    return level[0]


def _numpy(x):
    return keras.ops.convert_to_numpy(x)


@pytest.mark.parametrize("count", [2, 4, 8])
@pytest.mark.parametrize("shape", [(2, 2), (37,), (3, 5, 7)])
def test_tree_equals_numpy_reference(count, shape):
    rng = np.random.default_rng(count)
    tensors = [rng.normal(size=shape).astype("float32") for _ in range(count)]
    actual = _numpy(
        adasum_tree([keras.ops.convert_to_tensor(t) for t in tensors])
    )
    np.testing.assert_allclose(
        actual, _reference_tree(tensors), rtol=2e-5, atol=2e-6
    )


@pytest.mark.parametrize("size", [3, 2 * 20 - 17, 2 * 2 + 1])
def test_orthogonal_vectors_sum(size):
    q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(size, size)))
    columns = [q[:, i].astype("float32") for i in range(2)]
    actual = _numpy(adasum_pair(*columns))
    np.testing.assert_allclose(actual, columns[0] + columns[1], atol=1e-6)


def test_parallel_vectors_average():
    v = np.random.default_rng(1).normal(size=(19,)).astype("float32")
    tensors = [v * c for c in (0.5, 2.0, 3.0, 1.5)]
    actual = _numpy(adasum_tree(tensors))
    np.testing.assert_allclose(actual, np.mean(tensors, axis=0), rtol=1e-5)


# Squares of 1e-30 underflow and of 1e30 overflow in float32: the naive
# formula gives 0/0 or inf/inf there.
@pytest.mark.parametrize("magnitude", [1e-30, 1.0, 1e30])
def test_tiny_and_huge_magnitudes(magnitude):
    rng = np.random.default_rng(2)
    a = (rng.normal(size=(2**10 + 3,)) * magnitude).astype("float32")
    b = (rng.normal(size=(2**10 + 3,)) * magnitude).astype("float32")
    expected = _reference_pair(a.astype(np.float64), b.astype(np.float64))
    actual = _numpy(adasum_pair(a, b)).astype(np.float64)
    assert np.all(np.isfinite(actual))
    error = np.linalg.norm(expected - actual) / np.linalg.norm(expected)
    assert error < 1e-5


def test_spread_magnitudes_and_zeros():
    rng = np.random.default_rng(3)
    a = (rng.normal(size=(50,)) * np.logspace(-30, 18, 50)).astype("float32")
    zeros = np.zeros_like(a)
    np.testing.assert_allclose(_numpy(adasum_pair(a, zeros)), a, rtol=1e-6)
    expected = _reference_pair(a.astype(np.float64), 2.0 * a)
    np.testing.assert_allclose(
        _numpy(adasum_pair(a, 2 * a)), expected, rtol=1e-5
    )


@pytest.mark.parametrize(
    "replicas, device_number, groups",
    [(2, 1, 2), (4, 1, 4), (4, 2, 2), (8, 2, 4)],
)
def test_group_count(replicas, device_number, groups):
    assert AdaSum(device_number).group_count(replicas) == groups


@pytest.mark.parametrize(
    "replicas, device_number", [(1, 1), (3, 1), (4, 4), (6, 2), (4, 3)]
)
def test_group_count_must_be_a_power_of_two(replicas, device_number):
    with pytest.raises(ValueError, match="power-of-two"):
        AdaSum(device_number).group_count(replicas)


def test_bad_device_number():
    with pytest.raises(ValueError, match="`device_number`"):
        AdaSum(0)
