"""`THOR.recommended()` chosen by the clock: seconds to the target on
(b), (d), (e) and (f) against each task's fastest baseline (issue 37,
item 4).

The protocol, fixed on 2026-12-06 before any run of it (docs/benchmarks.md,
"The preset chosen by the clock"):

- **Runs:** benchmark 1's (`harness.run`: the task's data, seed 0 (the
  tune seed), initial weights, order, checks and target, stopping at the
  target), on JAX, every task's target and best baseline points from the
  recorded protocol.
- **Reference:** per task, the fastest baseline (fewest training seconds
  to the target at its best point of the tune; every baseline of the task,
  nanoGPT's AdamW included on (f)), run in the same process before and
  after the task's THOR runs; its seconds are the mean of the two.
- **Stage 1:** the shipped preset and each change of one setting that
  trades epochs for seconds (`CHANGES`), at the preset's rate and damping.
  A candidate's ratio on a task: its seconds to the target over the
  reference's (not reached: infinite). Its score: the largest ratio over
  the tasks (the issue's target is ≤ 0.8 on every task); scores within 2%
  of the lowest tie, and the lower geometric mean wins.
- **Stage 2:** the preset with every stage-1 change whose score is more
  than 2% below the preset's and that raised no task's ratio by more than
  10% (of two changes of the same setting, the better-scoring one), if
  there are at least two such changes.
- **Chosen:** the lowest score of stage 1 and 2; it ships only if
  `thor_sensitivity.py --tasks resnet autoencoder transformer mnist_mlp gpt`
  with it finds no divergence over the 3×3 rate × damping grid (else the
  next best), and is reported on seeds 1–3 on JAX and TensorFlow
  (`thor_time_to_accuracy.py --phase report`), the previous preset's
  numbers kept as history.

- **Follow-ups** (`--follow-ups`, fixed 2026-12-07 before their first
  run): the step-cost ideas stages 1 and 2 left untried (`FOLLOW_UPS`:
  the guard measured on refresh steps only, alone and with fewer
  inversions and statistics rows), measured as stage 1 against the
  shipped preset, scored the same way.

Writes `<prefix>.json` (every record; `<prefix>_follow_ups.json` with
`--follow-ups`) and prints the ratios per task.

    KERAS_BACKEND=jax python benchmarks/thor_preset_by_clock.py
        [--tasks resnet transformer mnist_mlp gpt] [--follow-ups]
"""

import argparse
import math
import os
import pathlib

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import harness  # noqa: E402
import keras  # noqa: E402
import outcomes  # noqa: E402
from outcomes import say  # noqa: E402

import keras_thor  # noqa: E402

TASKS = ("resnet", "transformer", "mnist_mlp", "gpt")
QUARTER = "a quarter of the batch"  # resolved per task: batch // 4
# One setting changed from the preset each (stage 1).
CHANGES = {
    "statistics_rows=batch/4": {"statistics_rows": QUARTER},
    'statistics_rows="width"': {"statistics_rows": "width"},
    # Statistics every other step: `frequency` must be a multiple of 2.
    "statistics_frequency=2, frequency=10": {
        "statistics_frequency": 2,
        "frequency": 10,
    },
    "frequency=10": {"frequency": 10},
    'kl_clip_mode="direction"': {"kl_clip_mode": "direction"},
    "split_dim=256": {"split_dim": 256},
}
# The step-cost ideas left untried after stages 1 and 2 (fixed
# 2026-12-07 before their first run), each measured as stage 1 is: the
# shipped preset, then each follow-up, between two runs of the reference
# (`--follow-ups`).
FOLLOW_UPS = {
    'kl_clip_steps="refresh"': {"kl_clip_steps": "refresh"},
    'kl_clip_steps="refresh", frequency=10': {
        "kl_clip_steps": "refresh",
        "frequency": 10,
    },
    'kl_clip_steps="refresh", frequency=10, statistics_rows="width"': {
        "kl_clip_steps": "refresh",
        "frequency": 10,
        "statistics_rows": "width",
    },
}
PRESET = "THOR.recommended()"
TIE = 0.02  # relative: scores this close are tied
WORSE = 0.10  # a change that raises a task's ratio by more is not combined


def resolve(options, task):
    """`options` with `QUARTER` replaced by `task.batch // 4`."""
    return {
        key: max(1, task.batch // 4) if value == QUARTER else value
        for key, value in options.items()
    }


def fastest_baseline(protocol, task):
    """The task's baseline with the fewest seconds to its target at its
    best point of the tune."""
    reached = {
        name: best
        for name, best in protocol["best"].items()
        if best["reached"] and name in harness.baselines(task)
    }
    if not reached:
        raise ValueError(f"no baseline reached {task.name}'s target")
    return min(reached, key=lambda name: reached[name]["seconds"])


def score(ratios):
    """`(largest ratio, geometric mean)` over the tasks' ratios; a task
    whose reference missed the target in this process (NaN) is left out,
    a candidate that missed it counts as infinite."""
    values = [v for v in ratios.values() if not math.isnan(v)]
    if not values or not all(math.isfinite(v) for v in values):
        return math.inf, math.inf
    return max(values), math.exp(sum(math.log(v) for v in values) / len(values))


def ranked(scores):
    """Candidate names best first: the lowest score, except that of the
    scores within `TIE` of the lowest the lower geometric mean goes
    first; then the same for the rest."""
    left, order = dict(scores), []
    while left:
        best = min(largest for largest, _ in left.values())
        tied = [
            name
            for name, (largest, _) in left.items()
            if largest <= best * (1 + TIE)
        ]
        first = min(tied, key=lambda name: left[name][1])
        order.append(first)
        del left[first]
    return order


def combination(ratios):
    """Stage 2's options: every stage-1 change whose score is below the
    preset's by more than `TIE` and that raised no task's ratio by more
    than `WORSE`; of changes of the same setting, the better-scoring;
    None with fewer than two such changes."""
    preset = ratios[PRESET]
    best_score = score(preset)[0]
    kept, names = {}, []
    for name in ranked({n: score(r) for n, r in ratios.items()}):
        if name not in CHANGES:
            continue
        if not score(ratios[name])[0] * (1 + TIE) < best_score:
            continue
        if any(
            ratios[name][task] > preset[task] * (1 + WORSE) for task in preset
        ):
            continue
        if any(key in kept for key in CHANGES[name]):
            continue  # a better-scoring change of the same setting is in
        kept.update(CHANGES[name])
        names.append(name)
    return kept if len(names) >= 2 else None


def _seconds(record, task):
    got = outcomes.outcome(record, task.higher_is_better)
    return got[1] if got else math.inf


def _thor_record(task, data, target, options):
    preset = keras_thor.optimizers.THOR.RECOMMENDED
    return harness.run_thor(task, data, target, {**preset, **options})


def measure(task, protocol, candidates):
    """The reference's and each candidate's records on `task`, and the
    candidates' ratios."""
    data = task.load()
    target = protocol["target"]
    reference = fastest_baseline(protocol, task)
    point = protocol["best"][reference]["point"]

    def run_reference():
        return harness.run(task, data, reference, point, 0, target, True)

    records = {"reference before": run_reference()}
    for name, options in candidates.items():
        records[name] = _thor_record(task, data, target, resolve(options, task))
        say(
            f"  [{task.name}] {name:<34} "
            f"{_seconds(records[name], task):8.2f} s to the target"
        )
    records["reference after"] = run_reference()
    seconds = [
        _seconds(records[key], task)
        for key in ("reference before", "reference after")
    ]
    base = sum(seconds) / 2
    say(f"  [{task.name}] reference {reference}: {seconds} s")
    if not math.isfinite(base):
        say(f"  [{task.name}] the reference missed the target: no ratios")
    ratios = {
        name: _seconds(records[name], task) / base
        if math.isfinite(base)
        else math.nan
        for name in candidates
    }
    return dict(reference=reference, seconds=seconds, records=records), ratios


def _table(ratios, tasks):
    width = max(40, *(len(name) + 2 for name in ratios))
    say(
        f"\n{'candidate':<{width}}"
        + "".join(f"{t:>12}" for t in tasks)
        + "  score"
    )
    scores = {name: score(row) for name, row in ratios.items()}
    for name in ranked(scores):
        cells = "".join(f"{ratios[name][t]:>12.3f}" for t in tasks)
        say(
            f"{name:<{width}}{cells}  "
            f"{scores[name][0]:.3f} / {scores[name][1]:.3f}"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS)
    parser.add_argument("--prefix", default="results/thor_preset_by_clock")
    parser.add_argument(
        "--follow-ups",
        action="store_true",
        help="measure FOLLOW_UPS against the shipped preset instead",
    )
    args = parser.parse_args()
    recorded = outcomes.read(harness.RECORDED_PROTOCOL)
    missing = [t for t in args.tasks if t not in recorded]
    if missing:
        parser.error(f"no recorded target for {missing}: tune them first")
    say(f"keras {keras.__version__}, backend {keras.backend.backend()}")
    if args.follow_ups:
        path = pathlib.Path(f"{args.prefix}_follow_ups.json")
        candidates, stage = {PRESET: {}, **FOLLOW_UPS}, "follow_ups"
    else:
        path = pathlib.Path(f"{args.prefix}.json")
        candidates, stage = {PRESET: {}, **CHANGES}, "stage1"
    results, ratios = {}, {name: {} for name in candidates}
    for name in args.tasks:
        task = harness.TASKS[name]
        results[name], task_ratios = measure(task, recorded[name], candidates)
        for candidate, ratio in task_ratios.items():
            ratios[candidate][name] = ratio
        outcomes.write(path, {stage: results, "ratios": ratios})
    _table(ratios, args.tasks)
    if args.follow_ups:
        return
    combined = combination(ratios)
    if combined is None:
        say("stage 2: fewer than two changes helped; nothing to combine")
        return
    label = "combined " + ", ".join(f"{k}={v}" for k, v in combined.items())
    ratios[label], stage2 = {}, {}
    for name in args.tasks:
        task = harness.TASKS[name]
        stage2[name], task_ratios = measure(
            task, recorded[name], {label: combined}
        )
        ratios[label][name] = task_ratios[label]
        outcomes.write(path, dict(stage1=results, stage2=stage2, ratios=ratios))
    _table(ratios, args.tasks)


if __name__ == "__main__":
    main()
