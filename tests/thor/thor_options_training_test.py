"""THOR's curvature options in Keras workflows: the statistics and refresh
schedule, errors at `fit`, non-finite statistics, `.keras` files and
BackupAndRestore, and the THOR logs in `History` and TensorBoard."""

import warnings

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.optimizers import THOR
from keras_thor.src.thor import blocks
from keras_thor.src.thor.estimator import CurvatureEstimator
from tests import helpers

pytestmark = pytest.mark.thor_training

THOR_LOGS = {
    "thor_damping",
    "thor_refreshes",
    "thor_curvature_troubles",
    "thor_skipped_updates",
}


def _data(samples=96, features=12, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    return x, x[:, :classes].argmax(axis=1).astype("int32")


def _mlp(optimizer, loss=None, **compile_options):
    base = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(4, name="logits"),
        ]
    )
    model = keras_thor.convert_to_thor_model(base)
    model.compile(
        optimizer=optimizer,
        loss=loss
        or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **compile_options,
    )
    return model


def _averaging_thor(**overrides):
    options = dict(
        learning_rate=0.05,
        damping=0.05,
        momentum=0.9,
        frequency=4,
        factor_decay=0.9,
        statistics_frequency=2,
    )
    options.update(overrides)
    return THOR(**options)


def _state(thor, index):
    """The curvature state of THOR's variable `index`."""
    return thor.state_for(thor.curvature_blocks[index].kernel)


def _count_statistics(monkeypatch, model):
    """Records the steps at which Dense statistics are computed, and those
    of the layers' inversions (one record per layer)."""
    counts = {
        name: helpers.RunTimeSteps() for name in ("statistics", "inverses")
    }
    dense_statistics = blocks.dense_statistics
    inverses = CurvatureEstimator.inverses

    def counted_statistics(inputs, sample_output_grads):
        counts["statistics"].record(model.optimizer.iterations)
        return dense_statistics(inputs, sample_output_grads)

    def counted_inverses(self, index, statistics, damping):
        counts["inverses"].record(model.optimizer.iterations)
        return inverses(self, index, statistics, damping)

    monkeypatch.setattr(blocks, "dense_statistics", counted_statistics)
    monkeypatch.setattr(CurvatureEstimator, "inverses", counted_inverses)
    return counts


def _counted(counts):
    """`{name: (records, sum of their steps)}`."""
    recorded = {name: steps.steps() for name, steps in counts.items()}
    return {name: (len(s), sum(s)) for name, s in recorded.items()}


class _Snapshots(keras.callbacks.Callback):
    """The hidden layer's averaged G and G⁻¹, and the logs, per batch."""

    def __init__(self):
        super().__init__()
        self.factors, self.inverses, self.logs = [], [], []

    def on_train_batch_end(self, batch, logs=None):
        thor = self.model.optimizer
        state = _state(thor, 0)
        self.factors.append(state.g_factor)
        self.inverses.append(state.g_inverse)
        self.logs.append(dict(logs or {}))


def _changed_at(snapshots, initial="factors"):
    """The steps after which a snapshot differs from the one before (or,
    for step 0, from the initial zero factors or identity inverses)."""
    shape = snapshots[0].shape
    if initial == "factors":
        initial = [np.zeros(shape)]
    else:
        initial = [np.broadcast_to(np.eye(shape[-1]), shape)]
    return [
        step
        for step, (before, after) in enumerate(
            zip(initial + snapshots[:-1], snapshots)
        )
        if not np.array_equal(before, after)
    ]


# The schedule.


def test_statistics_every_second_step_inverses_every_fourth(monkeypatch):
    model = _mlp(_averaging_thor())
    counts = _count_statistics(monkeypatch, model)
    snapshots = _Snapshots()
    x, y = _data()
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=2,  # 12 steps
        shuffle=False,
        verbose=0,
        callbacks=[snapshots],
    )
    statistics_steps = [0, 2, 4, 6, 8, 10]
    assert _changed_at(snapshots.factors) == statistics_steps
    # The first inverses come from the first statistics: identity before.
    assert _changed_at(snapshots.inverses, "inverses") == [0, 4, 8]
    # Two Dense layers: one statistic and one inversion each.
    assert _counted(counts) == {
        "statistics": (2 * 6, 2 * sum(statistics_steps)),
        "inverses": (2 * 3, 2 * (0 + 4 + 8)),
    }
    thor = model.optimizer
    for index in thor.curvature_blocks:
        np.testing.assert_allclose(
            float(_state(thor, index).factor_weight),
            sum(0.9**i for i in range(6)),
        )
    refreshes = [logs["thor_refreshes"] for logs in snapshots.logs]
    np.testing.assert_array_equal(refreshes, [s // 4 + 1 for s in range(12)])
    assert set(history.history) == {"loss"} | THOR_LOGS
    np.testing.assert_allclose(history.history["thor_damping"], [0.05] * 2)
    assert history.history["thor_refreshes"] == [2.0, 3.0]
    assert history.history["thor_curvature_troubles"] == [0.0, 0.0]


def test_steps_per_execution_follows_the_statistics_schedule(monkeypatch):
    model = _mlp(_averaging_thor(), steps_per_execution=3)
    counts = _count_statistics(monkeypatch, model)
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 12
    assert _counted(counts) == {
        "statistics": (2 * 6, 2 * (0 + 2 + 4 + 6 + 8 + 10)),
        "inverses": (2 * 3, 2 * (0 + 4 + 8)),
    }


def test_train_on_batch_follows_the_statistics_schedule(monkeypatch):
    model = _mlp(_averaging_thor())
    counts = _count_statistics(monkeypatch, model)
    x, y = _data()
    factors, inverses = [], []
    for step in range(9):
        batch = slice(16 * (step % 6), 16 * (step % 6 + 1))
        logs = model.train_on_batch(x[batch], y[batch], return_dict=True)
        state = _state(model.optimizer, 0)
        factors.append(state.a_factor)
        inverses.append(state.a_inverse)
    assert _changed_at(factors) == [0, 2, 4, 6, 8]
    assert _changed_at(inverses, "inverses") == [0, 4, 8]
    assert _counted(counts)["inverses"] == (2 * 3, 2 * (0 + 4 + 8))
    assert set(logs) >= THOR_LOGS
    assert logs["thor_refreshes"] == 3.0


# Errors and robustness.


@pytest.mark.parametrize("loss", ["hinge", keras.losses.Huber()])
def test_sampled_fisher_with_an_unsupported_loss_fails_at_fit(loss):
    model = _mlp(THOR(0.05, 0.05, 0.9, fisher="sampled"), loss=loss)
    x, y = _data()
    y = np.eye(4, dtype="float32")[y]
    with pytest.raises(ValueError, match="Received: loss=") as raised:
        model.fit(x, y, batch_size=16, verbose=0)
    assert "fisher" in str(raised.value)
    assert ("hinge" if loss == "hinge" else "huber") in str(raised.value)


def _nan_first_batch(decay):
    """A model after one refresh step whose hidden-layer statistics are not
    finite (one NaN input); eager, faster here than tracing."""
    keras.utils.set_random_seed(0)
    model = _mlp(
        THOR(0.05, 0.04, 0.9, frequency=2, factor_decay=decay, split_dim=32),
        run_eagerly=True,
    )
    x, y = _data()
    bad = x[:16].copy()
    bad[3, 2] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.train_on_batch(bad, y[:16])
    return model, x, y


def test_non_finite_statistics_keep_the_previous_averages():
    model, x, y = _nan_first_batch(0.9)
    thor = model.optimizer
    assert thor.curvature_troubles >= 1
    # Every average stays finite (the logits layer's statistics are NaN
    # too or not, depending on what relu makes of a NaN).
    for index in thor.curvature_blocks:
        state = _state(thor, index)
        assert all(
            np.isfinite(f).all() for f in (state.a_factor, state.g_factor)
        )
    # The hidden layer's averages were kept (still their initial zeros).
    np.testing.assert_array_equal(_state(thor, 0).a_factor, 0.0)
    np.testing.assert_array_equal(_state(thor, 0).g_factor, 0.0)
    model.fit(x, y, batch_size=16, verbose=0)
    assert all(np.isfinite(w).all() for w in helpers.weights_of(model))
    assert all(
        np.isfinite(v).all() for v in helpers.optimizer_state(model.optimizer)
    )


def test_non_finite_first_statistics_keep_the_previous_inverses():
    """As without `factor_decay` (THOR's docstring: "non-finite statistics
    keep the previous inverses"), a layer whose first statistics are not
    finite keeps its identity inverses; it gets no inverses of the
    zero-initialized averages, `(0 + √λ·I)⁻¹ = I / √λ` (here 5·I)."""
    model, _, _ = _nan_first_batch(0.9)
    thor = model.optimizer
    state = _state(thor, 0)
    for inverse in (state.a_inverse, state.g_inverse):
        np.testing.assert_allclose(inverse[0], np.eye(inverse.shape[-1]))


def test_a_skipped_first_statistics_step_does_not_weigh_in_the_average():
    """The average is over the statistics the layer took: after a skipped
    (non-finite) first step, the next batch's factor is the layer's first
    average (factor_averaging: "the first average is the first batch's
    factor"), not that factor shrunk by `1 / (1 + α)` towards the
    zero-initialized average."""
    model, x, y = _nan_first_batch(0.9)
    model.train_on_batch(x[16:32], y[16:32])  # plain step 1
    model.train_on_batch(x[32:48], y[32:48])  # statistics step 2
    rows = x[32:48].astype("float64")
    expected = rows.T @ rows / len(rows)
    np.testing.assert_allclose(
        _state(model.optimizer, 0).a_factor[0], expected, rtol=1e-5
    )


def test_a_kl_clip_that_never_binds_changes_nothing():
    """`ν = 1` on every step: the same training as without `kl_clip`."""
    x, y = _data()
    results = []
    for kl_clip in (None, 1e9):
        keras.utils.set_random_seed(0)
        thor = THOR(0.05, 0.05, 0.9, frequency=3, kl_clip=kl_clip)
        model = _mlp(thor, run_eagerly=True)
        history = model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        results.append(helpers.weights_of(model))
    assert history.history["thor_guard_scale"] == [1.0]
    helpers.assert_all_close(results[1], results[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "clipping", ["clipnorm", "clipvalue", "global_clipnorm"]
)
def test_kl_clip_refuses_keras_clipping(clipping):
    """Keras's clipping would clip the guarded directions, not `g`."""
    with pytest.raises(ValueError, match=f"kl_clip=0.001.*{clipping}=0.5"):
        THOR(0.05, 0.05, 0.9, kl_clip=1e-3, **{clipping: 0.5})


def test_every_option_under_mixed_precision():
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
            optimizer=_averaging_thor(
                statistics_rows=8, fisher="sampled", kl_clip=1e-3
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            run_eagerly=True,
        )
        x, y = _data()
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    thor = model.optimizer.inner_optimizer
    assert thor.curvature_troubles == 0
    assert float(model.optimizer.dynamic_scale) == 32768.0
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert min(history.history["thor_guard_scale"]) < 1.0
    assert all(np.isfinite(w).all() for w in helpers.weights_of(model))


# `.keras` files and BackupAndRestore.

STEPS_PER_EPOCH = 3


def _all_options_model(run_eagerly=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(10, activation="tanh", name="hidden")(inputs)
    normed = keras.layers.LayerNormalization(name="norm")(hidden)
    outputs = keras.layers.Dense(4, name="logits")(normed)
    model = keras_thor.convert_to_thor_model(keras.Model(inputs, outputs))
    model.compile(
        optimizer=THOR(
            learning_rate=0.1,
            damping=0.05,
            momentum=0.9,
            weight_decay=1e-3,
            frequency=4,
            split_dim=8,
            factor_decay=0.8,
            statistics_frequency=2,
            statistics_rows=12,
            fisher="sampled",
            kl_clip=1e-3,
            kl_clip_steps="refresh",  # a resumed step holds the saved ν
            precondition_biases="all",
            trace_thresholds=(0.05, 0.001),
            damping_split="pi",
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        run_eagerly=run_eagerly,
    )
    return model


def _fit(model, epochs, **kwargs):
    x, y = _data(16 * STEPS_PER_EPOCH)
    return model.fit(
        x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, **kwargs
    )


@pytest.fixture(scope="module")
def uninterrupted():
    """Weights and optimizer state after 3 epochs without interruption
    (eager: the traced steps' arithmetic, faster to run here)."""
    model = _all_options_model(run_eagerly=True)
    history = _fit(model, epochs=3)
    guard = history.history["thor_guard_scale"]
    assert min(guard) < 1.0  # the guard takes part
    assert (
        history.history["thor_skipped_inversions"][-1] > 0
    )  # so does the rule
    return helpers.weights_of(model), helpers.optimizer_state(model.optimizer)


def _assert_equals_uninterrupted(model, uninterrupted):
    weights, state = uninterrupted
    assert int(model.optimizer.iterations.numpy()) == 3 * STEPS_PER_EPOCH
    helpers.assert_all_close(helpers.weights_of(model), weights, atol=1e-6)
    helpers.assert_all_close(
        helpers.optimizer_state(model.optimizer), state, atol=1e-5
    )


def test_keras_file_with_every_option_resumes_as_uninterrupted(
    tmp_path, uninterrupted
):
    model = _all_options_model(run_eagerly=True)
    _fit(model, epochs=1)  # 3 steps: statistics at 0 and 2, a refresh at 4
    path = tmp_path / "thor.keras"
    model.save(path)
    loaded = keras_thor.load_model(path)
    thor, restored = model.optimizer, loaded.optimizer
    assert restored.get_config() == thor.get_config()
    assert (restored.factor_decay, restored.statistics_frequency) == (0.8, 2)
    assert (restored.statistics_rows, restored.fisher) == (12, "sampled")
    assert (restored.kl_clip, restored.precondition_biases) == (1e-3, "all")
    assert restored.trace_thresholds == (0.05, 0.001)
    assert restored.damping_split == "pi"
    names = [v.name for v in restored.variables]
    assert names == [v.name for v in thor.variables]
    assert names[-18:] == [
        f"{layer}_{variable}_{part}"
        for layer in ("hidden", "logits")
        for variable in ("kernel", "bias")
        for part in ("a_factor", "g_factor", "factor_weight")
    ] + [
        "guard_scale",
        "last_traces",
        "stopped_blocks",
        "skipped_inversions",
        "skipped_updates",
        "trained_batch_size",
    ]
    helpers.assert_all_close(
        helpers.optimizer_state(restored),
        helpers.optimizer_state(thor),
        atol=0,
        rtol=0,
    )
    for index in restored.curvature_blocks:
        np.testing.assert_allclose(
            float(_state(restored, index).factor_weight), 1 + 0.8
        )
    assert restored.estimator.guard_scale < 1.0
    _fit(loaded, epochs=2)
    _assert_equals_uninterrupted(loaded, uninterrupted)


def test_backup_and_restore_with_every_option_resumes_as_uninterrupted(
    tmp_path, uninterrupted
):
    resumed = helpers.resumed_after_interruption(
        lambda: _all_options_model(run_eagerly=True),
        lambda model, epochs, callbacks: _fit(
            model, epochs, callbacks=callbacks
        ),
        str(tmp_path / "backup"),
        epochs=3,
        interrupt_at=2,  # after 6 steps: the next one gathers statistics
    )
    _assert_equals_uninterrupted(resumed, uninterrupted)


# History and TensorBoard.


def _scalars(log_dir):
    """`{tag: [values]}` of the scalars in a TensorBoard log directory."""
    import tensorflow as tf

    scalars = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag == "keras":  # the model's config, as text
                    continue
                number = float(tf.make_ndarray(value.tensor))
                scalars.setdefault(value.tag, []).append(number)
    return scalars


def test_thor_logs_reach_history_and_tensorboard(tmp_path):
    # Keras's TensorBoard callback writes through `tf.summary`, which needs
    # the tensorboard package (not a dependency of TensorFlow 2.21).
    pytest.importorskip("tensorboard")
    model = _mlp(
        THOR(0.05, 0.05, 0.9, frequency=4, factor_decay=0.9, kl_clip=1e-3)
    )
    x, y = _data()
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.TensorBoard(log_dir=str(tmp_path))],
    )
    assert set(history.history) == {"loss", "thor_guard_scale"} | THOR_LOGS
    assert history.history["thor_refreshes"] == [2.0, 3.0]
    guard = history.history["thor_guard_scale"]
    assert all(0.0 < scale <= 1.0 for scale in guard)
    np.testing.assert_allclose(guard[-1], model.optimizer.estimator.guard_scale)
    scalars = _scalars(tmp_path / "train")
    for name in THOR_LOGS | {"thor_guard_scale"}:
        np.testing.assert_allclose(
            scalars[f"epoch_{name}"], history.history[name], err_msg=name
        )
    np.testing.assert_allclose(scalars["epoch_thor_damping"], [0.05, 0.05])
