"""THOR benchmark 1's phases over the harness: the tunes and the report.

1. `tune_baselines`: every baseline grid point on the tune seed for the
   whole budget; fixes the task's target and each baseline's best point.
2. `tune_thor`: THOR's grids on the tune seed against the stored target.
3. `report`: each optimizer's best point on the report seeds, interleaved
   by seed; `print_report` prints the table and the ratios, `plot` draws
   the curves.

The command line over them is `thor_time_to_accuracy.py`.
"""

import math
import time

import harness
import keras
import numpy as np
import outcomes
from harness import LEARNING_RATES
from harness import MUON
from harness import SCHEDULE_FREE
from harness import THORS
from outcomes import TUNE_SEED
from outcomes import describe
from outcomes import fmt
from outcomes import fmt_range
from outcomes import say

# ---------------------------------------------------------------------------
# Tune


def best_point(task, records, target, name):
    """`outcomes.select` over `name`'s records, one curve per evaluation
    point (ScheduleFreeAdamW's points keep their `at`)."""
    curves = [
        dict(
            point=dict(
                record["point"], at=at if name == SCHEDULE_FREE else None
            ),
            epochs=record["epochs"],
            seconds=record["seconds"],
            metrics=record["metrics"][at],
            diverged=record["diverged"],
        )
        for record in records
        if record["optimizer"] == name
        for at in record["metrics"]
    ]
    return outcomes.select(curves, target, task.higher_is_better)


def _summary(task, record, at=None):
    return outcomes.summary(record, task.higher_is_better, at)


def _tune_runs(task, data, quick):
    """Seed 0, every baseline grid point for the whole budget (one run
    gives ScheduleFreeAdamW's y and x)."""
    half = task.budget / 2
    records = []
    for name in harness.baselines(task):
        seen = set()
        for point in harness.grid(task, name, quick):
            key = (point["lr"], point["schedule"])
            if key in seen:
                continue
            seen.add(key)
            at = ["y", "x"] if name == SCHEDULE_FREE else ["y"]
            record = harness.run(
                task, data, name, point, TUNE_SEED, None, False, at
            )
            records.append(record)
            values = ", ".join(
                f"{a} {outcomes.metric_at(record, a, half):.4g}" for a in at
            )
            say(
                f"  [{task.name}] {name:<18} {describe(point):<16} "
                f"seed {TUNE_SEED}: at epoch {half:g}: {values}; "
                f"{_summary(task, record, at[0])}; "
                f"{record['wall_seconds']:.0f} s wall"
            )
    return records


def _best_at_half(task, records):
    """(metric, optimizer, point, at) of the best baseline at the check
    that ends epoch budget / 2."""
    half = task.budget / 2
    best = None
    for record in records:
        for at in record["metrics"]:
            entry = (
                outcomes.metric_at(record, at, half),
                record["optimizer"],
                record["point"],
                at,
            )
            if best is None or task.better(entry[0], best[0]):
                best = entry
    if best is None or not math.isfinite(best[0]):
        raise RuntimeError(f"{task.name}: no baseline has a finite metric")
    return best


def tune_baselines(task, data, quick, path):
    """Seed 0, every baseline grid point for the whole budget; fixes the
    target and each baseline's best point; writes them to `path`."""
    records = _tune_runs(task, data, quick)
    best = _best_at_half(task, records)
    target = task.round_target(best[0])
    best_point_at_half = dict(
        best[2], at=best[3] if best[1] == SCHEDULE_FREE else None
    )
    say(
        f"[{task.name}] target {target:.6g} ({task.metric}): the best "
        f"baseline at epoch {task.budget / 2:g} is {best[1]} "
        f"{describe(best_point_at_half)} with {best[0]:.6g}"
    )
    for record in records:
        record["target"] = target
    chosen = {}
    for name in harness.baselines(task):
        chosen[name] = best_point(task, records, target, name)
        say(f"  [{task.name}] best {name}: {_choice(chosen[name])}")
    entry = dict(
        task=task.name,
        budget=task.budget,
        batch=task.batch,
        checks_per_epoch=task.checks,
        metric=task.metric,
        higher_is_better=task.higher_is_better,
        half_budget_best=dict(
            value=best[0], optimizer=best[1], point=best_point_at_half
        ),
        target=target,
        best=chosen,
        grids={
            name: LEARNING_RATES[name][task.name]
            for name in harness.baselines(task)
        },
        runs=records,
        keras=keras.__version__,
        written=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    protocol = outcomes.read(path)
    protocol[task.name] = entry
    outcomes.write(path, protocol)
    return entry


def _choice(choice):
    if choice["reached"]:
        return (
            f"{describe(choice['point'])}: {choice['epochs']:.3g} epochs, "
            f"{choice['seconds']:.2f} s"
        )
    if choice["point"] is None:
        return "no run"
    return f"none reaches the target (closest: {describe(choice['point'])})"


def tune_thor(task, data, names, target, quick, path):
    """Seed 0, THOR's grids against the stored target, stopping there."""
    tuned = outcomes.read(path)
    entry = tuned.setdefault(task.name, {})
    for name in names:
        records = []
        for point in harness.grid(task, name, quick):
            record = harness.run(
                task, data, name, point, TUNE_SEED, target, True
            )
            records.append(record)
            say(
                f"  [{task.name}] {name:<22} {describe(point):<14} seed "
                f"{TUNE_SEED}: {_summary(task, record)}; "
                f"{record['wall_seconds']:.0f} s wall"
            )
        choice = best_point(task, records, target, name)
        say(f"  [{task.name}] best {name}: {_choice(choice)}")
        entry[name] = dict(
            best=choice,
            target=target,
            grid=LEARNING_RATES[name][task.name],
            runs=records,
            written=time.strftime("%Y-%m-%d %H:%M:%S"),
        )
        outcomes.write(path, tuned)
    return entry


# ---------------------------------------------------------------------------
# Report


def report(task, data, chosen, target, seeds):
    """Each optimizer's best point on `seeds`, interleaved by seed."""
    runs = {name: [] for name in chosen}
    for seed in seeds:
        for name, choice in chosen.items():
            record = harness.run(
                task, data, name, choice["point"], seed, target, True
            )
            runs[name].append(record)
            say(
                f"  [{task.name}] {name:<22} {describe(choice['point']):<16} "
                f"seed {seed}: {_summary(task, record)}; "
                f"{record['wall_seconds']:.0f} s wall"
            )
            if "sample" in record:
                say("    " + record["sample"].replace("\n", "\n    "))
    rows = {}
    for name, records in runs.items():
        got = [outcomes.outcome(r, task.higher_is_better) for r in records]
        epochs = [g[0] if g else float("inf") for g in got]
        seconds = [g[1] if g else float("inf") for g in got]
        rows[name] = dict(
            point=chosen[name]["point"],
            reached_on_tune_seed=chosen[name]["reached"],
            epochs=epochs,
            seconds=seconds,
            median_epochs=outcomes.median(epochs),
            median_seconds=outcomes.median(seconds),
            warmup_seconds=outcomes.median(
                [r["warmup_seconds"] or 0.0 for r in records]
            ),
            runs=records,
        )
    return rows


def _kind(variable):
    path = variable.path.lower()
    if "embedding" in path:
        return "embeddings"
    if variable.name in ("gamma", "beta"):
        return "normalization scales and offsets"
    if variable.name == "bias":
        return "biases"
    if len(variable.shape) == 4:
        return "conv kernels"
    if len(variable.shape) == 3:
        return "attention's 3-D kernels"
    return "other"


def muon_split(task):
    """What Keras's Muon updates with its Muon step and what with AdamW."""
    model = task.build()
    optimizer = keras.optimizers.Muon()
    muon, adamw, kinds = 0, 0, {}
    for variable in model.trainable_variables:
        size = int(np.prod(variable.shape))
        if optimizer._should_use_adamw(variable):
            adamw += size
            kinds[_kind(variable)] = kinds.get(_kind(variable), 0) + size
        else:
            muon += size
    parts = ", ".join(f"{kind} {size:,}" for kind, size in kinds.items())
    return (
        f"Muon step on {muon:,} of {muon + adamw:,} parameters (the 2-D "
        f"kernels), AdamW step on {adamw:,} ({parts})"
    )


def _print_table(task, rows, target, seeds):
    say(
        f"\n({task.letter}) {task.title}: target {task.metric} "
        f"{'>=' if task.higher_is_better else '<='} {target:.6g}, batch "
        f"{task.batch}, budget {task.budget} epochs, {task.checks} "
        f"checks an epoch, seeds {', '.join(map(str, seeds))}"
    )
    say(
        f"{'optimizer':<22} {'best point (seed 0)':<22} "
        f"{'epochs per seed':<20} {'median':>6} {'range':>11} "
        f"{'median s':>8} {'range s':>11} {'warm-up s':>9}"
    )
    for name, row in rows.items():
        per_seed = "/".join(fmt(e) for e in row["epochs"])
        point = describe(row["point"])
        if not row["reached_on_tune_seed"]:
            point += " (!)"
        say(
            f"{name:<22} {point:<22} {per_seed:<20} "
            f"{fmt(row['median_epochs']):>6} {fmt_range(row['epochs']):>11} "
            f"{fmt(row['median_seconds']):>8} "
            f"{fmt_range(row['seconds']):>11} {row['warmup_seconds']:>9.2f}"
        )


def _print_notes(rows, muon_note):
    if any(not row["reached_on_tune_seed"] for row in rows.values()):
        say(
            "(!) no grid point of it reached the target on seed 0: its "
            "closest one (best last metric) is run"
        )
    if MUON in rows:
        say(f"Muon (Keras {keras.__version__}): {muon_note}")
    if SCHEDULE_FREE in rows:
        at = rows[SCHEDULE_FREE]["point"].get("at")
        say(
            f"ScheduleFreeAdamW evaluated at "
            f"{'its average x' if at == 'x' else 'the trained point y'} "
            "(the better of the two on seed 0)"
        )


def _ratio(task, name, row, baselines, best, fastest):
    """THOR `name`'s ratios against the best (and the fastest) baseline,
    printed; None if no baseline reached the target."""
    note = "" if task.claim else " (demo: no target claim)"
    if not math.isfinite(baselines[best]["median_epochs"]):
        say(f"{name}: no ratio, no baseline reached the target")
        return None
    if not math.isfinite(row["median_epochs"]):
        say(
            f"{name} / best baseline ({best}): no ratio, {name} "
            "did not reach the target on the median seed"
        )
        return dict(best_baseline=best, reached=False)
    epochs = row["median_epochs"] / baselines[best]["median_epochs"]
    seconds = row["median_seconds"] / baselines[best]["median_seconds"]
    fastest_seconds = (
        row["median_seconds"] / baselines[fastest]["median_seconds"]
    )
    say(
        f"{name} / best baseline ({best}), medians: epochs "
        f"{fmt(epochs)}x, training seconds {fmt(seconds)}x{note}"
    )
    if fastest != best:
        say(
            f"  (fastest baseline in seconds: {fastest}, "
            f"{fmt(fastest_seconds)}x)"
        )
    return dict(
        best_baseline=best,
        reached=True,
        epochs=epochs,
        seconds=seconds,
        fastest_baseline=fastest,
        seconds_against_fastest=fastest_seconds,
    )


def print_report(task, rows, target, seeds, muon_note):
    """The report's table and notes; returns THOR's ratios against the
    best baseline (fewest median epochs, ties median seconds)."""
    _print_table(task, rows, target, seeds)
    _print_notes(rows, muon_note)
    baselines = {n: r for n, r in rows.items() if n in harness.baselines(task)}
    if not baselines:
        return {}
    best = min(
        baselines,
        key=lambda n: (
            baselines[n]["median_epochs"],
            baselines[n]["median_seconds"],
        ),
    )
    fastest = min(baselines, key=lambda n: baselines[n]["median_seconds"])
    ratios = {}
    for name in (n for n in rows if n in THORS):
        ratio = _ratio(task, name, rows[name], baselines, best, fastest)
        if ratio is not None:
            ratios[name] = ratio
    return ratios


def plot(task, rows, target, path):
    """Training loss and the metric against training seconds, the first
    report seed of each optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, metric_axis) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, row in rows.items():
        record = row["runs"][0]
        if not record["epochs"]:
            continue
        at = record["point"].get("at") or "y"
        label = f"{name} lr {describe(record['point'])}"
        loss_axis.plot(
            record["seconds"], record["losses"], marker=".", label=label
        )
        metric_axis.plot(
            record["seconds"], record["metrics"][at], marker=".", label=label
        )
    loss_axis.set_yscale("log")
    loss_axis.set_xlabel("training seconds")
    loss_axis.set_ylabel("training loss (mean so far this epoch)")
    metric_axis.axhline(target, color="gray", linestyle="--", label="target")
    metric_axis.set_xlabel("training seconds")
    metric_axis.set_ylabel(task.metric)
    if not task.higher_is_better:
        metric_axis.set_yscale("log")
    else:
        low = min(target - 0.1, 0.9)
        metric_axis.set_ylim(max(0.0, low), 1.001)
    seed = rows[next(iter(rows))]["runs"][0]["seed"]
    loss_axis.set_title(
        f"({task.letter}) {task.title}: each optimizer at its best "
        f"point of the seed-{TUNE_SEED} tune, run on seed {seed}",
        fontsize=9,
    )
    metric_axis.set_title(f"to the target {target:.6g}")
    metric_axis.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    say(f"wrote {path}")
