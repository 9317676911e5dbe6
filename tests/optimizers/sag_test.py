"""SAG against the real paddle.optimizer.ASGD and its documented formulas."""

import json
import pathlib

import keras
import numpy as np
import pytest

from keras_thor.optimizers import SAG
from keras_thor.src.optimizers.sag import sag_gradient_sum
from keras_thor.src.optimizers.sag import sag_parameter_update
from tests import helpers

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
PADDLE_CASES = json.loads((FIXTURES / "paddle_asgd_golden.json").read_text())[
    "cases"
]
# Keras keeps the learning rate in a float32 variable; Paddle uses it in
# float64 for float64 parameters: a relative 1.5e-8 that compounds over
# the steps, hence 1e-6 rather than 1e-12 there.
TOLERANCE = {"float32": 1e-5, "float64": 1e-6}
NAMES = ("kernel", "bias")


def _numpy_sag(x, grads, lr, batch_num, weight_decay=0.0):
    """Paddle's code: the decay term goes into the stored gradients."""
    d = np.zeros_like(x)
    y = np.zeros((batch_num, *x.shape), x.dtype)
    for m, grad in enumerate(grads):
        g = grad + weight_decay * x
        i = m % batch_num
        d = d - y[i] + g
        y[i] = g
        x = x - lr / min(m + 1, batch_num) * d
    return x, d, y


class TestFormulas:
    def test_gradient_sum_replaces_the_slot(self):
        d = np.array([3.0, 3.0], "float32")
        np.testing.assert_allclose(
            sag_gradient_sum(d, np.array([1.0, 2.0]), np.array([0.5, 0.5])),
            [2.5, 1.5],
        )

    def test_parameter_update_divides_by_filled_slots(self):
        np.testing.assert_allclose(
            sag_parameter_update(np.array([1.0]), np.array([3.0]), 0.1, 3.0),
            [0.9],
        )


@pytest.mark.parametrize(
    "case",
    PADDLE_CASES,
    ids=[f"{c['name']}-{c['dtype']}" for c in PADDLE_CASES],
)
def test_matches_paddle_after_every_step(case):
    dtype = case["dtype"]
    variables = [
        keras.Variable(np.array(case["initial"][name], dtype), name=name)
        for name in NAMES
    ]
    optimizer = SAG(**case["kwargs"])
    atol = TOLERANCE[dtype]
    for step in case["steps"]:
        grads = [np.array(step["grads"][name], dtype) for name in NAMES]
        optimizer.apply(grads, variables)
        for variable, name in zip(variables, NAMES):
            np.testing.assert_allclose(
                variable.numpy(), step["params"][name], atol=atol, rtol=atol
            )
    for index, name in enumerate(NAMES):
        expected = case["final_accumulators"][name]
        np.testing.assert_allclose(
            optimizer._gradient_sums[index].numpy(), expected["d"], atol=atol
        )
        np.testing.assert_allclose(
            optimizer._gradient_memories[index].numpy(),
            expected["y"],
            atol=atol,
        )
        assert int(optimizer.iterations) == expected["m"]


def test_decay_enters_memory_unlike_paddle_docstring():
    # Paddle's docstring: x -= lr * (d / n + wd * x) with d built from raw
    # gradients. Its code (and SAG) store grad + wd * x instead.
    rng = np.random.default_rng(3)
    grads = rng.normal(size=(6, 4)).astype("float32")
    x0 = rng.normal(size=4).astype("float32")
    variable = keras.Variable(x0)
    optimizer = SAG(learning_rate=0.1, batch_num=3, weight_decay=0.2)
    for g in grads:
        optimizer.apply([g], [variable])
    expected, _, _ = _numpy_sag(x0, grads, 0.1, 3, 0.2)
    np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-5)

    docstring_x, d, y = x0.copy(), np.zeros(4), np.zeros((3, 4))
    for m, g in enumerate(grads):
        d = d - y[m % 3] + g
        y[m % 3] = g
        docstring_x = docstring_x - 0.1 * (
            d / min(m + 1, 3) + 0.2 * docstring_x
        )
    assert not np.allclose(variable.numpy(), docstring_x, rtol=1e-3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_multi_precision_updates_a_float32_master_copy(dtype):
    rng = np.random.default_rng(4)
    x0 = rng.normal(size=(3, 2)).astype("float32")
    grads = 1e-3 * rng.normal(size=(7, 3, 2)).astype("float32")
    variable = keras.Variable(x0.astype(dtype), dtype=dtype)
    optimizer = SAG(learning_rate=0.01, batch_num=2, multi_precision=True)
    for g in grads:
        optimizer.apply([g.astype(dtype)], [variable])
    rounded = [g.astype(dtype).astype("float32") for g in grads]
    expected, d, _ = _numpy_sag(
        x0.astype(dtype).astype("float32"), rounded, 0.01, 2
    )
    master = optimizer._master_weights[0]
    assert master.dtype == "float32"
    assert optimizer._gradient_sums[0].dtype == "float32"
    np.testing.assert_allclose(master.numpy(), expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(keras.ops.cast(variable, "float32")),
        keras.ops.convert_to_numpy(
            keras.ops.cast(keras.ops.cast(expected, dtype), "float32")
        ),
    )


def test_low_precision_without_master_copy_warns():
    variable = keras.Variable(np.ones(3, "float16"), dtype="float16")
    with pytest.warns(UserWarning, match="multi_precision"):
        SAG().build([variable])


def test_non_finite_gradient_leaves_variable_and_memory_unchanged():
    variable = keras.Variable(np.array([1.0, 2.0], "float32"))
    optimizer = SAG(learning_rate=0.1, batch_num=2)
    optimizer.apply([np.array([1.0, 1.0], "float32")], [variable])
    before = [v.numpy().copy() for v in optimizer.variables] + [
        variable.numpy().copy()
    ]
    optimizer.apply([np.array([np.nan, 1.0], "float32")], [variable])
    after = [v.numpy() for v in optimizer.variables] + [variable.numpy()]
    for b, a in zip(before[1:], after[1:]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_fit_end_to_end_with_cyclic_batches(jit_compile):
    x, y = helpers.regression_data()
    model = helpers.mlp()
    model.compile(
        optimizer=SAG(learning_rate=0.05, batch_num=4),
        loss="mse",
        jit_compile=jit_compile,
    )
    history = model.fit(x, y, batch_size=16, epochs=8, shuffle=False, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.7 * losses[0]
    memory = model.optimizer._gradient_memories[0].numpy()
    assert memory.shape == (4, 6, 8)
    assert np.all(np.abs(memory).sum(axis=(1, 2)) > 0)


def test_clipping_happens_before_the_decay_term():
    # Paddle clips (grad_clip) before adding the L2 term; so does Keras's
    # clipnorm, which runs before `update_step`.
    variable = keras.Variable(np.array([2.0, 0.0], "float32"))
    optimizer = SAG(learning_rate=0.1, weight_decay=0.5, clipnorm=1.0)
    optimizer.apply([np.array([30.0, 40.0], "float32")], [variable])
    expected_step = np.array([0.6, 0.8]) + 0.5 * np.array([2.0, 0.0])
    np.testing.assert_allclose(
        variable.numpy(), [2.0, 0.0] - 0.1 * expected_step, rtol=1e-6
    )


@pytest.mark.filterwarnings("ignore:Gradients do not exist")
def test_variable_without_gradient_does_not_step():
    # Paddle keeps one step count `m` per parameter; so does SAG.
    used = keras.Variable(np.ones(2, "float32"), name="used")
    unused = keras.Variable(np.ones(2, "float32"), name="unused")
    optimizer = SAG(learning_rate=0.1, batch_num=3)
    optimizer.apply([np.ones(2, "float32"), None], [used, unused])
    optimizer.apply(
        [np.ones(2, "float32"), np.ones(2, "float32")], [used, unused]
    )
    assert [int(m) for m in optimizer._counts] == [2, 1]
    # `unused` took its first step: slot 0, one slot filled.
    np.testing.assert_allclose(unused.numpy(), [0.9, 0.9], rtol=1e-6)


def test_master_copy_follows_writes_to_the_variable():
    variable = keras.Variable(np.ones(3, "float16"), dtype="float16")
    optimizer = SAG(learning_rate=0.1, multi_precision=True)
    optimizer.apply([np.full(3, 1.0, "float16")], [variable])
    variable.assign(np.array([5.0, 0.9, 5.0], "float16"))
    optimizer.apply([np.zeros(3, "float16")], [variable])
    # Entries 0 and 2 were rewritten: the master takes them from the
    # variable. Entry 1 kept the master's float32 value 0.9.
    np.testing.assert_allclose(
        optimizer._master_weights[0].numpy(), [5.0, 0.9, 5.0], rtol=1e-6
    )


@pytest.mark.tf_only
@pytest.mark.parametrize("weight_decay", [None, 0.1])
def test_embedding_gradients_are_handled_densely(weight_decay):
    model = keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(10, 4, name="emb"),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )
    optimizer = SAG(learning_rate=0.1, batch_num=2, weight_decay=weight_decay)
    model.compile(optimizer=optimizer, loss="mse")
    table = model.get_layer("emb").embeddings.numpy().copy()
    x = np.array([[1, 2, 3]] * 4, "int32")
    model.fit(x, np.ones((4, 1), "float32"), epochs=2, verbose=0)
    new_table = model.get_layer("emb").embeddings.numpy()
    assert not np.allclose(new_table[1], table[1])  # in the batch
    if weight_decay is None:  # row 5 gets a zero gradient
        np.testing.assert_array_equal(new_table[5], table[5])
    else:  # and the decay term moves it
        assert not np.allclose(new_table[5], table[5])
