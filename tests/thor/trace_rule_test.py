"""THOR's trace rule (`trace_thresholds`): the trace and the decision
against NumPy, the argument checks, and `model.fit` against the NumPy
reference (`tests/thor/options_reference`), which forms each layer's
damped Kronecker product to take its trace.

The pure functions and the checks run on every backend; training needs
THOR's TensorFlow training step.
"""

import math
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_thor
from keras_thor.optimizers import THOR
from keras_thor.src.thor import block_inverse
from keras_thor.src.thor import trace_rule
from tests.thor import keras_models
from tests.thor.curvature_options_test import _spd
from tests.thor.thor_options_reference_test import EAGER
from tests.thor.thor_options_reference_test import HYPER
from tests.thor.thor_options_reference_test import _assert_follows
from tests.thor.thor_options_reference_test import _fit_and_reference
from tests.thor.thor_options_reference_test import _Recorder

thor_training = pytest.mark.thor_training
GOOD = dict(learning_rate=0.1, damping=0.03, momentum=0.9, frequency=4)


def _kronecker_trace(a, g, damping):
    """`tr(⊕_j (A_j + √λI) ⊗ (G_j + √λI))`, each product formed (the
    trace of a block-diagonal matrix is the sum of its blocks')."""
    root = math.sqrt(damping)
    total = 0.0
    for a_j, g_j in zip(a, g):
        a_j, g_j = np.asarray(a_j, np.float64), np.asarray(g_j, np.float64)
        if a_j.ndim == 1:
            a_damped = np.diag(a_j + root)
        else:
            a_damped = a_j + root * np.eye(len(a_j))
        total += np.trace(np.kron(a_damped, g_j + root * np.eye(len(g_j))))
    return float(total)


@pytest.mark.parametrize(
    "groups, a_dim, g_dim, split_dim",
    [(1, 6, 4, 128), (1, 7, 5, 3), (3, 5, 2, 2), (2, 4, 6, 4)],
)
def test_damped_kronecker_trace_is_the_formed_products_trace(
    groups, a_dim, g_dim, split_dim
):
    rng = np.random.default_rng(groups + a_dim)
    a, g = _spd(rng, groups, a_dim), _spd(rng, groups, g_dim)
    # THOR's blocks, the last one of a group padded with identity.
    a_blocks = block_inverse.diagonal_blocks(
        ops.convert_to_tensor(a), split_dim
    )
    g_blocks = block_inverse.diagonal_blocks(
        ops.convert_to_tensor(g), split_dim
    )
    trace = trace_rule.damped_kronecker_trace(
        a_blocks, g_blocks, groups, a_dim, g_dim, 0.05
    )
    expected = _kronecker_trace(a, g, 0.05)
    np.testing.assert_allclose(float(trace), expected, rtol=1e-5)


def test_damped_kronecker_trace_of_a_diagonal_input_factor():
    rng = np.random.default_rng(1)
    a = rng.uniform(0.0, 3.0, size=9).astype("float32")  # token counts
    g = _spd(rng, 1, 4)
    trace = trace_rule.damped_kronecker_trace(
        ops.convert_to_tensor(a),
        block_inverse.diagonal_blocks(ops.convert_to_tensor(g), 3),
        1,
        9,
        4,
        0.2,
    )
    expected = _kronecker_trace([a], g, 0.2)
    np.testing.assert_allclose(float(trace), expected, rtol=1e-5)


def _decide(trace, last, stopped=False, usable=True, thresholds=(0.1, 0.02)):
    refresh, stop = trace_rule.trace_decision(
        ops.convert_to_tensor(trace, "float32"),
        ops.convert_to_tensor(last, "float32"),
        ops.convert_to_tensor(stopped),
        ops.convert_to_tensor(usable),
        thresholds,
    )
    return bool(refresh), bool(stop)


@pytest.mark.parametrize(
    "trace, last, stopped, usable, expected",
    [
        (5.0, 0.0, False, True, (True, False)),  # the first inversion
        (1.2, 1.0, False, True, (True, False)),  # Δ = 0.2 > ω₁
        (0.85, 1.0, False, True, (True, False)),  # Δ = 0.15 > ω₁
        (1.05, 1.0, False, True, (False, False)),  # ω₂ <= Δ <= ω₁: keep
        (1.01, 1.0, False, True, (False, True)),  # Δ < ω₂: stop
        (3.0, 1.0, True, True, (False, True)),  # stopped for good
        (math.nan, 1.0, False, True, (True, False)),  # the guard keeps
        (math.inf, 1.0, False, True, (True, False)),
        (1.0, 1.0, False, False, (True, False)),  # no accepted average
    ],
)
def test_trace_decision(trace, last, stopped, usable, expected):
    assert _decide(trace, last, stopped, usable) == expected


@pytest.mark.parametrize("trace", [1.125, 0.875, 1.03125, 0.96875])
def test_a_change_on_a_threshold_keeps_the_inverses(trace):
    """`ω₂ <= Δ <= ω₁` keeps, both ends included (binary fractions, exact
    in float32)."""
    assert _decide(trace, 1.0, thresholds=(0.125, 0.03125)) == (False, False)


def test_no_stop_threshold_never_stops_and_no_update_threshold_always_inverts():
    assert _decide(1.0, 1.0, thresholds=(0.01, 0.0)) == (False, False)
    assert _decide(1.0 + 1e-6, 1.0, thresholds=(0.0, 0.0)) == (True, False)


BAD_THRESHOLDS = [
    ((0.01, 0.02), ValueError, r"trace_thresholds=\(0.01, 0.02\)"),
    ((0.1, 0.0, 0.0), ValueError, r"trace_thresholds=\(0.1, 0.0, 0.0\)"),
    (-0.1, ValueError, "trace_thresholds=-0.1"),
    ((0.1, -0.01), ValueError, r"trace_thresholds=\(0.1, -0.01\)"),
    ("0.01", TypeError, "trace_thresholds='0.01'"),
    ((0.01, "0"), TypeError, r"trace_thresholds=\(0.01, '0'\)"),
    ((0.01, math.nan), ValueError, r"trace_thresholds=\(0.01, nan\)"),
]


@pytest.mark.parametrize("value, error, message", BAD_THRESHOLDS)
def test_bad_trace_thresholds_name_the_argument_and_the_value(
    value, error, message
):
    with pytest.raises(error, match=message) as raised:
        THOR(**GOOD, trace_thresholds=value)
    assert "Argument `trace_thresholds` must be None, a float" in str(
        raised.value
    )


def test_trace_thresholds_are_kept_and_in_the_config():
    assert THOR(**GOOD).trace_thresholds is None
    assert THOR(**GOOD, trace_thresholds=0.01).trace_thresholds == (0.01, 0.0)
    pair = np.array([0.05, 1e-3])
    assert THOR(**GOOD, trace_thresholds=pair).trace_thresholds == (0.05, 1e-3)
    optimizer = THOR(**GOOD, trace_thresholds=[0.05, 1e-3])
    config = optimizer.get_config()
    assert config["trace_thresholds"] == (0.05, 0.001)
    restored = THOR.from_config({**config, "trace_thresholds": [0.05, 1e-3]})
    assert restored.get_config() == config


# Training against the reference.


@thor_training
@pytest.mark.parametrize(
    "kind, loss, thresholds, options",
    [
        # Averaged factors change slowly: the first layer stops.
        ("mlp", "mse", (0.1, 0.03), {"factor_decay": 0.8}),
        # Embedding (a diagonal A) and LayerNorm, every step eager.
        ("encoder", "ce", (0.12, 0.0), {"compile_options": EAGER}),
        # A convolution's factor scale c = √T.
        ("cnn", "ce", (0.05, 0.02), {"compile_options": EAGER}),
    ],
)
def test_trace_rule_follows_the_reference(kind, loss, thresholds, options):
    recorder, expected, reference, _ = _fit_and_reference(
        kind,
        loss,
        frequency=2,
        trace_thresholds=thresholds,
        **options,
        **HYPER,
    )
    decisions = [d for _, _, d in reference.trace_decisions]
    # Every kind of decision the thresholds allow happened.
    assert decisions.count("invert") > len(reference.factors)
    assert "keep" in decisions
    assert ("stop" in decisions) == (thresholds[1] > 0)
    _assert_follows(recorder.weights, expected)
    kept = sum(d != "invert" for d in decisions)
    stopped = decisions.count("stop")
    assert recorder.logs[-1]["thor_skipped_inversions"] == kept
    assert recorder.logs[-1]["thor_stopped_blocks"] == stopped


@thor_training
def test_a_zero_update_threshold_is_mindspores_rule():
    """`Δ > 0` for any new batch: every layer is inverted every time."""
    runs = []
    for thresholds in (None, (0.0, 0.0)):
        keras.utils.set_random_seed(0)
        recorder, _, _, _ = _fit_and_reference(
            "mlp",
            "mse",
            epochs=1,
            frequency=2,
            trace_thresholds=thresholds,
            **HYPER,
        )
        runs.append(recorder.weights[-1])
    for none, zero in zip(*runs):
        np.testing.assert_array_equal(none, zero)


TWO_DENSE_LAYERS = [
    {"type": "dense", "units": 5, "activation": "tanh"},
    {"type": "dense", "units": 3},
]


def _two_dense_layers():
    return keras_models.keras_model(TWO_DENSE_LAYERS, (6,), "float32")


def _states(thor):
    """The curvature state of each of THOR's blocks."""
    return [
        thor.state_for(block.kernel) for block in thor.curvature_blocks.values()
    ]


def _inverses(thor):
    return [
        inverse
        for state in _states(thor)
        for inverse in (state.a_inverse, state.g_inverse)
    ]


@thor_training
def test_stopped_layers_keep_their_inverses_through_save_and_load(tmp_path):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    model = _two_dense_layers()
    # ω₂ = ∞ > any Δ: every layer stops at its second refresh.
    model.compile(
        optimizer=THOR(**dict(HYPER, frequency=2), trace_thresholds=(1e9, 1e9)),
        loss="mse",
    )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    optimizer = model.optimizer
    assert sum(state.stopped for state in _states(optimizer)) == 2
    path = str(tmp_path / "model.keras")
    model.save(path)
    restored = keras_thor.load_model(path)
    restored_optimizer = restored.optimizer
    assert restored_optimizer.trace_thresholds == (1e9, 1e9)
    for name in ("last_trace", "stopped"):
        np.testing.assert_array_equal(
            [getattr(state, name) for state in _states(optimizer)],
            [getattr(state, name) for state in _states(restored_optimizer)],
        )
    assert optimizer.skipped_inversions == restored_optimizer.skipped_inversions
    inverses = _inverses(restored_optimizer)
    history = restored.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert history.history["thor_skipped_inversions"][-1] == 2 + 2 * 2
    after = _inverses(restored_optimizer)
    for before, now in zip(inverses, after):
        np.testing.assert_array_equal(before, now)


@thor_training
@pytest.mark.parametrize("factor_decay", [None, 0.9])
def test_a_non_finite_refresh_step_never_stops_a_layer(factor_decay):
    """With `ω₂ = ∞` every layer stops at its first decided refresh. A
    refresh step with a NaN input decides nothing: with `factor_decay` the
    unchanged averages would otherwise look settled."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 6)).astype("float32")
    y = rng.normal(size=(48, 3)).astype("float32")
    x[2 * 8 + 3, 1] = np.nan  # batch 2, a refresh step (frequency 2)
    model = _two_dense_layers()
    model.compile(
        optimizer=THOR(
            **dict(HYPER, frequency=2),
            factor_decay=factor_decay,
            trace_thresholds=(1e9, 1e9),
        ),
        loss="mse",
    )
    recorder = _Recorder(TWO_DENSE_LAYERS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # THOR warns of the NaN statistics
        model.fit(
            x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[recorder]
        )
    stopped = [int(logs["thor_stopped_blocks"]) for logs in recorder.logs]
    assert stopped == [0, 0, 0, 0, 2, 2]
    assert model.optimizer.curvature_troubles >= 1
    traces = np.array([state.last_trace for state in _states(model.optimizer)])
    assert np.isfinite(traces).all() and (traces > 0).all()
