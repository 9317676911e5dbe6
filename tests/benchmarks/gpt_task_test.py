"""What task (f) relies on: nanoGPT's model, schedule and AdamW, the
validation loss and the stream of fresh training windows."""

import math
import pathlib
import sys

import keras
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))

import gpt  # noqa: E402
import harness  # noqa: E402
import tasks  # noqa: E402

pytestmark = pytest.mark.tf_only  # the harness runs on the TF default


def nanogpt_get_lr(it, learning_rate=1e-3, warmup=100, decay=2000, low=1e-4):
    """nanoGPT's `train.py` `get_lr`, as written there."""
    if it < warmup:
        return learning_rate * (it + 1) / (warmup + 1)
    if it > decay:
        return low
    ratio = (it - warmup) / (decay - warmup)
    return low + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - low)


def test_schedule_is_nanogpts():
    schedule = gpt.NanoGPTSchedule()
    for step in (0, 1, 50, 99, 100, 101, 1050, 1999, 2000, 2001, 3999):
        assert float(schedule(step)) == pytest.approx(
            nanogpt_get_lr(step), rel=1e-5
        )


def test_model_is_nanogpts_cpu_configuration():
    model = gpt.gpt(65, seed=0)
    # nanoGPT prints 0.80M for Tiny Shakespeare's 65 characters; it leaves
    # the position table out of its count.
    parameters = model.count_params() - gpt.CONTEXT * gpt.WIDTH
    assert parameters == 4 * (12 * 128 * 128 + 2 * 128) + 65 * 128 + 128
    table = model.get_layer("token_embedding")
    assert table.tie_weights and not any(
        "bias" in v.path or "beta" in v.path for v in model.weights
    )
    # Causal: the logits at a position do not see later characters.
    ids = np.random.default_rng(0).integers(0, 65, (2, gpt.CONTEXT))
    changed = ids.copy()
    changed[:, 40:] = (changed[:, 40:] + 1) % 65
    a, b = model.predict(ids, verbose=0), model.predict(changed, verbose=0)
    np.testing.assert_allclose(a[:, :40], b[:, :40], atol=1e-5)
    assert not np.allclose(a[:, 40:], b[:, 40:], atol=1e-5)


def test_nanogpt_adamw_decays_matrices_only():
    model = gpt.gpt(65, blocks=1, seed=0)
    optimizer = gpt.nanogpt_adamw()
    optimizer.build(model.trainable_variables)
    decayed = {
        v.path
        for v in model.trainable_variables
        if optimizer._use_weight_decay(v)
    }
    assert decayed == {
        v.path for v in model.trainable_variables if len(v.shape) >= 2
    }
    assert optimizer.global_clipnorm == 1.0
    assert (optimizer.beta_1, optimizer.beta_2) == (0.9, 0.99)


def test_validation_loss_is_the_mean_token_cross_entropy():
    model = gpt.gpt(65, blocks=1, seed=0)
    rng = np.random.default_rng(1)
    x = rng.integers(0, 65, (5, gpt.CONTEXT)).astype("int32")
    y = rng.integers(0, 65, (5, gpt.CONTEXT)).astype("int32")
    expected = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
        y, model.predict(x, verbose=0)
    )
    assert tasks.validation_loss(model, x, y) == pytest.approx(
        float(expected), rel=1e-5
    )
    tasks.release(model)


def test_every_epoch_of_the_stream_trains_on_fresh_windows():
    task = harness.TASKS["gpt"]
    orders = harness.stream_orders(task)
    assert len(orders) == task.budget
    assert harness.steps_per_epoch(task, None) == task.epoch_steps == 100
    joined = np.concatenate(orders)
    np.testing.assert_array_equal(joined, np.arange(len(joined)))
    assert len(joined) == task.budget * task.epoch_steps * task.batch


def test_text_sample_is_seeded_and_reads_the_last_real_position():
    model = gpt.gpt(80, blocks=1, seed=0)
    window = np.random.default_rng(2).integers(0, 80, (1, 10))
    padded = np.pad(window, ((0, 0), (0, gpt.CONTEXT - 10)))
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(model(padded))[:, 9],
        keras.ops.convert_to_numpy(model(window))[:, -1],
        atol=1e-5,
    )
    first = harness.gpt_sample(model)
    assert len(first) == harness.SAMPLE_CHARACTERS
    assert first == harness.gpt_sample(model)
    tasks.release(model)
