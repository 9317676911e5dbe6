"""Small models and data shared by the tests."""

import functools
import re

import keras
import numpy as np

from keras_thor.src.backend.values import numpy_value


def regression_data(samples=64, features=6, outputs=3, seed=0):
    """A fixed linear regression problem with a little noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    true_kernel = rng.normal(size=(features, outputs)).astype("float32")
    noise = rng.normal(size=(samples, outputs)).astype("float32")
    y = x @ true_kernel + 0.1 * noise
    return x, y.astype("float32")


def mlp(features=6, outputs=3, hidden=8, seed=0):
    """A two-layer MLP with seeded initial weights."""
    init = keras.initializers.GlorotUniform(seed=seed)
    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(
                hidden, activation="tanh", kernel_initializer=init, name="d1"
            ),
            keras.layers.Dense(outputs, kernel_initializer=init, name="d2"),
        ]
    )


def vector_jacobian(function, values, cotangent=None):
    """The gradients, in the list of arrays `values`, of `function(values)`
    weighted by `cotangent` (of the scalar itself when `None`), computed by
    the test's backend; NumPy arrays."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        output, pull_back = jax.vjp(
            function, [jax.numpy.asarray(v) for v in values]
        )
        seed = jax.numpy.ones_like(output) if cotangent is None else cotangent
        (gradients,) = pull_back(jax.numpy.asarray(seed, output.dtype))
    elif backend == "tensorflow":
        import tensorflow as tf

        values = [tf.convert_to_tensor(v) for v in values]
        with tf.GradientTape() as tape:
            tape.watch(values)
            output = function(values)
        gradients = tape.gradient(output, values, output_gradients=cotangent)
    else:
        import torch

        values = [
            keras.ops.convert_to_tensor(v).detach().clone().requires_grad_()
            for v in values
        ]
        output = function(values)
        seed = torch.ones_like(output) if cotangent is None else cotangent
        gradients = torch.autograd.grad(
            output,
            values,
            torch.as_tensor(np.asarray(seed), dtype=output.dtype),
        )
    return [numpy_value(g) for g in gradients]


def per_example_gradients(model, loss, x, y):
    """`{variable.path: S}`, `S` of shape `(examples, size)` in float64:
    row `n` is the gradient of example `n`'s `loss(y, model(x))` (`loss`
    without reduction), by one backward pass per example."""
    trainable = model.trainable_variables
    non_trainable = [v.value for v in model.non_trainable_variables]
    rows = []
    for n in range(len(x)):

        def example_loss(values, n=n):
            outputs, _ = model.stateless_call(
                values, non_trainable, x[n : n + 1]
            )
            return keras.ops.sum(loss(y[n : n + 1], outputs))

        rows.append(vector_jacobian(example_loss, [v.value for v in trainable]))
    return {
        v.path: np.stack([r[i].reshape(-1) for r in rows]).astype(np.float64)
        for i, v in enumerate(trainable)
    }


class RunTimeSteps:
    """The steps at which compiled training code ran a line, recorded on
    the host each time it runs (not when it is traced): `record(step)`
    inside the step, then `steps()` after it."""

    def __init__(self):
        self._steps = []

    def record(self, step):
        step = keras.ops.convert_to_tensor(step)
        if keras.backend.backend() == "jax":
            import jax

            jax.debug.callback(self._append, step)
        else:
            import tensorflow as tf

            tf.numpy_function(self._append, [step], Tout=[])

    def _append(self, step):
        self._steps.append(int(step))
        return []

    def steps(self):
        if keras.backend.backend() == "jax":
            import jax

            jax.effects_barrier()
        return list(self._steps)


def weights_of(model):
    return [numpy_value(w) for w in model.weights]


def optimizer_state(optimizer):
    return [numpy_value(v) for v in optimizer.variables]


def replica_values(variable):
    """Every replica's copy of a variable made under a strategy."""
    return [np.asarray(v) for v in variable.value.values]


def assert_replicas_identical(variables):
    """Every replica's copy of each variable is bit-identical."""
    for variable in variables:
        first, *others = replica_values(variable)
        for other in others:
            np.testing.assert_array_equal(other, first)


def assert_all_close(actual, expected, atol=1e-6, rtol=1e-6):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, atol=atol, rtol=rtol)


def assert_same_training_state(model, reference, atol=1e-6, rtol=1e-6):
    """Weights and optimizer state of `model` equal `reference`'s."""
    assert_all_close(
        weights_of(model), weights_of(reference), atol=atol, rtol=rtol
    )
    assert_all_close(
        optimizer_state(model.optimizer),
        optimizer_state(reference.optimizer),
        atol=atol,
        rtol=rtol,
    )


class InterruptAtEpoch(keras.callbacks.Callback):
    """Stops `fit` with a RuntimeError when `epoch` begins."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def resumed_after_interruption(make_model, fit, backup, epochs, interrupt_at):
    """A model trained `epochs` by `fit(model, epochs, callbacks)` with a
    `BackupAndRestore` in `backup`: interrupted when epoch `interrupt_at`
    begins, then resumed by a fresh `make_model()`."""
    import pytest

    interrupted = make_model()
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(
            interrupted,
            epochs,
            [
                keras.callbacks.BackupAndRestore(backup),
                InterruptAtEpoch(interrupt_at),
            ],
        )
    resumed = make_model()
    fit(resumed, epochs, [keras.callbacks.BackupAndRestore(backup)])
    return resumed


@functools.cache
def mirrored_strategy(replicas):
    """One MirroredStrategy per replica count for the whole test session.

    Two strategies over the same devices start their collective instance
    keys at the same value, so collectives traced under one can collide
    with the other's ("Shape mismatch in the collective instance"):
    TensorFlow expects one strategy per process. Strategies of different
    sizes also get apart collective group keys (TF's class attribute
    `_collective_key_base`, read when a strategy is made), else a 4-replica
    group joins the 2-replica group's key.
    """
    import tensorflow as tf

    class KeyedMirroredStrategy(tf.distribute.MirroredStrategy):
        _collective_key_base = 1000 * replicas

    return KeyedMirroredStrategy([f"/cpu:{i}" for i in range(replicas)])


def stable_id(value):
    """A test id for `value` that is the same in every pytest-xdist worker
    (`repr` of a function holds its memory address)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))
