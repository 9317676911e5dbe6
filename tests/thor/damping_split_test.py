"""The π-corrected damping split (`THOR(damping_split="pi")`) against
NumPy: the traces of padded and grouped blocks, `π` and its fallbacks, and
the inverses it gives per group. `model.fit` against the NumPy reference
is in `thor_options_reference_test`. Every backend.
"""

import math

import numpy as np
import pytest
from keras import ops

from keras_thor.optimizers import THOR
from keras_thor.src.thor import block_inverse
from keras_thor.src.thor import damping_split
from keras_thor.src.thor import factor_inverses
from tests.thor.curvature_options_test import _spd


def _numpy_pi(a, g):
    """`sqrt((tr A / d_A) / (tr G / d_G))` per group, in float64."""
    a, g = np.asarray(a, np.float64), np.asarray(g, np.float64)
    a_means = np.trace(a, axis1=-2, axis2=-1) / a.shape[-1]
    g_means = np.trace(g, axis1=-2, axis2=-1) / g.shape[-1]
    return np.sqrt(a_means / g_means)


@pytest.mark.parametrize("groups, dim, split_dim", [(1, 7, 3), (2, 5, 2)])
def test_group_traces_take_the_identity_padding_back_out(
    groups, dim, split_dim
):
    factors = _spd(np.random.default_rng(dim), groups, dim)
    blocks = block_inverse.diagonal_blocks(
        ops.convert_to_tensor(factors), split_dim
    )
    assert blocks.shape[0] > groups  # cut and padded
    traces = damping_split.group_traces(blocks, groups, dim)
    np.testing.assert_allclose(
        ops.convert_to_numpy(traces),
        np.trace(factors, axis1=-2, axis2=-1),
        rtol=1e-5,
    )


def test_pi_is_the_ratio_of_mean_eigenvalues_and_one_where_undefined():
    a_traces = np.array([8.0, 0.0, np.nan, 3.0, np.inf], "float32")
    g_traces = np.array([0.5, 2.0, 1.0, 0.0, 1.0], "float32")
    pi = ops.convert_to_numpy(
        damping_split.pi_correction(a_traces, g_traces, 4, 2)
    )
    np.testing.assert_allclose(
        pi, [math.sqrt((8.0 / 4) / (0.5 / 2)), 1.0, 1.0, 1.0, 1.0], rtol=1e-6
    )


def test_the_uniform_split_has_no_correction():
    assert damping_split.split_pi("uniform", None, None, 1, 3, 3) == 1.0


@pytest.mark.parametrize("averaged", [False, True])
def test_pi_inverses_damp_each_group_by_its_own_pi(averaged):
    """Two groups with different scales, cut into padded blocks."""
    rng = np.random.default_rng(4)
    groups, a_dim, g_dim, split_dim, damping = 2, 5, 3, 3, 0.04
    a = _spd(rng, groups, a_dim) * np.array([3.0, 0.2])[:, None, None]
    g = _spd(rng, groups, g_dim) * 1e-2
    pi = damping_split.split_pi(
        "pi", a.astype("float32"), g.astype("float32"), groups, a_dim, g_dim
    )
    expected_pi = _numpy_pi(a, g)
    np.testing.assert_allclose(ops.convert_to_numpy(pi), expected_pi, rtol=1e-5)
    start = [np.eye(split_dim, dtype="float32")[None].repeat(4, 0)] * 2
    start[1] = np.eye(g_dim, dtype="float32")[None].repeat(2, 0)
    if averaged:
        a_blocks = block_inverse.diagonal_blocks(a.astype("float32"), split_dim)
        g_blocks = block_inverse.diagonal_blocks(g.astype("float32"), split_dim)
        a_inverse, g_inverse, trouble = factor_inverses.block_factor_inverses(
            a_blocks, g_blocks, False, damping, *start, pi=pi
        )
    else:
        a_inverse, g_inverse, trouble = factor_inverses.block_factor_inverses(
            block_inverse.diagonal_blocks(a.astype("float32"), split_dim),
            block_inverse.diagonal_blocks(g.astype("float32"), split_dim),
            False,
            damping,
            *start,
            pi=pi,
            layouts=((groups, a_dim), (groups, g_dim)),
        )
    assert not bool(ops.convert_to_numpy(trouble))
    root = math.sqrt(damping)
    for j in range(groups):
        a_damped = a[j] + expected_pi[j] * root * np.eye(a_dim)
        g_damped = g[j] + root / expected_pi[j] * np.eye(g_dim)
        np.testing.assert_allclose(
            ops.convert_to_numpy(g_inverse)[j],
            np.linalg.inv(g_damped),
            rtol=1e-4,
        )
        # A's first block (3 of 5 rows; the second is padded).
        np.testing.assert_allclose(
            ops.convert_to_numpy(a_inverse)[2 * j],
            np.linalg.inv(a_damped[:3, :3]),
            rtol=1e-4,
        )


def test_damping_split_is_checked_and_kept_in_the_config():
    with pytest.raises(ValueError, match="damping_split.*Received: "):
        THOR(0.1, 0.1, 0.9, damping_split="kfac")
    config = THOR(0.1, 0.1, 0.9, damping_split="pi").get_config()
    assert config["damping_split"] == "pi"
    assert THOR.from_config(config).damping_split == "pi"
    assert THOR(0.1, 0.1, 0.9).damping_split == "uniform"
