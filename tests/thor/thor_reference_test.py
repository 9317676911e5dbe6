"""THOR in `model.fit` against the NumPy reference, step by step."""

import numpy as np
import pytest

import keras_thor
from tests.thor import keras_models
from tests.thor import reference

pytestmark = pytest.mark.thor_training

MLP = [
    {"type": "dense", "units": 7, "activation": "relu"},
    {"type": "dense", "units": 5, "activation": "linear"},
]
CNN = [
    {
        "type": "conv2d",
        "filters": 3,
        "kernel_size": (3, 3),
        "padding": "same",
        "activation": "relu",
    },
    {
        "type": "conv2d",
        "filters": 4,
        "kernel_size": (2, 2),
        "strides": (2, 1),
        "padding": "valid",
        "activation": "tanh",
    },
    {
        "type": "conv2d",
        "filters": 3,
        "kernel_size": (3, 2),
        "dilation_rate": (2, 1),
        "padding": "same",
    },
    {"type": "global_average_pooling2d"},
    {"type": "dense", "units": 4},
]
ENCODER = [
    {"type": "embedding", "input_dim": 11, "output_dim": 6},
    {"type": "layer_norm", "epsilon": 1e-3},
    {"type": "dense", "units": 6, "activation": "tanh"},
    {"type": "global_average_pooling1d"},
    {"type": "dense", "units": 3},
]


def _data(kind, samples=48, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "mlp":
        x = rng.normal(size=(samples, 6)).astype("float32")
        y = rng.integers(0, 5, samples)
        return MLP, (6,), "float32", x, y
    if kind == "cnn":
        x = rng.normal(size=(samples, 7, 6, 2)).astype("float32")
        y = rng.integers(0, 4, samples)
        return CNN, (7, 6, 2), "float32", x, y
    x = rng.integers(0, 11, (samples, 5)).astype("int32")
    y = rng.integers(0, 3, samples)
    return ENCODER, (5,), "int32", x, y


def _recorded_fit(model, specs, x, y, **fit_options):
    """`model.fit` in order; returns the weights after every step."""
    history = keras_models.WeightHistory(specs)
    model.fit(
        x, y, shuffle=False, verbose=0, callbacks=[history], **fit_options
    )
    return history.history


def _fit_and_reference(
    kind, epochs=1, batch_size=8, loss="ce", fit=None, **hyper
):
    specs, shape, dtype, x, y = _data(kind)
    fit = dict(fit or {})
    loss = "mse" if loss == "mse" else reference.LOSSES[1]
    if loss == "mse":
        y = np.random.default_rng(1).normal(size=(len(x), specs[-1]["units"]))
        y = y.astype("float32")
    model = keras_models.keras_model(specs, shape, dtype)
    start = keras_models.reference_weights(model, specs)
    decay_filter = hyper.pop("decay_filter", None)
    model.compile(
        optimizer=keras_thor.optimizers.THOR(
            decay_filter=None
            if decay_filter is None
            else (lambda v: decay_filter(v.path)),
            **hyper,
        ),
        loss=keras_models.loss_object(loss),
        **fit.pop("compile", {}),
    )
    actual = _recorded_fit(
        model, specs, x, y, batch_size=batch_size, epochs=epochs, **fit
    )
    reference_hyper = dict(hyper)
    # THOR takes the batch `fit` trains with when not given one.
    reference_hyper.setdefault("batch_size", batch_size)
    if decay_filter is not None:
        names = {i: f"layer{i}" for i in range(len(specs))}
        reference_hyper["decay_filter"] = lambda i, name: decay_filter(
            f"{names[i]}/{name}"
        )
    batches = keras_models.random_batches(x, y, batch_size) * epochs
    expected = reference.run_reference(
        specs, start, batches, loss, **reference_hyper
    )
    return actual, [keras_models.flat(w) for w in expected], model


HYPER = dict(learning_rate=0.05, damping=0.03, momentum=0.9, frequency=3)


@pytest.mark.parametrize("kind", ["mlp", "cnn", "encoder"])
def test_fit_equals_the_reference_step_by_step(kind, fusion_mode):
    actual, expected, _ = _fit_and_reference(kind, split_dim=4, **HYPER)
    assert len(actual) == len(expected) == 6
    assert keras_models.relative_error(actual[0], expected[0]) < 1e-5
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert keras_models.relative_error(a, e) < 1e-4, step


def test_fifty_steps_with_decay_nesterov_clipping_and_blocks():
    actual, expected, _ = _fit_and_reference(
        "mlp",
        epochs=9,
        batch_size=8,
        learning_rate=0.02,
        damping=0.05,
        momentum=0.8,
        weight_decay=1e-3,
        decay_filter=lambda path: "bias" not in path,
        use_nesterov=True,
        enable_clip_grad=True,
        frequency=7,
        split_dim=3,
    )
    assert len(actual) == 54
    assert keras_models.relative_error(actual[-1], expected[-1]) < 2e-4


def test_per_step_learning_rate_and_damping_arrays():
    steps = 12
    learning_rate = np.linspace(0.05, 0.01, steps)
    damping = np.geomspace(0.1, 0.01, steps)
    actual, expected, _ = _fit_and_reference(
        "encoder",
        epochs=2,
        learning_rate=learning_rate,
        damping=damping,
        momentum=0.9,
        frequency=4,
        batch_size=32,
    )
    for a, e in zip(actual, expected):
        assert keras_models.relative_error(a, e) < 1e-4


def test_mse_loss_scale_and_sample_weights_follow_the_reference():
    specs, shape, dtype, x, _ = _data("mlp")
    y = np.random.default_rng(1).normal(size=(len(x), 5)).astype("float32")
    weights = np.random.default_rng(2).uniform(0.2, 2.0, len(x))
    model = keras_models.keras_model(specs, shape, dtype)
    start = keras_models.reference_weights(model, specs)
    model.compile(
        optimizer=keras_thor.optimizers.THOR(
            0.05, 0.03, 0.9, loss_scale=128, frequency=2
        ),
        loss="mse",
    )
    actual = _recorded_fit(
        model, specs, x, y, sample_weight=weights, batch_size=16
    )
    batches = [
        (x[i : i + 16], y[i : i + 16], weights[i : i + 16])
        for i in range(0, len(x), 16)
    ]
    expected = reference.run_reference(
        specs,
        start,
        batches,
        "mse",
        learning_rate=0.05,
        damping=0.03,
        momentum=0.9,
        frequency=2,
        loss_scale=128.0,
    )
    for a, e in zip(actual, expected):
        assert keras_models.relative_error(a, keras_models.flat(e)) < 1e-4


@pytest.mark.parametrize(
    "fit_options",
    [
        {"compile": {"jit_compile": True}},
        {"compile": {"steps_per_execution": 4}},
        {"compile": {"run_eagerly": True}},
    ],
    ids=["jit", "steps_per_execution", "eager"],
)
def test_compiled_eager_and_multi_step_execution_agree(fit_options):
    actual, expected, model = _fit_and_reference(
        "cnn", epochs=2, fit=fit_options, **HYPER
    )
    assert model.optimizer.iterations.numpy() == 12
    assert keras_models.relative_error(actual[-1], expected[-1]) < 1e-4


WIDE = [
    {"type": "dense", "units": 32, "activation": "tanh"},
    {"type": "dense", "units": 5, "activation": "linear"},
]


@pytest.mark.parametrize("batch_size", [4, 5], ids=["both", "first"])
def test_factored_order_equals_the_reference(batch_size):
    """Wide layers, small batches: the factored order is cheaper.

    At batch 4 both kernels take `(A⁻¹Xᵀ)(D·G⁻¹)`, at batch 5 only the
    first (6 -> 32); the weights still follow the reference step by step.
    """
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 6)).astype("float32")
    y = rng.integers(0, 5, 40)
    model = keras_models.keras_model(WIDE, (6,))
    start = keras_models.reference_weights(model, WIDE)
    model.compile(
        optimizer=keras_thor.optimizers.THOR(
            **HYPER, split_dim=16, batch_size=batch_size
        ),
        loss=keras_models.loss_object("ce"),
    )
    actual = _recorded_fit(model, WIDE, x, y, batch_size=batch_size)
    expected = reference.run_reference(
        WIDE,
        start,
        keras_models.random_batches(x, y, batch_size),
        reference.LOSSES[1],
        split_dim=16,
        **HYPER,
    )
    blocks = model.optimizer.curvature_blocks
    factored = {
        blocks[i].layer.name for i in model.optimizer.step_plan.factored_kernels
    }
    assert factored == ({"layer0", "layer1"} if batch_size == 4 else {"layer0"})
    for a, e in zip(actual, expected):
        assert keras_models.relative_error(a, keras_models.flat(e)) < 1e-4
