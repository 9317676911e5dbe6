"""THOR in Keras workflows: conversion, the two steps, robustness."""

import warnings

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.src.thor import blocks
from tests import helpers

pytestmark = pytest.mark.thor_training


def _digits_like(samples=96, features=12, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = (x[:, :classes].argmax(axis=1)).astype("int32")
    return x, y


def _thor(**overrides):
    options = dict(learning_rate=0.05, damping=0.05, momentum=0.9, frequency=3)
    options.update(overrides)
    return keras_thor.optimizers.THOR(**options)


def _converted_mlp(optimizer=None, features=12, classes=4):
    base = keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(classes, name="logits"),
        ]
    )
    model = keras_thor.convert_to_thor_model(base)
    model.compile(
        optimizer=optimizer or _thor(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


class SmallClassifier(keras_thor.models.ThorModel):
    """A subclassed THOR model, unbuilt until it trains."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.logits = keras.layers.Dense(4)

    def call(self, x):
        return self.logits(self.hidden(x))


def _fit(model, epochs=2, **kwargs):
    x, y = _digits_like()
    return model.fit(
        x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, **kwargs
    )


# Conversion.


def test_convert_sequential_keeps_weights_names_and_outputs():
    base = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, padding="same", name="conv"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Conv2D(4, 3, groups=2, name="grouped"),
            keras.layers.Flatten(),
            keras.layers.Dense(3, name="head"),
        ],
        name="small",
    )
    with pytest.warns(UserWarning, match=r"1 BatchNormalization \(8 p"):
        converted = keras_thor.convert_to_thor_model(base)
    # Converted in place: the same object, class and layers.
    assert converted is base and type(converted) is keras.Sequential
    assert converted.name == "small"
    assert [type(layer).__name__ for layer in converted.layers] == [
        "Conv2D",
        "BatchNormalization",
        "Conv2D",
        "Flatten",
        "Dense",
    ]
    rules = [
        row.rule for row in keras_thor.curvature_coverage(converted).layers
    ]
    assert rules[0] == rules[2] == "ConvKronecker"
    assert rules[1].startswith("first-order: MindSpore's rule")
    assert rules[3] == "DenseKronecker"
    assert [layer.name for layer in converted.layers] == [
        layer.name for layer in base.layers
    ]
    assert [w.name for w in converted.weights] == [w.name for w in base.weights]
    helpers.assert_all_close(
        helpers.weights_of(converted), helpers.weights_of(base)
    )
    x = np.random.default_rng(0).normal(size=(5, 8, 8, 1)).astype("float32")
    np.testing.assert_allclose(converted(x), base(x), rtol=1e-6, atol=1e-6)


def test_convert_functional_with_a_nested_model_and_shared_layer():
    inner = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(6, name="inner_dense")],
        name="inner",
    )
    inputs = keras.Input((5,), dtype="int32")
    embedded = keras.layers.Embedding(20, 6, name="embed")(inputs)
    normed = keras.layers.LayerNormalization(name="norm")(embedded)
    shared = keras.layers.Dense(6, activation="tanh", name="shared")
    hidden = shared(shared(normed))
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    outputs = keras.layers.Dense(2, name="head")(inner(pooled))
    base = keras.Model(inputs, outputs, name="encoder")
    outputs_before = base(np.zeros((1, 5), "int32"))
    converted = keras_thor.convert_to_thor_model(base)
    assert converted is base
    rules = {
        row.name: row.rule
        for row in keras_thor.curvature_coverage(converted).layers
    }
    assert rules == {
        "embed": "EmbeddingKronecker",
        "norm": "NormalizationDiagonal",
        "shared": "DenseKronecker",
        "inner_dense": "DenseKronecker",
        "head": "DenseKronecker",
    }
    # The hooked layers compute what they computed.
    np.testing.assert_allclose(
        converted(np.zeros((1, 5), "int32")), outputs_before, rtol=1e-6
    )
    x = np.random.default_rng(0).integers(0, 20, (4, 5)).astype("int32")

    converted.compile(
        optimizer=_thor(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    y = np.array([0, 1, 1, 0])
    converted.fit(x, y, epochs=2, verbose=0)
    optimizer = converted.optimizer
    assert len(optimizer.curvature_blocks) == 4
    assert optimizer.curvature_troubles == 0
    assert all(np.isfinite(w).all() for w in helpers.weights_of(converted))


def test_convert_resnet50_preconditions_every_convolution_and_the_head():
    base = keras.applications.ResNet50(
        weights=None, input_shape=(32, 32, 3), classes=10
    )
    x = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype("float32")
    before = base.predict(x, verbose=0)
    with pytest.warns(UserWarning, match="53 BatchNormalization"):
        converted = keras_thor.convert_to_thor_model(base)
    rules = [
        row.rule for row in keras_thor.curvature_coverage(converted).layers
    ]
    assert rules.count("ConvKronecker") == 53
    assert rules.count("DenseKronecker") == 1
    assert len(rules) == 107  # and 53 BatchNormalization layers
    assert converted is base
    # The hooked layers compute what they computed.
    np.testing.assert_allclose(
        converted.predict(x, verbose=0), before, atol=1e-5
    )


def test_convert_rejects_what_it_cannot_convert():
    with pytest.raises(TypeError, match="`model` must be a `keras.Model`"):
        keras_thor.convert_to_thor_model(keras.layers.Dense(2))
    with pytest.raises(ValueError, match="must be built"):
        keras_thor.convert_to_thor_model(
            keras.Sequential([keras.layers.Dense(2)])
        )


def test_thor_on_an_unconverted_model_says_to_convert():
    model = helpers.mlp()
    model.compile(optimizer=_thor(), loss="mse")
    x, y = helpers.regression_data()
    with pytest.raises(ValueError, match="convert_to_thor_model"):
        model.fit(x, y, verbose=0)


def test_thor_layers_in_a_plain_keras_model_say_to_convert():
    model = keras.Sequential(
        [keras.Input((6,)), keras_thor.layers.ThorDense(3)]
    )
    model.compile(optimizer=_thor(), loss="mse")
    x, y = helpers.regression_data()
    with pytest.raises(ValueError, match="convert_to_thor_model"):
        model.fit(x, y, verbose=0)


def test_subclassed_thor_model_trains():
    model = SmallClassifier()
    model.compile(
        optimizer=_thor(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = _fit(model, epochs=3)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert len(model.optimizer.curvature_blocks) == 2


@pytest.mark.tf_only
def test_each_step_variant_is_traced_once_from_a_tf_data_pipeline():
    """An unbuilt subclassed model, batches of 16 over 100 rows (a partial
    last batch, so a batch dimension of `None`): the model and THOR are
    built before the first trace, and the host-fetched first step and the
    in-graph fetches after it share one trace per variant."""
    import tensorflow as tf

    model = SmallClassifier()
    model.compile(
        optimizer=_thor(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = _digits_like(samples=100)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    model.fit(data, epochs=2, verbose=0)
    assert int(model.optimizer.iterations) == 14
    for key in ("refresh", "plain"):
        traced = model.train_function.traced_variant(key)
        assert traced.experimental_get_tracing_count() == 1, key


def test_thor_model_with_another_optimizer_trains_as_keras():
    x, labels = _digits_like()
    y = np.eye(4, dtype="float32")[labels]
    results = []
    for converted in (True, False):
        keras.utils.set_random_seed(3)
        base = keras.Sequential(
            [keras.Input((12,)), keras.layers.Dense(4, name="d")]
        )
        model = keras_thor.convert_to_thor_model(base) if converted else base
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        results.append(helpers.weights_of(model))
    helpers.assert_all_close(results[0], results[1], atol=1e-6)


# The two traced steps.


def _state(thor, index):
    """The curvature state of THOR's variable `index`."""
    return thor.state_for(thor.curvature_blocks[index].kernel)


def _count_refresh_steps(monkeypatch, model):
    """Records the steps at which dense statistics are computed."""
    steps = helpers.RunTimeSteps()
    original = blocks.dense_statistics

    def counted(inputs, sample_output_grads):
        steps.record(model.optimizer.iterations)
        return original(inputs, sample_output_grads)

    monkeypatch.setattr(blocks, "dense_statistics", counted)
    return steps


def test_statistics_are_computed_on_refresh_steps_only(monkeypatch):
    model = _converted_mlp(_thor(frequency=4))
    steps = _count_refresh_steps(monkeypatch, model)
    inverses = []

    class Inverses(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            # `self.model` (on JAX Keras syncs the training state first).
            inverses.append(_state(self.model.optimizer, 2).g_inverse)

    _fit(model, epochs=2, callbacks=[Inverses()])  # 12 steps
    # Refreshes at steps 0, 4, 8; two THOR layers each.
    assert sorted(steps.steps()) == [0, 0, 4, 4, 8, 8]
    for step in range(12):
        same_as_previous = step > 0 and np.array_equal(
            inverses[step], inverses[step - 1]
        )
        assert same_as_previous == (step % 4 != 0), step


def test_steps_per_execution_chunks_respect_the_refresh_schedule(monkeypatch):
    model = _converted_mlp()
    model.compile(
        optimizer=_thor(frequency=5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=4,
    )
    steps = _count_refresh_steps(monkeypatch, model)
    _fit(model, epochs=3)  # 18 steps: refreshes at 0, 5, 10, 15
    assert int(model.optimizer.iterations.numpy()) == 18
    # Two THOR layers.
    assert sorted(steps.steps()) == [0, 0, 5, 5, 10, 10, 15, 15]


def test_train_on_batch_refreshes_on_schedule():
    model = _converted_mlp(_thor(frequency=2))
    x, y = _digits_like()
    seen = []
    for _ in range(4):
        model.train_on_batch(x[:16], y[:16])
        seen.append(_state(model.optimizer, 2).a_inverse)
    np.testing.assert_array_equal(seen[0], seen[1])
    assert not np.array_equal(seen[1], seen[2])


def test_fit_with_validation_callbacks_and_class_weights():
    model = _converted_mlp()
    x, y = _digits_like()
    stopper = keras.callbacks.EarlyStopping(monitor="val_loss", patience=50)
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=3,
        validation_data=(x[:32], y[:32]),
        class_weight={0: 1.0, 1: 2.0, 2: 1.0, 3: 0.5},
        callbacks=[
            stopper,
            keras.callbacks.LearningRateScheduler(lambda e: 0.05),
        ],
        verbose=0,
    )
    assert set(history.history) >= {"loss", "val_loss", "val_accuracy"}
    assert len(history.history["val_loss"]) == 3
    model.evaluate(x, y, verbose=0)
    assert model.predict(x, verbose=0).shape == (96, 4)


def test_per_step_array_that_ends_early_is_a_clear_error():
    model = _converted_mlp(_thor(learning_rate=np.full(10, 0.05)))
    with pytest.raises(ValueError, match="reached step 10"):
        _fit(model, epochs=2)  # 12 steps
    assert int(model.optimizer.iterations.numpy()) == 10


@pytest.mark.parametrize("steps_per_execution", [1, 4])
@pytest.mark.parametrize("cardinality", ["known", "unknown"])
def test_per_step_array_as_long_as_training_is_enough(
    steps_per_execution, cardinality
):
    import tensorflow as tf

    x, y = _digits_like()  # 6 batches of 16
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    if cardinality == "unknown":
        dataset = dataset.filter(lambda features, label: True)
    # Keras 3.15 on TensorFlow counts one more iteration per epoch when it
    # has to run into the end of data (unknown cardinality, one step per
    # execution), for every optimizer; THOR's per-step values follow
    # `iterations`. On JAX the end of data stops before the step.
    runs_into_the_end = keras.backend.backend() == "tensorflow" and (
        cardinality,
        steps_per_execution,
    ) == ("unknown", 1)
    steps = 12 + (2 if runs_into_the_end else 0)
    model = _converted_mlp()
    model.compile(
        optimizer=_thor(learning_rate=np.full(steps, 0.05)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )
    model.fit(dataset, epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == steps


def test_convolutions_without_a_static_image_size_train():
    import tensorflow as tf

    def images():
        rng = np.random.default_rng(0)
        for size in (8, 10, 8, 10):
            yield (
                rng.normal(size=(4, size, size, 1)).astype("float32"),
                rng.integers(0, 3, 4),
            )

    dataset = tf.data.Dataset.from_generator(
        images,
        output_signature=(
            tf.TensorSpec((None, None, None, 1), "float32"),
            tf.TensorSpec((None,), "int64"),
        ),
    )
    inputs = keras.Input((None, None, 1))
    features = keras.layers.Conv2D(4, 3, padding="same", name="conv")(inputs)
    pooled = keras.layers.GlobalAveragePooling2D()(features)
    outputs = keras.layers.Dense(3, name="head")(pooled)
    model = keras_thor.convert_to_thor_model(keras.Model(inputs, outputs))
    model.compile(
        optimizer=_thor(frequency=2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(dataset, epochs=2, verbose=0)
    assert model.optimizer.curvature_troubles == 0
    assert all(np.isfinite(w).all() for w in helpers.weights_of(model))


def test_an_overridden_train_step_is_never_silently_replaced():
    class Custom(keras_thor.models.ThorModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(4)
            self.overridden_step_ran = False

        def call(self, x):
            return self.dense(x)

        def train_step(self, *args):  # `(data)`, on JAX `(state, data)`
            self.overridden_step_ran = True
            return super().train_step(*args)

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = Custom()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    _fit(model, epochs=1)
    assert model.overridden_step_ran  # Keras's loop ran the override
    model.compile(optimizer=_thor(), loss=loss)
    with pytest.raises(ValueError, match="cannot run an overridden"):
        _fit(model, epochs=1)


def test_loss_scale_optimizer_wrapping_gives_the_same_training():
    results = []
    for wrapped in (False, True):
        keras.utils.set_random_seed(1)
        optimizer = _thor()
        if wrapped:
            optimizer = keras.optimizers.LossScaleOptimizer(
                optimizer, initial_scale=256.0
            )
        model = _converted_mlp(optimizer)
        _fit(model, epochs=2)
        results.append(helpers.weights_of(model))
    helpers.assert_all_close(results[0], results[1], atol=2e-5, rtol=1e-4)


# Robustness.


def test_non_finite_batches_leave_weights_and_inverses_finite():
    model = _converted_mlp(_thor(frequency=2))
    optimizer = model.optimizer
    x, y = _digits_like()
    model.fit(x[:32], y[:32], batch_size=16, shuffle=False, verbose=0)
    state = {v.name: np.array(v.numpy()) for v in optimizer.variables}
    kernel = np.array(model.get_layer("hidden").kernel.numpy())
    bad = x[:16].copy()
    bad[3, 2] = np.nan  # step 2 refreshes: its statistics are NaN
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.train_on_batch(bad, y[:16])
        bad[3, 2] = np.inf
        model.train_on_batch(bad, y[:16])
        model.train_on_batch(bad, y[:16])  # a refresh step again
    messages = [str(w.message) for w in caught]
    assert sum("could not use the fresh curvature" in m for m in messages) == 1
    # Each refresh had non-finite hidden-layer statistics (and, depending
    # on what relu makes of them, logits-layer ones).
    assert 2 <= optimizer.curvature_troubles <= 4
    # The NaN reaches the hidden kernel's gradient (x · dz), not the others
    # (relu's gradient masks it): that kernel, its momentum and its inverses
    # stay.
    np.testing.assert_array_equal(model.get_layer("hidden").kernel, kernel)
    for variable in optimizer.variables:
        name = variable.name
        if name.startswith("hidden_kernel"):
            np.testing.assert_array_equal(variable, state[name], err_msg=name)
    model.fit(x, y, batch_size=16, verbose=0)
    assert all(np.isfinite(w).all() for w in helpers.weights_of(model))
    assert all(np.isfinite(v).all() for v in helpers.optimizer_state(optimizer))


def test_round_off_indefinite_factor_falls_back_to_more_damping():
    from keras_thor.src.thor.block_inverse import diagonal_blocks
    from keras_thor.src.thor.factor_inverses import block_factor_inverses

    def factor_inverses(a, g, scale, diagonal, damping, split, *previous):
        return block_factor_inverses(
            diagonal_blocks(scale * a, split),
            diagonal_blocks(scale * g, split),
            diagonal,
            damping,
            *previous,
            layouts=((1, a.shape[-1]), (1, g.shape[-1])),
        )

    # A Gram matrix is positive semi-definite; round-off can push an
    # eigenvalue below zero, which tiny damping does not repair.
    nearly = np.diag([1.0, -1e-3, 2.0]).astype("float32")
    previous = np.eye(3, dtype="float32")[None] * 7.0
    eye = np.eye(3, dtype="float32")
    a_inverse, g_inverse, trouble = factor_inverses(
        nearly[None], eye[None], 1.0, False, 1e-12, 128, previous, previous
    )
    assert bool(trouble)
    shift = 1e-6 + np.mean(np.diag(nearly))
    expected = np.linalg.inv(nearly + shift * np.eye(3))
    np.testing.assert_allclose(a_inverse[0], expected, rtol=1e-5)
    np.testing.assert_allclose(g_inverse[0], eye / (1 + 1e-6), rtol=1e-5)

    indefinite = np.diag([1.0, -5.0, 2.0]).astype("float32")
    a_inverse, g_inverse, trouble = factor_inverses(
        indefinite[None], eye[None], 1.0, False, 1e-12, 128, previous, previous
    )
    assert bool(trouble)
    np.testing.assert_array_equal(a_inverse, previous)
    np.testing.assert_array_equal(g_inverse, previous)


def test_mixed_precision_wraps_thor_in_a_loss_scale_optimizer():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        base = keras.Sequential(
            [
                keras.Input((12,)),
                keras.layers.Dense(16, activation="relu", name="hidden"),
                keras.layers.Dense(4, dtype="float32", name="logits"),
            ]
        )
        model = keras_thor.convert_to_thor_model(base)
        model.compile(
            optimizer=_thor(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        history = _fit(model, epochs=3)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    thor = model.optimizer.inner_optimizer
    # G was built from gradients with the 32768 loss scale undone.
    assert thor.curvature_troubles == 0
    assert float(model.optimizer.dynamic_scale) == 32768.0
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert all(np.isfinite(w).all() for w in helpers.weights_of(model))
