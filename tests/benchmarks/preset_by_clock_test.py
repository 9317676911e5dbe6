"""The rules of the preset chosen by the clock (issue 37, item 4): the
per-task options, the reference baseline, the score and stage 2."""

import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))

import harness  # noqa: E402
import thor_preset_by_clock as clock  # noqa: E402

import keras_thor  # noqa: E402

pytestmark = pytest.mark.tf_only  # the harness runs on the TF default


def test_every_candidate_is_a_valid_thor():
    for task in ("mnist_mlp", "gpt"):
        for options in [*clock.CHANGES.values(), *clock.FOLLOW_UPS.values()]:
            options = clock.resolve(options, harness.TASKS[task])
            keras_thor.optimizers.THOR.recommended(batch_size=12, **options)
    quarter = clock.CHANGES["statistics_rows=batch/4"]
    assert clock.resolve(quarter, harness.TASKS["gpt"]) == {
        "statistics_rows": 3
    }
    assert clock.resolve(quarter, harness.TASKS["mnist_mlp"]) == {
        "statistics_rows": 32
    }


def _best(seconds, reached=True):
    return dict(point=dict(lr=1.0), seconds=seconds, reached=reached)


def test_reference_is_the_fastest_baseline_of_the_task():
    protocol = dict(
        best={
            harness.NANOGPT_ADAMW: _best(1.0),
            harness.ADAMW: _best(5.0),
            harness.SGD: _best(0.5, reached=False),
        }
    )
    gpt, mlp = harness.TASKS["gpt"], harness.TASKS["mnist_mlp"]
    assert clock.fastest_baseline(protocol, gpt) == harness.NANOGPT_ADAMW
    assert clock.fastest_baseline(protocol, mlp) == harness.ADAMW
    with pytest.raises(ValueError, match="no baseline reached"):
        clock.fastest_baseline(dict(best={}), mlp)


def test_score_is_the_worst_task_then_the_geometric_mean():
    assert clock.score({"a": 0.5, "b": 2.0}) == (2.0, pytest.approx(1.0))
    assert clock.score({"a": 0.5, "b": math.inf})[0] == math.inf
    # A task whose reference missed the target in the run is left out.
    assert clock.score({"a": math.nan, "b": 2.0}) == (2.0, 2.0)
    scores = {
        "worse": (1.2, 0.5),
        "tied, lower mean": (1.005, 0.7),
        "tied": (1.0, 0.9),
        "never": (math.inf, math.inf),
    }
    assert clock.ranked(scores) == [
        "tied, lower mean",
        "tied",
        "worse",
        "never",
    ]


def test_stage_two_combines_the_changes_that_helped():
    preset = {"b": 1.0, "f": 2.0}
    ratios = {
        clock.PRESET: preset,
        "statistics_rows=batch/4": {"b": 1.05, "f": 1.5},  # helps
        "frequency=10": {"b": 0.9, "f": 1.8},  # helps
        "split_dim=256": {"b": 1.3, "f": 1.2},  # raises (b) by more than 10%
        'kl_clip_mode="direction"': {"b": 0.5, "f": 2.5},  # the score rose
    }
    assert clock.combination(ratios) == {
        "statistics_rows": clock.QUARTER,
        "frequency": 10,
    }
    del ratios["frequency=10"]
    assert clock.combination(ratios) is None
    # One change of two settings is one change: nothing to combine; nor
    # is a second change of a setting already kept.
    both = "statistics_frequency=2, frequency=10"
    alone = {clock.PRESET: preset, both: {"b": 0.8, "f": 1.0}}
    assert clock.combination(alone) is None
    alone["frequency=10"] = {"b": 0.9, "f": 1.5}
    assert clock.combination(alone) is None
