"""The batch-size frontier on task (f): steps to the target against the
sequences a step, for THOR, nanoGPT's AdamW and the fastest other baseline.

The protocol, fixed on 2026-12-06 before any THOR run of it
(docs/benchmarks.md, "The batch-size frontier"):

- **Batches** 12, 24, 48 and 96 sequences a step (`--batches`; each the
  double of the one before, 192 if the machine allows), seed 0.
- **Budget** 4,000 steps at batch 12 (task (f)'s); each doubling gets the
  previous budget / 1.6, rounded up (2,500, 1,563, 977, 611), so whether
  an optimizer's steps fell by 1.6x is always decided within it; a run
  goes on to the end of its last check interval (1,575 steps at 48, 984
  at 96, 612 at 192), and a cosine decays over those steps.
- **Checks** of the validation loss about every 1,200 windows:
  `round(1200 / batch)` steps (100, 50, 25, 12, 6: every 1,152 windows at
  96 and 192). One stream of windows, drawn once (`harness.load_gpt`):
  step `t` at batch `B` trains windows `t·B ... (t+1)·B - 1`.
- **Optimizers:** "THOR (recommended)" (`THOR.recommended(batch_size=B)`
  at its rate), "AdamW (nanoGPT)" (its warm-up and decay keep their
  sequences: steps × 12 / B), and the fastest other baseline: the fewest
  training seconds to the target at its best point of (f)'s baseline tune
  (seed 0), nanoGPT's AdamW excluded.
- **Rates:** `r12 · √(B / 12) · {1/3, 1, 3}`, `r12` the optimizer's rate
  at batch 12 (the tune's best point; THOR's preset rate). Each keeps its
  batch-12 schedule (a cosine decays over the batch's budget). An
  optimizer's point at a batch: the fewest steps to the target (ties: the
  fewer seconds).
- **Perfect scaling** halves the steps when the batch doubles. An
  optimizer leaves it at the first doubling where its steps fall by less
  than 1.6x (or it does not reach the target).

Writes `<prefix>.json` (every run's record, after each run) and
`<prefix>.png` (steps against batch, log-log, with each optimizer's
perfect-scaling line). Run again with the same prefix, it resumes: a run
already recorded there (same target, the same budget at its batch, the
same optimizer and point; for THOR the same `THOR.RECOMMENDED`) is read
back, not run again. A run's steps do not depend on what ran before it
in the process (each starts from its seed's weights with its functions
traced anew), so a resumed frontier takes the steps one run whole would;
its seconds come from different processes, maybe different days.

    KERAS_BACKEND=jax python benchmarks/thor_batch_frontier.py
"""

import argparse
import dataclasses
import json
import math
import os
import pathlib

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import harness  # noqa: E402
import keras  # noqa: E402
import outcomes  # noqa: E402
from harness import NANOGPT_ADAMW  # noqa: E402
from harness import THOR_RECOMMENDED  # noqa: E402
from outcomes import say  # noqa: E402

import keras_thor  # noqa: E402

BATCHES = (12, 24, 48, 96)
BASE_BATCH = 12
BASE_BUDGET_STEPS = 4000
CHECK_WINDOWS = 1200
BUDGET_SHRINK = 1.6  # also the least fall of steps a doubling that scales
RATE_FACTORS = (1 / 3, 1.0, 3.0)


def budget_steps(batches):
    """`{batch: steps}`: 4,000 at batch 12, each doubling the previous
    budget / 1.6 rounded up."""
    budgets, steps = {}, BASE_BUDGET_STEPS
    for index, batch in enumerate(batches):
        if batch != BASE_BATCH * 2**index:
            raise ValueError(
                f"`batches` must double from {BASE_BATCH}; received "
                f"batches={tuple(batches)}"
            )
        budgets[batch] = steps
        steps = math.ceil(steps / BUDGET_SHRINK)
    return budgets


def check_steps(batch):
    """Steps between validation checks: every 1,200 windows."""
    return max(1, round(CHECK_WINDOWS / batch))


def frontier_task(task, batch, budget):
    """(f) at `batch` sequences a step, `budget` steps or a little more
    (whole check intervals), one check an "epoch"."""
    every = check_steps(batch)
    return dataclasses.replace(
        task,
        batch=batch,
        epoch_steps=every,
        checks=1,
        budget=math.ceil(budget / every),
    )


def rates(rate, batch):
    """The three rates tried at `batch` around `rate`, the batch-12 one."""
    middle = rate * math.sqrt(batch / BASE_BATCH)
    return [middle * factor for factor in RATE_FACTORS]


def fastest_other(protocol):
    """The baseline with the fewest training seconds to (f)'s target at
    its best point of the tune, nanoGPT's AdamW excluded."""
    reached = {
        name: best
        for name, best in protocol["best"].items()
        if best["reached"] and name != NANOGPT_ADAMW
    }
    if not reached:
        raise ValueError("no baseline but nanoGPT's reached (f)'s target")
    return min(reached, key=lambda name: reached[name]["seconds"])


def batch12_points(protocol):
    """`{optimizer: its batch-12 point}` of the three the frontier runs."""
    other = fastest_other(protocol)
    return {
        THOR_RECOMMENDED: dict(
            lr=keras_thor.optimizers.THOR.RECOMMENDED["learning_rate"],
            schedule="constant",
            at=None,
        ),
        NANOGPT_ADAMW: protocol["best"][NANOGPT_ADAMW]["point"],
        other: protocol["best"][other]["point"],
    }


def steps_to_target(record):
    """(steps, seconds) to the record's target, or None."""
    got = outcomes.outcome(record, higher_is_better=False)
    if got is None:
        return None
    epochs, seconds = got
    return round(epochs * record["check_steps"]), seconds


def best_at_batch(records):
    """Of one optimizer's records at one batch, the one with the fewest
    steps to the target (ties: seconds); None if none reached it."""
    reached = [(steps_to_target(r), r) for r in records]
    reached = [(got, r) for got, r in reached if got is not None]
    if not reached:
        return None
    return min(reached, key=lambda item: item[0])[1]


def leaves_perfect_scaling(steps):
    """The first batch whose steps fell by less than 1.6x from the batch
    before (`steps`: `{batch: steps or None}` in increasing batch), or None
    if every doubling scaled. A batch not reached is left at."""
    batches = sorted(steps)
    for before, batch in zip(batches, batches[1:]):
        if steps[before] is None:
            return before
        if steps[batch] is None or steps[before] / steps[batch] < BUDGET_SHRINK:
            return batch
    return None


def recorded_runs(previous, target, budgets, preset):
    """`{run key: record}` of a frontier file's runs (`previous`: its
    content, {} if none): those of the same target, each at a batch with
    the same budget, THOR's only if they ran the same `preset` (its
    `THOR.RECOMMENDED`)."""
    if previous.get("target") != target:
        return {}
    same_preset = previous.get("thor_preset") == preset
    recorded_budgets = previous.get("budgets", {})
    return {
        run_key(r["batch"], r["optimizer"], r["point"]): r
        for r in previous["runs"]
        if recorded_budgets.get(str(r["batch"])) == budgets.get(r["batch"])
        and (same_preset or r["optimizer"] != THOR_RECOMMENDED)
    }


def run_key(batch, name, point):
    """What makes two runs the same: the batch, the optimizer and its
    whole point (rate, schedule, ...) as JSON."""
    return batch, name, json.dumps(outcomes.plain(point), sort_keys=True)


def _run(task, data, name, point, target):
    record = harness.run(task, data, name, point, 0, target, stop=True)
    record.update(batch=task.batch, check_steps=task.epoch_steps)
    got = steps_to_target(record)
    say(
        f"  {name:<22} batch {task.batch:>3} lr {point['lr']:.3g}: "
        + (f"{got[0]} steps, {got[1]:.1f} s" if got else "not reached")
        + f" (compile {record['warmup_seconds'] or 0:.1f} s)"
    )
    return record


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 4.5))
    for name, row in summary.items():
        batches = [b for b in sorted(row) if row[b] is not None]
        if not batches:
            continue
        line = axis.plot(
            batches, [row[b] for b in batches], marker="o", label=name
        )[0]
        first = batches[0]
        every = sorted(row)
        axis.plot(
            every,
            [row[first] * first / b for b in every],
            linestyle="--",
            color=line.get_color(),
            alpha=0.5,
        )
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("sequences a step")
    axis.set_ylabel("steps to the target")
    axis.set_title(
        "(f) batch-size frontier, seed 0 (dashed: perfect scaling)",
        fontsize=9,
    )
    axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    say(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    parser.add_argument(
        "--protocol",
        type=pathlib.Path,
        default=harness.RECORDED_PROTOCOL,
        help="the protocol file holding (f)'s target and best points",
    )
    parser.add_argument("--prefix", default="results/thor_frontier")
    args = parser.parse_args()
    try:
        budgets = budget_steps(args.batches)
    except ValueError as error:
        parser.error(str(error))
    protocol = outcomes.read(args.protocol).get("gpt")
    if protocol is None:
        parser.error(f"no (f) target in {args.protocol}: tune (f) first")
    target = protocol["target"]
    points = batch12_points(protocol)
    base = harness.TASKS["gpt"]
    frontier = {b: frontier_task(base, b, budgets[b]) for b in args.batches}
    data = harness.load_gpt(
        max(t.budget * t.epoch_steps * t.batch for t in frontier.values())
    )
    say(
        f"keras {keras.__version__}, backend {keras.backend.backend()}; "
        f"(f) target {target}; budgets {budgets}"
    )
    path = pathlib.Path(f"{args.prefix}.json")
    preset = outcomes.plain(keras_thor.optimizers.THOR.RECOMMENDED)
    previous = outcomes.read(path)
    done = recorded_runs(previous, target, budgets, preset)
    if done:
        say(f"resuming: {len(done)} runs read back from {path}")
    summary = {name: {} for name in points}
    # The budgets of every batch run so far, those of other batch lists
    # included: their runs stay in the file.
    header = dict(
        target=target,
        budgets={
            **previous.get("budgets", {}),
            **{str(batch): steps for batch, steps in budgets.items()},
        },
        thor_preset=preset,
    )

    def write():
        runs = list(done.values())
        outcomes.write(path, dict(header, summary=summary, runs=runs))

    for batch, task in frontier.items():
        for name, point in points.items():
            runs = []
            for lr in rates(point["lr"], batch):
                key = run_key(batch, name, dict(point, lr=lr))
                if key not in done:
                    done[key] = _run(
                        task, data, name, dict(point, lr=lr), target
                    )
                    write()
                runs.append(done[key])
            best = best_at_batch(runs)
            summary[name][batch] = steps_to_target(best)[0] if best else None
    write()
    say("\nsteps to the target (best of 3 rates):")
    say(f"{'optimizer':<22}" + "".join(f"{b:>8}" for b in args.batches))
    for name, row in summary.items():
        cells = "".join(
            f"{row[b] if row[b] is not None else '-':>8}" for b in args.batches
        )
        left = leaves_perfect_scaling(row)
        say(f"{name:<22}{cells}   leaves perfect scaling at: {left or '-'}")
    plot(summary, pathlib.Path(f"{args.prefix}.png"))


if __name__ == "__main__":
    main()
