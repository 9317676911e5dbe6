"""THOR's curvature options in `model.fit` against NumPy, step by step.

The expected weights come from `tests/thor/options_reference`, the
documented rules of `factor_decay`, `statistics_frequency`,
`statistics_rows`, `fisher="sampled"` and `kl_clip` (on the direction and
on the velocity) written out in float64 NumPy on top of the MindSpore
reference.
"""

import keras
import numpy as np
import pytest

import keras_thor
from tests.thor import keras_models
from tests.thor import options_reference
from tests.thor import reference
from tests.thor.thor_reference_test import ENCODER
from tests.thor.thor_reference_test import MLP

pytestmark = pytest.mark.thor_training

CE = reference.LOSSES[1]
SMALL_CNN = [
    {
        "type": "conv2d",
        "filters": 3,
        "kernel_size": (3, 3),
        "padding": "same",
        "activation": "tanh",
    },
    {"type": "global_average_pooling2d"},
    {"type": "dense", "units": 3},
]
HYPER = dict(learning_rate=0.05, damping=0.03, momentum=0.9, split_dim=4)


def _data(kind, loss, samples=48, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "mlp":
        specs, shape, dtype = MLP, (6,), "float32"
        x = rng.normal(size=(samples, 6)).astype("float32")
    elif kind == "cnn":
        specs, shape, dtype = SMALL_CNN, (5, 4, 2), "float32"
        x = rng.normal(size=(samples, 5, 4, 2)).astype("float32")
    else:
        specs, shape, dtype = ENCODER, (5,), "int32"
        x = rng.integers(0, 11, (samples, 5)).astype("int32")
    outputs = specs[-1]["units"]
    if loss == "mse":
        y = rng.normal(size=(samples, outputs)).astype("float32")
    else:
        y = rng.integers(0, outputs, samples)
    return specs, shape, dtype, x, y


class _Recorder(keras.callbacks.Callback):
    """The weights and the logs after every batch."""

    def __init__(self, specs):
        super().__init__()
        self.specs = specs
        self.weights = []
        self.logs = []
        self.steps = []
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        # Keras reports the last step of each execution only.
        self.steps.append(self.epoch * self.params["steps"] + batch)
        self.weights.append(
            keras_models.flat(
                keras_models.reference_weights(self.model, self.specs)
            )
        )
        self.logs.append(
            {k: float(np.asarray(v)) for k, v in (logs or {}).items()}
        )


def _fit_and_reference(
    kind,
    loss,
    epochs=2,
    batch_size=8,
    reference_hyper=None,
    compile_options=None,
    **hyper,
):
    """`(recorder, expected weights per step, reference, model)`."""
    specs, shape, dtype, x, y = _data(kind, loss)
    model = keras_models.keras_model(specs, shape, dtype)
    start = keras_models.reference_weights(model, specs)
    model.compile(
        optimizer=keras_thor.optimizers.THOR(**hyper),
        loss=keras_models.loss_object(loss),
        **(compile_options or {}),
    )
    recorder = _Recorder(specs)
    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[recorder],
    )
    hyper = {k: v for k, v in hyper.items() if k != "fisher"}
    if hyper.pop("precondition_biases", None) == "joint":
        hyper["joint_biases"] = True
    hyper.update(reference_hyper or {})
    # THOR takes the batch `fit` trains with when not given one.
    hyper.setdefault("batch_size", batch_size)
    batches = keras_models.random_batches(x, y, batch_size) * epochs
    recorder.start, recorder.batches = start, batches
    expected, optimizer = options_reference.run_options_reference(
        specs,
        start,
        batches,
        "mse" if loss == "mse" else CE,
        **hyper,
    )
    expected = [keras_models.flat(w) for w in expected]
    return recorder, expected, optimizer, model


def _assert_follows(actual, expected, tolerance=1e-4):
    assert len(actual) == len(expected)
    for step, (a, e) in enumerate(zip(actual, expected)):
        error = keras_models.relative_error(a, e)
        assert error < tolerance, (step, error)


# Eager steps are 3x faster to run than to trace for these small models;
# one case of each option runs compiled.
EAGER = {"run_eagerly": True}


@pytest.mark.parametrize(
    "kind, loss, statistics_frequency, compile_options, damping",
    [
        ("mlp", "mse", 2, None, 0.03),
        ("encoder", "ce", None, EAGER, 0.03),
        # The inverses of the averages take the refresh step's damping.
        ("cnn", "ce", 1, EAGER, np.geomspace(0.1, 0.01, 12)),
        # Three statistics steps between refreshes, run as one loop.
        ("mlp", "ce", 1, {"steps_per_execution": 4}, 0.03),
    ],
    ids=[
        "mlp-mse-2",
        "encoder-ce-None-eager",
        "cnn-ce-1-eager-damping",
        "mlp-ce-1-fused",
    ],
)
def test_factor_decay_and_statistics_frequency_follow_the_reference(
    kind, loss, statistics_frequency, compile_options, damping
):
    recorder, expected, optimizer, model = _fit_and_reference(
        kind,
        loss,
        compile_options=compile_options,
        frequency=4,
        factor_decay=0.8,
        statistics_frequency=statistics_frequency,
        weight_decay=1e-3,
        **dict(HYPER, damping=damping),
    )
    assert len(expected) == 12
    period = statistics_frequency or 4
    assert optimizer.statistics_steps == list(range(0, 12, period))
    assert optimizer.refresh_steps == [0, 4, 8]
    if compile_options and "steps_per_execution" in compile_options:
        # Keras reports the last step of each execution only (4 and 2
        # steps of each 6-batch epoch).
        expected = [expected[i] for i in (3, 5, 9, 11)]
    _assert_follows(recorder.weights, expected)
    # The averages differ from the last statistics step's factors: the
    # comparison above would fail without the averaging.
    thor = model.optimizer
    first = thor.curvature_blocks[min(thor.curvature_blocks)]
    state = thor.state_for(first.kernel)
    weight = sum(0.8**i for i in range(len(optimizer.statistics_steps)))
    np.testing.assert_allclose(float(state.factor_weight), weight)
    a, g, c = optimizer.current_factors(0)
    last_g = optimizer.factors[0][-1][1]
    assert not np.allclose(g, last_g, rtol=1e-2)
    stored_g = state.g_factor
    width = g.shape[0]
    blocks = [
        stored_g[b][: min(4, width - 4 * b), : min(4, width - 4 * b)]
        for b in range(stored_g.shape[0])
    ]
    for b, block in enumerate(blocks):
        part = slice(4 * b, 4 * b + block.shape[0])
        np.testing.assert_allclose(
            block, c * g[part, part], rtol=1e-4, atol=1e-6
        )


@pytest.mark.parametrize(
    "options",
    [
        {"weight_decay": 1e-2},
        # The velocity each step leaves, in the averaged factors' norm,
        # with the joint bias rows.
        {
            "kl_clip_mode": "velocity",
            "factor_decay": 0.8,
            "statistics_frequency": 1,
            "damping_split": "pi",
            "precondition_biases": "joint",
        },
        # ν measured on refresh steps only, held through fused steps.
        {
            "kl_clip_mode": "velocity",
            "kl_clip_steps": "refresh",
            "factor_decay": 0.8,
            "statistics_frequency": 1,
            "compile_options": {"steps_per_execution": 2},
        },
        {
            "kl_clip_mode": "velocity",
            "kl_clip_steps": "refresh",
            "burn_in_steps": 2,
            "factor_decay": 0.8,
            "statistics_frequency": 1,
        },
    ],
    ids=[
        "direction",
        "velocity-joint",
        "velocity-refresh-fused",
        "velocity-refresh-burn-in",
    ],
)
def test_kl_clip_follows_the_reference_and_logs_the_guard_scale(options):
    frequency = 3
    recorder, expected, optimizer, model = _fit_and_reference(
        "mlp",
        "ce",
        frequency=frequency,
        kl_clip=0.03,
        learning_rate=0.1,
        damping=0.03,
        momentum=0.9,
        split_dim=4,
        **options,
    )
    scales = np.array(optimizer.guard_scales)
    # The guard is active on some steps, not on others.
    assert (scales < 0.999).any() and (scales == 1.0).any(), scales
    _assert_follows(recorder.weights, [expected[i] for i in recorder.steps])
    # `scales` has one ν per update: burn-in steps update nothing.
    burned = options.get("burn_in_steps", 0)
    logged = [
        logs["thor_guard_scale"]
        for step, logs in zip(recorder.steps, recorder.logs)
        if step >= burned
    ]
    updates = [step - burned for step in recorder.steps if step >= burned]
    np.testing.assert_allclose(logged, scales[updates], rtol=1e-4)
    np.testing.assert_allclose(
        model.optimizer.estimator.guard_scale, scales[-1], rtol=1e-4
    )
    if options.get("kl_clip_steps") == "refresh":
        refresh = np.arange(len(scales)) // frequency * frequency
        np.testing.assert_array_equal(scales, scales[refresh])
    # No kernel takes the factored order under the guard.
    assert model.optimizer.step_plan.factored_kernels == frozenset()


def test_kl_clip_with_factored_order_widths_still_guards_every_kernel():
    """Wide Dense layers at a small batch would take the factored order;
    with `kl_clip` they are preconditioned in the step and guarded."""
    wide = [
        {"type": "dense", "units": 32, "activation": "tanh"},
        {"type": "dense", "units": 5},
    ]
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.integers(0, 5, 16)
    model = keras_models.keras_model(wide, (6,))
    start = keras_models.reference_weights(model, wide)
    hyper = dict(
        learning_rate=0.1, damping=0.03, momentum=0.9, frequency=3, kl_clip=1e-4
    )
    model.compile(
        optimizer=keras_thor.optimizers.THOR(**hyper, batch_size=4),
        loss=keras_models.loss_object("ce"),
        run_eagerly=True,
    )
    recorder = _Recorder(wide)
    model.fit(
        x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[recorder]
    )
    assert model.optimizer.step_plan.factored_kernels == frozenset()
    expected, optimizer = options_reference.run_options_reference(
        wide, start, keras_models.random_batches(x, y, 4), CE, **hyper
    )
    assert min(optimizer.guard_scales) < 0.999
    _assert_follows(recorder.weights, [keras_models.flat(w) for w in expected])


def test_statistics_rows_give_the_inverses_of_the_first_rows():
    """One refresh step: the inverses from `statistics_rows=m` on a batch
    are those of the whole of its first `m` examples."""
    specs, shape, _, x, y = _data("cnn", "ce")
    inverses = []
    for rows, batch in ((5, 16), (None, 5)):
        keras.utils.set_random_seed(0)
        model = keras_models.keras_model(specs, shape)
        model.compile(
            optimizer=keras_thor.optimizers.THOR(
                frequency=2, statistics_rows=rows, **HYPER
            ),
            loss=keras_models.loss_object("ce"),
            run_eagerly=True,
        )
        model.train_on_batch(x[:batch], y[:batch])
        thor = model.optimizer
        inverses.append(
            [
                inverse
                for block in thor.curvature_blocks.values()
                for state in [thor.state_for(block.kernel)]
                for inverse in (state.a_inverse, state.g_inverse)
            ]
        )
    for rows_only, first_rows in zip(*inverses):
        np.testing.assert_allclose(rows_only, first_rows, rtol=1e-5, atol=1e-6)


def test_conv_statistics_rows_cut_only_the_convolutions():
    """One refresh step on 16 examples with `conv_statistics_rows=5`: the
    convolution's inverses are those of the first 5 examples, the Dense
    layer's those of all 16."""
    specs, shape, _, x, y = _data("cnn", "ce")
    inverses = []
    for conv_rows, batch in ((5, 16), (None, 5), (None, 16)):
        keras.utils.set_random_seed(0)
        model = keras_models.keras_model(specs, shape)
        model.compile(
            optimizer=keras_thor.optimizers.THOR(
                frequency=2, conv_statistics_rows=conv_rows, **HYPER
            ),
            loss=keras_models.loss_object("ce"),
            run_eagerly=True,
        )
        model.train_on_batch(x[:batch], y[:batch])
        thor = model.optimizer
        inverses.append(
            {
                block.convolutional: [
                    getattr(thor.state_for(block.kernel), part)
                    for part in ("a_inverse", "g_inverse")
                ]
                for block in thor.curvature_blocks.values()
            }
        )
    cut, first_rows, whole = inverses
    assert set(cut) == {True, False}
    for kind, source in ((True, first_rows), (False, whole)):
        for got, expected in zip(cut[kind], source[kind]):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def _first_step_inverses(specs, shape, x, y, batch, **options):
    """Each block's `(A⁻¹, G⁻¹)` after one refresh step on `batch`
    examples, by layer name."""
    keras.utils.set_random_seed(0)
    model = keras_models.keras_model(specs, shape)
    model.compile(
        optimizer=keras_thor.optimizers.THOR(frequency=2, **options, **HYPER),
        loss=keras_models.loss_object("ce"),
    )
    model.train_on_batch(x[:batch], y[:batch])
    thor = model.optimizer
    return {
        block.layer.name: [
            getattr(thor.state_for(block.kernel), part)
            for part in ("a_inverse", "g_inverse")
        ]
        for block in thor.curvature_blocks.values()
    }


@pytest.mark.parametrize(
    "options, examples",
    [
        # The embedding (width 6 on 5 positions; its diagonal A does not
        # count): ⌈6/5⌉; the Dense layer on the positions (6 -> 6): ⌈6/5⌉;
        # the head (6 -> 3, one row an example): 6.
        ({}, (2, 2, 6)),
        # Joint biases: the [x, 1] rows are 7 wide; ⌈7/5⌉ is still 2.
        ({"precondition_biases": "joint"}, (2, 2, 7)),
    ],
)
def test_statistics_rows_width_cut_each_layer_at_its_widest_factor(
    options, examples
):
    """One refresh step on 16 examples with `statistics_rows="width"`:
    each layer's inverses are those of the whole of its first
    `⌈max(d_A, d_G) / rows per example⌉` examples."""
    specs, shape, _, x, y = _data("encoder", "ce")
    cut = _first_step_inverses(
        specs, shape, x, y, 16, statistics_rows="width", **options
    )
    assert len(cut) == len(examples)
    for (name, got), count in zip(cut.items(), examples):
        expected = _first_step_inverses(specs, shape, x, y, count, **options)
        expected = expected[name]
        for part, reference_part in zip(got, expected):
            np.testing.assert_allclose(
                part, reference_part, rtol=1e-5, atol=1e-6
            )


@pytest.mark.parametrize(
    "data_format, output_shape, examples",
    [
        # 3·3·2 = 18 patch values against 20 and 4 output pixels.
        ("channels_last", (16, 5, 4, 3), 1),
        ("channels_last", (16, 2, 2, 3), 5),
        ("channels_first", (16, 3, 2, 2), 5),
        ("channels_last", (None, None, None, 3), None),  # the whole batch
    ],
)
def test_a_convolutions_rows_per_example_are_its_output_pixels(
    data_format, output_shape, examples
):
    inputs = (2, 5, 4) if data_format == "channels_first" else (5, 4, 2)
    conv = keras.layers.Conv2D(3, 3, padding="same", data_format=data_format)
    model = keras_thor.convert_to_thor_model(
        keras.Sequential([keras.Input(inputs), conv])
    )
    thor = keras_thor.optimizers.THOR(**HYPER)
    thor.build(model.trainable_variables)
    (block,) = thor.curvature_blocks.values()
    grads = keras.KerasTensor(output_shape)
    assert block.examples_for_width(grads) == examples


def _backend_draws(kind, output_width):
    """The sampled Fisher's draws for step `t` on one device: seed
    `(t, 0)`, with the backend's own generator, as
    `keras_thor.src.thor.sampled_fisher` documents."""
    from keras_thor.src.backend import stateless_random

    dtype = "int32" if keras.backend.backend() == "jax" else "int64"

    def draw(step, predictions):
        seed = keras.ops.convert_to_tensor([step, 0], dtype)
        if kind == "mse":
            noise = stateless_random.normal(predictions.shape, seed)
            noise = keras.ops.convert_to_numpy(noise)
            return predictions + np.sqrt(output_width / 2.0) * noise
        logits = keras.ops.convert_to_tensor(predictions, "float32")
        drawn = stateless_random.categorical(logits, seed)
        return keras.ops.convert_to_numpy(drawn)

    return draw


def test_sampled_fisher_follows_the_reference_with_the_same_draws():
    """Cross-entropy here, mean squared error with every option below."""
    recorder, expected, _, _ = _fit_and_reference(
        "mlp",
        "ce",
        epochs=1,
        frequency=2,
        fisher="sampled",
        reference_hyper={
            "fisher_targets": _backend_draws("ce", MLP[-1]["units"])
        },
        compile_options=EAGER,
        **HYPER,
    )
    _assert_follows(recorder.weights, expected)
    # The draws matter: the empirical Fisher gives other weights.
    empirical = reference.run_reference(
        MLP,
        recorder.start,
        recorder.batches,
        CE,
        frequency=2,
        **HYPER,
    )
    error = keras_models.relative_error(
        recorder.weights[-1], keras_models.flat(empirical[-1])
    )
    assert error > 1e-3


def test_every_option_together_follows_the_reference():
    recorder, expected, optimizer, _ = _fit_and_reference(
        "mlp",
        "mse",
        frequency=4,
        factor_decay=0.9,
        statistics_frequency=2,
        statistics_rows=5,
        fisher="sampled",
        kl_clip=1e-4,
        weight_decay=1e-3,
        reference_hyper={"fisher_targets": _backend_draws("mse", 5)},
        compile_options={"steps_per_execution": 3},
        **HYPER,
    )
    assert min(optimizer.guard_scales) < 0.999
    _assert_follows(recorder.weights[-1:], expected[-1:])


@pytest.mark.parametrize(
    "kind, options, compile_options",
    [
        # Split and identity-padded blocks (split_dim=4 on widths 6, 7, 5).
        ("mlp", {}, None),
        # π of the averages, and the trace rule's damped trace.
        (
            "cnn",
            {"factor_decay": 0.8, "statistics_frequency": 1},
            EAGER,
        ),
        # The diagonal A of an Embedding, LayerNorm's rule beside it.
        ("encoder", {"trace_thresholds": (0.05, 0.0)}, EAGER),
    ],
    ids=["mlp", "cnn-averaged", "encoder-trace-rule"],
)
def test_pi_damping_split_follows_the_reference(kind, options, compile_options):
    recorder, expected, optimizer, model = _fit_and_reference(
        kind,
        "ce",
        compile_options=compile_options,
        frequency=4,
        damping_split="pi",
        **options,
        **HYPER,
    )
    _assert_follows(recorder.weights, expected)
    assert model.optimizer.damping_split == "pi"
    # π is far from 1 here: the uniform split gives other weights.
    specs = _data(kind, "ce")[0]
    uniform, _ = options_reference.run_options_reference(
        specs,
        recorder.start,
        recorder.batches,
        CE,
        frequency=4,
        **options,
        **HYPER,
    )
    error = keras_models.relative_error(
        recorder.weights[-1], keras_models.flat(uniform[-1])
    )
    assert error > 1e-3


@pytest.mark.parametrize(
    "kind, options, compile_options",
    [
        # [x, 1] of 6 inputs and of 7 hidden units: 7- and 8-wide A, cut
        # into blocks of split_dim + 1 = 5 (the bias row does not count).
        ("mlp", {}, None),
        # The guard's sum takes each bias with its kernel.
        ("mlp", {"kl_clip": 3e-4}, None),
        # The 1 ends every im2col patch row; with π and the averages.
        (
            "cnn",
            {
                "factor_decay": 0.8,
                "statistics_frequency": 1,
                "damping_split": "pi",
            },
            EAGER,
        ),
    ],
    ids=["mlp", "mlp-guarded", "cnn-averaged-pi"],
)
def test_joint_bias_rows_follow_the_reference(kind, options, compile_options):
    recorder, expected, optimizer, model = _fit_and_reference(
        kind,
        "ce",
        compile_options=compile_options,
        frequency=4,
        precondition_biases="joint",
        **options,
        **HYPER,
    )
    _assert_follows(recorder.weights, expected)
    if "kl_clip" in options:
        # The guard binds on some steps.
        assert min(optimizer.guard_scales) < 0.999, optimizer.guard_scales
    thor = model.optimizer
    assert set(thor.step_plan.joint_biases) == set(thor.curvature_blocks)
    # Kernel and bias share one block: the bias row joins A.
    first = min(thor.curvature_blocks)
    block = thor.curvature_blocks[first]
    assert block.a_dim == block.inner.a_dim + 1
    # The cross terms matter: separate bias blocks give other weights.
    specs = _data(kind, "ce")[0]
    separate, _ = options_reference.run_options_reference(
        specs,
        recorder.start,
        recorder.batches,
        CE,
        frequency=4,
        **options,
        **HYPER,
    )
    error = keras_models.relative_error(
        recorder.weights[-1], keras_models.flat(separate[-1])
    )
    assert error > 1e-3
