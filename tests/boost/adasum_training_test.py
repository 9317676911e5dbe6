"""AdaSum in model.fit under MirroredStrategy, against a NumPy re-run."""

import keras
import numpy as np
import pytest

from keras_thor.boost import AdaSum
from keras_thor.boost import AutoBoost
from keras_thor.boost import BoostOptimizer
from keras_thor.src import keras_internals
from tests import helpers
from tests.boost import models

pytestmark = pytest.mark.multi_device

BATCH = 16
STEPS = 3
LEARNING_RATE = 0.1


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 8)).astype("float32")
    return x, rng.integers(0, 3, BATCH * STEPS)


def _reference_pair(a, b):
    dot = np.vdot(a, b)
    a_coefficient = 1 - dot / (2 * np.vdot(a, a))
    b_coefficient = 1 - dot / (2 * np.vdot(b, b))
    return a_coefficient * a + b_coefficient * b


def _reference_tree(tensors):
    while len(tensors) > 1:
        tensors = [
            _reference_pair(tensors[i], tensors[i + 1])
            for i in range(0, len(tensors), 2)
        ]
    return tensors[0]


def _reference(replicas, device_number, momentum):
    """Per replica: its batch slice's gradient (averaged in its group), its
    own SGD momentum; then AdaSum of one delta per group."""
    import tensorflow as tf

    x, y = _data()
    keras.utils.set_random_seed(0)
    model = models.dense_stack()
    variables = model.trainable_variables
    velocities = [
        [np.zeros(v.shape) for v in variables] for _ in range(replicas)
    ]
    rows = BATCH // replicas
    for step in range(STEPS):
        grads = []
        for replica in range(replicas):
            start = step * BATCH + replica * rows
            with tf.GradientTape() as tape:
                loss = models.LOSS(
                    y[start : start + rows], model(x[start : start + rows])
                )
            grads.append([g.numpy() for g in tape.gradient(loss, variables)])
        deltas = []
        for replica in range(replicas):
            first = replica // device_number * device_number
            group = grads[first : first + device_number]
            mean = [np.mean(parts, axis=0) for parts in zip(*group)]
            for index, g in enumerate(mean):
                velocities[replica][index] = (
                    momentum * velocities[replica][index] - LEARNING_RATE * g
                )
            deltas.append(velocities[replica])
        representatives = deltas[::device_number]
        for index, variable in enumerate(variables):
            combined = _reference_tree(
                [delta[index].astype(np.float64) for delta in representatives]
            )
            variable.assign(variable.numpy() + combined)
    return model, velocities


def _boosted(replicas, device_number, momentum):
    strategy = helpers.mirrored_strategy(replicas)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = models.dense_stack()
        model.compile(
            optimizer=BoostOptimizer(
                keras.optimizers.SGD(LEARNING_RATE, momentum=momentum),
                adasum=AdaSum(device_number),
            ),
            loss=models.LOSS,
        )
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize(
    "replicas, device_number, momentum",
    [(2, 1, 0.0), (2, 1, 0.9), (4, 1, 0.9), (4, 2, 0.9)],
)
def test_fit_equals_reference(replicas, device_number, momentum):
    model = _boosted(replicas, device_number, momentum)
    reference, velocities = _reference(replicas, device_number, momentum)
    helpers.assert_all_close(
        helpers.weights_of(model), helpers.weights_of(reference), atol=2e-6
    )
    for variable in model.weights:  # the weights agree on every replica
        values = helpers.replica_values(variable)
        for value in values[1:]:
            np.testing.assert_array_equal(value, values[0])
    sgd = model.optimizer.inner_optimizer
    if momentum:
        # Each replica keeps its own momentum, as in Horovod and MindSpore.
        for index, variable in enumerate(model.trainable_variables):
            momenta = helpers.replica_values(
                sgd.momentums[
                    keras_internals.trained_variable_index(sgd, variable)
                ]
            )
            for replica, value in enumerate(momenta):
                np.testing.assert_allclose(
                    value, velocities[replica][index], atol=2e-6
                )
            if device_number == 1:
                assert not np.allclose(momenta[0], momenta[1])


def test_auto_boost_o2_runs_adasum_across_replicas():
    strategy = helpers.mirrored_strategy(2)
    with strategy.scope():
        boost = AutoBoost(
            "O2",
            {
                "adasum": {"device_number": 1},
                "grad_freeze": {"param_groups": 3, "total_steps": 12},
            },
        )
        model, optimizer, _ = boost.network_auto_process_train(
            models.bottleneck_resnet(), keras.optimizers.SGD(0.05)
        )
        assert optimizer.adasum.device_number == 1
        model.compile(optimizer=optimizer, loss=models.LOSS)
    x, y = models.image_data(32)
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    # (Keras's own BatchNormalization moving statistics differ across
    # replicas under MirroredStrategy, with or without boost.)
    for variable in model.trainable_weights:
        first, second = helpers.replica_values(variable)
        np.testing.assert_array_equal(first, second)


def test_auto_boost_o2_on_one_node_is_off_with_a_warning():
    strategy = helpers.mirrored_strategy(2)
    with strategy.scope():
        with pytest.warns(UserWarning, match="make one group"):
            _, optimizer, _ = AutoBoost("O2").network_auto_process_train(
                models.bottleneck_resnet(), keras.optimizers.SGD()
            )
    assert optimizer.adasum is None


def test_three_groups_are_refused():
    strategy = helpers.mirrored_strategy(4)
    with strategy.scope():
        with pytest.raises(ValueError, match="power-of-two"):
            AutoBoost(
                "O0",
                {
                    "boost": {"mode": "manual", "adasum": True},
                    "adasum": {"device_number": 3},
                },
            ).network_auto_process_train(
                models.bottleneck_resnet(), keras.optimizers.SGD()
            )
