"""BoostOptimizer in model.fit: accumulation, freezing, state, replicas."""

import contextlib

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.boost import BoostOptimizer
from keras_thor.boost import GradientFreeze
from keras_thor.src import keras_internals
from keras_thor.src.backend.values import numpy_value
from keras_thor.src.boost.boost_model import is_boost_model
from tests import helpers
from tests.boost import models

pytestmark = pytest.mark.tf_only


def _data(samples=48, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 8)).astype("float32")
    return x, rng.integers(0, 3, samples)


def _compiled(optimizer, strategy=None, boost=True, seed=0):
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        keras.utils.set_random_seed(seed)
        model = models.dense_stack()
        if boost:
            model = keras_thor.boost.to_boost_model(model)
        model.compile(optimizer=optimizer(), loss=models.LOSS)
    return model


def _sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.01)


def _freeze():
    # 3 groups; continuous sequence 0 0 1 2 0 0 1 2 ...
    return GradientFreeze(
        param_groups=3, freeze_type=0, freeze_p=0.5, total_steps=10
    )


def test_accumulation_equals_one_large_batch_step():
    x, y = _data()
    large = _compiled(_sgd, boost=False)
    large.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    accumulated = _compiled(
        lambda: keras_thor.boost.GradientAccumulation(4, _sgd())
    )
    accumulated.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    assert int(accumulated.optimizer.micro_steps) == 36
    assert int(accumulated.optimizer.iterations) == 9
    helpers.assert_all_close(
        helpers.weights_of(accumulated), helpers.weights_of(large), atol=2e-6
    )


def test_non_finite_micro_steps_are_dropped():
    x, y = _data(16)
    x_bad = x.copy()
    x_bad[4:8] = np.inf  # the second of four micro-batches
    model = _compiled(
        lambda: BoostOptimizer(
            keras.optimizers.SGD(0.1), grad_accumulation_step=4
        )
    )
    model.fit(x_bad, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    reference = _compiled(lambda: keras.optimizers.SGD(0.1), boost=False)
    import tensorflow as tf

    grads = None
    for start in (0, 8, 12):
        with tf.GradientTape() as tape:
            loss = models.LOSS(
                y[start : start + 4], reference(x[start : start + 4])
            )
        batch = tape.gradient(loss, reference.trainable_weights)
        grads = (
            batch if grads is None else [a + b for a, b in zip(grads, batch)]
        )
    reference.optimizer.apply(
        [g / 4 for g in grads], reference.trainable_weights
    )
    helpers.assert_all_close(
        helpers.weights_of(model), helpers.weights_of(reference), atol=1e-6
    )


def test_non_finite_step_without_accumulation_keeps_weights_finite():
    x, y = _data(16)
    x[:4] = np.nan
    model = _compiled(lambda: BoostOptimizer(_sgd(), grad_freeze=_freeze()))
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert all(np.isfinite(w).all() for w in helpers.weights_of(model))
    assert all(
        np.isfinite(v).all() for v in helpers.optimizer_state(model.optimizer)
    )


def test_loss_scaled_accumulation_skips_and_lowers_the_scale():
    x, y = _data(16)
    x[4:8] = np.inf
    model = _compiled(
        lambda: BoostOptimizer(
            keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.1), initial_scale=1024.0
            ),
            grad_accumulation_step=4,
        )
    )
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    lso = model.optimizer.inner_optimizer
    assert float(lso.dynamic_scale) == 512.0
    assert int(lso.iterations) == 1
    unscaled = _compiled(
        lambda: BoostOptimizer(
            keras.optimizers.SGD(0.1), grad_accumulation_step=4
        )
    )
    unscaled.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    helpers.assert_all_close(
        helpers.weights_of(model), helpers.weights_of(unscaled), atol=1e-6
    )


def _freeze_reference(x, y, batch_size, epochs):
    """Each step trains the group the sequence names, by hand."""
    import tensorflow as tf

    model = _compiled(_sgd, boost=False)
    freeze = _freeze()
    groups = freeze.split_parameters_groups(model)
    step = 0
    for _ in range(epochs):
        for start in range(0, len(x), batch_size):
            variables = groups[freeze.group_at(step)]
            with tf.GradientTape() as tape:
                loss = models.LOSS(
                    y[start : start + batch_size],
                    model(x[start : start + batch_size], training=True),
                )
            grads = tape.gradient(loss, variables)
            model.optimizer.apply(grads, variables)
            step += 1
    return model


def test_freezing_trains_the_sequence_group():
    x, y = _data(8)
    model = _compiled(lambda: BoostOptimizer(_sgd(), grad_freeze=_freeze()))
    groups = model.optimizer.grad_freeze.split_parameters_groups(model)
    assert [len(g) for g in groups] == [10, 6, 2]
    # Two fits of two steps: the step count carries over (steps 0..3).
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.micro_steps) == 4
    assert int(model.optimizer.iterations) == 4
    reference = _freeze_reference(x, y, batch_size=4, epochs=2)
    helpers.assert_all_close(
        helpers.weights_of(model), helpers.weights_of(reference), atol=1e-6
    )


def test_freezing_callback_trains_as_the_boost_optimizer(tmp_path):
    x, y = _data(10)  # a partial last batch of 2
    model = _compiled(_sgd)
    callback = keras_thor.callbacks.GradientFreeze(
        param_groups=3, freeze_type=0, freeze_p=0.5, total_steps=10
    )
    model.fit(
        x,
        y,
        batch_size=4,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[callback],
    )
    assert model.optimizer.grad_freeze is callback
    assert int(model.optimizer.micro_steps) == 6
    reference = _freeze_reference(x, y, batch_size=4, epochs=2)
    helpers.assert_all_close(
        helpers.weights_of(model), helpers.weights_of(reference), atol=1e-6
    )
    # Saved as the optimizer that froze; the callback passed again on the
    # loaded model keeps its step count.
    model.save(tmp_path / "m.keras")
    loaded = keras_thor.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, BoostOptimizer)
    helpers.assert_same_training_state(loaded, model, atol=0)
    loaded.fit(
        x,
        y,
        batch_size=4,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[_freeze()],
    )
    assert int(loaded.optimizer.micro_steps) == 9


def test_freezing_callback_needs_a_boost_model():
    x, y = _data(4)
    model = _compiled(_sgd, boost=False)
    with pytest.raises(ValueError, match="to_boost_model"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[_freeze()])
    boost_model = _compiled(_sgd)
    boost_model.fit(x, y, batch_size=4, verbose=0, callbacks=[_freeze()])
    with pytest.raises(ValueError, match="other settings"):
        boost_model.fit(
            x,
            y,
            batch_size=4,
            verbose=0,
            callbacks=[GradientFreeze(param_groups=2)],
        )


def test_frozen_variables_get_no_update_at_all():
    x, y = _data(4)
    model = _compiled(lambda: BoostOptimizer(_sgd(), grad_freeze=_freeze()))
    model.fit(x, y, batch_size=4, epochs=3, verbose=0)  # groups 0, 0, 1
    sgd = model.optimizer.inner_optimizer
    groups = model.optimizer.grad_freeze.split_parameters_groups(model)
    trained_ids = {id(v) for v in groups[2]}
    front = [v for v in groups[0] if id(v) not in trained_ids]
    momenta = [
        sgd.momentums[keras_internals.trained_variable_index(sgd, v)]
        for v in front
    ]
    before = [numpy_value(v) for v in front + momenta]
    trained = [numpy_value(v) for v in groups[2]]
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # group 2
    helpers.assert_all_close(
        [numpy_value(v) for v in front + momenta], before, atol=0, rtol=0
    )
    assert all(
        not np.array_equal(numpy_value(v), old)
        for v, old in zip(groups[2], trained)
    )


def _matmuls(model, group, update, data):
    function = model.train_function.traced_variant((group, update))
    graph = function.get_concrete_function(data).graph
    return sum(op.type == "MatMul" for op in graph.get_operations())


def test_frozen_steps_stop_backpropagation_early():
    import tensorflow as tf

    x, y = _data(4)
    model = _compiled(lambda: BoostOptimizer(_sgd(), grad_freeze=_freeze()))
    model.fit(x, y, batch_size=4, epochs=4, verbose=0)  # traces 0, 1, 2
    data = (tf.constant(x), tf.constant(y))
    counts = [_matmuls(model, group, True, data) for group in range(3)]
    # 5 Dense layers: forward 5; backward dW of each trained layer and dX
    # of every layer above the first trained one.
    assert counts == [5 + 5 + 4, 5 + 3 + 2, 5 + 1 + 0]


def _fit(model, x, y, epochs, callbacks=()):
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )


BOOSTED = {
    "freeze": lambda: BoostOptimizer(
        _sgd(), grad_freeze=_freeze(), centralized_variables=["d1/kernel"]
    ),
    # 6 steps an epoch, 4 micro-steps an update: saved mid-accumulation.
    "accumulation": lambda: BoostOptimizer(_sgd(), grad_accumulation_step=4),
}


@pytest.mark.parametrize("name", BOOSTED)
def test_keras_file_resume_equals_uninterrupted(name, tmp_path):
    x, y = _data()
    reference = _compiled(BOOSTED[name])
    _fit(reference, x, y, epochs=4)
    model = _compiled(BOOSTED[name])
    _fit(model, x, y, epochs=2)
    path = tmp_path / "boost.keras"
    model.save(path)
    loaded = keras_thor.load_model(path)
    assert is_boost_model(loaded) and type(loaded) is type(model)
    assert isinstance(loaded.optimizer, BoostOptimizer)
    assert int(loaded.optimizer.micro_steps) == 12
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    _fit(loaded, x, y, epochs=2)
    helpers.assert_same_training_state(loaded, reference)


@pytest.mark.parametrize("name", BOOSTED)
def test_backup_and_restore_resume_equals_uninterrupted(name, tmp_path):
    x, y = _data()
    reference = _compiled(BOOSTED[name])
    _fit(reference, x, y, epochs=4)
    resumed = helpers.resumed_after_interruption(
        lambda: _compiled(BOOSTED[name]),
        lambda model, epochs, callbacks: _fit(model, x, y, epochs, callbacks),
        str(tmp_path / "backup"),
        epochs=4,
        interrupt_at=3,
    )
    assert int(resumed.optimizer.micro_steps) == 24
    helpers.assert_same_training_state(resumed, reference)


@pytest.mark.multi_device
@pytest.mark.parametrize("name", BOOSTED)
def test_two_replicas_equal_one_device(name):
    x, y = _data()
    single = _compiled(BOOSTED[name])
    _fit(single, x, y, epochs=2)
    strategy = helpers.mirrored_strategy(2)
    mirrored = _compiled(BOOSTED[name], strategy)
    _fit(mirrored, x, y, epochs=2)
    helpers.assert_all_close(
        helpers.weights_of(mirrored), helpers.weights_of(single), atol=1e-6
    )
    helpers.assert_replicas_identical(
        mirrored.optimizer.variables + mirrored.weights
    )


def test_keras_own_training_step_refuses_freezing_and_accumulation():
    x, y = _data(8)
    model = _compiled(
        lambda: BoostOptimizer(_sgd(), grad_freeze=_freeze()), boost=False
    )
    with pytest.raises(ValueError, match="keras_thor.boost"):
        model.fit(x, y, verbose=0)


def test_overridden_train_step_is_refused():
    class Custom(keras_thor.models.BoostFunctional):
        def train_step(self, data):
            return super().train_step(data)

    base = models.dense_stack()
    model = Custom(base.inputs, base.outputs)
    model.compile(BoostOptimizer(_sgd(), grad_freeze=_freeze()), models.LOSS)
    x, y = _data(8)
    with pytest.raises(ValueError, match="overridden `train_step`"):
        model.fit(x, y, verbose=0)


def test_other_optimizers_train_as_keras_does():
    x, y = _data()
    boosted = _compiled(_sgd)
    _fit(boosted, x, y, epochs=2)
    plain = _compiled(_sgd, boost=False)
    _fit(plain, x, y, epochs=2)
    helpers.assert_all_close(
        helpers.weights_of(boosted), helpers.weights_of(plain), atol=0
    )


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"inner_optimizer": "sgd"}, TypeError, "inner_optimizer"),
        ({"grad_accumulation_step": 0}, ValueError, "grad_accumulation_step"),
        ({"grad_freeze": 3}, TypeError, "grad_freeze"),
        ({"centralized_variables": "d1/kernel"}, TypeError, "centralized"),
        (
            {"grad_freeze": GradientFreeze(), "grad_accumulation_step": 2},
            ValueError,
            "do not combine",
        ),
    ],
)
def test_bad_arguments(kwargs, error, match):
    kwargs = {"inner_optimizer": keras.optimizers.SGD(), **kwargs}
    with pytest.raises(error, match=match):
        BoostOptimizer(**kwargs)


@pytest.mark.parametrize(
    "compile_options",
    [{"jit_compile": True}, {"steps_per_execution": 3}, {"run_eagerly": True}],
)
def test_compile_options_give_the_same_training(compile_options):
    x, y = _data()
    reference = _compiled(BOOSTED["freeze"])
    _fit(reference, x, y, epochs=2)
    keras.utils.set_random_seed(0)
    model = keras_thor.boost.to_boost_model(models.dense_stack())
    model.compile(
        optimizer=BOOSTED["freeze"](), loss=models.LOSS, **compile_options
    )
    _fit(model, x, y, epochs=2)
    helpers.assert_same_training_state(model, reference, atol=2e-6)


def test_train_on_batch_counts_steps_and_accumulates():
    x, y = _data(8)
    model = _compiled(lambda: BoostOptimizer(_sgd(), grad_accumulation_step=2))
    model.train_on_batch(x[:4], y[:4])
    assert int(model.optimizer.iterations) == 0
    model.train_on_batch(x[4:], y[4:])
    assert int(model.optimizer.micro_steps) == 2
    assert int(model.optimizer.iterations) == 1
