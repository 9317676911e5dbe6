"""THOR's curvature options alone: the pure functions against NumPy, the
sampled Fisher's targets, and the argument checks.

The factor averaging, the block inverses, the guard scale, the loss kinds
and the argument checks run on every backend; the sampled targets (seeded
stateless draws) and the fallback of a failed factorization run where THOR
trains (torch raises on a failed factorization in eager mode).
"""

import math

import keras
import numpy as np
import pytest
from keras import ops

from keras_thor.optimizers import THOR
from keras_thor.src.thor import block_inverse
from keras_thor.src.thor import factor_averaging
from keras_thor.src.thor import factor_inverses
from keras_thor.src.thor import kl_guard
from keras_thor.src.thor import sampled_fisher
from tests import helpers

thor_training = pytest.mark.thor_training


@pytest.fixture(autouse=True)
def _seeded():
    """tests/conftest.py's seeding without its `clear_session` (a garbage
    collection, 0.2 s a test): no test here builds a model or a layer."""
    keras.utils.set_random_seed(0)
    np.random.seed(0)
    yield


def _np(value):
    return np.asarray(ops.convert_to_numpy(value), np.float64)


def _tensors(*arrays):
    """THOR passes its variables: tensors, not NumPy arrays."""
    return [ops.convert_to_tensor(a) for a in arrays]


def _spd(rng, count, size, ridge=0.1):
    m = rng.normal(size=(count, size, size))
    blocks = m @ np.swapaxes(m, 1, 2) / size + ridge * np.eye(size)
    return blocks.astype("float32")


# Factor averaging.


@pytest.mark.parametrize("decay", [0.0, 0.95])
def test_moving_average_is_the_normalized_decayed_sum(decay):
    rng = np.random.default_rng(0)
    factors = [rng.normal(size=(2, 3, 3)).astype("float32") for _ in range(6)]
    weight = ops.convert_to_tensor(0.0, "float32")  # THOR's W_0
    average = ops.zeros((2, 3, 3), "float32")
    for k in range(1, len(factors) + 1):
        weight = factor_averaging.average_weight(weight, decay)
        average = factor_averaging.averaged_factor(
            average, factors[k - 1], weight
        )
        powers = [decay ** (k - i) for i in range(1, k + 1)]
        expected = sum(p * f for p, f in zip(powers, factors[:k])) / sum(powers)
        np.testing.assert_allclose(_np(weight), sum(powers), rtol=1e-6)
        np.testing.assert_allclose(_np(average), expected, atol=1e-5)
        if k == 1 or decay == 0.0:
            # No start from zero: the first average is the first factor,
            # and α = 0 keeps the newest one only (MindSpore's rule).
            np.testing.assert_allclose(_np(average), factors[k - 1], atol=1e-6)


def test_moving_average_keeps_the_averages_dtype():
    average = ops.zeros((3,), "float32")
    new = np.array([1.0, 2.0, 3.0], "float64")
    result = factor_averaging.averaged_factor(average, new, 1.0)
    assert keras.backend.standardize_dtype(result.dtype) == "float32"
    np.testing.assert_allclose(_np(result), new)


# Inverses of stored blocks.


def test_damped_inverse_of_blocks_is_numpy_inverse():
    blocks = _spd(np.random.default_rng(1), 3, 4)
    inverse, fell_back = block_inverse.damped_inverse_of_blocks(blocks, 0.2)
    assert not bool(_np(fell_back))
    expected = np.linalg.inv(blocks.astype("float64") + 0.2 * np.eye(4))
    np.testing.assert_allclose(_np(inverse), expected, rtol=2e-4, atol=1e-5)


@thor_training
def test_damped_inverse_of_blocks_falls_back_on_a_non_definite_block():
    # One block not positive definite: every block is inverted with the
    # mean diagonal of all the blocks added to the damping.
    spd = _spd(np.random.default_rng(2), 1, 3)[0]
    indefinite = np.diag([1.0, -1e-3, 2.0]).astype("float32")
    blocks = np.stack([indefinite, spd])
    inverse, fell_back = block_inverse.damped_inverse_of_blocks(blocks, 1e-6)
    assert bool(_np(fell_back))
    shift = 1e-6 + abs(np.mean(np.diagonal(blocks, axis1=1, axis2=2)))
    expected = np.linalg.inv(blocks.astype("float64") + shift * np.eye(3))
    np.testing.assert_allclose(_np(inverse), expected, rtol=1e-4, atol=1e-6)


def test_block_factor_inverses_are_numpy_inverses():
    rng = np.random.default_rng(3)
    a_blocks, g_blocks = _spd(rng, 2, 3), _spd(rng, 1, 4)
    damping = 0.04
    previous_a, previous_g = np.zeros_like(a_blocks), np.zeros_like(g_blocks)
    a_inverse, g_inverse, trouble = factor_inverses.block_factor_inverses(
        *_tensors(a_blocks, g_blocks),
        False,
        damping,
        *_tensors(previous_a, previous_g),
    )
    assert not bool(_np(trouble))
    root = math.sqrt(damping)
    for actual, blocks in ((a_inverse, a_blocks), (g_inverse, g_blocks)):
        size = blocks.shape[-1]
        expected = np.linalg.inv(blocks.astype("float64") + root * np.eye(size))
        np.testing.assert_allclose(_np(actual), expected, rtol=2e-4, atol=1e-5)


def test_block_factor_inverses_of_a_diagonal_input_factor():
    rng = np.random.default_rng(4)
    a = rng.uniform(0.0, 0.5, 7).astype("float32")  # token frequencies
    g_blocks = _spd(rng, 1, 3)
    a_inverse, g_inverse, trouble = factor_inverses.block_factor_inverses(
        *_tensors(a, g_blocks),
        True,
        0.09,
        *_tensors(np.ones(7, "float32"), np.zeros_like(g_blocks)),
    )
    assert not bool(_np(trouble))
    np.testing.assert_allclose(_np(a_inverse), 1.0 / (a + 0.3), rtol=1e-5)
    expected = np.linalg.inv(g_blocks.astype("float64") + 0.3 * np.eye(3))
    np.testing.assert_allclose(_np(g_inverse), expected, rtol=2e-4)


@thor_training
def test_block_factor_inverses_fall_back_and_report_trouble():
    spd = _spd(np.random.default_rng(5), 1, 3)
    nearly = np.diag([1.0, -1e-3, 2.0]).astype("float32")[None]
    previous = 7.0 * np.ones_like(spd)
    a_inverse, g_inverse, trouble = factor_inverses.block_factor_inverses(
        *_tensors(nearly, spd), False, 1e-12, *_tensors(previous, previous)
    )
    assert bool(_np(trouble))
    shift = 1e-6 + np.mean(np.diag(nearly[0]))
    np.testing.assert_allclose(
        _np(a_inverse)[0], np.linalg.inv(nearly[0] + shift * np.eye(3)), 1e-4
    )
    np.testing.assert_allclose(
        _np(g_inverse), np.linalg.inv(spd + 1e-6 * np.eye(3)), rtol=1e-4
    )


@thor_training
@pytest.mark.parametrize(
    "broken", ["a_nan", "g_inf", "diagonal_a_nan", "hopeless"]
)
def test_block_factor_inverses_keep_the_previous_ones_when_not_finite(broken):
    rng = np.random.default_rng(6)
    diagonal = broken == "diagonal_a_nan"
    a = rng.uniform(0.1, 1.0, 3).astype("float32") if diagonal else None
    a = _spd(rng, 2, 3) if a is None else a
    g = _spd(rng, 1, 3)
    if broken == "a_nan":
        a[1, 0, 0] = np.nan
    elif broken == "g_inf":
        g[0, 2, 2] = np.inf
    elif broken == "diagonal_a_nan":
        a[0] = np.nan
    else:  # not finite even after the fallback's extra damping
        a = np.diag([1.0, -50.0, 2.0]).astype("float32")[None]
    previous_a = np.full_like(a, 3.0)
    previous_g = np.full_like(g, 5.0)
    a_inverse, g_inverse, trouble = factor_inverses.block_factor_inverses(
        *_tensors(a, g), diagonal, 0.01, *_tensors(previous_a, previous_g)
    )
    assert bool(_np(trouble))
    np.testing.assert_array_equal(_np(a_inverse), previous_a)
    np.testing.assert_array_equal(_np(g_inverse), previous_g)


# The step-size guard.


def test_kl_clip_scale_is_the_documented_formula():
    for inner, learning_rate, kl_clip in [
        (2.0, 0.1, 1e-3),
        (-2.0, 0.1, 1e-3),
        (50.0, 0.5, 0.01),
        (1e-3, 0.1, 1.0),  # a small step: ν = 1
    ]:
        scale = kl_guard.kl_clip_scale(
            ops.convert_to_tensor(inner, "float32"),
            ops.convert_to_tensor(learning_rate, "float32"),
            kl_clip,
        )
        quadratic = abs(learning_rate**2 * inner)
        expected = min(1.0, math.sqrt(kl_clip / quadratic))
        np.testing.assert_allclose(_np(scale), expected, rtol=1e-5)


def test_kl_clip_scale_is_one_for_zero_or_non_finite_products():
    for inner in [0.0, -0.0, np.nan, np.inf, -np.inf]:
        scale = kl_guard.kl_clip_scale(
            ops.convert_to_tensor(inner, "float32"),
            ops.convert_to_tensor(0.1, "float32"),
            1e-3,
        )
        assert _np(scale) == 1.0, inner


def test_a_held_guard_scale_is_applied_and_a_refresh_keeps_it_if_not_finite():
    directions = {"w": ops.convert_to_tensor([[1.0, -2.0]])}
    velocities = {"w": ops.convert_to_tensor([[0.5, 0.5]])}

    def guard(norm, mode="velocity", **kwargs):
        steps, scale = kl_guard.guarded_directions(
            directions,
            {"w": ops.convert_to_tensor([[np.nan, np.nan]])},  # direction's g
            velocities,
            norm,
            0.1,
            0.9,
            1e-3,
            mode,
            **kwargs,
        )
        return _np(steps["w"]), float(_np(scale))

    def never(steps):
        raise AssertionError("a held ν measures nothing")

    held = ops.convert_to_tensor(0.25)
    steps, scale = guard(never, held_scale=held)
    # ν·(μ·v + d) − μ·v
    np.testing.assert_allclose(
        steps, [[0.25 * 1.45 - 0.45, 0.25 * -1.55 - 0.45]], rtol=1e-6
    )
    assert scale == 0.25
    steps, scale = guard(never, "direction", held_scale=held)
    np.testing.assert_allclose(steps, [[0.25, -0.5]])  # ν·d
    # A non-finite sum: the direction's from `g`, the velocity's from `norm`.
    _, scale = guard(never, "direction", fallback_scale=held)
    assert scale == 0.25
    _, scale = guard(
        lambda steps: ops.convert_to_tensor(np.nan), fallback_scale=held
    )
    assert scale == 0.25
    _, scale = guard(lambda steps: ops.convert_to_tensor(np.nan))
    assert scale == 1.0


# The sampled Fisher's losses.

SUPPORTED = [
    ("sparse_categorical_crossentropy", ("sparse", False)),
    ("categorical_crossentropy", ("categorical", False)),
    ("binary_crossentropy", ("binary", False)),
    ("mean_squared_error", ("squared", False)),
    ("mse", ("squared", False)),
    (keras.losses.sparse_categorical_crossentropy, ("sparse", False)),
    (keras.losses.categorical_crossentropy, ("categorical", False)),
    (keras.losses.binary_crossentropy, ("binary", False)),
    (keras.losses.mean_squared_error, ("squared", False)),
    (keras.losses.SparseCategoricalCrossentropy(), ("sparse", False)),
    (
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        ("sparse", True),
    ),
    (keras.losses.CategoricalCrossentropy(), ("categorical", False)),
    (
        keras.losses.CategoricalCrossentropy(from_logits=True),
        ("categorical", True),
    ),
    (keras.losses.BinaryCrossentropy(from_logits=True), ("binary", True)),
    (keras.losses.BinaryCrossentropy(), ("binary", False)),
    (keras.losses.MeanSquaredError(), ("squared", False)),
]
KINDS = {
    "sparse": "sparse_categorical_crossentropy",
    "categorical": "categorical_crossentropy",
    "binary": "binary_crossentropy",
    "squared": "mean_squared_error",
}


def test_fisher_loss_kind_of_supported_losses():
    for loss, (kind, from_logits) in SUPPORTED:
        assert sampled_fisher.fisher_loss_kind(loss) == (
            KINDS[kind],
            from_logits,
        ), loss


def test_fisher_loss_kind_names_an_unsupported_loss():
    for loss, shown in [
        ("hinge", "'hinge'"),
        ("mae", "'mae'"),
        (keras.losses.Hinge(), "hinge"),
        (keras.losses.BinaryFocalCrossentropy(), "binary_focal"),
        (keras.losses.huber, "huber"),
        ({"out": "mse"}, "{'out': 'mse'}"),
    ]:
        with pytest.raises(ValueError, match="Received: loss=") as raised:
            sampled_fisher.fisher_loss_kind(loss)
        assert shown in str(raised.value), str(raised.value)
        assert 'fisher="empirical"' in str(raised.value)


# The sampled Fisher's targets: E[ĝĝᵀ] is the Gauss-Newton matrix.

EXAMPLES = 40000


def _softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _case(kind, from_logits):
    """`(distinct predictions (3, d), their Gauss-Newton matrices)` of the
    mean-over-examples loss `kind`, per example."""
    rng = np.random.default_rng(7)
    logits = rng.normal(scale=0.6, size=(3, 4))
    if kind in ("sparse", "categorical"):
        p = _softmax(logits)
        if from_logits:
            return logits, [np.diag(q) - np.outer(q, q) for q in p]
        # The loss of probabilities normalizes them first: the Hessian of
        # -log(p_y / Σp) in p at E_y, y ~ p.
        return p, [np.diag(1.0 / q) - np.ones((4, 4)) for q in p]
    if kind == "binary":
        p, width = _sigmoid(logits), logits.shape[-1]
        if from_logits:
            return logits, [np.diag(q * (1 - q)) / width for q in p]
        return p, [np.diag(1.0 / (q * (1 - q))) / width for q in p]
    width = logits.shape[-1]
    return logits, [2.0 / width * np.eye(width)] * 3


def _per_example_gradients(kind, from_logits, predictions, seed):
    loss_kind = KINDS[kind]
    y_pred = ops.convert_to_tensor(
        np.tile(predictions, (EXAMPLES, 1)), "float32"
    )
    targets = sampled_fisher.sampled_targets(
        loss_kind, from_logits, y_pred, ops.convert_to_tensor(seed, "int64")
    )
    (gradients,) = helpers.vector_jacobian(
        lambda values: sampled_fisher.sampled_loss(
            loss_kind, from_logits, targets, values[0]
        ),
        [y_pred],
    )
    # The loss is the mean over examples: `N ·` its gradient is per example.
    return targets, gradients.astype("float64") * y_pred.shape[0]


@thor_training
@pytest.mark.parametrize(
    "kind, from_logits",
    [
        ("sparse", True),
        ("sparse", False),
        ("categorical", True),
        ("categorical", False),
        ("binary", True),
        ("binary", False),
        ("squared", False),
    ],
)
def test_sampled_gradients_have_the_gauss_newton_matrix_as_second_moment(
    kind, from_logits
):
    predictions, gauss_newton = _case(kind, from_logits)
    _, gradients = _per_example_gradients(
        kind, from_logits, predictions, [3, 0]
    )
    for row, expected in enumerate(gauss_newton):
        g = gradients[row :: len(predictions)]
        second_moment = g.T @ g / len(g)
        scale = np.abs(expected).max()
        np.testing.assert_allclose(
            second_moment, expected, atol=0.05 * scale, err_msg=str(row)
        )
        # The mean gradient at sampled targets is zero (unlike the data's).
        np.testing.assert_allclose(
            g.mean(axis=0), 0.0, atol=0.05 * math.sqrt(scale)
        )


@thor_training
@pytest.mark.parametrize("kind", ["sparse", "categorical", "binary", "squared"])
def test_sampled_targets_are_deterministic_in_the_seed(kind):
    predictions, _ = _case(kind, True)
    y_pred = ops.convert_to_tensor(np.tile(predictions, (50, 1)), "float32")
    draw = [
        np.asarray(
            sampled_fisher.sampled_targets(
                KINDS[kind], True, y_pred, ops.convert_to_tensor(seed, "int64")
            )
        )
        for seed in ([5, 0], [5, 0], [5, 1], [6, 0])
    ]
    np.testing.assert_array_equal(draw[0], draw[1])
    assert not np.array_equal(draw[0], draw[2])  # another replica
    assert not np.array_equal(draw[0], draw[3])  # another step
    if kind == "sparse":
        assert draw[0].shape == (150,)
    else:
        assert draw[0].shape == (150, 4)


def _finite_rows_of_gradient(kind, from_logits, targets, y_pred):
    (gradients,) = helpers.vector_jacobian(
        lambda values: sampled_fisher.sampled_loss(
            KINDS[kind], from_logits, targets, values[0]
        ),
        [y_pred],
    )
    return np.isfinite(gradients).all(axis=-1)


@thor_training
@pytest.mark.parametrize("kind", ["sparse", "categorical", "binary", "squared"])
@pytest.mark.parametrize("from_logits", [True, False])
def test_sampled_targets_of_non_finite_predictions_are_valid(kind, from_logits):
    """Rows with a NaN or an infinity get a valid target (a class in
    `[0, classes)`), and the sampled loss's gradient is non-finite in the
    rows where the loss at the data's labels has one: the statistics count
    a trouble as the empirical Fisher's do."""
    nan, inf = np.nan, np.inf
    bad = [[nan] * 4, [nan, 0, 1, 2], [inf, 0, 1, 2], [inf, -inf, 1, 2]]
    bad += [[-inf] * 4, [inf] * 4]
    good, _ = _case(kind, from_logits)
    rows = np.concatenate([np.array(bad), good])
    y_pred = ops.convert_to_tensor(np.tile(rows, (20, 1)), "float32")
    targets = sampled_fisher.sampled_targets(
        KINDS[kind], from_logits, y_pred, ops.convert_to_tensor([3, 0], "int64")
    )
    drawn = np.asarray(targets)
    if kind == "sparse":
        assert drawn.dtype == np.int32
        assert ((drawn >= 0) & (drawn < 4)).all(), drawn
    elif kind in ("categorical", "binary"):
        assert set(np.unique(drawn)) <= {0.0, 1.0}
    if kind == "categorical":
        np.testing.assert_array_equal(drawn.sum(axis=-1), 1.0)
    # The data's labels: class 0, or zeros.
    labels = ops.zeros_like(targets)
    finite = _finite_rows_of_gradient(kind, from_logits, targets, y_pred)
    np.testing.assert_array_equal(
        finite,
        _finite_rows_of_gradient(kind, from_logits, labels, y_pred),
    )
    assert finite[len(bad) : len(rows)].all()


# Argument checks.

GOOD = dict(learning_rate=0.1, damping=0.03, momentum=0.9, frequency=4)
BAD_OPTIONS = [
    ({"factor_decay": 1.0}, ValueError, r"`factor_decay` must be in \[0, 1\)"),
    ({"factor_decay": -0.1}, ValueError, r"factor_decay=-0.1"),
    ({"factor_decay": "0.9"}, TypeError, "`factor_decay` must be a float"),
    ({"factor_decay": float("nan")}, ValueError, "`factor_decay` must be a"),
    (
        {"factor_decay": 0.9, "statistics_frequency": 3},
        ValueError,
        "statistics_frequency=3, frequency=4",
    ),
    (
        {"statistics_frequency": 2},
        ValueError,
        "statistics_frequency=2, factor_decay=None",
    ),
    (
        {"factor_decay": 0.9, "statistics_frequency": 0},
        ValueError,
        "`statistics_frequency` must be an integer >= 1",
    ),
    (
        {"factor_decay": 0.9, "statistics_frequency": 2.0},
        TypeError,
        "`statistics_frequency` must be an integer",
    ),
    ({"fisher": "exact"}, ValueError, "fisher='exact'"),
    ({"fisher": None}, ValueError, "fisher=None"),
    (
        {"precondition_biases": "some"},
        ValueError,
        r"must be one of \(None, 'shared', 'all', 'joint'\)"
        r".*precondition_biases='some'",
    ),
    ({"kl_clip": 0}, ValueError, r"`kl_clip` must be > 0 or None"),
    ({"kl_clip": -1e-3}, ValueError, "kl_clip=-0.001"),
    ({"kl_clip": "1e-3"}, TypeError, "`kl_clip` must be a float"),
    ({"statistics_rows": 0}, ValueError, "`statistics_rows` must be an"),
    (
        {"conv_statistics_rows": 0},
        ValueError,
        "`conv_statistics_rows` must be an",
    ),
    ({"statistics_rows": 8.0}, TypeError, "`statistics_rows` must be an"),
    (
        {"statistics_rows": "auto"},
        ValueError,
        '`statistics_rows` must be None, an integer >= 1 or "width"',
    ),
    (
        {"conv_statistics_rows": "width"},
        TypeError,
        "`conv_statistics_rows` must be an integer",
    ),
    (
        {"kl_clip_mode": "step"},
        ValueError,
        r"must be one of \('direction', 'velocity'\).*kl_clip_mode='step'",
    ),
    (
        {"kl_clip": 0.01, "kl_clip_mode": "velocity"},
        ValueError,
        "kl_clip_mode='velocity', kl_clip=0.01, factor_decay=None",
    ),
    (
        {"kl_clip_steps": 5},
        ValueError,
        r"must be one of \('every', 'refresh'\).*kl_clip_steps=5",
    ),
]


def test_bad_options_name_the_argument_and_the_value():
    for options, error, message in BAD_OPTIONS:
        with pytest.raises(error, match=message) as raised:
            THOR(**dict(GOOD, **options))
        assert "Received" in str(raised.value), options


def test_good_options_are_kept_and_in_the_config():
    optimizer = THOR(
        **GOOD,
        factor_decay=0,
        statistics_frequency=4,  # = frequency: no averaging needed
        statistics_rows=8,
        fisher="sampled",
        kl_clip=1,
        kl_clip_mode="velocity",
        kl_clip_steps="refresh",
    )
    assert optimizer.factor_decay == 0.0
    assert isinstance(optimizer.kl_clip, float)
    config = optimizer.get_config()
    assert {
        k: config[k]
        for k in (
            "factor_decay",
            "statistics_frequency",
            "statistics_rows",
            "fisher",
            "kl_clip",
            "kl_clip_mode",
            "kl_clip_steps",
        )
    } == {
        "factor_decay": 0.0,
        "statistics_frequency": 4,
        "statistics_rows": 8,
        "fisher": "sampled",
        "kl_clip": 1.0,
        "kl_clip_mode": "velocity",
        "kl_clip_steps": "refresh",
    }
    assert THOR.from_config(config).get_config() == config
    width = THOR(**GOOD, statistics_rows="width").get_config()
    assert THOR.from_config(width).statistics_rows == "width"
    assert THOR(**GOOD, statistics_frequency=4).statistics_period == 4
    assert THOR(**GOOD).statistics_period == 4


def test_statistics_schedule_of_the_optimizer():
    thor = THOR(**dict(GOOD, frequency=6), factor_decay=0.9)
    schedule = thor.refresh_schedule
    assert [s for s in range(13) if schedule.gathers_statistics_at(s)] == [
        0,
        6,
        12,
    ]
    thor = THOR(
        **dict(GOOD, frequency=6), factor_decay=0.9, statistics_frequency=2
    )
    schedule = thor.refresh_schedule
    assert [s for s in range(13) if schedule.gathers_statistics_at(s)] == [
        0,
        2,
        4,
        6,
        8,
        10,
        12,
    ]
    assert [s for s in range(13) if schedule.refreshes_at(s)] == [0, 6, 12]


def test_recommended_is_the_documented_setting_and_takes_overrides():
    thor = THOR.recommended()
    assert float(thor.learning_rate) == pytest.approx(1e-3)
    assert (thor.damping, thor.momentum) == (1e-3, 0.9)
    assert (thor.frequency, thor.statistics_frequency) == (5, 1)
    assert (thor.factor_decay, thor.fisher) == (0.95, "empirical")
    assert (thor.damping_split, thor.precondition_biases) == ("pi", "joint")
    assert (thor.split_dim, thor.kl_clip, thor.burn_in_steps) == (256, 0.01, 0)
    assert thor.kl_clip_mode == "velocity"
    assert (thor.statistics_rows, thor.conv_statistics_rows) == (None, 32)
    tuned = THOR.recommended(learning_rate=0.1, kl_clip=None, batch_size=64)
    assert float(tuned.learning_rate) == pytest.approx(0.1)
    assert (tuned.kl_clip, tuned.batch_size, tuned.damping) == (None, 64, 1e-3)
    config = tuned.get_config()
    assert THOR.from_config(config).get_config() == config
