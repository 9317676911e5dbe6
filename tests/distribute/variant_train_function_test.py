"""The variant train function THOR and boost share: every variant traced
once on its own (no retracing warning from switching between them), fused
runs of one variant, and the same training as Keras's own loop."""

import logging

import keras
import numpy as np
import pytest

from keras_thor.src.backend.values import numpy_value
from keras_thor.src.distribute.train_step import keras_train_step
from keras_thor.src.distribute.variant_train_function import (
    VariantTrainFunction,
)
from tests import helpers

STEPS_PER_EPOCH = 6


class _Switching(VariantTrainFunction):
    """Keras's own step under `variants` keys, the key of step `t` being
    `t // run % variants` (AutoBoost's freezing groups switch so)."""

    def __init__(self, model, variants, run=1, fetches_in_step=False):
        super().__init__(model)
        self.variants = variants
        self.run = run
        self.fetches_in_step = fetches_in_step

    def read_step(self):
        return int(numpy_value(self.model.optimizer.iterations))

    def variant_at(self, step):
        return step // self.run % self.variants

    def variant_step(self, key):
        return lambda data: keras_train_step(self.model, data)


def _model(**compile_options):
    keras.utils.set_random_seed(0)
    model = helpers.mlp()
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss="mse",
        **compile_options,
    )
    return model


def _fit(model, epochs=2):
    x, y = helpers.regression_data(samples=8 * STEPS_PER_EPOCH - 4)
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_switching_between_many_variants_warns_of_no_retracing():
    import tensorflow as tf

    model = _model()
    model.train_function = _Switching(model, variants=6)
    messages = _Messages()
    tf.get_logger().addHandler(messages)
    try:
        _fit(model, epochs=3)
    finally:
        tf.get_logger().removeHandler(messages)
    assert not [m for m in messages.messages if "retracing" in m]
    # Each variant traced for the full batches, then the partial last one.
    for key in range(6):
        traced = model.train_function.traced_variant(key)
        assert traced.experimental_get_tracing_count() <= 2, key


@pytest.mark.parametrize(
    "steps_per_execution, fetches_in_step, run_eagerly",
    [(1, False, False), (1, True, False), (4, False, False), (4, False, True)],
)
def test_variants_train_as_keras_does(
    steps_per_execution, fetches_in_step, run_eagerly
):
    reference = _model()
    _fit(reference)
    model = _model(
        steps_per_execution=steps_per_execution, run_eagerly=run_eagerly
    )
    # Runs of 3 steps of one variant: fused with 4 steps per execution.
    model.train_function = _Switching(
        model, variants=2, run=3, fetches_in_step=fetches_in_step
    )
    _fit(model)
    assert int(numpy_value(model.optimizer.iterations)) == 2 * STEPS_PER_EPOCH
    helpers.assert_same_training_state(model, reference)


def test_a_list_of_batches_runs_one_step_a_batch():
    x, y = helpers.regression_data(samples=16)
    reference = _model()
    reference.train_on_batch(x[:8], y[:8])
    reference.train_on_batch(x[8:], y[8:])
    model = _model()
    model.train_function = _Switching(model, variants=2)
    model.train_function([(x[:8], y[:8])])
    model.train_function([(x[8:], y[8:])])
    assert int(numpy_value(model.optimizer.iterations)) == 2
    np.testing.assert_allclose(
        helpers.weights_of(model)[0], helpers.weights_of(reference)[0]
    )
