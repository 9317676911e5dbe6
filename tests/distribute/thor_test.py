"""THOR under MirroredStrategy: 2 and 4 replicas equal one device, with
clipping after the all-reduce, inverse spreading, reduction buckets,
BackupAndRestore and the curvature options.

Moving averages of the factors, statistics between refreshes and the
step-size guard use all-reduced statistics and gradients: the training
equals one device's. The sampled Fisher draws each replica's targets from
its own seed `(step, replica)`, so two replicas draw other targets than one
device: there the replicas must agree with each other and train.
"""

import contextlib

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.src.backend.traced_ops import traced_op_counts
from tests import helpers

pytestmark = pytest.mark.multi_device

STEPS_PER_EPOCH = 4


def _model(strategy=None, layers=2, run_eagerly=False, **thor_args):
    # `N` is per replica (by default one replica's share of `fit`'s batch):
    # fixed here, so every replica count runs the same rule.
    thor_args.setdefault("batch_size", 16)
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((12,))
        x = inputs
        for i in range(layers - 1):
            x = keras.layers.Dense(10, activation="tanh", name=f"hidden{i}")(x)
        x = keras.layers.LayerNormalization(name="norm")(x)
        outputs = keras.layers.Dense(4, name="logits")(x)
        model = keras_thor.convert_to_thor_model(keras.Model(inputs, outputs))
        model.compile(
            optimizer=keras_thor.optimizers.THOR(
                learning_rate=0.2,
                damping=0.05,
                momentum=0.9,
                weight_decay=1e-3,
                frequency=3,
                split_dim=8,
                **thor_args,
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            run_eagerly=run_eagerly,
        )
    return model


def _data():
    rng = np.random.default_rng(0)
    x = 3 * rng.normal(size=(16 * STEPS_PER_EPOCH, 12)).astype("float32")
    return x, x[:, :4].argmax(axis=1)


def _fit(model, epochs=2, callbacks=()):
    x, y = _data()
    return model.fit(
        x,
        y,
        batch_size=16,
        epochs=epochs,
        shuffle=False,
        callbacks=list(callbacks),
        verbose=0,
    )


@pytest.mark.parametrize(
    "replicas, thor_args",
    [
        (4, {}),
        (2, {"enable_clip_grad": True}),
        (4, {"enable_clip_grad": True, "spread_inverses": False}),
        (2, {"spread_inverses": False}),
        (
            2,
            {
                "damping_split": "pi",
                "factor_decay": 0.8,
                "burn_in_steps": 2,
                "precondition_biases": "joint",
                "kl_clip": 1e-3,
                "kl_clip_mode": "velocity",
            },
        ),
    ],
)
def test_replicas_equal_one_device(replicas, thor_args):
    single = _model(**thor_args)
    single_history = _fit(single)
    mirrored = _model(helpers.mirrored_strategy(replicas), **thor_args)
    mirrored_history = _fit(mirrored)
    np.testing.assert_allclose(
        mirrored_history.history["loss"],
        single_history.history["loss"],
        rtol=1e-5,
    )
    # π leaves G a small damping here (√λ/π), so its inverses reach ~80
    # and the order of the float32 sums across replicas shows at ~5e-5.
    rtol = 1e-4 if thor_args.get("damping_split") == "pi" else 1e-6
    helpers.assert_same_training_state(mirrored, single, atol=1e-5, rtol=rtol)
    helpers.assert_replicas_identical(
        mirrored.optimizer.variables + mirrored.weights
    )


def test_clipping_runs_on_the_reduced_gradient():
    # The learning rate makes every preconditioned gradient longer than 1:
    # clipping each replica's share would give a different update.
    unclipped, clipped = (
        _model(helpers.mirrored_strategy(2), enable_clip_grad=clip)
        for clip in (False, True)
    )
    for model in (unclipped, clipped):
        _fit(model, epochs=1)
    single = _model(enable_clip_grad=True)
    _fit(single, epochs=1)
    helpers.assert_same_training_state(clipped, single, atol=1e-5)
    assert not np.allclose(
        helpers.weights_of(clipped)[0], helpers.weights_of(unclipped)[0]
    )


@pytest.mark.parametrize(
    "split_indices, spread_inverses, reductions",
    [
        # One gradient all-reduce, then one per statistics bucket, plus
        # one that gathers the spread inverses.
        (None, False, 2),
        ([1], False, 3),
        ([0, 1, 2], False, 5),
        (None, True, 3),
    ],
)
def test_collectives_per_refresh_step(
    split_indices, spread_inverses, reductions
):
    replicas = 2
    model = _model(
        helpers.mirrored_strategy(replicas),
        layers=4,
        split_indices=split_indices,
        spread_inverses=spread_inverses,
    )
    _fit(model, epochs=1)
    refresh = traced_op_counts(model.train_function.traced_variant("refresh"))
    plain = traced_op_counts(model.train_function.traced_variant("plain"))
    # Every replica's ops are in the one graph.
    assert refresh["CollectiveReduceV2"] == replicas * reductions
    assert plain["CollectiveReduceV2"] == replicas
    if spread_inverses:
        # Each layer's factors are inverted on one replica only.
        every_replica = _model(
            helpers.mirrored_strategy(replicas), layers=4, spread_inverses=False
        )
        _fit(every_replica, epochs=1)
        baseline = every_replica.train_function.traced_variant("refresh")
        factorizations = traced_op_counts(baseline)["Cholesky"]
        assert refresh["Cholesky"] * replicas == factorizations


def test_backup_and_restore_resumes_as_uninterrupted(tmp_path):
    strategy = helpers.mirrored_strategy(2)
    reference = _model(strategy)
    _fit(reference, epochs=3)
    resumed = helpers.resumed_after_interruption(
        lambda: _model(strategy),
        lambda model, epochs, callbacks: _fit(model, epochs, callbacks),
        str(tmp_path / "backup"),
        epochs=3,
        interrupt_at=2,
    )
    assert int(resumed.optimizer.iterations.numpy()) == 3 * STEPS_PER_EPOCH
    helpers.assert_same_training_state(resumed, reference, atol=1e-6)
    helpers.assert_replicas_identical(
        resumed.optimizer.variables + resumed.weights
    )


def test_spread_inverses_with_a_replica_id_known_only_at_run_time(
    monkeypatch,
):
    # TPUs give the replica id as a tensor while tracing: each layer's
    # inversion is then a `cond` on it.
    import tensorflow as tf

    from keras_thor.src.distribute import replicas

    static_replica_id = replicas.replica_id

    def run_time_replica_id():
        zero = tf.cast(tf.timestamp() * 0.0, "int32")
        return static_replica_id() + zero

    def conds(model):
        counts = traced_op_counts(
            model.train_function.traced_variant("refresh")
        )
        return counts["StatelessIf"] + counts["If"]

    static = _model(helpers.mirrored_strategy(2))
    _fit(static, epochs=1)
    monkeypatch.setattr(replicas, "replica_id", run_time_replica_id)
    single = _model()
    _fit(single)
    mirrored = _model(helpers.mirrored_strategy(2))
    _fit(mirrored)
    # Each replica now holds every layer's inversion, inside a `cond`.
    assert conds(mirrored) > conds(static)
    helpers.assert_same_training_state(mirrored, single, atol=1e-5)
    helpers.assert_replicas_identical(
        mirrored.optimizer.variables + mirrored.weights
    )


OPTIONS = dict(
    factor_decay=0.8,
    statistics_frequency=1,
    kl_clip=1e-3,
    precondition_biases="joint",
    trace_thresholds=(0.05, 0.01),
)


def test_averaging_guard_and_trace_rule_on_two_replicas_equal_one_device():
    single = _model(run_eagerly=True, **OPTIONS)  # faster than tracing
    single_history = _fit(single)
    mirrored = _model(helpers.mirrored_strategy(2), **OPTIONS)
    mirrored_history = _fit(mirrored)
    assert min(single_history.history["thor_guard_scale"]) < 1.0
    assert single_history.history["thor_skipped_inversions"][-1] > 0
    assert single_history.history["thor_stopped_blocks"][-1] > 0
    for name in (
        "loss",
        "thor_guard_scale",
        "thor_refreshes",
        "thor_skipped_inversions",
        "thor_stopped_blocks",
    ):
        np.testing.assert_allclose(
            mirrored_history.history[name],
            single_history.history[name],
            rtol=1e-5,
            err_msg=name,
        )
    helpers.assert_same_training_state(mirrored, single, atol=1e-5)
    helpers.assert_replicas_identical(
        mirrored.optimizer.variables + mirrored.weights
    )


def test_sampled_fisher_on_two_replicas_trains_and_replicas_agree():
    options = dict(OPTIONS, fisher="sampled", statistics_rows=6)
    mirrored = _model(helpers.mirrored_strategy(2), **options)
    history = _fit(mirrored)
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    thor = mirrored.optimizer
    assert thor.curvature_troubles == 0
    assert all(np.isfinite(w).all() for w in helpers.weights_of(mirrored))
    assert all(np.isfinite(v).all() for v in helpers.optimizer_state(thor))
    # The replicas drew other targets but share the reduced statistics.
    helpers.assert_replicas_identical(thor.variables + mirrored.weights)


def test_keras_hub_causal_lm_on_two_replicas_equals_one_device():
    pytest.importorskip("keras_hub")
    from tests.thor.users_models_test import causal_lm
    from tests.thor.users_models_test import token_data

    x, y = token_data(rows=400)  # 50 steps of 8

    def trained(strategy):
        scope = strategy.scope() if strategy else contextlib.nullcontext()
        with scope:
            model = causal_lm(batch_size=8)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert model.optimizer.iterations.numpy() == 50
        return model

    one = trained(None)
    two = trained(helpers.mirrored_strategy(2))
    helpers.assert_all_close(
        helpers.weights_of(two), helpers.weights_of(one), atol=1e-4, rtol=1e-4
    )
