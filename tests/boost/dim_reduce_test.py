"""DimReduce: the pure pieces against NumPy, `fit` against the NumPy
reference (accepted, backtracked and rejected steps), state, strategies,
AutoBoost and bad input."""

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.boost import AutoBoost
from keras_thor.boost import DimReduce
from keras_thor.src.backend.values import numpy_value
from keras_thor.src.boost.subspace_bfgs import armijo_step
from keras_thor.src.boost.subspace_bfgs import bfgs_inverse_update
from tests import helpers
from tests.boost import dim_reduce_reference as reference

pytestmark = pytest.mark.tf_only

SAMPLES, FEATURES, BATCH = 50, 6, 16  # a partial last batch of 2


def _data(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(SAMPLES, FEATURES)) * scale).astype("float32")
    y = (x[:, :2] @ np.array([1.0, -2.0]) + x[:, 2] ** 2).astype("float32")
    return x, y[:, None]


def _network(dropout=False, batch_norm=False):
    keras.utils.set_random_seed(3)
    layers = [keras.Input((FEATURES,))]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization(name="bn"))
    layers.append(keras.layers.Dense(5, activation="tanh", name="hidden"))
    if dropout:
        layers.append(keras.layers.Dropout(0.3, seed=1))
    layers.append(keras.layers.Dense(1, name="out"))
    return keras.Sequential(layers)


def _dimension(model):
    return sum(int(np.prod(v.shape)) for v in model.trainable_variables)


def _components(model, k=3, seed=0):
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.normal(size=(_dimension(model), k)))
    return q.T.astype("float32")


def _saved(tmp_path, matrix, name="P.npy"):
    path = str(tmp_path / name)
    np.save(path, matrix)
    return path


def _boost_model(network, optimizer=None):
    model = keras_thor.boost.to_boost_model(network)
    model.compile(optimizer or keras.optimizers.SGD(1.0), "mse")
    return model


def _fit(model, x, y, dim_reduce, epochs=2, callbacks=()):
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[dim_reduce, *callbacks],
    )


# The pure pieces.


def test_bfgs_inverse_update_matches_numpy():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(4, 4))
    inverse_hessian = a @ a.T + np.eye(4)
    s, y = rng.normal(size=4), rng.normal(size=4)
    y = y if y @ s > 0 else -y
    updated = bfgs_inverse_update(
        inverse_hessian.astype("float32"),
        s.astype("float32"),
        y.astype("float32"),
    )
    helpers.assert_all_close(
        updated, reference.bfgs(inverse_hessian, s, y), atol=1e-4, rtol=1e-4
    )
    # The secant equation B y = s holds after the update.
    helpers.assert_all_close(np.asarray(updated) @ y, s, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ys", [0.0, -1.0, 1e-21])
def test_bfgs_inverse_update_keeps_b_without_curvature(ys):
    inverse_hessian = np.diag([1.0, 2.0]).astype("float32")
    s = np.array([1.0, 0.0], "float32")
    y = np.array([ys, 5.0], "float32")
    helpers.assert_all_close(
        bfgs_inverse_update(inverse_hessian, s, y), inverse_hessian
    )


@pytest.mark.parametrize(
    "trials, expected",
    [
        ((0.5, 0.9), 1.0),  # 1 + 0.4·1·(−1) = 0.6 > 0.5
        ((0.7, 0.7), 0.5),  # 0.6 > 0.7 fails; 1 + 0.4·0.5·(−1) = 0.8 > 0.7
        ((0.7, 0.9), 0.0),
        ((float("nan"), 0.7), 0.5),
        ((float("nan"), float("inf")), 0.0),
    ],
)
def test_armijo_step_takes_the_first_sufficient_decrease(trials, expected):
    step = armijo_step(1.0, list(trials), (1.0, 0.5), 0.4, -1.0)
    assert float(step) == expected


# Training against the NumPy reference.


def _reference_run(x, y, components, settings, epochs=2, network=None):
    model = network or _network()
    model.compile(loss="mse")
    run = reference.DimReduceReference(components, **settings)
    for _ in range(epochs):
        for start in range(0, SAMPLES, BATCH):
            run.step(model, x[start : start + BATCH], y[start : start + BATCH])
    return model, run


SETTINGS = {
    "defaults": ({"rho": 0.55, "gamma": 0.9, "alpha": 0.01, "sigma": 0.4}, 1),
    # Steps of 1, rho and 0 (found with the reference).
    "mixed": ({"rho": 0.3, "gamma": 0.9, "alpha": 0.01, "sigma": 0.4}, 2),
}


@pytest.mark.parametrize("case", sorted(SETTINGS))
def test_fit_matches_the_numpy_reference(case, tmp_path):
    settings, scale = SETTINGS[case]
    x, y = _data(scale=scale)
    network = _network()
    components = _components(network)
    expected, run = _reference_run(x, y, components, settings)
    dim_reduce = DimReduce(
        n_components=3, pca_mat_path=_saved(tmp_path, components), **settings
    )
    model = _boost_model(network)
    history = _fit(model, x, y, dim_reduce)
    if case == "mixed":
        assert set(run.taken) == {1.0, settings["rho"], 0.0}, run.taken
    np.testing.assert_allclose(
        reference.flat(model.trainable_variables),
        reference.flat(expected.trainable_variables),
        atol=2e-5,
        rtol=1e-4,
    )
    search = model.optimizer.algorithm("dim_reduce")
    np.testing.assert_allclose(
        numpy_value(search.inverse_hessian),
        run.inverse_hessian,
        atol=1e-4,
        rtol=1e-3,
    )
    np.testing.assert_allclose(
        numpy_value(search.subspace_step),
        run.subspace_step,
        atol=1e-5,
        rtol=1e-4,
    )
    assert history.history["dim_reduce_step"][-1] == pytest.approx(
        run.taken[-1]
    )


def test_trials_reuse_the_steps_dropout_and_leave_moving_statistics(
    tmp_path,
):
    # With P = 0 the direction is 0: every trial loss equals the step's
    # loss exactly (same dropout masks), so no step is ever accepted.
    x, y = _data()
    network = _network(dropout=True, batch_norm=True)
    zeros = np.zeros((2, _dimension(network)), "float32")
    dim_reduce = DimReduce(
        n_components=2, pca_mat_path=_saved(tmp_path, zeros), alpha=0.0
    )
    model = _boost_model(network)
    steps = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: steps.append(
            float(logs["dim_reduce_step"])
        )
    )
    model.fit(
        x[:BATCH],
        y[:BATCH],
        batch_size=BATCH,
        epochs=4,
        verbose=0,
        callbacks=[dim_reduce, record],
    )
    assert steps == [0.0] * 4
    # Four steps moved the moving mean four times, not twelve.
    momentum = model.get_layer("bn").momentum
    expected = (1 - momentum**4) * x[:BATCH].mean(axis=0)
    np.testing.assert_allclose(
        numpy_value(model.get_layer("bn").moving_mean),
        expected,
        atol=1e-5,
        rtol=1e-4,
    )


def test_non_finite_batch_leaves_weights_and_state(tmp_path):
    x, y = _data()
    network = _network()
    dim_reduce = DimReduce(
        n_components=3, pca_mat_path=_saved(tmp_path, _components(network))
    )
    model = _boost_model(network)
    _fit(model, x, y, dim_reduce, epochs=1)
    weights = helpers.weights_of(model)
    state = helpers.optimizer_state(model.optimizer)
    bad = x[:BATCH].copy()
    bad[0, 0] = np.nan
    history = _fit(model, bad, y[:BATCH], dim_reduce, epochs=1)
    assert history.history["dim_reduce_step"] == [0.0]
    helpers.assert_all_close(helpers.weights_of(model), weights, 0, 0)
    after = helpers.optimizer_state(model.optimizer)
    changed = [
        v.path
        for v, before, now in zip(model.optimizer.variables, state, after)
        if not np.array_equal(before, now)
    ]
    # Only the step counters move, and the logged step (0 now).
    assert all(
        any(name in p for name in ("micro_steps", "iteration", "line_search"))
        for p in changed
    ), changed


# State.


def _state_run(tmp_path, epochs, callbacks=()):
    x, y = _data(scale=4)
    network = _network()
    path = str(tmp_path / "P.npy")
    if not (tmp_path / "P.npy").exists():
        np.save(path, _components(network))
    dim_reduce = DimReduce(n_components=3, pca_mat_path=path, rho=0.3)
    model = _boost_model(network)
    _fit(model, x, y, dim_reduce, epochs=epochs, callbacks=callbacks)
    return model, (x, y)


def test_keras_save_load_resumes_as_uninterrupted(tmp_path):
    reference_model, (x, y) = _state_run(tmp_path, epochs=3)
    model, _ = _state_run(tmp_path, epochs=2)
    model.save(tmp_path / "m.keras")
    loaded = keras_thor.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer.dim_reduce, DimReduce)
    assert loaded.optimizer.dim_reduce.pca_mat_path == str(tmp_path / "P.npy")
    helpers.assert_same_training_state(loaded, model, atol=0)
    # Resumed with the callback passed again, as the user's script does.
    again = DimReduce(
        n_components=3, pca_mat_path=str(tmp_path / "P.npy"), rho=0.3
    )
    _fit(loaded, x, y, again, epochs=1)
    assert loaded.optimizer.dim_reduce is not again  # the restored state ran
    helpers.assert_same_training_state(loaded, reference_model, atol=1e-6)


def test_backup_and_restore_resumes_as_uninterrupted(tmp_path):
    reference_model, (x, y) = _state_run(tmp_path, epochs=3)
    path = str(tmp_path / "P.npy")

    def make():
        network = _network()
        model = keras_thor.boost.to_boost_model(network)
        model.compile(keras.optimizers.SGD(1.0), "mse")
        return model

    def fit(model, epochs, callbacks):
        dim_reduce = DimReduce(n_components=3, pca_mat_path=path, rho=0.3)
        _fit(model, x, y, dim_reduce, epochs=epochs, callbacks=callbacks)

    resumed = helpers.resumed_after_interruption(
        make, fit, str(tmp_path / "backup"), epochs=3, interrupt_at=2
    )
    helpers.assert_same_training_state(resumed, reference_model, atol=1e-6)


@pytest.mark.multi_device
def test_mirrored_strategy_equals_one_device(tmp_path):
    x, y = _data()
    path = _saved(tmp_path, _components(_network()))
    settings = {"n_components": 3, "pca_mat_path": path}
    single = _boost_model(_network())
    single_dim = DimReduce(**settings)
    _fit(single, x, y, single_dim)
    strategy = helpers.mirrored_strategy(2)
    with strategy.scope():
        mirrored = _boost_model(_network())
    mirrored_dim = DimReduce(**settings)
    history = _fit(mirrored, x, y, mirrored_dim)
    helpers.assert_same_training_state(mirrored, single, atol=2e-5)
    helpers.assert_replicas_identical(mirrored.optimizer.variables)
    assert "dim_reduce_step" in history.history


# AutoBoost and the callback form.


def _snapshots(tmp_path, count=5):
    network = _network()
    directory = tmp_path / "snapshots"
    directory.mkdir()
    rng = np.random.default_rng(1)
    weights = network.get_weights()
    for i in range(count):
        network.set_weights(
            [w + 0.1 * rng.normal(size=w.shape) for w in weights]
        )
        network.save_weights(str(directory / f"snap_{i:02d}.weights.h5"))
    network.set_weights(weights)
    return network, str(directory)


def test_auto_boost_runs_dim_reduce_alone(tmp_path):
    network, directory = _snapshots(tmp_path)
    config = {
        "boost": {"mode": "manual", "dim_reduce": True},
        "dim_reduce": {"n_components": 3, "weight_load_dir": directory},
    }
    with pytest.warns(UserWarning, match="`dim_reduce` runs alone"):
        boost = AutoBoost("O1", config)
    assert boost.flags == {
        **dict.fromkeys(boost.flags, False),
        "dim_reduce": True,
    }
    model, optimizer, callbacks = boost.network_auto_process_train(
        network, keras.optimizers.SGD(1.0)
    )
    assert callbacks == [optimizer.dim_reduce]
    assert optimizer.dim_reduce.pca_mat_path.endswith("pca_mat_temp.npy")
    model.compile(optimizer, "mse")
    x, y = _data()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=callbacks
    )
    assert history.history["dim_reduce_step"][0] in (0.0, 0.55, 1.0)


# Bad input.


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"rho": 1.0}, ValueError, "`rho` must be a float in \\(0, 1\\)"),
        ({"sigma": 0}, ValueError, "`sigma`"),
        ({"gamma": 1.0}, ValueError, "`gamma`"),
        ({"alpha": -1}, ValueError, "`alpha`"),
        ({"n_components": 0}, ValueError, "`n_components`"),
        ({"n_components": 2.0}, TypeError, "`n_components`"),
        ({"pca_mat_path": 3}, TypeError, "`pca_mat_path`"),
        ({"pca_mat_path": None}, ValueError, "needs its PCA matrix"),
        ({"timeout": 0}, ValueError, "`timeout` must be > 0"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    arguments = {"pca_mat_path": "P.npy", **kwargs}
    with pytest.raises(error, match=match):
        DimReduce(**arguments)


@pytest.mark.parametrize(
    "optimizer",
    [
        keras.optimizers.Adam(),
        keras.optimizers.SGD(0.5),
        keras.optimizers.SGD(1.0, momentum=0.9),
        keras.optimizers.SGD(1.0, weight_decay=0.1),
        keras.optimizers.SGD(1.0, loss_scale_factor=8.0),
    ],
)
def test_other_optimizers_are_refused(optimizer, tmp_path):
    network = _network()
    dim_reduce = DimReduce(
        n_components=3, pca_mat_path=_saved(tmp_path, _components(network))
    )
    model = _boost_model(network, optimizer=optimizer)
    x, y = _data()
    with pytest.raises(ValueError, match="SGD\\(learning_rate=1.0\\)"):
        _fit(model, x, y, dim_reduce, epochs=1)


def test_plain_keras_model_and_other_algorithms_are_refused(tmp_path):
    network = _network()
    path = _saved(tmp_path, _components(network))
    network.compile(keras.optimizers.SGD(1.0), "mse")
    x, y = _data()
    with pytest.raises(ValueError, match="to_boost_model"):
        _fit(network, x, y, DimReduce(n_components=3, pca_mat_path=path))
    with pytest.raises(ValueError, match="DimReduce runs alone"):
        keras_thor.boost.BoostOptimizer(
            keras.optimizers.SGD(1.0),
            grad_accumulation_step=2,
            dim_reduce=DimReduce(n_components=3, pca_mat_path=path),
        )


def test_wrong_matrix_shape_names_both_shapes(tmp_path):
    network = _network()
    path = _saved(tmp_path, np.zeros((3, 7), "float32"))
    dim_reduce = DimReduce(n_components=3, pca_mat_path=path)
    model = _boost_model(network)
    x, y = _data()
    weights = helpers.weights_of(model)
    with pytest.raises(ValueError, match=r"\(3, 7\).*\(3, 41\)"):
        _fit(model, x, y, dim_reduce, epochs=1)
    helpers.assert_all_close(helpers.weights_of(model), weights, 0, 0)


def test_steps_per_execution_and_jit_compile_train_as_plain_fit(tmp_path):
    x, y = _data()
    path = _saved(tmp_path, _components(_network()))
    models = []
    for options in ({}, {"steps_per_execution": 3, "jit_compile": True}):
        model = keras_thor.boost.to_boost_model(_network())
        model.compile(keras.optimizers.SGD(1.0), "mse", **options)
        _fit(model, x, y, DimReduce(n_components=3, pca_mat_path=path))
        models.append(model)
    helpers.assert_same_training_state(models[1], models[0], atol=2e-5)


@pytest.mark.multi_device
def test_one_replica_strategy_trains_as_no_strategy(tmp_path):
    # Under a strategy (even of one replica) both trials run: the same
    # steps, no `cond` around the strategy's merge calls.
    x, y = _data(scale=2)
    path = _saved(tmp_path, _components(_network()))
    settings = {"n_components": 3, "pca_mat_path": path, "rho": 0.3}
    single = _boost_model(_network())
    _fit(single, x, y, DimReduce(**settings))
    with helpers.mirrored_strategy(1).scope():
        mirrored = _boost_model(_network())
    _fit(mirrored, x, y, DimReduce(**settings))
    helpers.assert_same_training_state(mirrored, single, atol=2e-5)


def test_a_callback_used_on_two_models_loads_p_for_each(tmp_path):
    x, y = _data()
    path = _saved(tmp_path, _components(_network()))
    dim_reduce = DimReduce(n_components=3, pca_mat_path=path)
    _fit(_boost_model(_network()), x, y, dim_reduce, epochs=1)
    keras.utils.set_random_seed(0)
    wider = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(9), keras.layers.Dense(1)]
    )
    with pytest.raises(ValueError, match=r"\(3, 41\).*\(3, 73\)"):
        _fit(_boost_model(wider), x, y, dim_reduce, epochs=1)
