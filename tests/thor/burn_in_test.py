"""THOR's burn-in (`burn_in_steps`): statistics-only steps before the
first update. The schedule and the checks on every backend; `model.fit`
against the NumPy reference, `.keras` files and BackupAndRestore (with
`damping_split="pi"`, `precondition_biases="joint"` and the velocity's
guard as well) with THOR's TensorFlow training step.
"""

import keras
import numpy as np
import pytest

import keras_thor
from keras_thor.optimizers import THOR
from keras_thor.src.thor.schedule import RefreshSchedule
from tests import helpers
from tests.thor import keras_models
from tests.thor.thor_options_reference_test import HYPER
from tests.thor.thor_options_reference_test import _assert_follows
from tests.thor.thor_options_reference_test import _fit_and_reference
from tests.thor.thor_options_training_test import _data
from tests.thor.thor_options_training_test import _mlp


def test_schedule_burns_in_first_and_counts_updates_after():
    schedule = RefreshSchedule(4, 2, burn_in_steps=3)
    steps = range(12)
    assert [s for s in steps if schedule.burns_in_at(s)] == [0, 1, 2]
    assert [s for s in steps if schedule.refreshes_at(s)] == [3, 7, 11]
    assert [s for s in steps if schedule.gathers_statistics_at(s)] == [
        0, 1, 2, 3, 5, 7, 9, 11
    ]  # fmt: skip


def test_burn_in_steps_are_checked_and_kept_in_the_config():
    with pytest.raises(ValueError, match="factor_decay"):
        THOR(0.1, 0.1, 0.9, burn_in_steps=10)
    with pytest.raises(ValueError, match="burn_in_steps"):
        THOR(0.1, 0.1, 0.9, burn_in_steps=-1, factor_decay=0.9)
    with pytest.raises(TypeError, match="burn_in_steps"):
        THOR(0.1, 0.1, 0.9, burn_in_steps=True, factor_decay=0.9)
    thor = THOR(0.1, 0.1, 0.9, burn_in_steps=10, factor_decay=0.95)
    config = thor.get_config()
    assert config["burn_in_steps"] == 10
    assert THOR.from_config(config).burn_in_steps == 10
    assert THOR(0.1, 0.1, 0.9).burn_in_steps == 0


@pytest.mark.thor_training
def test_burn_in_follows_the_reference_and_leaves_the_weights_alone():
    recorder, expected, optimizer, model = _fit_and_reference(
        "mlp",
        "ce",
        frequency=4,
        factor_decay=0.8,
        statistics_frequency=2,
        burn_in_steps=3,
        **HYPER,
    )
    assert len(expected) == 12
    assert optimizer.refresh_steps == [0, 4, 8]
    start = keras_models.flat(recorder.start)
    for weights in recorder.weights[:3]:
        helpers.assert_all_close(weights, start, atol=0, rtol=0)
    assert keras_models.relative_error(recorder.weights[3], start) > 1e-3
    _assert_follows(recorder.weights, expected)
    thor = model.optimizer
    assert int(thor.iterations.numpy()) == 9
    assert (
        int(keras.ops.convert_to_numpy(thor.estimator.steps_burned_in())) == 3
    )
    first = thor.curvature_blocks[min(thor.curvature_blocks)]
    # 3 burn-in statistics steps, then updates 0, 2, 4, 6, 8.
    weight = sum(0.8**i for i in range(8))
    np.testing.assert_allclose(
        float(thor.state_for(first.kernel).factor_weight), weight, rtol=1e-6
    )


STEPS_PER_EPOCH = 3


def _burn_in_model():
    keras.utils.set_random_seed(0)
    return _mlp(
        THOR(
            0.1,
            0.05,
            0.9,
            frequency=2,
            factor_decay=0.8,
            statistics_frequency=1,
            burn_in_steps=4,
            fisher="sampled",
            # The other K-FAC-grade options round-trip here too.
            damping_split="pi",
            precondition_biases="joint",
            kl_clip=1e-3,
            kl_clip_mode="velocity",
        ),
        run_eagerly=True,
    )


def _fit(model, epochs, callbacks=()):
    x, y = _data(16 * STEPS_PER_EPOCH)
    return model.fit(
        x,
        y,
        batch_size=16,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )


@pytest.fixture(scope="module")
def uninterrupted():
    model = _burn_in_model()
    _fit(model, epochs=3)
    assert int(model.optimizer.iterations.numpy()) == 9 - 4
    return helpers.weights_of(model), helpers.optimizer_state(model.optimizer)


def _assert_equals_uninterrupted(model, uninterrupted):
    weights, state = uninterrupted
    helpers.assert_all_close(helpers.weights_of(model), weights, atol=1e-6)
    helpers.assert_all_close(
        helpers.optimizer_state(model.optimizer), state, atol=1e-5
    )


@pytest.mark.thor_training
def test_keras_file_saved_during_burn_in_resumes_as_uninterrupted(
    tmp_path, uninterrupted
):
    model = _burn_in_model()
    _fit(model, epochs=1)  # 3 of the 4 burn-in steps
    assert int(model.optimizer.iterations.numpy()) == 0
    path = tmp_path / "thor.keras"
    model.save(path)
    loaded = keras_thor.load_model(path)
    restored = loaded.optimizer
    assert restored.burn_in_steps == 4
    assert (restored.damping_split, restored.precondition_biases) == (
        "pi",
        "joint",
    )
    assert (
        int(keras.ops.convert_to_numpy(restored.estimator.steps_burned_in()))
        == 3
    )
    _fit(loaded, epochs=2)
    _assert_equals_uninterrupted(loaded, uninterrupted)


@pytest.mark.thor_training
def test_backup_and_restore_during_burn_in_resumes_as_uninterrupted(
    tmp_path, uninterrupted
):
    resumed = helpers.resumed_after_interruption(
        _burn_in_model,
        lambda model, epochs, callbacks: _fit(model, epochs, callbacks),
        str(tmp_path / "backup"),
        epochs=3,
        interrupt_at=1,  # after 3 steps: the next one still burns in
    )
    _assert_equals_uninterrupted(resumed, uninterrupted)


@pytest.mark.thor_training
def test_fused_burn_in_and_statistics_steps_follow_the_reference():
    """Steps of one kind run as one loop: burn-in 0-2 then statistics."""
    recorder, expected, _, _ = _fit_and_reference(
        "mlp",
        "ce",
        frequency=4,
        factor_decay=0.8,
        statistics_frequency=1,
        burn_in_steps=3,
        compile_options={"steps_per_execution": 6},
        **HYPER,
    )
    _assert_follows(recorder.weights, expected[5::6])
