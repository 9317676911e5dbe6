"""The trace rule on the benchmark tasks: inversions skipped, time, metric.

`THOR.recommended()` as it is, and with the THOR paper's trace rule
(`trace_thresholds` (0.01, 0) and (0.01, 0.001)), on the tasks of benchmark
1 (`tasks.py`: (b) the MNIST ResNet, (c) the deep autoencoder, (d) the
marker-order transformer), the same seeds, epochs and batch for each
setting, the settings taking turns within each seed (so a drift of the
machine's speed reaches all of them). Prints, per task and setting,
medians over the seeds: the epoch time (the median epoch after the first,
which traces; each seed's in brackets) and its ratio to the recommended
setting's, the share of block inversions the rule skipped, and the task's
metric after the last epoch (test accuracy for (b) and (d), training
reconstruction error for (c); each seed's after it). This measures the
option; it does not tune the recommended setting (docs/thor.md,
"Curvature options").

    python benchmarks/thor_trace_rule.py [--tasks resnet autoencoder
        transformer] [--epochs 4] [--seeds 1 2 3]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from tasks import EpochTimer  # noqa: E402
from tasks import release  # noqa: E402
from tasks import skipped_share  # noqa: E402
from thor_sensitivity import BATCH  # noqa: E402
from thor_sensitivity import TASKS  # noqa: E402
from thor_sensitivity import task_setup  # noqa: E402

import keras_thor  # noqa: E402

SETTINGS = {
    "recommended": None,
    "+ trace (0.01, 0)": (0.01, 0.0),
    "+ trace (0.01, 0.001)": (0.01, 0.001),
}


def run(name, trace_thresholds, epochs, seed):
    """`(epoch seconds, share of inversions skipped, metric)` of one run."""
    keras.utils.set_random_seed(seed)
    model, loss, x, y, metric = task_setup(name)
    model = keras_thor.convert_to_thor_model(model)
    thor = keras_thor.optimizers.THOR.recommended(
        batch_size=BATCH, trace_thresholds=trace_thresholds
    )
    model.compile(optimizer=thor, loss=loss)
    timer = EpochTimer()
    model.fit(
        x, y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=[timer]
    )
    result = (
        float(np.median(timer.seconds[1:])),
        skipped_share(thor),
        metric(model),
    )
    release(model)
    keras.backend.clear_session(free_memory=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tasks", nargs="+", default=list(TASKS), choices=TASKS
    )
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    print(
        f"keras {keras.__version__}, backend {keras.backend.backend()}, "
        f"{os.cpu_count()} CPUs; {args.epochs} epochs, batch {BATCH}, "
        f"seeds {args.seeds}, medians"
    )
    for name in args.tasks:
        print(f"\n{name}")
        print(
            f"  {'setting':<24}{'epoch s':>9}{'x recommended':>15}"
            f"{'skipped':>9}{'metric':>9}  (metric per seed)"
        )
        results = {setting: [] for setting in SETTINGS}
        for seed in args.seeds:
            for setting, thresholds in SETTINGS.items():
                results[setting].append(
                    run(name, thresholds, args.epochs, seed)
                )
        baseline = None
        for setting, runs in results.items():
            seconds, skipped, metrics = (np.array(r) for r in zip(*runs))
            epoch = float(np.median(seconds))
            baseline = baseline or epoch
            skipped = (
                f"{np.median(skipped):9.2f}"
                if SETTINGS[setting]
                else f"{'-':>9}"
            )
            print(
                f"  {setting:<24}{epoch:9.2f}{epoch / baseline:15.3f}"
                f"{skipped}{np.median(metrics):9.4f}  "
                + " ".join(f"{m:.4f}" for m in metrics)
                + "  ["
                + " ".join(f"{t:.2f}" for t in seconds)
                + " s]",
                flush=True,
            )


if __name__ == "__main__":
    main()
