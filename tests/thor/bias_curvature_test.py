"""`THOR(precondition_biases=...)`: biases as K-FAC's homogeneous coordinate.

Reference (NumPy, from the documented rule): with `S` the per-example
gradients of the bias (here from the backend's own gradient of each
example's loss, not from keras_thor's output-gradient rows),
`G_b = SᵀS / N`, `g = mean(S)` and the bias step
`d_b = g · (G_b + √λ·I)⁻¹ / (1 + √λ)`.
"""

import math

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.optimizers import THOR
from keras_thor.src.thor.blocks import BiasKronecker
from tests import helpers

# Compiling THOR needs a backend it trains on; the statistics, the coverage
# and the argument check run on every backend.
thor_training = pytest.mark.thor_training
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
PER_EXAMPLE = keras.losses.SparseCategoricalCrossentropy(
    from_logits=True, reduction=None
)
EXAMPLES, POSITIONS, FEATURES = 6, 5, 3


def _sequence_model():
    """A Dense layer on sequences (its bias shared by 5 positions), average
    pooling, and a Dense head (its bias added once per example)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((POSITIONS, FEATURES))
    x = keras.layers.Dense(4, activation="tanh", name="sequence")(inputs)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(3, name="logits")(x)
    return keras_thor.convert_to_thor_model(keras.Model(inputs, outputs))


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(EXAMPLES, POSITIONS, FEATURES)).astype("float32")
    return x, np.array([0, 1, 2, 0, 1, 2])


def _reference_bias_step(per_example, damping):
    """`g · (G_b + √λ·I)⁻¹ / (1 + √λ)` and `g`."""
    gradient = per_example.mean(axis=0)
    g_b = per_example.T @ per_example / len(per_example)
    root = math.sqrt(damping)
    inverse = np.linalg.inv(g_b + root * np.eye(len(g_b)))
    return gradient @ inverse / (1.0 + root), gradient


def _one_step(model, **options):
    return _one_step_on(model, *_data(), **options)


def _one_step_on(model, x, y, **options):
    model.compile(
        optimizer=THOR(0.1, damping=0.05, momentum=0.9, frequency=2, **options),
        loss=LOSS,
    )
    before = {v.path: v.numpy().astype(np.float64) for v in model.weights}
    gradients = helpers.per_example_gradients(model, PER_EXAMPLE, x, y)
    history = model.fit(x, y, batch_size=EXAMPLES, shuffle=False, verbose=0)
    steps = {
        v.path: (v.numpy().astype(np.float64) - before[v.path]).reshape(-1)
        for v in model.trainable_variables
    }
    return steps, gradients, history


@thor_training
@pytest.mark.parametrize("rule", ["shared", "all"])
def test_one_step_of_the_biases_matches_numpy(rule):
    steps, gradients, _ = _one_step(_sequence_model(), precondition_biases=rule)
    # Shared by positions: preconditioned under both rules.
    expected, _ = _reference_bias_step(gradients["sequence/bias"], 0.05)
    np.testing.assert_allclose(
        steps["sequence/bias"], -0.1 * expected, rtol=1e-4, atol=1e-7
    )
    # Added once per example: only `"all"` preconditions it.
    preconditioned, plain = _reference_bias_step(gradients["logits/bias"], 0.05)
    expected = preconditioned if rule == "all" else plain
    np.testing.assert_allclose(
        steps["logits/bias"], -0.1 * expected, rtol=1e-4, atol=1e-7
    )


@thor_training
def test_a_per_position_loss_divides_the_bias_factor_by_its_terms():
    """Logits at every position (`M = N·L` loss terms): `S` the gradients
    of each example's summed terms, `G_b = SᵀS / (N·L)`, `g = ΣS / (N·L)`."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((POSITIONS, FEATURES))
    x = keras.layers.EinsumDense(
        "btf,fu->btu", (POSITIONS, 4), bias_axes="u", name="sequence"
    )(inputs)
    outputs = keras.layers.Dense(3, name="logits")(keras.ops.tanh(x))
    model = keras_thor.convert_to_thor_model(keras.Model(inputs, outputs))
    x, _ = _data()
    y = np.random.default_rng(2).integers(0, 3, (EXAMPLES, POSITIONS))
    steps, gradients, _ = _one_step_on(
        model, x, y, precondition_biases="shared"
    )
    per_example = gradients["sequence/bias"]
    terms = EXAMPLES * POSITIONS
    gradient = per_example.sum(axis=0) / terms
    root = math.sqrt(0.05)
    g_b = per_example.T @ per_example / terms
    expected = gradient @ np.linalg.inv(g_b + root * np.eye(4)) / (1 + root)
    np.testing.assert_allclose(
        steps["sequence/bias"], -0.1 * expected, rtol=1e-4, atol=1e-7
    )


def _convolution_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 2))
    x = keras.layers.SeparableConv2D(3, 3, name="separable")(inputs)
    x = keras.layers.DepthwiseConv2D(2, depth_multiplier=2, name="depthwise")(x)
    x = keras.layers.Conv2D(4, 2, padding="same", name="convolution")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(3, name="logits")(x)
    return keras_thor.convert_to_thor_model(keras.Model(inputs, outputs))


@thor_training
def test_one_step_of_convolution_biases_matches_numpy():
    model = _convolution_model()
    model.compile(
        optimizer=THOR(
            0.1, damping=0.05, momentum=0.9, precondition_biases="all"
        ),
        loss=LOSS,
    )
    rng = np.random.default_rng(2)
    x = rng.normal(size=(EXAMPLES, 6, 6, 2)).astype("float32")
    y = np.array([0, 1, 2, 0, 1, 2])
    biases = [v for v in model.trainable_variables if v.path.endswith("bias")]
    assert len(biases) == 4
    before = [v.numpy().astype(np.float64) for v in biases]
    gradients = helpers.per_example_gradients(model, PER_EXAMPLE, x, y)
    expected = [
        _reference_bias_step(gradients[v.path], 0.05)[0] for v in biases
    ]
    model.fit(x, y, batch_size=EXAMPLES, shuffle=False, verbose=0)
    for variable, start, step in zip(biases, before, expected):
        np.testing.assert_allclose(
            variable.numpy().reshape(-1) - start.reshape(-1),
            -0.1 * step,
            rtol=1e-4,
            atol=1e-7,
            err_msg=variable.path,
        )


@thor_training
def test_without_the_option_biases_take_the_plain_gradient():
    steps, gradients, _ = _one_step(_sequence_model())
    for path in ("sequence/bias", "logits/bias"):
        plain = gradients[path].mean(axis=0)
        np.testing.assert_allclose(
            steps[path], -0.1 * plain, rtol=1e-4, atol=1e-7
        )


@thor_training
@pytest.mark.parametrize("rule", [None, "all"])
def test_guard_counts_exactly_the_preconditioned_variables(rule):
    # First step: Δw = −lr·ν·d for guarded variables, so with
    # Q = Σ ⟨−Δw, g⟩ over them, ν = sqrt(κ / (lr²·Σ⟨d, g⟩)) gives
    # ν = κ / (lr·Q).
    kl_clip = 1e-6
    steps, gradients, history = _one_step(
        _sequence_model(), kl_clip=kl_clip, precondition_biases=rule
    )
    scale = history.history["thor_guard_scale"][0]
    assert scale < 1.0
    guarded = ["sequence/kernel", "logits/kernel"]
    if rule == "all":
        guarded += ["sequence/bias", "logits/bias"]
    inner = sum(
        float(np.dot(-steps[p], gradients[p].mean(axis=0))) for p in guarded
    )
    np.testing.assert_allclose(scale, kl_clip / (0.1 * inner), rtol=1e-3)


def _bias_of_shape(shape):
    return keras.Variable(np.zeros(shape, "float32"))


@pytest.mark.parametrize(
    "grads_shape, bias_shape, data_format, summed",
    [
        ((4, 5, 3), (3,), "channels_last", (1,)),  # Dense on sequences
        ((4, 3, 2, 5), (3,), "channels_first", (2, 3)),  # Conv2D
        ((4, 5, 3, 2), (3, 1), "channels_last", (1, 3)),  # EinsumDense "d"
        ((4, 5, 3, 2), (3, 2), "channels_last", (1,)),  # EinsumDense "de"
        ((4, 3), (3,), "channels_last", ()),  # Dense on vectors
    ],
)
def test_bias_statistics_sum_the_rows_of_each_example(
    grads_shape, bias_shape, data_format, summed
):
    rng = np.random.default_rng(0)
    grads = rng.normal(size=grads_shape).astype("float32")
    block = BiasKronecker(None, _bias_of_shape(bias_shape), data_format, True)
    a_sum, g_sum, rows, scale = block.statistics(None, grads)
    sums = grads.astype(np.float64).sum(axis=summed) if summed else grads
    sums = sums.reshape(len(grads), -1)
    np.testing.assert_allclose(np.asarray(g_sum)[0], sums.T @ sums, rtol=1e-5)
    assert np.asarray(a_sum).tolist() == [4.0]
    assert (float(rows), scale) == (4.0, 1.0)


def _bias_blocks(model, rule):
    model.compile(
        optimizer=THOR(0.1, 0.05, 0.9, precondition_biases=rule), loss=LOSS
    )
    model.optimizer.build(model.trainable_variables)
    return sorted(
        block.kernel.path
        for block in model.optimizer.curvature_blocks.values()
        if isinstance(block, BiasKronecker)
    )


def _mixed_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(3, 3, name="conv")(inputs)
    x = keras.layers.Conv2D(3, 3, use_bias=False, name="conv_no_bias")(x)
    x = keras.layers.Reshape((4, 3))(x)
    x = keras.layers.Dense(4, name="sequence")(x)
    attention = keras.layers.MultiHeadAttention(2, 2, name="attention")
    x = attention(x, x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(5, name="hidden")(x)
    outputs = keras.layers.Dense(3, name="logits")(x)
    return keras_thor.convert_to_thor_model(keras.Model(inputs, outputs))


@thor_training
def test_shared_rule_selects_the_biases_added_at_several_positions():
    shared = [
        "attention/attention_output/bias",
        "attention/key/bias",
        "attention/query/bias",
        "attention/value/bias",
        "conv/bias",
        "sequence/bias",
    ]
    assert _bias_blocks(_mixed_model(), "shared") == shared
    every = sorted(shared + ["hidden/bias", "logits/bias"])
    assert _bias_blocks(_mixed_model(), "all") == every
    assert _bias_blocks(_mixed_model(), None) == []


@thor_training
def test_mixed_model_trains_with_preconditioned_biases():
    model = _mixed_model()
    model.compile(
        optimizer=THOR.recommended(frequency=3, precondition_biases="all"),
        loss=LOSS,
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 6, 6, 2)).astype("float32")
    y = (x[:, :3, :, 0].mean(axis=(1, 2)) > 0).astype("int32")
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0)  # last 8
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    assert model.optimizer.curvature_troubles == 0
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_coverage_counts_biases_as_first_order():
    coverage = keras_thor.curvature_coverage(_mixed_model())
    rows = {row.name: row for row in coverage.layers}
    assert rows["sequence"].curvature_parameters == 3 * 4
    assert rows["sequence"].rule == "DenseKronecker"


@pytest.mark.parametrize("value", [True, "every", 1])
def test_other_values_are_refused(value):
    with pytest.raises(ValueError, match="precondition_biases"):
        THOR(0.1, 0.05, 0.9, precondition_biases=value)
