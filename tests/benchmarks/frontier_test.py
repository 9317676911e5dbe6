"""What the batch-size frontier on task (f) relies on: its budgets, checks,
rates and baseline, the scaling rule, and nanoGPT's schedule at a larger
batch."""

import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))

import gpt  # noqa: E402
import harness  # noqa: E402
import thor_batch_frontier as frontier  # noqa: E402

pytestmark = pytest.mark.tf_only  # the harness runs on the TF default


def test_budgets_shrink_by_the_scaling_factor():
    assert frontier.budget_steps((12, 24, 48, 96, 192)) == {
        12: 4000,
        24: 2500,
        48: 1563,
        96: 977,
        192: 611,
    }
    with pytest.raises(ValueError, match=r"batches=\(12, 36\)"):
        frontier.budget_steps((12, 36))


def test_frontier_task_checks_every_1200_windows():
    base = harness.TASKS["gpt"]
    for batch, every in ((12, 100), (24, 50), (48, 25), (96, 12)):
        task = frontier.frontier_task(base, batch, 977)
        assert (task.batch, task.epoch_steps, task.checks) == (batch, every, 1)
        assert task.budget * every >= 977 > (task.budget - 1) * every
        orders = np.concatenate(harness.stream_orders(task))
        np.testing.assert_array_equal(orders, np.arange(len(orders)))
    assert base.batch == 12 and base.epoch_steps == 100  # left as it was


def test_rates_follow_the_square_root_of_the_batch():
    np.testing.assert_allclose(frontier.rates(1e-3, 12), [1e-3 / 3, 1e-3, 3e-3])
    np.testing.assert_allclose(frontier.rates(1e-3, 48), [2e-3 / 3, 2e-3, 6e-3])


def _best(seconds, reached=True):
    return dict(point=dict(lr=1.0), seconds=seconds, reached=reached)


def test_fastest_other_baseline_is_by_seconds_without_nanogpt():
    protocol = dict(
        best={
            harness.NANOGPT_ADAMW: _best(1.0),
            harness.ADAMW: _best(5.0),
            harness.LION: _best(3.0, reached=False),
            harness.MUON: _best(4.0),
        }
    )
    assert frontier.fastest_other(protocol) == harness.MUON
    with pytest.raises(ValueError, match="no baseline"):
        frontier.fastest_other(dict(best={harness.NANOGPT_ADAMW: _best(1.0)}))


def _record(losses, every, target=1.5):
    return dict(
        target=target,
        point=dict(lr=1.0, at=None),
        epochs=[float(i + 1) for i in range(len(losses))],
        seconds=[float(i + 1) for i in range(len(losses))],
        metrics={"y": losses},
        check_steps=every,
    )


def test_steps_to_target_and_the_best_run_at_a_batch():
    slow, fast = _record([2.0, 1.6, 1.4], 25), _record([1.8, 1.5], 25)
    assert frontier.steps_to_target(slow) == (75, 3.0)
    assert frontier.best_at_batch([slow, fast]) is fast
    assert frontier.best_at_batch([_record([2.0, 1.9], 25)]) is None


def test_perfect_scaling_is_left_at_the_first_short_fall():
    assert (
        frontier.leaves_perfect_scaling({12: 2000, 24: 1000, 48: 500}) is None
    )
    assert frontier.leaves_perfect_scaling({12: 2000, 24: 1250, 48: 800}) == 48
    assert frontier.leaves_perfect_scaling({12: 2000, 24: 1300, 48: 600}) == 24
    assert frontier.leaves_perfect_scaling({12: 2000, 24: None}) == 24
    assert frontier.leaves_perfect_scaling({12: None, 24: 900}) == 12


def test_nanogpt_schedule_keeps_its_sequences_at_a_larger_batch():
    def schedule(optimizer):
        return optimizer.get_config()["learning_rate"]["config"]

    base = schedule(gpt.nanogpt_adamw())
    wide = schedule(gpt.nanogpt_adamw(2e-3, batch=48))
    assert (base["warmup_steps"], base["decay_steps"]) == (100, 2000)
    assert (wide["warmup_steps"], wide["decay_steps"]) == (25, 500)
    assert (wide["rate"], wide["min_rate"]) == pytest.approx((2e-3, 2e-4))


def test_a_rerun_reads_back_the_runs_of_the_same_frontier():
    budgets, preset = {12: 4000, 24: 2500}, {"learning_rate": 1e-3}
    point = dict(lr=frontier.rates(1e-3, 24)[0], schedule="cosine")
    runs = [
        dict(batch=24, optimizer=name, point=json.loads(json.dumps(point)))
        for name in (harness.MUON, harness.THOR_RECOMMENDED)
    ]
    previous = dict(
        target=1.8,
        budgets={"24": 2500, "96": 977},
        thor_preset=preset,
        runs=runs,
    )
    done = frontier.recorded_runs(previous, 1.8, budgets, preset)
    for run in runs:
        assert done[frontier.run_key(24, run["optimizer"], point)] is run
    # Another schedule at the same rate is another run.
    other_point = dict(point, schedule="constant")
    assert frontier.run_key(24, harness.MUON, other_point) not in done
    # Another preset: THOR runs again, the baselines' runs stand.
    other = frontier.recorded_runs(previous, 1.8, budgets, {"learning_rate": 1})
    assert list(other.values()) == runs[:1]
    assert frontier.recorded_runs(previous, 1.7, budgets, preset) == {}
    assert frontier.recorded_runs(previous, 1.8, {24: 2000}, preset) == {}
    assert frontier.recorded_runs({}, 1.8, budgets, preset) == {}
