"""`make demo`: THOR on the digits MLP against Keras's optimizers, seeds 1-3.

Part (a) of THOR benchmark 1 (docs/benchmarks.md), with nothing tuned at
run time: the target and each baseline's best point are the ones the full
protocol's baseline tune recorded (seed 0) in
`benchmarks/thor_time_to_accuracy_protocol.json`. On seeds 1, 2, 3:

- `THOR.recommended(batch_size=256)`: the preset exactly as it ships (its
  own learning rate, `THOR.RECOMMENDED["learning_rate"]`; nothing tuned on
  digits);
- THOR with MindSpore's rule: the protocol's "THOR (MindSpore rule)"
  (damping 0.03, momentum 0.9, frequency 2 here) at learning rate 0.1
  constant: `THOR` has no default rate and no THOR tune of digits is
  recorded, so the rule's best point on the one main task where it reached
  its target, (b) resnet (`thor_time_to_accuracy_thor_tune.json`; its
  closest point on (d) too);
- AdamW, Muon, Lion, ScheduleFreeAdamW at their recorded best points.
  SGD (Nesterov) is listed but not run: none of its rates reached the
  target in the recorded tune, so it has no best point (the full protocol,
  `make benchmark`'s script, runs it at its closest one).

Same model, initial weights, shuffles, clock and checks as
`thor_time_to_accuracy.py --phase report` (4 checks an epoch; the clock
runs during the training steps only; a run stops at the target or after
the 20-epoch budget). For speed, each optimizer gets one model and one
optimizer, built once; every seed then restores that seed's initial
weights and the optimizer's initial state, and traces again outside the
clock (setting the seed, needed for the protocol's shuffles, makes
TensorFlow trace again). `--check-fresh` also reruns seed 1 the slow way,
a fresh model per run as `thor_time_to_accuracy.py` does, and compares the
curves. Prints a table and a one-line verdict computed from it; writes
`results/thor_demo_digits.png` and `results/thor_demo_digits.json`. 360
test images: a demo, not a claim.
"""

import argparse
import json
import math
import os
import pathlib
import sys
import time

START = time.perf_counter()

import harness  # noqa: E402  (sets up the backend first)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import outcomes  # noqa: E402
import tasks  # noqa: E402
from outcomes import describe  # noqa: E402
from outcomes import fmt  # noqa: E402
from outcomes import say  # noqa: E402

import keras_thor  # noqa: E402

PROTOCOL = harness.RECORDED_PROTOCOL
SEEDS = outcomes.REPORT_SEEDS
TASK = harness.TASKS["digits"]
# THOR's MindSpore rule on digits: see the module docstring.
MINDSPORE_POINT = dict(lr=0.1, schedule="constant", at=None)
PRESET = "THOR.recommended()"
MINDSPORE = "THOR, MindSpore's rule"


# ---------------------------------------------------------------------------
# Training


def _train(check_fresh):
    """Trains every optimizer on every seed; returns the rows and the
    task's facts."""
    protocol = json.loads(PROTOCOL.read_text())["digits"]
    target = protocol["target"]
    data = TASK.load()
    steps = harness.steps_per_epoch(TASK, data[0])
    say(
        f"keras {keras.__version__}, backend {keras.backend.backend()}, "
        f"keras_thor {keras_thor.__version__}, {os.cpu_count()} CPUs"
    )
    weights = {}
    rows = []
    for entry in _entries(protocol, steps):
        name, thor = entry["name"], entry["thor"]
        if entry["skip"]:
            rows.append({k: v for k, v in entry.items() if k != "make"})
            continue
        if thor not in weights:
            weights[thor] = _seed_weights(thor)
        runs, warm_up, wall = _runs_of(entry, data, target, weights[thor])
        got = [_to_target(r, target) for r in runs]
        rows.append(
            dict(
                {k: v for k, v in entry.items() if k != "make"},
                runs=runs,
                epochs=[g[0] for g in got],
                seconds=[g[1] for g in got],
                warm_up=warm_up,
                wall=wall,
            )
        )
        say(
            f"  {name:<24} epochs to {target:g} on seeds "
            f"{', '.join(map(str, SEEDS))}: "
            f"{'/'.join(fmt(g[0]) for g in got)}; {wall:.1f} s wall "
            f"({warm_up:.1f} s building and tracing)"
        )
    checks = []
    if check_fresh:
        for row in rows:
            if "runs" in row:
                checks.append(_check_fresh(row, data, target, SEEDS[0]))
    meta = dict(
        title=TASK.title, budget=TASK.budget, batch=TASK.batch, steps=steps
    )
    return rows, checks, meta


def _entries(protocol, steps):
    """The rows: a name, a short setting (table), a label (legend), how to
    make its optimizer, THOR or not, its point, whether the recorded tune
    saw it reach the target (None: THOR), and whether it is left out (a
    baseline without a best point)."""
    preset_rate = keras_thor.optimizers.THOR.RECOMMENDED["learning_rate"]
    frequency = harness.mindspore_frequency(steps)
    rows = [
        dict(
            name=PRESET,
            setting=f"lr {preset_rate:g}, the preset as is",
            label=f"{PRESET} (lr {preset_rate:g}, the preset as shipped)",
            make=lambda: keras_thor.optimizers.THOR.recommended(
                batch_size=TASK.batch
            ),
            thor=True,
            point=dict(lr=preset_rate, schedule="constant", at=None),
            reached_on_tune_seed=None,
            skip=False,
        ),
        dict(
            name=MINDSPORE,
            setting=f"lr {MINDSPORE_POINT['lr']:g}, damping "
            f"{harness.MINDSPORE_DAMPING:g}, freq. {frequency}",
            label=f"{MINDSPORE} (lr {MINDSPORE_POINT['lr']:g}, damping "
            f"{harness.MINDSPORE_DAMPING:g}, frequency {frequency}; rate not "
            "tuned on digits)",
            make=lambda: harness.make_optimizer(
                harness.THOR_MINDSPORE, MINDSPORE_POINT, TASK, steps
            ),
            thor=True,
            point=MINDSPORE_POINT,
            reached_on_tune_seed=None,
            skip=False,
        ),
    ]
    for name in harness.BASELINES:
        best = protocol["best"][name]
        point = best["point"]
        rows.append(
            dict(
                name=name,
                setting=f"lr {describe(point)}",
                label=f"{name} lr {describe(point)} ("
                + (
                    "best of the recorded tune)"
                    if best["reached"]
                    else "closest of the recorded tune; none reached the "
                    "target)"
                ),
                make=lambda name=name, point=point: harness.make_optimizer(
                    name, point, TASK, steps
                ),
                thor=False,
                point=point,
                reached_on_tune_seed=best["reached"],
                skip=not best["reached"],
            )
        )
    return rows


def _seed_weights(thor):
    """Each seed's initial weights, as `harness.run` builds them."""
    weights = {}
    for seed in SEEDS:
        keras.utils.set_random_seed(seed)
        model = TASK.build()
        if thor:
            model = keras_thor.convert_to_thor_model(model)
        weights[seed] = model.get_weights()
    return weights


def _runs_of(entry, data, target, weights):
    """One model for `entry`, built once; a timed run per seed, each from
    that seed's initial weights and the optimizer's initial state (all its
    variables, `iterations` included).

    As in `harness.run`, each seed is set just before the warm-up, so the
    timed run shuffles as the full protocol's does: setting TensorFlow's
    seed makes every `tf.function` trace again on its next call (0.2-1 s
    here), so each seed gets its own warm-up, outside the clock.
    """
    steps = harness.steps_per_epoch(TASK, data[0])
    start = time.perf_counter()
    keras.utils.set_random_seed(SEEDS[0])
    model = harness.compiled_model(TASK, entry["make"], entry["thor"])
    _, optimizer_state = harness.snapshot(model)
    warm_up = time.perf_counter() - start
    records = []
    for seed in SEEDS:
        warm_up += harness.warm_up_and_reset(
            model, TASK, data, (weights[seed], optimizer_state), seed
        )
        tracker = harness.TimeToTarget(TASK, data[2], steps, target, stop="y")
        harness.train_timed(model, TASK, data, tracker)
        records.append(
            dict(
                seed=seed,
                epochs=tracker.epochs,
                seconds=tracker.seconds,
                losses=tracker.losses,
                metrics=tracker.metrics["y"],
                diverged=tracker.diverged,
            )
        )
    tasks.release(model)
    return records, warm_up, time.perf_counter() - start


def _to_target(record, target):
    got = outcomes.reached(
        record["epochs"],
        record["seconds"],
        record["metrics"],
        target,
        TASK.higher_is_better,
    )
    return got or (math.inf, math.inf)


def _check_fresh(row, data, target, seed):
    """Reruns `row` on `seed` with a fresh model (`harness.run`, the full
    protocol's path) and compares the curves with the reused model's."""
    key = {PRESET: harness.THOR_RECOMMENDED, MINDSPORE: harness.THOR_MINDSPORE}
    name = row["name"]
    fresh = harness.run(
        TASK, data, key.get(name, name), row["point"], seed, target, True
    )
    reused = next(r for r in row["runs"] if r["seed"] == seed)
    same = (
        fresh["epochs"] == reused["epochs"]
        and np.allclose(fresh["metrics"]["y"], reused["metrics"])
        and np.allclose(fresh["losses"], reused["losses"], rtol=1e-5)
    )
    line = (
        f"check {name}, seed {seed}: fresh model {len(fresh['epochs'])} "
        f"checks, last accuracy {fresh['metrics']['y'][-1]:.4f}, last loss "
        f"{fresh['losses'][-1]:.6g}; reused model "
        f"{len(reused['epochs'])} checks, {reused['metrics'][-1]:.4f}, "
        f"{reused['losses'][-1]:.6g}: {'same' if same else 'DIFFERENT'}; "
        f"training seconds {fresh['seconds'][-1]:.2f} fresh, "
        f"{reused['seconds'][-1]:.2f} reused"
    )
    say(line)
    return dict(name=name, same=bool(same), line=line)


# ---------------------------------------------------------------------------
# The report


def table(rows, target, meta):
    say(
        f"\n(a) {meta['title']}: epochs and training seconds to test "
        f"accuracy >= {target:g} (360 test images), seeds "
        f"{', '.join(map(str, SEEDS))}; '-': not reached in "
        f"{meta['budget']} epochs"
    )
    header = (
        f"{'optimizer':<24} {'setting':<34} {'epochs per seed':<17} "
        f"{'median':>6} {'median s':>8} {'last acc per seed':<18} "
        f"{'warm-up s':>9}"
    )
    say(header)
    say("-" * len(header))
    for row in rows:
        if "runs" not in row:
            say(
                f"{row['name']:<24} not run: no rate of its grid reached "
                "the target in the recorded tune (seed 0)"
            )
            continue
        last = [
            r["metrics"][-1] if r["metrics"] else math.nan for r in row["runs"]
        ]
        say(
            f"{row['name']:<24} {row['setting']:<34} "
            f"{'/'.join(fmt(e) for e in row['epochs']):<17} "
            f"{fmt(row['median_epochs']):>6} "
            f"{fmt(row['median_seconds'], 2):>8} "
            f"{'/'.join(f'{a:.3f}' for a in last):<18} "
            f"{row['warm_up']:>9.1f}"
        )
    say(
        "THOR: no rate tuned on digits. Baselines: the best points of the "
        "recorded tune (seed 0). Warm-up: building the model once and tracing "
        "(per seed), outside the clock."
    )


def verdict(rows, target):
    """One line, from the numbers."""
    baselines = [r for r in rows if not r["thor"]]
    best = min(
        baselines, key=lambda r: (r["median_epochs"], r["median_seconds"])
    )
    if not math.isfinite(best["median_epochs"]):
        return (
            f"No baseline reached {target:g} on the median seed: no "
            "comparison (a demo on 360 test images)."
        )
    parts = []
    for row in (r for r in rows if r["thor"]):
        reached = sum(math.isfinite(e) for e in row["epochs"])
        if not math.isfinite(row["median_epochs"]):
            parts.append(
                f"{row['name']} reached it on {reached} of {len(SEEDS)} "
                "seeds, so not on the median seed"
            )
            continue
        epochs = row["median_epochs"] / best["median_epochs"]
        seconds = row["median_seconds"] / best["median_seconds"]
        parts.append(
            f"{row['name']} reached it on {reached} of {len(SEEDS)} seeds, "
            f"in {fmt(epochs, 2)}x the epochs "
            f"({'fewer' if epochs < 1 else 'no fewer'}) and "
            f"{fmt(seconds, 2)}x the training seconds "
            f"({'less' if seconds < 1 else 'no less'}) of the best baseline"
        )
    return (
        f"Verdict (medians over seeds {SEEDS[0]}-{SEEDS[-1]}, target "
        f"{target:g}; best baseline {best['name']} "
        f"{describe(best['point'])}: {fmt(best['median_epochs'])} epochs, "
        f"{fmt(best['median_seconds'], 2)} s): "
        + "; ".join(parts)
        + ". A demo on 360 test images, not a claim."
    )


def plot(rows, target, meta, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_epoch, by_second) = plt.subplots(1, 2, figsize=(14, 6.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, row in enumerate(rows):
        color = colors[i % len(colors)]
        for j, record in enumerate(row["runs"]):
            label = None
            if j == 0:
                reached = sum(math.isfinite(e) for e in row["epochs"])
                label = f"{row['label']}: " + (
                    f"median {fmt(row['median_epochs'])} epochs, "
                    f"{fmt(row['median_seconds'], 2)} s"
                    if math.isfinite(row["median_epochs"])
                    else "not reached on the median seed"
                )
                label += f" (target on {reached} of {len(SEEDS)} seeds)"
            for axis, x in (
                (by_epoch, record["epochs"]),
                (by_second, record["seconds"]),
            ):
                axis.plot(
                    x,
                    record["metrics"],
                    "-" if row["thor"] else "--",
                    color=color,
                    linewidth=2.0 if row["thor"] else 1.0,
                    alpha=0.8,
                    label=label if axis is by_epoch else None,
                )
    for axis, xlabel in (
        (by_epoch, f"epochs ({meta['steps']} steps of {meta['batch']})"),
        (by_second, "training seconds (clock stopped during the checks)"),
    ):
        axis.axhline(target, color="gray", linestyle=":", linewidth=1)
        axis.set_xlabel(xlabel)
        axis.set_ylabel("test accuracy (360 images)")
        axis.set_ylim(0.85, 1.0)
        axis.grid(alpha=0.3)
    by_epoch.set_title(
        f"(a) {meta['title']}: seeds {SEEDS[0]}–{SEEDS[-1]}, one line per "
        f"seed, each to the target {target:g}",
        fontsize=10,
    )
    by_second.set_title(
        "baselines at their best points of the recorded tune (seed 0); "
        "THOR untuned",
        fontsize=10,
    )
    figure.legend(loc="lower center", ncol=2, fontsize=7.5, frameon=False)
    figure.tight_layout(rect=(0, 0.17, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    say(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    parser.add_argument("--prefix", default="results/thor_demo")
    parser.add_argument(
        "--check-fresh",
        action="store_true",
        help="also rerun every optimizer on seed 1 with a fresh model (the "
        "full protocol's path) and compare",
    )
    args = parser.parse_args()
    protocol = json.loads(PROTOCOL.read_text()).get("digits")
    if protocol is None:
        sys.exit(
            f"{PROTOCOL} has no digits task: run thor_time_to_accuracy.py "
            "--phase tune --optimizers baselines --tasks digits"
        )
    target = protocol["target"]
    say(
        f"Target {target:g} and baseline points: the recorded tune of "
        f"{protocol['written']} (seed 0, {PROTOCOL.name}); seeds "
        f"{', '.join(map(str, SEEDS))}"
    )
    rows, checks, meta = _train(args.check_fresh)
    ran = [row for row in rows if "runs" in row]
    for row in ran:
        row["median_epochs"] = outcomes.median(row["epochs"])
        row["median_seconds"] = outcomes.median(row["seconds"])
    table(rows, target, meta)
    line = verdict(ran, target)
    say("\n" + line)
    prefix = pathlib.Path(args.prefix)
    plot(ran, target, meta, prefix.with_name(prefix.name + "_digits.png"))
    out = prefix.with_name(prefix.name + "_digits.json")
    outcomes.write(
        out,
        dict(
            target=target,
            seeds=list(SEEDS),
            protocol_written=protocol["written"],
            rows=rows,
            verdict=line,
            checks=checks,
            written=time.strftime("%Y-%m-%d %H:%M:%S"),
        ),
    )
    say(f"wrote {out}")
    if checks:
        same = sum(check["same"] for check in checks)
        say(
            f"fresh models against reused ones on seed {SEEDS[0]}: {same} "
            f"of {len(checks)} the same"
        )
    say(f"demo: {time.perf_counter() - START:.0f} s in all")


if __name__ == "__main__":
    main()
