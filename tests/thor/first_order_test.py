"""`THOR(first_order="adam")`: Adam's step on the variables without
curvature, against a NumPy reference and in `fit`."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_thor
from keras_thor.src.thor import update


def _reference(w, grads, beta_1, learning_rate, weight_decay):
    """Adam as `first_order="adam"` documents it, in float64."""
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = beta_1 * m + (1 - beta_1) * g
        v = update.ADAM_BETA_2 * v + (1 - update.ADAM_BETA_2) * g**2
        m_hat = m / (1 - beta_1**t)
        v_hat = v / (1 - update.ADAM_BETA_2**t)
        w = w - learning_rate * (
            m_hat / (np.sqrt(v_hat) + update.ADAM_EPSILON) + weight_decay * w
        )
    return w, m, v


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_update_matches_the_numpy_reference(weight_decay):
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(3, 4))
    grads = [rng.normal(size=(3, 4)) for _ in range(3)]
    w = keras.Variable(w0.astype("float32"))
    m = keras.Variable(np.zeros((3, 4), "float32"))
    v = keras.Variable(np.zeros((3, 4), "float32"))
    for t, g in enumerate(grads, start=1):
        new_w, new_m, new_v, skipped = update.adam_update(
            w, g.astype("float32"), m, v, 0.01, 0.9, float(t), weight_decay
        )
        assert not bool(skipped)
        w.assign(new_w)
        m.assign(new_m)
        v.assign(new_v)
    expected = _reference(w0, grads, 0.9, 0.01, weight_decay)
    for actual, wanted in zip((w, m, v), expected):
        np.testing.assert_allclose(
            np.asarray(actual), wanted, rtol=1e-5, atol=1e-6
        )


def test_a_non_finite_gradient_leaves_the_adam_state_unchanged():
    w = keras.Variable(np.ones(3, "float32"))
    m = keras.Variable(np.full(3, 0.5, "float32"))
    v = keras.Variable(np.full(3, 0.25, "float32"))
    gradient = np.array([1.0, np.nan, 2.0], "float32")
    new_w, new_m, new_v, skipped = update.adam_update(
        w, gradient, m, v, 0.1, 0.9, 2.0, 0.0
    )
    assert bool(skipped)
    np.testing.assert_array_equal(ops.convert_to_numpy(new_w), np.ones(3))
    np.testing.assert_array_equal(ops.convert_to_numpy(new_m), np.full(3, 0.5))
    np.testing.assert_array_equal(ops.convert_to_numpy(new_v), np.full(3, 0.25))


@pytest.mark.thor_training
@pytest.mark.parametrize("first_order", ["momentum", "adam"])
def test_first_order_rule_steps_the_variables_without_curvature(first_order):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(5),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(2),
        ]
    )
    keras_thor.convert_to_thor_model(model)
    thor = keras_thor.optimizers.THOR.recommended(first_order=first_order)
    model.compile(optimizer=thor, loss="mse")
    assert thor.first_order == first_order
    assert thor.get_config()["first_order"] == first_order
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    gamma = model.layers[1].gamma
    before = np.asarray(gamma)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    change = np.abs(np.asarray(gamma) - before)
    second_moments = [v for v in thor.variables if "second_moment" in v.name]
    if first_order == "adam":
        # Adam's first step moves each entry by the learning rate.
        np.testing.assert_allclose(change, 1e-3, rtol=1e-3)
        # The BatchNormalization's gamma and beta (the preset's Dense
        # biases are in their kernels' blocks).
        assert len(second_moments) == 2
    else:
        assert not np.allclose(change, 1e-3, rtol=1e-3)
        assert not second_moments
