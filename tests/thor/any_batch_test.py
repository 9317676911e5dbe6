"""THOR trains, evaluates and predicts on batches of any size.

Partial last batches, tf.data batches of unknown static size, batches of
one, and layers wider than `split_dim`, for every THOR-aware layer kind and
both preconditioning orders of a Dense kernel (direct `A⁻¹·g·G⁻¹` and
factored `(A⁻¹Xᵀ)(D·G⁻¹)`), whatever `batch_size` THOR is given.
"""

import keras
import numpy as np
import pytest

import keras_thor
from tests import helpers

pytestmark = pytest.mark.thor_training

# On JAX (each batch shape compiles each step variant: costly on 2 cores)
# the factored order on partial last batches and the MNIST MLP run.
ON_TENSORFLOW = pytest.mark.tf_only

ROWS = 21  # two full batches of 8 and a partial one of 5
BATCH = 8
SPLIT_DIM = 4
CLASSES = 3
TOKENS = 20
# THOR's `batch_size` for each order: for batches of one, every Dense
# kernel is cheaper in the factored order; for 4096, none is.
ORDERS = {"factored": 1, "direct": 4096}
DENSE_LAYERS = {"sequence_dense", "wide", "mine", "logits"}
# The layers of `_every_kind` with Kronecker blocks (separable ones: two;
# the LayerNormalization takes the diagonal rule).
BLOCK_LAYERS = sorted(
    [
        *("grouped", "depthwise", "separable", "separable"),
        *("conv1d", "depthwise1d", "separable1d", "separable1d", "conv3d"),
        *("embedding", "query", "key", "value", "attention_output"),
        *DENSE_LAYERS,
    ]
)


@keras.saving.register_keras_serializable(package="any_batch_test")
class MyDense(keras.layers.Dense):
    """A user's Dense subclass that keeps `Dense.call`."""


def _every_kind():
    """One small functional model holding every THOR-aware layer kind.

    With `split_dim=4`, every factor larger than 4 has several blocks.
    """
    layers = keras.layers
    image = keras.Input((6, 6, 4), name="image")
    x = layers.Conv2D(
        6, 3, groups=2, padding="same", activation="relu", name="grouped"
    )(image)
    x = layers.DepthwiseConv2D(3, padding="same", name="depthwise")(x)
    x = layers.SeparableConv2D(6, 3, activation="relu", name="separable")(x)
    image_features = layers.GlobalAveragePooling2D()(x)

    signal = keras.Input((10, 3), name="signal")
    y = layers.Conv1D(6, 3, activation="relu", name="conv1d")(signal)
    y = layers.DepthwiseConv1D(3, name="depthwise1d")(y)
    y = layers.SeparableConv1D(5, 3, name="separable1d")(y)
    signal_features = layers.GlobalAveragePooling1D()(y)

    volume = keras.Input((4, 4, 4, 2), name="volume")
    z = layers.Conv3D(5, 2, activation="relu", name="conv3d")(volume)
    volume_features = layers.GlobalAveragePooling3D()(z)

    tokens = keras.Input((6,), dtype="int32", name="tokens")
    t = layers.Embedding(TOKENS, 8, name="embedding")(tokens)
    attended = layers.MultiHeadAttention(2, 4, name="attention")(t, t)
    t = layers.LayerNormalization(name="norm")(layers.Add()([t, attended]))
    # 6 positions per example: still factored for a batch of one.
    t = layers.Dense(16, activation="relu", name="sequence_dense")(t)
    token_features = layers.GlobalAveragePooling1D()(t)

    merged = layers.Concatenate()(
        [image_features, signal_features, volume_features, token_features]
    )
    h = layers.Dense(16, activation="relu", name="wide")(merged)
    h = MyDense(10, activation="tanh", name="mine")(h)
    outputs = layers.Dense(CLASSES, name="logits")(h)
    base = keras.Model([image, signal, volume, tokens], outputs)
    return keras_thor.convert_to_thor_model(base)


def _data(rows, seed=0):
    rng = np.random.default_rng(seed)
    x = {
        "image": rng.normal(size=(rows, 6, 6, 4)).astype("float32"),
        "signal": rng.normal(size=(rows, 10, 3)).astype("float32"),
        "volume": rng.normal(size=(rows, 4, 4, 4, 2)).astype("float32"),
        "tokens": rng.integers(0, TOKENS, (rows, 6)).astype("int32"),
    }
    y = rng.integers(0, CLASSES, rows).astype("int32")
    return x, y


def _thor(batch_size):
    return keras_thor.optimizers.THOR(
        learning_rate=0.02,
        damping=0.1,
        momentum=0.9,
        batch_size=batch_size,
        frequency=2,
        split_dim=SPLIT_DIM,
    )


def _compiled(batch_size):
    model = _every_kind()
    model.compile(
        optimizer=_thor(batch_size),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _inverses(optimizer):
    return {
        v.path: keras.ops.convert_to_numpy(v)
        for v in optimizer.variables
        if v.name.endswith(("_a_inverse", "_g_inverse"))
    }


def _is_initial(inverse):
    """Whether a stored inverse is still what `THOR.build` made."""
    if inverse.ndim == 1:  # an Embedding's diagonal A⁻¹
        return np.array_equal(inverse, np.ones_like(inverse))
    eye = np.eye(inverse.shape[-1], dtype=inverse.dtype)
    return np.array_equal(inverse, np.broadcast_to(eye, inverse.shape))


def _check_fit(model, fit, steps):
    """Runs `fit()` and checks that it took `steps` steps, moved every
    trainable weight to finite values with finite losses, and refreshed
    every stored inverse."""
    optimizer = model.optimizer
    before = _inverses(optimizer) if optimizer.built else None
    start = int(optimizer.iterations.numpy())
    weights = {v.path: v.numpy() for v in model.trainable_weights}
    history = fit()
    assert int(optimizer.iterations.numpy()) == start + steps
    assert np.isfinite(history.history["loss"]).all()
    assert all(np.isfinite(w).all() for w in helpers.weights_of(model))
    # Factored-order kernels too: their gradient is formed apart.
    unmoved = [
        v.path
        for v in model.trainable_weights
        if np.array_equal(v.numpy(), weights[v.path])
    ]
    assert not unmoved, unmoved
    assert optimizer.curvature_troubles == 0
    inverses = _inverses(optimizer)
    # Every kernel with curvature has a pair of stored inverses.
    assert len(inverses) == 2 * len(optimizer.curvature_blocks)
    # Grouped, depthwise and wider-than-split_dim factors: several blocks.
    assert max(len(i) for i in inverses.values() if i.ndim == 3) > 1
    assert all(np.isfinite(i).all() for i in inverses.values())
    if before is None:
        stale = [path for path, i in inverses.items() if _is_initial(i)]
    else:
        stale = [
            path
            for path, i in inverses.items()
            if np.array_equal(i, before[path])
        ]
    assert not stale, stale


def _factored_layers(optimizer):
    blocks = optimizer.curvature_blocks
    return {blocks[i].layer.name for i in optimizer.step_plan.factored_kernels}


def _dataset(x, y=None, batch=BATCH):
    import tensorflow as tf

    elements = x if y is None else (x, y)
    dataset = tf.data.Dataset.from_tensor_slices(elements).batch(batch)
    # No `drop_remainder`: the static batch dimension is unknown.
    assert all(
        spec.shape[0] is None for spec in tf.nest.flatten(dataset.element_spec)
    )
    return dataset


def _check_predictions(predictions, rows):
    assert predictions.shape == (rows, CLASSES)
    assert np.isfinite(predictions).all()


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(order, marks=() if order == "factored" else ON_TENSORFLOW)
        for order in sorted(ORDERS)
    ],
)
def order_and_model(request):
    """One model per order, shared by the batch cases (each checks only
    what its own `fit` did): tracing THOR's steps is what takes time."""
    keras.utils.set_random_seed(0)
    return request.param, _compiled(batch_size=ORDERS[request.param])


@pytest.mark.parametrize(
    "batches",
    [
        "partial_last",
        pytest.param("tf_data", marks=ON_TENSORFLOW),
        pytest.param("one", marks=ON_TENSORFLOW),
    ],
)
def test_every_layer_kind_trains_on_any_batch(order_and_model, batches):
    order, model = order_and_model
    # Data of its own: the first layers' input factors `A` change only if
    # their inputs do.
    seed = ["partial_last", "tf_data", "one"].index(batches)
    x, y = _data(ROWS, seed=seed)
    new_x = _data(5, seed=10 + seed)[0]
    options = dict(epochs=2, shuffle=False, verbose=0)
    # 2 epochs of 3 batches (8, 8, 5): the partial batch falls on one
    # refresh step and one plain step (frequency 2), whatever the start.
    if batches == "partial_last":
        _check_fit(model, lambda: model.fit(x, y, BATCH, **options), 6)
        loss = model.evaluate(x, y, batch_size=BATCH, verbose=0)
        _check_predictions(model.predict(x, BATCH, verbose=0), ROWS)
        _check_predictions(model.predict(new_x, BATCH, verbose=0), 5)
    elif batches == "tf_data":
        data = _dataset(x, y)
        _check_fit(model, lambda: model.fit(data, **options), 6)
        loss = model.evaluate(data, verbose=0)
        _check_predictions(model.predict(_dataset(x), verbose=0), ROWS)
        _check_predictions(model.predict(_dataset(new_x), verbose=0), 5)
    else:
        x, y = _data(5, seed=seed)
        _check_fit(model, lambda: model.fit(x, y, 1, **options), 10)
        loss = model.evaluate(x, y, batch_size=1, verbose=0)
        _check_predictions(model.predict(x, 1, verbose=0), 5)
        _check_predictions(model.predict(new_x, 2, verbose=0), 5)
    assert np.isfinite(loss)
    blocks = model.optimizer.curvature_blocks.values()
    assert sorted(block.layer.name for block in blocks) == BLOCK_LAYERS
    coverage = keras_thor.curvature_coverage(model)
    assert not coverage.first_order, coverage.first_order
    factored = _factored_layers(model.optimizer)
    assert factored == (DENSE_LAYERS if order == "factored" else set())


def _mlp(batch_size, steps_per_execution=1):
    keras.utils.set_random_seed(0)
    base = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(32, activation="relu", name="wide"),
            MyDense(8, activation="tanh", name="mine"),
            keras.layers.Dense(CLASSES, name="logits"),
        ]
    )
    model = keras_thor.convert_to_thor_model(base)
    model.compile(
        optimizer=_thor(batch_size),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )
    return model


def _mlp_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(37, 12)).astype("float32")
    y = rng.integers(0, CLASSES, 37).astype("int32")
    return x, y  # 4 batches of 8 and one of 5


@ON_TENSORFLOW
def test_steps_per_execution_and_both_orders_take_the_same_steps():
    # Assuming batches of 8, the wide kernel takes the factored order, the
    # narrow ones the direct order.
    model = _mlp(batch_size=8, steps_per_execution=3)
    x, y = _mlp_data()
    # Executions of 3 and 2 steps per epoch.
    _check_fit(
        model,
        lambda: model.fit(x, y, BATCH, epochs=2, shuffle=False, verbose=0),
        2 * 5,
    )
    assert _factored_layers(model.optimizer) == {"wide"}
    assert np.isfinite(model.evaluate(x, y, batch_size=BATCH, verbose=0))
    _check_predictions(model.predict(x, BATCH, verbose=0), 37)

    # The same steps as the direct order, one step per execution, and as
    # the factored order on batches of unknown static size.
    direct = _mlp(batch_size=4096)
    direct.fit(x, y, BATCH, epochs=2, shuffle=False, verbose=0)
    assert not direct.optimizer.step_plan.factored_kernels
    factored = _mlp(batch_size=1)
    factored.fit(_dataset(x, y), epochs=2, shuffle=False, verbose=0)
    assert _factored_layers(factored.optimizer) == {"wide", "mine", "logits"}
    for other in (model, factored):
        helpers.assert_all_close(
            helpers.weights_of(other), helpers.weights_of(direct), atol=1e-5
        )


def test_mnist_mlp_with_default_batch_size_and_a_partial_last_batch():
    # The crash: THOR(batch_size=32) (the default then) picks the
    # factored order for the 784 -> 128 kernel, and fit(batch_size=128) over
    # 1,000 rows ends on a batch of 104; it raised `TypeError: Failed to
    # convert elements of (7, 128, None) to Tensor`.
    base = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(128, activation="relu", name="hidden"),
            keras.layers.Dense(10, name="logits"),
        ]
    )
    model = keras_thor.convert_to_thor_model(base)
    model.compile(
        optimizer=keras_thor.optimizers.THOR(
            0.05, damping=0.03, momentum=0.9, batch_size=32
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    rng = np.random.default_rng(0)
    x = rng.random((1000, 784), dtype="float32")
    y = rng.integers(0, 10, 1000)
    history = model.fit(x, y, batch_size=128, epochs=1, verbose=0)
    assert _factored_layers(model.optimizer) == {"hidden"}
    assert int(model.optimizer.iterations.numpy()) == 8
    assert np.isfinite(history.history["loss"]).all()
    assert all(np.isfinite(w).all() for w in helpers.weights_of(model))
    assert model.predict(x[:5], verbose=0).shape == (5, 10)
